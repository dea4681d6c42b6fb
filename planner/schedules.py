"""Pipeline schedules: explicit clock tables that every executor iterates, and what the planner
asks of a schedule before any table exists (micro-batches in flight, step time).

A pipelined step has S stages on n meshes and m micro-batches; stage s (its forward and its
backward) runs on mesh s mod n. Without virtual stages S = n; interleaved 1F1B puts v = S/n
stages on every mesh (Megatron-LM's virtual stages: mesh i holds layer chunks i, i+n, ...). A
schedule is one task order per mesh; its table is the synchronous simulation of those orders:
every task takes one clock, and at each clock each mesh runs its next task if all of the task's
dependencies ran at earlier clocks, else it idles. After the compute clocks come v clocks in which
every mesh applies the accumulated gradients of its stages.

GPipe and 1F1B take 2(n+m-1) compute clocks (REFERENCE.md "Schedules"): GPipe keeps all m
micro-batches in flight on every mesh, 1F1B (PipeDream-flush) at most n-i on mesh i. Zero bubble
(ZB-H1's idea, arXiv 2401.10241) splits each backward into the gradient with respect to the
stage's inputs (B, on the critical path) and with respect to its parameters (W, deferrable); W
tasks fill the clocks where 1F1B idles. With F, B and W one clock each it takes 3m + 2(n-1)
clocks against 1F1B's 3(m+n-1) with the backward as one task of two clocks, and keeps 1F1B's
micro-batches in flight (counted until their W). Interleaved 1F1B (Megatron-LM, arXiv
2104.04473) runs each mesh's v chunks in turn, n micro-batches at a time: the fill and drain
pass through chunks of 1/v of a mesh's layers, so the bubble shrinks v-fold, for more
activations in flight: a mesh's first chunk holds up to 2n micro-batches (`stage_in_flight`).

The planner prices a schedule by `PipelineSchedule.step_time`: c·Σ t + (m−c)·max T over the
stages' latencies t (forward and backward of one micro-batch) and the meshes' loads T (the sum of
the t of a mesh's stages), where c is the share of one pass through the stages the schedule
leaves idle: 1 for GPipe and 1F1B (Alpa's Σ t + (m−1)·max t), 2/3 for zero bubble (its W third of
the backward work fills the rest), 1/v for interleaved 1F1B. Exact for equal stages whose
forward, B and W parts take a third of t each.

>>> print(make_schedule("1f1b", 2, 3).to_text())
1f1b: 2 stages, 3 micro-batches, 8 compute clocks + 1 apply clock
mesh 0: F0 F1 .  B0 F2 B1 .  B2 A
mesh 1: .  F0 B0 F1 B1 F2 B2 .  A
"""

from __future__ import annotations

import dataclasses
import enum
import functools
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
    """One clock of work of stage `stage` (on its mesh); APPLY has no micro-batch, the others
    need one."""

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


