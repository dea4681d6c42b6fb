"""A mesh worker's own step program: its stage's share of a step, compiled once from the walk.

`runtime.layout.walk_step` orders a step's operations for all stages together. A Ray mesh worker
runs only its stage's, from one call per step, and exchanges values with the other stages itself
(`runtime.transport`). This module cuts the walk into one instruction list per stage:

* `PlaceInput` (the walk's own): hold a step input (the caller's value, a micro-batch slice of
  it, or a constant);
* `Receive`: hold a value another stage sends (waits for it);
* `RunTask` (the walk's own): run a task;
* `Send`: send a value to a stage that will read it, right after it is available here (after
  the task that wrote it, or after it arrived), not when the reader gets to it;
* `Free`: drop values no task of this stage reads any more (consecutive frees in one).

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
    source: int


@dataclasses.dataclass(frozen=True)
class Send:
    key: Key
    target: int


@dataclasses.dataclass(frozen=True)
class Free:
    keys: tuple[Key, ...]


Instruction = PlaceInput | Receive | RunTask | Send | Free


def worker_programs(layout: PipelineLayout) -> list[tuple[Instruction, ...]]:
    """Per stage, the instructions its workers carry out in one step (module docstring)."""
    programs: list[list[Instruction]] = [[] for _ in range(layout.num_stages)]
    available_at: dict[tuple[Key, int], int] = {}  # (key, stage) -> index of the instruction
    sends: dict[tuple[int, int], list[Send]] = {}  # (stage, index) -> sends that follow it
    for op in layout.walk.ops:
        if isinstance(op, PlaceInput):
            programs[op.stage].append(op)
            available_at[op.key, op.stage] = len(programs[op.stage]) - 1
        elif isinstance(op, CopyValue):
            after = (op.source, available_at[op.key, op.source])
            sends.setdefault(after, []).append(Send(op.key, op.target))
            programs[op.target].append(Receive(op.key, op.source))
            available_at[op.key, op.target] = len(programs[op.target]) - 1
        elif isinstance(op, RunTask):
            stage = op.segment.stage
            programs[stage].append(op)
            for key in layout.writes_of(op.segment, op.micro_batch):
                available_at[key, stage] = len(programs[stage]) - 1
        elif isinstance(op, FreeValue):
            for stage in op.stages:
                program = programs[stage]
                if program and isinstance(program[-1], Free):
                    program[-1] = Free((*program[-1].keys, op.key))
                else:
                    program.append(Free((op.key,)))
    return [
        tuple(
            item
            for n, instruction in enumerate(program)
            for item in (instruction, *sends.get((stage, n), ()))
        )
        for stage, program in enumerate(programs)
    ]


def taken_inputs(program: tuple[Instruction, ...]) -> list[Key]:
    """The step inputs a stage's program takes, in order."""
    return [i.key for i in program if isinstance(i, PlaceInput)]
