"""Worker processes for the stage search's layer ILPs, forked from the planner.

Building and solving a layer's ILP is about half Python (menus, costs, the memory model, the
emitted plan) and half HiGHS, so threads share one core's worth of the Python under the GIL: on
2 CPUs the 42 fastest layer plans of a Flax GPT-39B took 88 s on one thread, 71 s on two threads
and 39 s in two forked processes. A forked worker inherits the program, its analyses and the
layer plans registered before the fork without pickling any of them (a jaxpr does not pickle);
only a task's key and its small result cross. A new key goes to the first free worker, which
builds the layer's ILP and keeps it for the squeeze levels after; a free worker with none of its
own keys left takes a queued task of a busy one (building that ILP again) rather than wait: the
layer ILPs take 0.2 to 13 s, and a fixed split of the keys left one worker idle for a third of
a level while the other ran a long one. Keys may come in groups (`group_of`: a layer ILP's
mesh): a free worker takes a new key of a group it ran before, else of a group no worker ran,
so that what a group's tasks share (`menus.MeshCache`) is found once per worker.

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
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
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
    """`count` worker processes that run `task(key, argument)` on the `keys` given here (and on
    no other: they are what the fork captured), each task in a worker that ran its key before
    where one is free, a new key in one that ran its group (`group_of`) where one is free
    (module docstring). Use as a context manager: the workers fork at the first task and are
    joined on exit."""

    def __init__(
        self,
        count: int,
        task: Callable[[Hashable, Any], Any],
        keys: Iterable[Hashable],
        group_of: Callable[[Hashable], Hashable] = lambda key: key,
    ) -> None:
        self.keys = frozenset(keys)
        self.group_of = group_of
        self._token = next(_tokens)
        _TASKS[self._token] = task
        context = multiprocessing.get_context("fork")
        self._pools = [ProcessPoolExecutor(1, mp_context=context) for _ in range(count)]
        self._ran: dict[Hashable, set[int]] = {}  # key -> the workers that ran it
        self._ran_group: dict[Hashable, set[int]] = {}  # group -> the workers that ran one

    def __enter__(self) -> ForkedWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        for pool in self._pools:
            pool.shutdown(cancel_futures=True)
        _TASKS.pop(self._token, None)

    def map(self, tasks: Iterable[tuple[Hashable, Any]]) -> Iterator[Any]:
        """Each task's (key, argument) result, in order, the tasks running in the workers
        meanwhile; a PlanningError where a worker died."""
        tasks = list(tasks)
        for key, _ in tasks:
            if key not in self.keys:
                raise PlanningError(
                    f"layer ILP {key!r} was not registered before the workers forked"
                )
        queued, running, results = list(range(len(tasks))), {}, {}
        for index in range(len(tasks)):
            while index not in results:
                busy = {worker for worker, _ in running.values()}
                for worker, task in self._dispatch(tasks, queued, busy):
                    running[self._submit(worker, *tasks[task])] = worker, task
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    results[running.pop(future)[1]] = self._result(future)
            yield results.pop(index)

    def _dispatch(
        self, tasks: list[tuple[Hashable, Any]], queued: list[int], busy: set[int]
    ) -> Iterator[tuple[int, int]]:
        """(worker, task) for each idle worker that gets one, taken off `queued`: first a task
        of a key it ran before, else of a new key (one of a group it ran, else of a group no
        worker ran, else any), then (every idle worker served) the last queued task, of a key
        that only busy workers ran."""
        idle = [w for w in range(len(self._pools)) if w not in busy]
        left = []
        for worker in idle:
            task = next((t for t in queued if worker in self._ran.get(tasks[t][0], ())), None)
            if task is None:
                task = self._new_key_task(worker, tasks, queued)
            if task is None:
                left.append(worker)
            else:
                yield self._take(worker, task, tasks, queued)
        for worker in left:
            if queued:
                yield self._take(worker, queued[-1], tasks, queued)

    def _new_key_task(
        self, worker: int, tasks: list[tuple[Hashable, Any]], queued: list[int]
    ) -> int | None:
        """The first queued task of a key no worker ran, by preference of a group `worker`
        ran, else of a group no worker ran; None where every queued key ran somewhere."""

        def rank(task: int) -> int:  # 0: its group ran here; 1: nowhere; 2: elsewhere only
            ran = self._ran_group.get(self.group_of(tasks[task][0]), set())
            return 0 if worker in ran else 1 if not ran else 2

        new = (t for t in queued if tasks[t][0] not in self._ran)
        return min(new, key=rank, default=None)  # the first queued of the best rank

    def _take(
        self, worker: int, task: int, tasks: list[tuple[Hashable, Any]], queued: list[int]
    ) -> tuple[int, int]:
        """`task` off `queued` for `worker`, which runs its key from now on too."""
        queued.remove(task)
        key = tasks[task][0]
        self._ran.setdefault(key, set()).add(worker)
        self._ran_group.setdefault(self.group_of(key), set()).add(worker)
        return worker, task

    def _result(self, future: Future) -> Any:
        try:
            return future.result()
        except BrokenProcessPool as e:
            raise PlanningError(
                f"a worker process planning layer ILPs died ({e}); set "
                f"{PROCESSES_ENV}=0 to plan them on threads in this process instead"
            ) from None

    def _submit(self, worker: int, key: Hashable, argument: Any) -> Future:
        with warnings.catch_warnings():
            # JAX (and Python >= 3.12) warn that a fork of a multithreaded process may
            # deadlock; the children run no JAX or XLA code (see the module docstring)
            warnings.filterwarnings("ignore", message=r".*fork\(\)", category=RuntimeWarning)
            warnings.filterwarnings("ignore", message=r".*fork\(\)", category=DeprecationWarning)
            return self._pools[worker].submit(_run, self._token, key, argument)
