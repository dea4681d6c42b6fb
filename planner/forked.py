"""Worker processes for the stage search's layer ILPs, forked from the planner.

Building and solving a layer's ILP is about half Python (menus, costs, the memory model, the
emitted plan) and half HiGHS, so threads share one core's worth of the Python under the GIL: on
2 CPUs the 42 fastest layer plans of a Flax GPT-39B took 88 s on one thread, 71 s on two threads
and 39 s in two forked processes. A forked worker inherits the program, its analyses and the
layer plans registered before the fork without pickling any of them (a jaxpr does not pickle);
only a task's key and its small result cross. Each key is routed to one worker for good, so a
layer's ILP is built once there and solved again at each squeeze level.

The children run the planner's Python, numpy and HiGHS (one thread per solve), never JAX or
XLA, whose threads the fork leaves behind. Only on Linux, where fork is the default start
method; elsewhere, or with `AUTOPAR_PLANNING_PROCESSES=0` (or 1), the caller plans on threads.
`AUTOPAR_PLANNING_PROCESSES=N` sets the number of workers (default: the CPU count).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from autopar.planner.errors import InvalidArgumentError, PlanningError

PROCESSES_ENV = "AUTOPAR_PLANNING_PROCESSES"

# token -> the function its workers run; set before they fork, so they inherit it
_TASKS: dict[int, Callable[[Hashable, Any], Any]] = {}
_tokens = itertools.count()


def process_count() -> int:
    """How many worker processes to fork (0: plan on threads; see the module docstring)."""
    setting = os.environ.get(PROCESSES_ENV, "").strip()
    if not setting:
        count = os.cpu_count() or 1
    elif setting.isdigit():
        count = int(setting)
    else:
        raise InvalidArgumentError(
            f"{PROCESSES_ENV} must be a number of worker processes (0 or 1: plan on threads), "
            f"got {setting!r}"
        )
    return count if count > 1 and sys.platform == "linux" else 0


def _run(token: int, key: Hashable, argument: Any) -> Any:
    """A task, in a worker: the registered function on `key`."""
    return _TASKS[token](key, argument)


class ForkedWorkers:
    """`count` worker processes, each owning the keys routed to it, that run `task(key,
    argument)` on the `keys` given here (and on no other: they are what the fork captured).
    Use as a context manager: the workers fork at the first task and are joined on exit."""

    def __init__(
        self, count: int, task: Callable[[Hashable, Any], Any], keys: Iterable[Hashable]
    ) -> None:
        self.keys = frozenset(keys)
        self._token = next(_tokens)
        _TASKS[self._token] = task
        context = multiprocessing.get_context("fork")
        self._pools = [ProcessPoolExecutor(1, mp_context=context) for _ in range(count)]
        self._owner: dict[Hashable, ProcessPoolExecutor] = {}

    def __enter__(self) -> ForkedWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        for pool in self._pools:
            pool.shutdown(cancel_futures=True)
        _TASKS.pop(self._token, None)

    def map(self, tasks: Iterable[tuple[Hashable, Any]]) -> Iterator[Any]:
        """Each task's (key, argument) result, in order, the tasks running in their keys'
        workers meanwhile; a PlanningError where a worker died."""
        futures = [self._submit(key, argument) for key, argument in tasks]
        for future in futures:
            try:
                yield future.result()
            except BrokenProcessPool as e:
                raise PlanningError(
                    f"a worker process planning layer ILPs died ({e}); set "
                    f"{PROCESSES_ENV}=0 to plan them on threads in this process instead"
                ) from None

    def _submit(self, key: Hashable, argument: Any) -> Future:
        if key not in self.keys:
            raise PlanningError(f"layer ILP {key!r} was not registered before the workers forked")
        if key not in self._owner:  # the least loaded worker takes a new key for good
            loads = [sum(o is pool for o in self._owner.values()) for pool in self._pools]
            self._owner[key] = self._pools[loads.index(min(loads))]
        with warnings.catch_warnings():
            # JAX (and Python >= 3.12) warn that a fork of a multithreaded process may
            # deadlock; the children run no JAX or XLA code (see the module docstring)
            warnings.filterwarnings("ignore", message=r".*fork\(\)", category=RuntimeWarning)
            warnings.filterwarnings("ignore", message=r".*fork\(\)", category=DeprecationWarning)
            return self._owner[key].submit(_run, self._token, key, argument)
