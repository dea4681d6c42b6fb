"""Worker processes forked for the layer ILPs (`planner.forked`): tasks run in other processes,
each key in one worker for good, results and autopar's errors come back, a dead worker is a
PlanningError that says what to change, and the process count's setting is checked."""

import os

import pytest

from autopar.planner.errors import InvalidArgumentError, MemoryBudgetError, PlanningError
from autopar.planner.forked import PROCESSES_ENV, ForkedWorkers, process_count

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forked workers need fork")


def _whose(key, argument):
    return os.getpid(), key, argument


def test_tasks_run_in_forked_workers_each_key_in_one():
    tasks = [(key, level) for level in range(3) for key in ("a", "b", "c", "d")]
    with ForkedWorkers(2, _whose, ["a", "b", "c", "d"]) as workers:
        results = list(workers.map(tasks))
    assert [(key, level) for _, key, level in results] == tasks  # in order
    pids = {key: {pid for pid, k, _ in results if k == key} for key in "abcd"}
    assert all(len(p) == 1 for p in pids.values()), pids  # a key stays in its worker
    assert len(set.union(*pids.values())) == 2  # the keys are spread over both
    assert os.getpid() not in set.union(*pids.values())


def test_a_key_not_registered_before_the_fork_is_refused():
    with ForkedWorkers(2, _whose, ["a"]) as workers, pytest.raises(PlanningError, match="'b'"):
        list(workers.map([("b", 0)]))


def _over_budget(key, argument):
    raise MemoryBudgetError(f"layer {key} does not fit", 2.0**30, 3.0 * 2**30)


def test_an_error_in_a_worker_is_raised_here_whole():
    fits = pytest.raises(MemoryBudgetError, match="layer a does not fit")
    with ForkedWorkers(2, _over_budget, ["a"]) as workers, fits as caught:
        list(workers.map([("a", 0)]))
    assert (caught.value.budget, caught.value.least) == (2.0**30, 3.0 * 2**30)


def _dies(key, argument):
    os._exit(3)


def test_a_worker_that_dies_is_a_planning_error_naming_the_setting():
    named = pytest.raises(PlanningError, match=f"{PROCESSES_ENV}=0")
    with ForkedWorkers(2, _dies, ["a"]) as workers, named:
        list(workers.map([("a", 0)]))


def test_process_count_setting(monkeypatch):
    monkeypatch.setenv(PROCESSES_ENV, "0")
    assert process_count() == 0
    monkeypatch.setenv(PROCESSES_ENV, "1")
    assert process_count() == 0  # one process: plan on threads here
    monkeypatch.setenv(PROCESSES_ENV, "3")
    assert process_count() == (3 if os.uname().sysname == "Linux" else 0)
    monkeypatch.setenv(PROCESSES_ENV, "many")
    with pytest.raises(InvalidArgumentError, match=f"{PROCESSES_ENV}.*'many'"):
        process_count()
