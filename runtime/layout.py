"""What a pipelined step runs where, without devices: stage programs cut into segments, in order.

Each stage's program (`planner.pipeline.StageProgram`) is cut into *segments*: forward (once per
micro-batch), backward (once per micro-batch, adding the stage's gradients into accumulators; the
last micro-batch turns them into means) and apply (once per step, after every backward). A
segment reads and writes variables of the step's jaxpr; a value a stage reads from another stage
(an activation, a cotangent, a parameter used on two stages) has to be moved there first.

The apply part of a stage may need results of another stage's apply (e.g. a global gradient
norm): apply segments run in *levels*, level l+1 after every segment of level l.

`PipelineLayout` is built the same way by every process from the same traced step and plan —
the driver and each Ray mesh worker — so variables are named across processes by `var_id`.
`walk_step` walks the schedule's clock table once per layout into the operations of a step (place
an input, copy a value between stages, run a task, free a value), the same for every executor:
`run_step` replays them on a `StepBackend` (the local executor); a Ray mesh worker compiles its
stage's share into its own step program (`runtime.worker_program`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.extend.core import JaxprEqn, Literal, Var

from autopar.planner.pipeline import StagePlacement, StageProgram, place_stages, split_step
from autopar.planner.pipeline import stage_program as build_stage_program
from autopar.planner.plan import Plan
from autopar.planner.schedules import GRADIENT_KINDS, Schedule, TaskKind
from autopar.runtime.interpreter import free_vars
from autopar.tracing import TracedStep

HOST = -1  # the "stage" of values the caller passed in

Key = tuple[Var, int | None]  # a variable for one micro-batch, or for the whole step (None)


@dataclasses.dataclass(frozen=True)
class Segment:
    """A piece of one stage run as one jitted call: reads `reads`, writes `writes`."""

    stage: int
    kind: TaskKind
    level: int | None  # apply segments: their level; else None
    eqns: tuple[tuple[str, JaxprEqn], ...]
    reads: tuple[Var, ...]
    writes: tuple[Var, ...]

    @property
    def name(self) -> str:
        level = "" if self.level is None else str(self.level)
        return f"stage{self.stage}.{self.kind.value}{level}"


class PipelineLayout:
    """A pipeshard plan's stages as segments over the step's variables (module docstring)."""

    def __init__(self, traced: TracedStep, plan: Plan) -> None:
        if plan.pipeline_schedule is None:
            raise ValueError("PipelineLayout lays out pipelined plans (plan.pipeline_schedule)")
        self.traced = traced
        self.plan = plan
        self.num_micro_batches = plan.num_micro_batches
        signature = traced.program.signature
        parts = split_step(traced.closed_jaxpr, signature.batch_inputs)
        self.placement: StagePlacement = place_stages(parts, [s.layers for s in plan.stages])
        self.schedule: Schedule = plan.pipeline_table()
        self.programs: tuple[StageProgram, ...] = tuple(
            build_stage_program(parts, self.placement, s, signature)
            for s in range(len(plan.stages))
        )
        jaxpr = traced.closed_jaxpr.jaxpr
        self.batch_vars = frozenset(jaxpr.invars[i] for i in signature.batch_inputs)
        self.segments: dict[tuple[int, TaskKind, int | None], Segment] = {}
        self._cut_segments(parts)
        self.readers = self._count_readers()
        top = [*jaxpr.invars, *jaxpr.constvars, *(v for e in jaxpr.eqns for v in e.outvars)]
        self.var_id: dict[Var, int] = {v: n for n, v in enumerate(dict.fromkeys(top))}
        self.var_of: dict[int, Var] = {n: v for v, n in self.var_id.items()}

    @property
    def num_stages(self) -> int:
        return len(self.programs)

    @functools.cached_property
    def walk(self) -> StepWalk:
        """One step's operations, worked out once (`walk_step`)."""
        return walk_step(self)

    def segment(self, stage: int, kind: TaskKind, level: int | None = None) -> Segment:
        return self.segments[stage, kind, level]

    def apply_levels(self) -> list[int]:
        return sorted({lv for (_, kind, lv) in self.segments if kind is TaskKind.APPLY})

    def tasks(self) -> Iterator[tuple[Segment, int | None]]:
        """(segment, micro-batch) in the order every executor dispatches them: the schedule's
        compute clocks, then the apply clock level by level."""
        for row in self.schedule.clocks:
            for task in row:
                if task is not None and task.kind is not TaskKind.APPLY:
                    yield self.segment(task.stage, task.kind), task.micro_batch
        for level in self.apply_levels():
            for s in range(self.num_stages):
                if (s, TaskKind.APPLY, level) in self.segments:
                    yield self.segment(s, TaskKind.APPLY, level), None

    def writes_of(self, segment: Segment, micro_batch: int | None) -> list[Key]:
        """The keys a task defines: its writes, plus the gradient means after the last backward."""
        keys: list[Key] = [(v, micro_batch) for v in segment.writes]
        if segment.kind in GRADIENT_KINDS and micro_batch == self.num_micro_batches - 1:
            keys += [(v, None) for v in self.programs[segment.stage].means]
        return keys

    # ------------------------------------------------------------------ building

    def _cut_segments(self, parts) -> None:
        step_outputs = self.traced.closed_jaxpr.jaxpr.outvars
        outputs = {
            v
            for v, s in zip(step_outputs, self.placement.output_stage, strict=True)
            if s is not None and isinstance(v, Var)
        }
        levels = self._apply_levels(parts)
        pieces: list[tuple[StageProgram, TaskKind, int | None, list]] = []
        for prog in self.programs:
            pieces.append((prog, TaskKind.FORWARD, None, prog.part("forward")))
            pieces.append((prog, TaskKind.BACKWARD, None, prog.part("backward")))
            apply = prog.part("apply")
            for level in sorted(set(levels[prog.index])):
                eqns = [pe for pe, lv in zip(apply, levels[prog.index], strict=True) if lv == level]
                pieces.append((prog, TaskKind.APPLY, level, eqns))
        if self.schedule.split_backward:
            pieces = self._split_backwards(pieces, outputs)
        reads = []
        for prog, kind, _, eqns in pieces:
            r = free_vars(eqns)
            if kind in GRADIENT_KINDS:
                inner = {x for _, e in eqns for x in e.outvars}
                r += [g for g in prog.grads if isinstance(g, Var) and g not in r]
                r = [v for v in r if v not in inner]
            reads.append(r)
        for n, (prog, kind, level, eqns) in enumerate(pieces):
            defined = [v for _, e in eqns for v in e.outvars]
            elsewhere = {v for m, r in enumerate(reads) if m != n for v in r}
            writes = [v for v in dict.fromkeys(defined) if v in elsewhere or v in outputs]
            self.segments[prog.index, kind, level] = Segment(
                prog.index, kind, level, tuple(eqns), tuple(reads[n]), tuple(writes)
            )

    @staticmethod
    def _split_backwards(pieces: list, outputs: set[Var]) -> list:
        """Each stage's backward as B (what the cotangents other stages read need) and W (the
        rest: what only its parameter gradients need), for schedules that defer W."""
        read_by: dict[Var, set[int]] = {}
        for n, (_, _, _, eqns) in enumerate(pieces):
            for v in free_vars(eqns):
                read_by.setdefault(v, set()).add(n)
        split = []
        for n, (prog, kind, level, eqns) in enumerate(pieces):
            if kind is not TaskKind.BACKWARD:
                split.append((prog, kind, level, eqns))
                continue
            needed = {
                v for _, e in eqns for v in e.outvars if v in outputs or read_by.get(v, set()) - {n}
            }
            inputs = []
            for node, e in reversed(eqns):  # producers of what leaves the stage, backwards
                if needed.intersection(e.outvars):
                    inputs.append((node, e))
                    needed.update(v for v in e.invars if isinstance(v, Var))
            inputs.reverse()
            chosen = {node for node, _ in inputs}
            weights = [(node, e) for node, e in eqns if node not in chosen]
            split.append((prog, TaskKind.BACKWARD_INPUT, None, inputs))
            split.append((prog, TaskKind.BACKWARD_WEIGHT, None, weights))
        return split

    def _apply_levels(self, parts) -> list[list[int]]:
        """Per stage, the level of each apply eqn: one more than any other stage's apply result
        it reads (see the module docstring)."""
        eqns = parts.closed.jaxpr.eqns
        placement = self.placement
        level_of: dict[tuple[int, Var], int] = {}
        made_by: dict[Var, list[int]] = {}
        runs = [set(a) for a in placement.apply]
        for i in parts.apply:
            for s in range(placement.num_stages):
                if i not in runs[s]:
                    continue
                level = 0
                for v in eqns[i].invars:
                    if not isinstance(v, Var):
                        continue
                    if (s, v) in level_of:
                        level = max(level, level_of[s, v])
                    elif v in made_by:
                        level = max(level, 1 + max(level_of[t, v] for t in made_by[v]))
                for v in eqns[i].outvars:
                    level_of[s, v] = level
                    made_by.setdefault(v, []).append(s)
        return [
            [level_of[s, e.outvars[0]] if e.outvars else 0 for _, e in prog.part("apply")]
            for s, prog in enumerate(self.programs)
        ]

    def _count_readers(self) -> dict[Var, int]:
        """How many per-micro-batch tasks read each variable (to free it after the last one)."""
        counts: dict[Var, int] = {}
        for (_, kind, _), segment in self.segments.items():
            if kind is not TaskKind.APPLY:
                for v in segment.reads:
                    counts[v] = counts.get(v, 0) + 1
        return counts


