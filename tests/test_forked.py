"""Worker processes forked for the layer ILPs (`planner.forked`): tasks run in other processes,
a key again where it ran unless a free worker takes it from a busy one, results and autopar's
errors come back, a dead worker is a PlanningError that says what to change, and the process
count's setting is checked."""

import os
import time

import pytest

from autopar.planner.errors import InvalidArgumentError, MemoryBudgetError, PlanningError
from autopar.planner.forked import PROCESSES_ENV, ForkedWorkers, process_count

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forked workers need fork")


def _whose(key, argument):
    time.sleep(argument)
    return os.getpid(), key, argument


def test_tasks_run_in_forked_workers_a_key_again_where_it_ran():
    with ForkedWorkers(2, _whose, ["a", "b"]) as workers:
        first = list(workers.map([("a", 0), ("b", 0)]))
        again = list(workers.map([("b", 0), ("a", 0)]))  # both workers free: each its own key
    assert [(key, argument) for _, key, argument in again] == [("b", 0), ("a", 0)]  # in order
    pids = {key: pid for pid, key, _ in first}
    assert pids["a"] != pids["b"]  # the keys are spread over both workers
    assert {key: pid for pid, key, _ in again} == pids  # and run again where they ran
    assert os.getpid() not in pids.values()


def test_a_free_worker_takes_a_queued_task_of_a_busy_one():
    with ForkedWorkers(2, _whose, ["a", "b"]) as workers:
        first = {key: pid for pid, key, _ in workers.map([("a", 0), ("b", 0)])}
        # a's worker sleeps on its first task; b's worker, done at once, takes a's second
        again = list(workers.map([("a", 2), ("a", 0), ("b", 0)]))
    assert [pid for pid, *_ in again] == [first["a"], first["b"], first["b"]]


def _started(key, argument):
    started = time.monotonic()
    time.sleep(argument)
    return os.getpid(), key, started


def test_a_new_key_goes_to_a_worker_of_its_group_or_of_none():
    keys = ["a1", "a2", "b1", "b2"]
    with ForkedWorkers(2, _started, keys, group_of=lambda key: key[0]) as workers:
        tasks = [("a1", 0.5), ("a2", 0), ("b1", 0), ("b2", 0)]
        ran = {key: (pid, started) for pid, key, started in workers.map(tasks)}
    # a1 keeps one worker busy; the other takes b1 (a group no worker ran) before a2 (a1's
    # group), then b2 (its own group): a2 waits for a worker with nothing better to do
    assert ran["b1"][0] == ran["b2"][0] != ran["a1"][0]
    assert ran["b1"][1] < ran["b2"][1] < ran["a2"][1]


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
