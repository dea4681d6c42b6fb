"""Progress bars for planning phases that take more than a few seconds (layer ILPs, stage
plans, profiled stages), and the seconds spent so far in a phase that is one long call (tracing
a step, a single-mesh ILP): on stderr, shown when it is a terminal; `AUTOPAR_PROGRESS=0` turns
them off and `AUTOPAR_PROGRESS=1` on. tqdm is imported only when a bar is shown, so the planner
imports without it."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def enabled() -> bool:
    """Whether progress bars are shown (see the module docstring)."""
    setting = os.environ.get("AUTOPAR_PROGRESS", "").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return False
    return setting in ("1", "on", "true", "yes") or sys.stderr.isatty()


def progress(
    iterable: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it"
) -> Iterable[T]:
    """`iterable`, with a progress bar while it is consumed when bars are `enabled`."""
    if not enabled():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=False, file=sys.stderr)


@contextlib.contextmanager
def phase(desc: str, refresh_s: float = 0.5) -> Iterator[None]:
    """While the block runs, `desc` and the seconds spent in it, refreshed every `refresh_s`
    when bars are `enabled`: a phase with nothing to count still shows it is alive."""
    if not enabled():
        yield
        return
    from tqdm import tqdm

    bar = tqdm(desc=desc, bar_format="{desc}: {elapsed}", leave=False, file=sys.stderr)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(refresh_s):
            bar.refresh()

    ticker = threading.Thread(target=tick, name=f"autopar progress: {desc}", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


def progress_bar(*, desc: str, unit: str = "it") -> Any:
    """A bar updated by hand (`.update(n)`, `.close()`), or a stand-in that does nothing."""
    if not enabled():
        return _Silent()
    from tqdm import tqdm

    return tqdm(desc=desc, unit=unit, leave=False, file=sys.stderr)


class _Silent:
    def update(self, n: int = 1) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to close."""
