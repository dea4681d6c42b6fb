"""A mesh worker's own step program: its mesh's share of a step, compiled once from the walk.

`runtime.layout.walk_step` orders a step's operations for all stages together. A Ray mesh worker
runs only those of the stages on its mesh (one, or several with interleaved 1F1B's virtual
stages), from one call per step, and exchanges values with the other meshes itself
(`runtime.transport`). This module cuts the walk into one instruction list per mesh:

* `PlaceInput` (the walk's own): hold a step input on a stage (the caller's value, a micro-batch
  slice of it, or a constant);
* `Receive`: hold a value another mesh's stage sends (waits for it);
* `Copy`: hand a value from one stage of this mesh to another (no transfer);
* `RunTask` (the walk's own): run a task;
* `Send`: send a value to a stage on another mesh that will read it, right after it is
  available here (after the task that wrote it, or after it arrived), not when the reader gets
  to it;
* `Free`: drop values no task of a stage reads any more (consecutive frees in one).

Every process builds the same lists from the same layout, so the driver knows which inputs each
worker takes without asking it.
"""

from __future__ import annotations

import dataclasses

from autopar.runtime.layout import (
    CopyValue,
    FreeValue,
    Key,
    PipelineLayout,
    PlaceInput,
    RunTask,
)


@dataclasses.dataclass(frozen=True)
class Receive:
    key: Key
    source: int  # the sending stage
    stage: int  # the stage of this mesh that holds it


@dataclasses.dataclass(frozen=True)
class Send:
    key: Key
    source: int  # the stage of this mesh that holds it
    target: int


@dataclasses.dataclass(frozen=True)
class Copy:
    key: Key
    source: int
    target: int


@dataclasses.dataclass(frozen=True)
class Free:
    keys: tuple[Key, ...]
    stage: int


Instruction = PlaceInput | Receive | Copy | RunTask | Send | Free


def worker_programs(layout: PipelineLayout) -> list[tuple[Instruction, ...]]:
    """Per mesh, the instructions its workers carry out in one step (module docstring)."""
    mesh_of = layout.schedule.mesh_of
    programs: list[list[Instruction]] = [[] for _ in range(layout.schedule.num_meshes)]
    available_at: dict[tuple[Key, int], int] = {}  # (key, stage) -> index in its mesh's program
    sends: dict[tuple[int, int], list[Send]] = {}  # (mesh, index) -> sends that follow it

    def add(stage: int, instruction: Instruction) -> int:
        program = programs[mesh_of(stage)]
        program.append(instruction)
        return len(program) - 1

    for op in layout.walk.ops:
        if isinstance(op, PlaceInput):
            available_at[op.key, op.stage] = add(op.stage, op)
        elif isinstance(op, CopyValue) and mesh_of(op.source) == mesh_of(op.target):
            available_at[op.key, op.target] = add(op.target, Copy(op.key, op.source, op.target))
        elif isinstance(op, CopyValue):
            after = (mesh_of(op.source), available_at[op.key, op.source])
            sends.setdefault(after, []).append(Send(op.key, op.source, op.target))
            available_at[op.key, op.target] = add(op.target, Receive(op.key, op.source, op.target))
        elif isinstance(op, RunTask):
            stage = op.segment.stage
            index = add(stage, op)
            for key in layout.writes_of(op.segment, op.micro_batch):
                available_at[key, stage] = index
        elif isinstance(op, FreeValue):
            for stage in op.stages:
                program = programs[mesh_of(stage)]
                last = program[-1] if program else None
                if isinstance(last, Free) and last.stage == stage:
                    program[-1] = Free((*last.keys, op.key), stage)
                else:
                    program.append(Free((op.key,), stage))
    return [
        tuple(
            item
            for n, instruction in enumerate(program)
            for item in (instruction, *sends.get((mesh, n), ()))
        )
        for mesh, program in enumerate(programs)
    ]


def taken_inputs(program: tuple[Instruction, ...]) -> list[Key]:
    """The step inputs a mesh's program takes, in order."""
    return [i.key for i in program if isinstance(i, PlaceInput)]
