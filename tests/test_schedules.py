"""Pipeline schedules: complete, dependency-respecting clock tables of the promised length."""

import dataclasses

import numpy as np
import pytest

from autopar.planner.errors import InvalidArgumentError
from autopar.planner.schedules import (
    AUTO_SCHEDULE,
    WORK_SHARE,
    PipelineSchedule,
    Schedule,
    Task,
    TaskKind,
    _simulate,
    candidate_schedules,
    make_schedule,
)


def F(stage, micro_batch):
    return Task(TaskKind.FORWARD, stage, micro_batch)


def B(stage, micro_batch):
    return Task(TaskKind.BACKWARD, stage, micro_batch)


def A(stage):
    return Task(TaskKind.APPLY, stage, None)


def I(stage, micro_batch):  # noqa: E743 - zero bubble's B: the input gradient
    return Task(TaskKind.BACKWARD_INPUT, stage, micro_batch)


def W(stage, micro_batch):
    return Task(TaskKind.BACKWARD_WEIGHT, stage, micro_batch)


SIZES = [(n, m) for n in range(1, 7) for m in range(1, 10)]
WHOLE_BACKWARD = ("gpipe", "1f1b")
ONE_STAGE_PER_MESH = tuple(s.value for s in PipelineSchedule if not s.interleaves)
# (meshes n, stages per mesh v, micro-batches m): m a multiple of n
INTERLEAVED = [(n, v, k * n) for n in range(1, 5) for v in range(1, 4) for k in (1, 2, 3)]


@pytest.mark.parametrize("name", WHOLE_BACKWARD)
@pytest.mark.parametrize(("n", "m"), SIZES)
def test_schedule_is_complete_valid_and_takes_2_n_plus_m_minus_1_clocks(name, n, m):
    schedule = make_schedule(name, n, m)
    schedule.validate()
    assert schedule.num_compute_clocks == 2 * (n + m - 1)
    assert schedule.clocks[-1] == tuple(A(i) for i in range(n))
    compute = [task for row in schedule.clocks[:-1] for task in row if task is not None]
    assert all(task.kind is not TaskKind.APPLY for task in compute)
    for mesh in range(n):
        tasks = schedule.tasks_of_mesh(mesh)
        assert all(task.stage == mesh for task in tasks)
        assert sorted(t.micro_batch for t in tasks if t.kind is TaskKind.FORWARD) == list(range(m))
        assert sorted(t.micro_batch for t in tasks if t.kind is TaskKind.BACKWARD) == list(range(m))
        assert tasks[-1] == A(mesh)
    assert len(compute) == 2 * n * m


@pytest.mark.parametrize("name", WHOLE_BACKWARD)
def test_clock_count_up_to_8_stages_and_16_micro_batches(name):
    for n in range(1, 9):
        for m in range(1, 17):
            assert make_schedule(name, n, m).num_compute_clocks == 2 * (n + m - 1), (n, m)


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_zero_bubble_is_complete_valid_and_fills_the_bubble_with_weight_gradients(n, m):
    """3m + 2(n−1) clocks with F, B and W one clock each, against 3(m + n − 1) for 1F1B whose
    backward takes two; every W after its B; 1F1B's micro-batches in flight."""
    schedule = make_schedule("zero_bubble", n, m)
    schedule.validate()
    assert schedule.split_backward
    assert schedule.num_compute_clocks == 3 * m + 2 * (n - 1)
    for mesh in range(n):
        tasks = schedule.tasks_of_mesh(mesh)
        for kind in (TaskKind.FORWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT):
            assert [t.micro_batch for t in tasks if t.kind is kind] == list(range(m))
        assert not any(t.kind is TaskKind.BACKWARD for t in tasks)
        assert schedule.max_in_flight(mesh) == min(n - mesh, m)


