"""Pipeline schedules: explicit clock tables that every executor iterates, and what the planner
asks of a schedule before any table exists (micro-batches in flight, step time).

A pipelined step has n stages on n meshes (forward stage i and its backward both run on mesh i)
and m micro-batches. A schedule is one task order per mesh; its table is the synchronous simulation
of those orders: every task takes one clock, and at each clock each mesh runs its next task if all
of the task's dependencies ran at earlier clocks, else it idles. After the compute clocks comes one
clock in which every mesh applies its accumulated gradients.

GPipe and 1F1B take 2(n+m-1) compute clocks (REFERENCE.md "Schedules"): GPipe keeps all m
micro-batches in flight on every mesh, 1F1B (PipeDream-flush) at most n-i on mesh i. Zero bubble
(ZB-H1's idea, arXiv 2401.10241) splits each backward into the gradient with respect to the
stage's inputs (B, on the critical path) and with respect to its parameters (W, deferrable); W
tasks fill the clocks where 1F1B idles. With F, B and W one clock each it takes 3m + 2(n-1)
clocks against 1F1B's 3(m+n-1) with the backward as one task of two clocks, and keeps 1F1B's
micro-batches in flight (counted until their W).

The planner prices a schedule by `PipelineSchedule.step_time`: c·Σ t + (m−c)·max t over the
stages' latencies t (forward and backward of one micro-batch), where c is the share of the
pipeline fill and drain the schedule leaves idle: 1 for GPipe and 1F1B (Alpa's Σ t + (m−1)·max t),
2/3 for zero bubble (its W third of the backward work fills the rest). Exact for equal stages
whose forward, B and W parts take a third of t each.

>>> print(make_schedule("1f1b", 2, 3).to_text())
1f1b: 2 stages, 3 micro-batches, 8 compute clocks + 1 apply clock
mesh 0: F0 F1 .  B0 F2 B1 .  B2 A
mesh 1: .  F0 B0 F1 B1 F2 B2 .  A
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

from autopar.planner.errors import InvalidArgumentError, check_positive_int


class TaskKind(enum.Enum):
    """What a mesh does in one clock."""

    FORWARD = "forward"
    BACKWARD = "backward"  # the whole backward of a micro-batch (GPipe, 1F1B)
    BACKWARD_INPUT = "backward_input"  # zero bubble's B: the cotangents of the stage's inputs
    BACKWARD_WEIGHT = "backward_weight"  # zero bubble's W: the parameters' gradients
    APPLY = "apply"


# The task that adds a micro-batch's parameter gradients, and so ends its stay on the mesh.
GRADIENT_KINDS = (TaskKind.BACKWARD, TaskKind.BACKWARD_WEIGHT)

# Each task's share of a stage's time per micro-batch: a backward does about twice a forward's
# FLOPs, split evenly between the input and the weight gradients.
WORK_SHARE = {
    TaskKind.FORWARD: 1 / 3,
    TaskKind.BACKWARD: 2 / 3,
    TaskKind.BACKWARD_INPUT: 1 / 3,
    TaskKind.BACKWARD_WEIGHT: 1 / 3,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    """One clock of work on mesh `stage`; APPLY has no micro-batch, the others need one."""

    kind: TaskKind
    stage: int
    micro_batch: int | None

    def __post_init__(self) -> None:
        if (self.kind is TaskKind.APPLY) != (self.micro_batch is None):
            raise ValueError(
                f"{self.kind.value} task of stage {self.stage} has micro_batch={self.micro_batch}; "
                "apply tasks take None, forward and backward tasks a micro-batch index"
            )

    def __str__(self) -> str:
        if self.kind is TaskKind.APPLY:
            return f"apply(stage={self.stage})"
        return f"{self.kind.value}(stage={self.stage}, micro_batch={self.micro_batch})"


def _dependencies(
    task: Task, num_stages: int, num_micro_batches: int, split: bool
) -> tuple[Task, ...]:
    """Tasks whose outputs `task` reads: activations flow up the stages, gradients down; `split`:
    the backward is B and W tasks."""
    stage, micro_batch = task.stage, task.micro_batch
    if task.kind is TaskKind.FORWARD:
        return (Task(TaskKind.FORWARD, stage - 1, micro_batch),) if stage > 0 else ()
    if task.kind in (TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT):
        own_forward = Task(TaskKind.FORWARD, stage, micro_batch)
        if stage == num_stages - 1:
            return (own_forward,)
        return (own_forward, Task(task.kind, stage + 1, micro_batch))
    if task.kind is TaskKind.BACKWARD_WEIGHT:
        return (Task(TaskKind.BACKWARD_INPUT, stage, micro_batch),)
    gradients = TaskKind.BACKWARD_WEIGHT if split else TaskKind.BACKWARD
    return tuple(Task(gradients, stage, j) for j in range(num_micro_batches))


def _kinds(split: bool) -> tuple[TaskKind, ...]:
    """The kinds of a micro-batch's tasks."""
    if split:
        return (TaskKind.FORWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT)
    return (TaskKind.FORWARD, TaskKind.BACKWARD)