@dataclasses.dataclass(frozen=True)
class PlaceInput:
    """Make a value the caller passed in (or its micro-batch slice, or a constant) available on
    `stage`."""

    key: Key
    stage: int


@dataclasses.dataclass(frozen=True)
class CopyValue:
    """Make the value `key` that stage `source` holds available on stage `target`."""

    key: Key
    source: int
    target: int


@dataclasses.dataclass(frozen=True)
class RunTask:
    """Run a task: its reads are available on its stage; it defines `writes_of` there."""

    segment: Segment
    micro_batch: int | None


@dataclasses.dataclass(frozen=True)
class FreeValue:
    """No task reads `key` any more: drop it on `stages`."""

    key: Key
    stages: tuple[int, ...]


StepOp = PlaceInput | CopyValue | RunTask | FreeValue


@dataclasses.dataclass(frozen=True)
class StepWalk:
    """One step of a layout as the ordered operations every executor carries out, and the stage
    that holds each step output variable afterwards (`HOST`: an input passed through)."""

    ops: tuple[StepOp, ...]
    holders: dict[Var, int]


def walk_step(layout: PipelineLayout) -> StepWalk:
    """The operations of one step of `layout`, which depend on the layout only (not on values).

    Tasks run in `layout.tasks()` order; every value is moved at most once to each stage that
    reads it, from a stage on the same mesh that holds it or else the lowest, and freed after
    its last reader.
    """
    jaxpr = layout.traced.closed_jaxpr.jaxpr
    k = layout.num_micro_batches
    where: dict[Key, set[int]] = {(v, None): {HOST} for v in jaxpr.constvars}
    for v in jaxpr.invars:
        batch = v in layout.batch_vars
        where.update({(v, j): {HOST} for j in (range(k) if batch else (None,))})
    ops: list[StepOp] = []
    remaining: dict[Key, int] = {}
    for segment, j in layout.tasks():
        s = segment.stage
        for v in segment.reads:
            key = (v, j) if (v, j) in where else (v, None)
            holders = where[key]
            if s not in holders:
                if HOST in holders:
                    ops.append(PlaceInput(key, s))
                else:  # from a stage on the same mesh if one holds it, else the lowest
                    mesh = layout.schedule.mesh_of
                    source = min(holders, key=lambda h: (mesh(h) != mesh(s), h))
                    ops.append(CopyValue(key, source, s))
                holders.add(s)
        ops.append(RunTask(segment, j))
        for key in layout.writes_of(segment, j):
            where[key] = {s}
        if j is None:
            continue
        for v in segment.reads:
            key = (v, j)
            if key not in where:
                continue
            left = remaining.get(key, layout.readers.get(v, 1)) - 1
            remaining[key] = left
            if left == 0:
                ops.append(FreeValue(key, tuple(sorted(where.pop(key) - {HOST}))))
    found = {}
    for v, s in zip(jaxpr.outvars, layout.placement.output_stage, strict=True):
        if not isinstance(v, Literal):
            holders = where[v, None]
            found[v] = s if s is not None else (HOST if HOST in holders else min(holders))
    return StepWalk(tuple(ops), found)