def test_zero_bubble_table_by_hand():
    schedule = make_schedule("zero_bubble", 2, 3)
    assert schedule.to_text() == (
        "zero_bubble: 2 stages, 3 micro-batches, 11 compute clocks + 1 apply clock\n"
        "mesh 0: F0 F1 .  B0 W0 F2 B1 W1 .  B2 W2 A\n"
        "mesh 1: .  F0 B0 W0 F1 B1 W1 F2 B2 W2 .  A"
    )
    assert schedule.dependencies(I(0, 1)) == (F(0, 1), I(1, 1))
    assert schedule.dependencies(W(0, 1)) == (I(0, 1),)
    assert schedule.dependencies(A(1)) == (W(1, 0), W(1, 1), W(1, 2))
    early = _swapped_on_mesh_0(schedule, 3, 4)  # W0 before B0 on mesh 0
    with pytest.raises(
        ValueError,
        match=r"backward_weight\(stage=0, micro_batch=0\) runs at clock 3 but its dependency "
        r"backward_input",
    ):
        early.validate()


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_in_flight_micro_batches(n, m):
    """What the planner asks without a table equals what the table keeps in flight."""
    for name in ONE_STAGE_PER_MESH:
        schedule = make_schedule(name, n, m)
        for mesh in range(n):
            planned = PipelineSchedule.parse(name).in_flight(n - 1 - mesh, m)
            assert schedule.max_in_flight(mesh) == planned, (name, mesh)
    one_f_one_b, gpipe = make_schedule("1f1b", n, m), make_schedule("gpipe", n, m)
    for mesh in range(n):
        assert one_f_one_b.max_in_flight(mesh) == min(n - mesh, m)
        assert gpipe.max_in_flight(mesh) == m


@pytest.mark.parametrize("name", ONE_STAGE_PER_MESH)
@pytest.mark.parametrize(("n", "m"), [(1, 1), (2, 3), (4, 8), (4, 2), (6, 9)])
def test_step_time_is_the_table_timed_for_equal_stages(name, n, m):
    """c·Σ t + (m − c)·max t is the table's makespan when every stage takes t per micro-batch,
    each task its WORK_SHARE of it."""
    schedule = PipelineSchedule.parse(name)
    times = schedule.table(n, m).timed(lambda task: WORK_SHARE[task.kind] * 3.0)
    assert max(end for _, end in times.values()) == pytest.approx(schedule.step_time([3.0] * n, m))


@pytest.mark.parametrize(("n", "v", "m"), INTERLEAVED)
def test_interleaved_table_is_valid_shares_meshes_and_shrinks_the_bubble(n, v, m):
    """n·v stages on n meshes, stage s on mesh s mod n; 2mv + 2(n−1) clocks of chunk work (1F1B:
    2(m + n − 1) clocks of v chunks each); the stage DP's formula is the table timed; what the
    planner reads per stage is what the table holds."""
    schedule = make_schedule("interleaved_1f1b", n * v, m, n)
    schedule.validate()
    assert (schedule.num_meshes, schedule.stages_per_mesh) == (n, v)
    assert schedule.num_compute_clocks == 2 * m * v + 2 * (n - 1)
    for mesh in range(n):
        tasks = schedule.tasks_of_mesh(mesh)
        assert {t.stage for t in tasks} == {mesh + c * n for c in range(v)}
    assert schedule.clocks[-v:] == tuple(tuple(A(r * n + i) for i in range(n)) for r in range(v))
    interleaved = PipelineSchedule.INTERLEAVED_1F1B
    times = schedule.timed(lambda task: WORK_SHARE[task.kind] * 3.0)
    makespan = max(end for _, end in times.values())
    assert makespan == pytest.approx(3.0 * (m * v + n - 1))
    assert makespan == pytest.approx(interleaved.step_time([3.0] * (n * v), m, n))
    in_flight = interleaved.stage_in_flight(n * v, m, n)
    assert in_flight == tuple(schedule.max_in_flight(s) for s in range(n * v))
    for s, flight in enumerate(in_flight):  # the bound the squeezes use
        assert flight <= interleaved.in_flight(n * v - 1 - s, m)
    assert in_flight[0] == min(m, 2 * n if v > 1 else n)