def _all_tasks(num_stages: int, num_micro_batches: int, split: bool) -> set[Task]:
    """Every task a complete schedule runs exactly once."""
    tasks = {Task(TaskKind.APPLY, i, None) for i in range(num_stages)}
    for kind in _kinds(split):
        tasks.update(Task(kind, i, j) for i in range(num_stages) for j in range(num_micro_batches))
    return tasks


_LETTERS = {
    TaskKind.FORWARD: "F",
    TaskKind.BACKWARD: "B",
    TaskKind.BACKWARD_INPUT: "B",
    TaskKind.BACKWARD_WEIGHT: "W",
}


def _cell(task: Task | None) -> str:
    if task is None:
        return "."
    if task.kind is TaskKind.APPLY:
        return "A"
    return f"{_LETTERS[task.kind]}{task.micro_batch}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`clocks[t][mesh]` is the task mesh runs at clock t (None: idle); the last clock applies."""

    name: str
    num_stages: int
    num_micro_batches: int
    clocks: tuple[tuple[Task | None, ...], ...]
    split_backward: bool = False  # backward as B and W tasks (zero bubble)

    @property
    def num_compute_clocks(self) -> int:
        """Clocks of forward and backward work, i.e. all but the apply clock."""
        return len(self.clocks) - 1

    def _check_mesh(self, mesh: int) -> None:
        if not 0 <= mesh < self.num_stages:
            raise InvalidArgumentError(
                f"mesh={mesh} is out of range for a schedule of {self.num_stages} stages"
            )

    def tasks_of_mesh(self, mesh: int) -> list[Task]:
        """The tasks mesh runs, in clock order: what one mesh's worker executes."""
        self._check_mesh(mesh)
        return [row[mesh] for row in self.clocks if row[mesh] is not None]

    def max_in_flight(self, mesh: int) -> int:
        """Most micro-batches forwarded but whose parameter gradients are not yet computed on
        mesh (their activations' memory)."""
        in_flight = peak = 0
        for task in self.tasks_of_mesh(mesh):
            if task.kind is TaskKind.FORWARD:
                in_flight += 1
                peak = max(peak, in_flight)
            elif task.kind in GRADIENT_KINDS:
                in_flight -= 1
        return peak

    def dependencies(self, task: Task) -> tuple[Task, ...]:
        """Tasks that must finish before `task` starts (an executor waits on their outputs)."""
        return _dependencies(task, self.num_stages, self.num_micro_batches, self.split_backward)

    def timed(self, duration: Callable[[Task], float]) -> dict[Task, tuple[float, float]]:
        """(Start, end) of every compute task when each takes `duration(task)` seconds: in the
        table's order on its mesh, starting when the mesh is free and its dependencies have
        ended (transfers take no time)."""
        times: dict[Task, tuple[float, float]] = {}
        free = [0.0] * self.num_stages
        for row in self.clocks:
            for task in row:
                if task is None or task.kind is TaskKind.APPLY:
                    continue
                ready = max((times[dep][1] for dep in self.dependencies(task)), default=0.0)
                start = max(free[task.stage], ready)
                free[task.stage] = start + duration(task)
                times[task] = (start, free[task.stage])
        return times

    def validate(self) -> None:
        """Raise ValueError unless every task runs once, on its own mesh, after its dependencies."""
        n, m = self.num_stages, self.num_micro_batches
        if not self.clocks or self.clocks[-1] != tuple(
            Task(TaskKind.APPLY, i, None) for i in range(n)
        ):
            raise ValueError(f"{self.name}: the last clock must be apply(stage=i) on every mesh i")
        expected = _all_tasks(n, m, self.split_backward)
        clock_of: dict[Task, int] = {}
        for clock, row in enumerate(self.clocks):
            if len(row) != n:
                raise ValueError(f"{self.name}: clock {clock} has {len(row)} meshes, expected {n}")
            for mesh, task in enumerate(row):
                if task is None:
                    continue
                if task.stage != mesh:
                    raise ValueError(f"{self.name}: {task} runs on mesh {mesh} at clock {clock}")
                if task not in expected:
                    raise ValueError(
                        f"{self.name}: {task} at clock {clock} is not a task of {m} micro-batches"
                    )
                if task in clock_of:
                    raise ValueError(
                        f"{self.name}: {task} runs twice, at clocks {clock_of[task]} and {clock}"
                    )
                clock_of[task] = clock
        missing = expected - clock_of.keys()
        if missing:
            first = min(missing, key=lambda t: (t.stage, t.kind.value, t.micro_batch or 0))
            raise ValueError(f"{self.name}: {len(missing)} tasks never run, e.g. {first}")
        for task, clock in clock_of.items():
            for dep in self.dependencies(task):
                if clock_of[dep] >= clock:
                    raise ValueError(
                        f"{self.name}: {task} runs at clock {clock} but its dependency {dep} "
                        f"runs at clock {clock_of[dep]}"
                    )

    def to_text(self, max_width: int = 100) -> str:
        """A grid (rows: meshes, columns: clocks) for plan summaries; wide tables keep both ends.

        Lines stay within `max_width` characters by eliding middle clocks as "...", but always
        show at least the first clock, the last compute clock and the apply clock.
        """
        cell_width = max(len(_cell(task)) for row in self.clocks for task in row)
        label_width = len(f"mesh {self.num_stages - 1}: ")
        fits = max(4, (max_width - label_width) // (cell_width + 1))
        columns: list[int | None] = list(range(len(self.clocks)))
        if len(columns) > fits:
            head = (fits - 1) // 2
            columns = [*columns[:head], None, *columns[head + 1 - fits :]]
        lines = [
            f"{self.name}: {self.num_stages} stages, {self.num_micro_batches} micro-batches, "
            f"{self.num_compute_clocks} compute clocks + 1 apply clock"
        ]
        for mesh in range(self.num_stages):
            cells = [
                "..." if t is None else _cell(self.clocks[t][mesh]).ljust(cell_width)
                for t in columns
            ]
            lines.append(f"mesh {mesh}: ".ljust(label_width) + " ".join(cells).rstrip())
        return "\n".join(lines)


def _simulate(name: str, orders: Sequence[Sequence[Task]], num_micro_batches: int) -> Schedule:
    """The clock table of per-mesh task orders, each task running as early as its order allows."""
    num_stages = len(orders)
    split = any(t.kind is TaskKind.BACKWARD_INPUT for order in orders for t in order)
    clock_of: dict[Task, int] = {}
    position = [0] * num_stages
    clocks: list[tuple[Task | None, ...]] = []
    while any(p < len(order) for p, order in zip(position, orders, strict=True)):
        clock = len(clocks)
        row: list[Task | None] = [None] * num_stages
        for mesh, order in enumerate(orders):
            if position[mesh] == len(order):
                continue
            task = order[position[mesh]]
            deps = _dependencies(task, num_stages, num_micro_batches, split)
            # A dependency not yet in clock_of has not run; default it to "now", which is too late.
            if all(clock_of.get(dep, clock) < clock for dep in deps):
                row[mesh] = task
        if not any(row):
            raise RuntimeError(f"{name}: per-mesh task orders deadlock at clock {clock}")
        for mesh, task in enumerate(row):
            if task is not None:
                clock_of[task] = clock
                position[mesh] += 1
        clocks.append(tuple(row))
    clocks.append(tuple(Task(TaskKind.APPLY, i, None) for i in range(num_stages)))
    schedule = Schedule(name, num_stages, num_micro_batches, tuple(clocks), split)
    schedule.validate()
    return schedule


def _gpipe_order(stage: int, num_micro_batches: int) -> list[Task]:
    return [Task(TaskKind.FORWARD, stage, j) for j in range(num_micro_batches)] + [
        Task(TaskKind.BACKWARD, stage, j) for j in range(num_micro_batches)
    ]


def _one_f_one_b_order(stage: int, num_stages: int, num_micro_batches: int) -> list[Task]:
    warmup = min(num_stages - stage - 1, num_micro_batches)
    order = [Task(TaskKind.FORWARD, stage, j) for j in range(warmup)]
    for j in range(num_micro_batches - warmup):
        order += [Task(TaskKind.FORWARD, stage, warmup + j), Task(TaskKind.BACKWARD, stage, j)]
    order += [
        Task(TaskKind.BACKWARD, stage, j)
        for j in range(num_micro_batches - warmup, num_micro_batches)
    ]
    return order


def _zero_bubble_orders(num_stages: int, num_micro_batches: int) -> list[list[Task]]:
    """Per mesh, the order in which a greedy list scheduler runs its tasks, one clock each: at
    every clock a mesh runs its next B if its inputs are there (the critical path), else its next
    forward if fewer than 1F1B's min(n−i, m) micro-batches are in flight (counted until their
    W), else its next W; a micro-batch's tasks run in micro-batch order."""
    n, m = num_stages, num_micro_batches
    done: dict[Task, int] = {}
    count = {kind: [0] * n for kind in _kinds(True)}
    orders: list[list[Task]] = [[] for _ in range(n)]
    clock = 0
    while len(done) < 3 * n * m:
        ran = []
        for s in range(n):
            limit = min(n - s, m)
            for kind in (TaskKind.BACKWARD_INPUT, TaskKind.FORWARD, TaskKind.BACKWARD_WEIGHT):
                j = count[kind][s]
                if j == m:
                    continue
                task = Task(kind, s, j)
                in_flight = count[TaskKind.FORWARD][s] - count[TaskKind.BACKWARD_WEIGHT][s]
                if kind is TaskKind.FORWARD and in_flight >= limit:
                    continue
                deps = _dependencies(task, n, m, split=True)
                if all(done.get(dep, clock) < clock for dep in deps):
                    ran.append(task)
                    break
        for task in ran:
            done[task] = clock
            count[task.kind][task.stage] += 1
            orders[task.stage].append(task)
        clock += 1
    return orders


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    """All forwards as a wavefront, then all backwards from the last stage: simple, m in flight.

    Mesh i runs forward j at clock i+j and backward j at clock (n+m-1) + (n-1-i) + j.
    """
    n = check_positive_int("num_stages", num_stages)
    m = check_positive_int("num_micro_batches", num_micro_batches)
    return _simulate("gpipe", [_gpipe_order(i, m) for i in range(n)], m)


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """PipeDream-flush: as fast as GPipe, but at most n-i micro-batches' activations on mesh i.

    Mesh i runs min(n-i-1, m) warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards (Alpa's PipeDreamFlush). Simulated with one clock per task, this
    plain order already takes 2(n+m-1) compute clocks, the same as GPipe.
    """
    n = check_positive_int("num_stages", num_stages)
    m = check_positive_int("num_micro_batches", num_micro_batches)
    return _simulate("1f1b", [_one_f_one_b_order(i, n, m) for i in range(n)], m)


def zero_bubble(num_stages: int, num_micro_batches: int) -> Schedule:
    """Backward split into B and W; W tasks fill the bubble, 1F1B's micro-batches in flight.

    3m + 2(n−1) compute clocks (`_zero_bubble_orders`), where 1F1B with its backward as two
    clocks takes 3(m + n − 1).
    """
    n = check_positive_int("num_stages", num_stages)
    m = check_positive_int("num_micro_batches", num_micro_batches)
    return _simulate("zero_bubble", _zero_bubble_orders(n, m), m)


class PipelineSchedule(enum.Enum):
    """The schedules a pipeline runs, and what the planner asks of one (module docstring)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    ZERO_BUBBLE = "zero_bubble"

    @classmethod
    def parse(cls, name: object) -> PipelineSchedule:
        """The schedule called `name` (one of SCHEDULES); the one place names are parsed."""
        if isinstance(name, cls):
            return name
        for schedule in cls:
            if name == schedule.value:
                return schedule
        raise InvalidArgumentError(f"schedule name={name!r} is unknown; choose one of {SCHEDULES}")

    def table(self, num_stages: int, num_micro_batches: int) -> Schedule:
        """The validated clock table for n stages and m micro-batches."""
        builder = {"gpipe": gpipe, "1f1b": one_f_one_b, "zero_bubble": zero_bubble}[self.value]
        return builder(num_stages, num_micro_batches)

    @property
    def splits_backward(self) -> bool:
        return self is PipelineSchedule.ZERO_BUBBLE

    def in_flight(self, stages_after: int, num_micro_batches: int) -> int:
        """Micro-batches whose activations a stage with `stages_after` stages after it holds at
        once: what its table's `max_in_flight` says, without the table."""
        if self is PipelineSchedule.GPIPE:
            return num_micro_batches
        return min(stages_after + 1, num_micro_batches)

    @property
    def bubble_share(self) -> float:
        """c in `step_time`: the part of one pass through every stage left idle."""
        return 2 / 3 if self is PipelineSchedule.ZERO_BUBBLE else 1.0

    def step_time(self, latencies: Sequence[float], num_micro_batches: int) -> float:
        """Step time of stages taking `latencies` each per micro-batch: c·Σ t + (m − c)·max t."""
        c = self.bubble_share
        return c * sum(latencies) + (num_micro_batches - c) * max(latencies)


SCHEDULES = tuple(s.value for s in PipelineSchedule)
AUTO_SCHEDULE = "auto"


def candidate_schedules(name: str) -> tuple[PipelineSchedule, ...]:
    """The schedule called `name`, or for "auto" every schedule, in order of preference on ties
    (1F1B holds the least; zero bubble splits the backward; GPipe holds every micro-batch)."""
    if name == AUTO_SCHEDULE:
        return (PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.ZERO_BUBBLE, PipelineSchedule.GPIPE)
    return (PipelineSchedule.parse(name),)


def make_schedule(name: str, num_stages: int, num_micro_batches: int) -> Schedule:
    """The clock table of the schedule called `name` (one of SCHEDULES)."""
    return PipelineSchedule.parse(name).table(num_stages, num_micro_batches)