def step_inputs(layout: PipelineLayout, flat: Sequence[Any]) -> dict[Key, Any]:
    """The value of every key a `PlaceInput` may name, from the flattened dynamic arguments.

    Batch inputs are cut into micro-batches on the host (micro-batch j: rows j, j+k, ..., as in
    `runtime.accumulate`); constants the step computed with numpy (a rotary sin/cos table) are
    inputs like the caller's own."""
    closed = layout.traced.closed_jaxpr
    jaxpr = closed.jaxpr
    k = layout.num_micro_batches
    inputs: dict[Key, Any] = {
        (v, None): c for v, c in zip(jaxpr.constvars, closed.consts, strict=True)
    }
    for v, x in zip(jaxpr.invars, flat, strict=True):
        if v in layout.batch_vars:
            inputs.update({(v, j): micro_batch_of(x, j, k) for j in range(k)})
        else:
            inputs[v, None] = x
    return inputs


def micro_batch_of(x: Any, j: int, k: int) -> Any:
    """Micro-batch `j` of `k` of a batch input: rows j, j+k, ... (typed PRNG keys have no numpy
    form and are sliced as they are)."""
    keys = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return (x if keys else np.asarray(x))[j::k]


class StepBackend(Protocol):
    """How an executor holds values and runs segments; `walk_step` decides what and when."""

    def place_input(self, key: Key, value: Any, stage: int) -> None:
        """Carry out a `PlaceInput` with the key's value."""

    def copy(self, key: Key, source: int, target: int) -> None:
        """Carry out a `CopyValue`."""

    def run(self, segment: Segment, micro_batch: int | None) -> None:
        """Carry out a `RunTask`."""

    def free(self, key: Key, stages: Sequence[int]) -> None:
        """Carry out a `FreeValue`."""


def run_step(layout: PipelineLayout, backend: StepBackend, flat: Sequence[Any]) -> dict[Var, int]:
    """Run one step of `layout` on `backend` from the flattened dynamic arguments; returns, per
    step output variable, the stage that holds it (`StepWalk.holders`)."""
    inputs = step_inputs(layout, flat)
    for op in layout.walk.ops:
        if isinstance(op, PlaceInput):
            backend.place_input(op.key, inputs[op.key], op.stage)
        elif isinstance(op, CopyValue):
            backend.copy(op.key, op.source, op.target)
        elif isinstance(op, RunTask):
            backend.run(op.segment, op.micro_batch)
        else:
            backend.free(op.key, op.stages)
    return layout.walk.holders