def test_interleaved_table_by_hand():
    """Megatron-LM's order: forwards through chunk a then b, n micro-batches at a time."""
    text = make_schedule("interleaved_1f1b", 4, 4, 2).to_text()
    assert text.splitlines() == [
        "interleaved_1f1b: 4 stages on 2 meshes, 4 micro-batches, 18 compute clocks + 2 apply "
        "clocks",
        "mesh 0: F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a .   B2b .   B3b B2a B3a Aa  Ab",
        "mesh 1: .   F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a .   Aa  Ab",
    ]


def test_step_time_uses_the_busiest_mesh():
    """Unequal stages: the steady state runs at the pace of the mesh with the most work."""
    interleaved = PipelineSchedule.INTERLEAVED_1F1B
    latencies = [1.0, 2.0, 3.0, 1.0]  # mesh 0: 1 + 3, mesh 1: 2 + 1
    assert interleaved.step_time(latencies, 8, 2) == pytest.approx(7 / 2 + (8 - 1 / 2) * 4)
    assert PipelineSchedule.ONE_F_ONE_B.step_time(latencies, 8) == pytest.approx(7 + 7 * 3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("interleaved_1f1b", 4, 4), "needs num_meshes"),
        (("interleaved_1f1b", 5, 4, 2), "num_stages=5 is not a multiple of num_meshes=2"),
        (("interleaved_1f1b", 4, 3, 2), "num_micro_batches=3 must be a multiple of the 2"),
        (("1f1b", 4, 4, 2), "use pipeline_schedule='interleaved_1f1b' to share meshes"),
    ],
)
def test_interleaved_bad_inputs(args, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make_schedule(*args)


def test_candidate_schedules():
    assert candidate_schedules("gpipe") == (PipelineSchedule.GPIPE,)
    assert set(candidate_schedules(AUTO_SCHEDULE)) == set(PipelineSchedule)
    assert candidate_schedules(AUTO_SCHEDULE)[0] is PipelineSchedule.ONE_F_ONE_B
    with pytest.raises(InvalidArgumentError, match="'2f2b' is unknown"):
        candidate_schedules("2f2b")


def test_gpipe_table_by_hand():
    expected = (
        (F(0, 0), None),
        (F(0, 1), F(1, 0)),
        (None, F(1, 1)),
        (None, B(1, 0)),
        (B(0, 0), B(1, 1)),
        (B(0, 1), None),
        (A(0), A(1)),
    )
    assert make_schedule("gpipe", 2, 2).clocks == expected


def test_one_f_one_b_table_by_hand():
    expected = (
        (F(0, 0), None),
        (F(0, 1), F(1, 0)),
        (None, B(1, 0)),
        (B(0, 0), F(1, 1)),
        (F(0, 2), B(1, 1)),
        (B(0, 1), F(1, 2)),
        (None, B(1, 2)),
        (B(0, 2), None),
        (A(0), A(1)),
    )
    schedule = make_schedule("1f1b", 2, 3)
    assert schedule.clocks == expected
    assert schedule.to_text() == (
        "1f1b: 2 stages, 3 micro-batches, 8 compute clocks + 1 apply clock\n"
        "mesh 0: F0 F1 .  B0 F2 B1 .  B2 A\n"
        "mesh 1: .  F0 B0 F1 B1 F2 B2 .  A"
    )


def test_dependencies():
    schedule = make_schedule("1f1b", 3, 2)
    assert schedule.dependencies(F(0, 1)) == ()
    assert schedule.dependencies(F(2, 1)) == (F(1, 1),)
    assert schedule.dependencies(B(1, 0)) == (F(1, 0), B(2, 0))
    assert schedule.dependencies(B(2, 0)) == (F(2, 0),)
    assert schedule.dependencies(A(1)) == (B(1, 0), B(1, 1))


def _with_cell(schedule, clock, mesh, task):
    rows = [list(row) for row in schedule.clocks]
    rows[clock][mesh] = task
    return dataclasses.replace(schedule, clocks=tuple(tuple(row) for row in rows))


def _swapped_on_mesh_0(schedule, clock_a, clock_b):
    rows = [list(row) for row in schedule.clocks]
    rows[clock_a][0], rows[clock_b][0] = rows[clock_b][0], rows[clock_a][0]
    return dataclasses.replace(schedule, clocks=tuple(tuple(row) for row in rows))


GOOD = make_schedule("1f1b", 2, 3)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (
            _swapped_on_mesh_0(GOOD, 0, 1),
            r"forward\(stage=1, micro_batch=0\) runs at clock 1 but its dependency "
            r"forward\(stage=0, micro_batch=0\) runs at clock 1",
        ),
        (_swapped_on_mesh_0(GOOD, 3, 2), r"backward\(stage=0, micro_batch=0\) runs at clock 2"),
        (_with_cell(GOOD, 2, 0, F(1, 2)), r"forward\(stage=1, micro_batch=2\) runs on mesh 0"),
        (_with_cell(GOOD, 2, 0, F(0, 1)), r"forward\(stage=0, micro_batch=1\) runs twice"),
        (_with_cell(GOOD, 2, 0, F(0, 3)), r"is not a task of 3 micro-batches"),
        (_with_cell(GOOD, 7, 0, None), r"1 tasks never run, e.g. backward\(stage=0, micro_batch=2"),
        (_with_cell(GOOD, 8, 1, None), r"the last 1 clock\(s\) must apply every stage"),
        (
            dataclasses.replace(GOOD, clocks=GOOD.clocks[:1] + ((None,),) + GOOD.clocks[1:]),
            "clock 1 has 1 meshes, expected 2",
        ),
    ],
)
def test_validate_rejects_broken_tables(broken, message):
    with pytest.raises(ValueError, match=message):
        broken.validate()