def _cell(task: Task | None, num_meshes: int, num_stages: int) -> str:
    """F3, B3, W3, A; with virtual stages the chunk as a letter (F3a: micro-batch 3 through the
    mesh's first chunk)."""
    if task is None:
        return "."
    chunk = chr(ord("a") + task.stage // num_meshes) if num_stages > num_meshes else ""
    if task.kind is TaskKind.APPLY:
        return f"A{chunk}"
    return f"{_LETTERS[task.kind]}{task.micro_batch}{chunk}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`clocks[t][mesh]` is the task mesh runs at clock t (None: idle); the last clocks apply,
    one per stage on a mesh. Stage s runs on mesh s mod num_meshes."""

    name: str
    num_stages: int
    num_micro_batches: int
    clocks: tuple[tuple[Task | None, ...], ...]
    split_backward: bool = False  # backward as B and W tasks (zero bubble)

    @property
    def num_meshes(self) -> int:
        """Meshes the stages run on: a row's width."""
        return len(self.clocks[0])

    @property
    def stages_per_mesh(self) -> int:
        """v: 1, or the virtual stages of an interleaved schedule."""
        return self.num_stages // self.num_meshes

    @property
    def num_compute_clocks(self) -> int:
        """Clocks of forward and backward work, i.e. all but the apply clocks."""
        return len(self.clocks) - self.stages_per_mesh

    def mesh_of(self, stage: int) -> int:
        return stage % self.num_meshes

    def _check_mesh(self, mesh: int) -> None:
        if not 0 <= mesh < self.num_meshes:
            raise InvalidArgumentError(
                f"mesh={mesh} is out of range for a schedule on {self.num_meshes} meshes"
            )

    def tasks_of_mesh(self, mesh: int) -> list[Task]:
        """The tasks mesh runs, in clock order: what one mesh's worker executes."""
        self._check_mesh(mesh)
        return [row[mesh] for row in self.clocks if row[mesh] is not None]

    def max_in_flight(self, stage: int) -> int:
        """Most micro-batches forwarded through `stage` whose parameter gradients it has not yet
        computed (their activations' memory)."""
        if not 0 <= stage < self.num_stages:
            raise InvalidArgumentError(
                f"stage={stage} is out of range for a schedule of {self.num_stages} stages"
            )
        in_flight = peak = 0
        for task in self.tasks_of_mesh(self.mesh_of(stage)):
            if task.stage != stage:
                continue
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
        free = [0.0] * self.num_meshes
        for row in self.clocks:
            for mesh, task in enumerate(row):
                if task is None or task.kind is TaskKind.APPLY:
                    continue
                ready = max((times[dep][1] for dep in self.dependencies(task)), default=0.0)
                start = max(free[mesh], ready)
                free[mesh] = start + duration(task)
                times[task] = (start, free[mesh])
        return times

    def validate(self) -> None:
        """Raise ValueError unless every task runs once, on its own mesh, after its dependencies."""
        n, m, meshes = self.num_stages, self.num_micro_batches, self.num_meshes
        if n % meshes:
            raise ValueError(f"{self.name}: {n} stages do not divide evenly over {meshes} meshes")
        applies = tuple(
            tuple(Task(TaskKind.APPLY, r * meshes + i, None) for i in range(meshes))
            for r in range(n // meshes)
        )
        if self.clocks[len(self.clocks) - len(applies) :] != applies:
            raise ValueError(
                f"{self.name}: the last {len(applies)} clock(s) must apply every stage, stage s "
                f"on mesh s mod {meshes}"
            )
        expected = _all_tasks(n, m, self.split_backward)
        clock_of: dict[Task, int] = {}
        for clock, row in enumerate(self.clocks):
            if len(row) != meshes:
                raise ValueError(
                    f"{self.name}: clock {clock} has {len(row)} meshes, expected {meshes}"
                )
            for mesh, task in enumerate(row):
                if task is None:
                    continue
                if self.mesh_of(task.stage) != mesh:
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
        cells = [[_cell(t, self.num_meshes, self.num_stages) for t in row] for row in self.clocks]
        cell_width = max(len(cell) for row in cells for cell in row)
        label_width = len(f"mesh {self.num_meshes - 1}: ")
        fits = max(4, (max_width - label_width) // (cell_width + 1))
        columns: list[int | None] = list(range(len(self.clocks)))
        if len(columns) > fits:
            head = (fits - 1) // 2
            columns = [*columns[:head], None, *columns[head + 1 - fits :]]
        on = "" if self.num_meshes == self.num_stages else f" on {self.num_meshes} meshes"
        applies = self.stages_per_mesh
        lines = [
            f"{self.name}: {self.num_stages} stages{on}, {self.num_micro_batches} micro-batches, "
            f"{self.num_compute_clocks} compute clocks + {applies} apply clock"
            + ("s" if applies > 1 else "")
        ]
        for mesh in range(self.num_meshes):
            row = ["..." if t is None else cells[t][mesh].ljust(cell_width) for t in columns]
            lines.append(f"mesh {mesh}: ".ljust(label_width) + " ".join(row).rstrip())
        return "\n".join(lines)


def _simulate(
    name: str,
    orders: Sequence[Sequence[Task]],
    num_micro_batches: int,
    num_stages: int | None = None,
) -> Schedule:
    """The clock table of per-mesh task orders, each task running as early as its order allows
    (`num_stages`: more than the meshes with virtual stages)."""
    num_meshes = len(orders)
    num_stages = num_stages or num_meshes
    split = any(t.kind is TaskKind.BACKWARD_INPUT for order in orders for t in order)
    clock_of: dict[Task, int] = {}
    position = [0] * num_meshes
    clocks: list[tuple[Task | None, ...]] = []
    while any(p < len(order) for p, order in zip(position, orders, strict=True)):
        clock = len(clocks)
        row: list[Task | None] = [None] * num_meshes
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
    for r in range(num_stages // num_meshes):
        clocks.append(
            tuple(Task(TaskKind.APPLY, r * num_meshes + i, None) for i in range(num_meshes))
        )
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


def _interleaved_order(
    mesh: int, num_meshes: int, stages_per_mesh: int, num_micro_batches: int
) -> list[Task]:
    """Megatron-LM's interleaved 1F1B order on one mesh: forwards go through the mesh's chunks
    n micro-batches at a time (chunk c's stage is c·n + mesh), backwards through them in reverse;
    (n−mesh−1)·2 + (v−1)·n warm-up forwards (1F1B's n−mesh−1 for v = 1), then one forward and
    one backward in turn."""
    n, v, m = num_meshes, stages_per_mesh, num_micro_batches

    def task(kind: TaskKind, k: int) -> Task:
        chunk = (k % (n * v)) // n
        if kind is TaskKind.BACKWARD:
            chunk = v - 1 - chunk
        return Task(kind, chunk * n + mesh, (k // (n * v)) * n + k % n)

    total = m * v
    warmup = n - mesh - 1 if v == 1 else (n - mesh - 1) * 2 + (v - 1) * n  # v = 1: 1F1B
    warmup = min(warmup, total)
    order = [task(TaskKind.FORWARD, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [task(TaskKind.FORWARD, warmup + k), task(TaskKind.BACKWARD, k)]
    order += [task(TaskKind.BACKWARD, k) for k in range(total - warmup, total)]
    return order


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


def interleaved_one_f_one_b(num_stages: int, num_micro_batches: int, num_meshes: int) -> Schedule:
    """Virtual stages: v = num_stages / num_meshes chunks per mesh, stage s on mesh s mod n.

    2·m·v + 2(n−1) compute clocks against 1F1B's 2(m + n − 1) clocks of v times the work each:
    the bubble is v times smaller. Needs m a multiple of n (micro-batches go through the chunks
    n at a time), as Megatron-LM does.
    """
    s = check_positive_int("num_stages", num_stages)
    m = check_positive_int("num_micro_batches", num_micro_batches)
    n = check_positive_int("num_meshes", num_meshes)
    if s % n:
        raise InvalidArgumentError(
            f"interleaved 1F1B puts the same number of stages on every mesh: num_stages={s} "
            f"is not a multiple of num_meshes={n}"
        )
    if m % n:
        raise InvalidArgumentError(
            f"interleaved 1F1B runs micro-batches through the chunks {n} at a time: "
            f"num_micro_batches={m} must be a multiple of the {n} meshes"
        )
    orders = [_interleaved_order(i, n, s // n, m) for i in range(n)]
    return _simulate("interleaved_1f1b", orders, m, s)


class PipelineSchedule(enum.StrEnum):
    """The schedules a pipeline runs, and what the planner asks of one (module docstring);
    each compares equal to its name."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    ZERO_BUBBLE = "zero_bubble"
    INTERLEAVED_1F1B = "interleaved_1f1b"

    @classmethod
    def parse(cls, name: object) -> PipelineSchedule:
        """The schedule called `name` (one of SCHEDULES); the one place names are parsed."""
        if isinstance(name, cls):
            return name
        for schedule in cls:
            if name == schedule.value:
                return schedule
        raise InvalidArgumentError(f"schedule name={name!r} is unknown; choose one of {SCHEDULES}")

    @property
    def interleaves(self) -> bool:
        """Whether several stages share a mesh (virtual stages)."""
        return self is PipelineSchedule.INTERLEAVED_1F1B

    def table(
        self, num_stages: int, num_micro_batches: int, num_meshes: int | None = None
    ) -> Schedule:
        """The validated clock table for n stages and m micro-batches (on `num_meshes` meshes:
        interleaved schedules only, which need it)."""
        if self.interleaves:
            if num_meshes is None:
                raise InvalidArgumentError(
                    f"{self.value} needs num_meshes: the meshes its {num_stages} stages share"
                )
            return interleaved_one_f_one_b(num_stages, num_micro_batches, num_meshes)
        if num_meshes not in (None, num_stages):
            raise InvalidArgumentError(
                f"{self.value} runs one stage per mesh: num_meshes={num_meshes} for "
                f"{num_stages} stages; use pipeline_schedule='interleaved_1f1b' to share meshes"
            )
        builder = {"gpipe": gpipe, "1f1b": one_f_one_b, "zero_bubble": zero_bubble}[self.value]
        return builder(num_stages, num_micro_batches)

    @property
    def splits_backward(self) -> bool:
        return self is PipelineSchedule.ZERO_BUBBLE

    def tasks_per_step(self, num_stages: int, num_micro_batches: int) -> int:
        """Tasks a step runs: a forward and a backward per stage and micro-batch, the backward
        as two (input and weight gradients) where the schedule splits it."""
        return num_stages * num_micro_batches * (3 if self.splits_backward else 2)

    def host_time(self, num_stages: int, num_micro_batches: int, launch_s: float) -> float:
        """Seconds one host takes to launch every task of a step, `launch_s` each: a step is
        never shorter, however fast the devices run them."""
        return self.tasks_per_step(num_stages, num_micro_batches) * launch_s

    def in_flight(self, stages_after: int, num_micro_batches: int) -> int:
        """Micro-batches whose activations a stage with `stages_after` stages after it holds at
        once: what its table's `max_in_flight` says, without the table. For interleaved 1F1B,
        whose count depends on the mesh too (`stage_in_flight`), a bound: twice 1F1B's."""
        if self is PipelineSchedule.GPIPE:
            return num_micro_batches
        if self.interleaves:
            return min(2 * (stages_after + 1), num_micro_batches)
        return min(stages_after + 1, num_micro_batches)

    def stage_in_flight(
        self, num_stages: int, num_micro_batches: int, num_meshes: int | None = None
    ) -> tuple[int, ...]:
        """Per stage, the micro-batches in flight (its table's `max_in_flight`)."""
        if self.interleaves:
            return _table_in_flight(self, num_stages, num_micro_batches, num_meshes)
        return tuple(
            self.in_flight(num_stages - 1 - s, num_micro_batches) for s in range(num_stages)
        )

    @property
    def bubble_share(self) -> float:
        """c in `step_time` (without virtual stages): the part of one pass through every stage
        left idle."""
        return 2 / 3 if self is PipelineSchedule.ZERO_BUBBLE else 1.0

    def step_time(
        self, latencies: Sequence[float], num_micro_batches: int, num_meshes: int | None = None
    ) -> float:
        """Step time of stages taking `latencies` each per micro-batch, stage s on mesh s mod n:
        c·Σ t + (m − c)·max T, T a mesh's load, c the bubble share over v stages per mesh."""
        n = num_meshes or len(latencies)
        c = self.bubble_share * n / len(latencies)
        loads = [sum(latencies[i::n]) for i in range(n)]
        return c * sum(latencies) + (num_micro_batches - c) * max(loads)


@functools.lru_cache(maxsize=64)
def _table_in_flight(
    schedule: PipelineSchedule, num_stages: int, num_micro_batches: int, num_meshes: int | None
) -> tuple[int, ...]:
    table = schedule.table(num_stages, num_micro_batches, num_meshes)
    return tuple(table.max_in_flight(s) for s in range(num_stages))


SCHEDULES = tuple(s.value for s in PipelineSchedule)
AUTO_SCHEDULE = "auto"


def candidate_schedules(name: str) -> tuple[PipelineSchedule, ...]:
    """The schedule called `name`, or for "auto" every schedule, in order of preference on ties
    (1F1B holds the least; zero bubble splits the backward; GPipe holds every micro-batch;
    interleaving needs equal meshes and more transfers)."""
    if name == AUTO_SCHEDULE:
        return (
            PipelineSchedule.ONE_F_ONE_B,
            PipelineSchedule.ZERO_BUBBLE,
            PipelineSchedule.GPIPE,
            PipelineSchedule.INTERLEAVED_1F1B,
        )
    return (PipelineSchedule.parse(name),)


def make_schedule(
    name: str, num_stages: int, num_micro_batches: int, num_meshes: int | None = None
) -> Schedule:
    """The clock table of the schedule called `name` (one of SCHEDULES)."""
    return PipelineSchedule.parse(name).table(num_stages, num_micro_batches, num_meshes)
