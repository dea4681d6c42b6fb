"""Progress bars for planning phases that take more than a few seconds (layer ILPs, stage
plans, profiled stages): on stderr, shown when it is a terminal; `AUTOPAR_PROGRESS=0` turns
them off and `AUTOPAR_PROGRESS=1` on. tqdm is imported only when a bar is shown, so the planner
imports without it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
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