def test_simulation_reports_deadlock_instead_of_hanging():
    orders = [[B(0, 0), F(0, 0)], [F(1, 0), B(1, 0)]]
    with pytest.raises(RuntimeError, match="deadlock at clock 0"):
        _simulate("broken", orders, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("zero-bubble", 2, 2), r"schedule name='zero-bubble' is unknown; choose one of \('gpipe'"),
        (("zero_bubble", 0, 2), "num_stages=0 must be a positive integer"),
        (("1f1b", 0, 2), "num_stages=0 must be a positive integer"),
        (("gpipe", 2, -1), "num_micro_batches=-1 must be a positive integer"),
        (("1f1b", 2.0, 2), "num_stages=2.0 must be a positive integer"),
        (("1f1b", 2, True), "num_micro_batches=True must be a positive integer"),
    ],
)
def test_bad_arguments_name_the_argument(args, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make_schedule(*args)


def test_numpy_integers_are_accepted():
    assert make_schedule("gpipe", np.int64(2), np.int32(3)) == make_schedule("gpipe", 2, 3)


def test_bad_task_and_mesh():
    with pytest.raises(ValueError, match="apply tasks take None"):
        Task(TaskKind.FORWARD, 0, None)
    with pytest.raises(InvalidArgumentError, match="mesh=2 is out of range"):
        GOOD.tasks_of_mesh(2)


def test_wide_tables_are_truncated_to_the_width():
    schedule = make_schedule("1f1b", 16, 1024)
    assert schedule.num_compute_clocks == 2 * (16 + 1024 - 1)
    assert [schedule.max_in_flight(i) for i in range(16)] == list(range(16, 0, -1))
    lines = schedule.to_text(max_width=80).splitlines()
    assert len(lines) == 17
    assert all(len(line) <= 80 and " ... " in line for line in lines[1:])
    assert lines[1].startswith("mesh 0:  F0 ") and lines[1].endswith(" B1023 A")
    assert lines[16].startswith("mesh 15: .  ")


def test_schedule_is_plain_frozen_data():
    assert isinstance(GOOD, Schedule)
    with pytest.raises(dataclasses.FrozenInstanceError):
        GOOD.name = "gpipe"
    assert hash(GOOD) == hash(make_schedule("1f1b", 2, 3))
