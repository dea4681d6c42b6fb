"""Run a pipeshard plan on local devices: one sub-mesh per stage, tasks in schedule order.

Each stage's program (`planner.pipeline.StageProgram`) is cut into jitted *segments*: forward
(once per micro-batch), backward (once per micro-batch, adding the stage's gradients into
accumulators; the last micro-batch turns them into means) and apply (once per step, after every
backward). The executor walks the schedule's clock table and dispatches each task's segment;
JAX's asynchronous dispatch lets stages on different devices run at the same time. A value a
stage reads from another stage (an activation, a cotangent, a parameter used on two stages) is
moved with `jax.device_put` to the sharding the reading stage's plan gives it, once per value.

The apply part of a stage may need results of another stage's apply (e.g. a global gradient
norm): apply segments run in *levels*, level l+1 after every segment of level l.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal, Var
from jax.sharding import NamedSharding

from autopar.planner.pipeline import (
    StagePlacement,
    StageProgram,
    StepParts,
    place_stages,
    split_step,
    stage_program,
)
from autopar.planner.plan import Plan
from autopar.runtime.executable import MemoryStats, collective_bytes
from autopar.runtime.interpreter import (
    ShardingRules,
    build_mesh,
    constrain,
    evaluate_eqns,
    free_vars,
    partition_spec,
    read,
)
from autopar.runtime.schedules import Schedule, Task, TaskKind, make_schedule
from autopar.tracing import TracedStep

logger = logging.getLogger(__name__)

HOST = -1  # "stage" of values the caller passed in


def _is_float(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


class _Segment:
    """A jitted piece of one stage: reads `reads`, writes `writes` (program variables)."""

    def __init__(self, name: str, fn: Any, reads: Sequence[Var], writes: Sequence[Var], donate=()):
        self.name = name
        self.reads = tuple(reads)
        self.writes = tuple(writes)
        self._jit = jax.jit(fn, donate_argnums=tuple(donate))
        self.compiled: jax.stages.Compiled | None = None

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:  # shapes and shardings never change between calls
            self.compiled = self._jit.lower(*args).compile()
        return self.compiled(*args)


@dataclasses.dataclass
class _Stage:
    """A stage bound to its mesh: the program, the sharding rules and its segments."""

    program: StageProgram
    rules: ShardingRules
    input_sharding: dict[Var, NamedSharding]
    output_sharding: dict[Var, NamedSharding]
    consts: dict[Var, Any]
    forward: _Segment | None = None
    backward: dict[tuple[bool, bool], _Segment] = dataclasses.field(default_factory=dict)
    apply: dict[int, _Segment] = dataclasses.field(default_factory=dict)  # by level


class PipelineExecutable:
    """A pipeshard plan bound to local devices. Call it like the original step."""

    def __init__(self, traced: TracedStep, plan: Plan, devices: Sequence[jax.Device]) -> None:
        if plan.pipeline_schedule is None:
            raise ValueError("PipelineExecutable runs pipelined plans (plan.pipeline_schedule)")
        self.plan = plan
        self._traced = traced
        self._k = plan.num_micro_batches
        jaxpr = traced.closed_jaxpr.jaxpr
        signature = traced.program.signature
        parts = split_step(traced.closed_jaxpr, signature.batch_inputs)
        placement = place_stages(parts, [s.layers for s in plan.stages])
        self._placement = placement
        self.schedule: Schedule = make_schedule(plan.pipeline_schedule, len(plan.stages), self._k)
        self._stages = [
            self._bind(stage_program(parts, placement, s, signature), plan.stages[s], devices)
            for s in range(len(plan.stages))
        ]
        self._batch_vars = {jaxpr.invars[i] for i in signature.batch_inputs}
        self._build_segments(parts)
        self._readers = self._count_readers()

    # ------------------------------------------------------------------ building

    def _bind(self, program: StageProgram, stage_plan, devices) -> _Stage:
        mesh = build_mesh(stage_plan.mesh, devices)
        named = [NamedSharding(mesh, partition_spec(s)) for s in stage_plan.input_specs]
        outs = [NamedSharding(mesh, partition_spec(s)) for s in stage_plan.output_specs]
        closed = program.closed
        return _Stage(
            program=program,
            rules=ShardingRules.from_stage(stage_plan, mesh),
            input_sharding=dict(zip(closed.jaxpr.invars, named, strict=True)),
            output_sharding=dict(zip(closed.jaxpr.outvars, outs, strict=True)),
            consts=dict(zip(closed.jaxpr.constvars, closed.consts, strict=True)),
        )

    def _segment_fn(self, stage: _Stage, eqns, reads, writes):
        def run(*args):
            env = dict(stage.consts)
            env.update(zip(reads, args, strict=True))
            evaluate_eqns(eqns, env, stage.rules)
            return [constrain(read(env, v), stage.output_sharding.get(v)) for v in writes], None

        return run

    def _backward_fn(self, stage: _Stage, eqns, reads, writes, first: bool, last: bool):
        grads, k = stage.program.grads, self._k

        def run(acc, *args):
            env = dict(stage.consts)
            env.update(zip(reads, args, strict=True))
            evaluate_eqns(eqns, env, stage.rules)
            new = [read(env, g) for g in grads]
            if not first:
                new = [a + g if _is_float(g) else g for a, g in zip(acc, new, strict=True)]
            if last:
                new = [a / k if _is_float(a) else a for a in new]
            outs = [constrain(read(env, v), stage.output_sharding.get(v)) for v in writes]
            return outs, new

        return run

    def _build_segments(self, parts: StepParts) -> None:
        step_outputs = self._traced.closed_jaxpr.jaxpr.outvars
        outputs = {
            v
            for v, s in zip(step_outputs, self._placement.output_stage, strict=True)
            if s is not None and isinstance(v, Var)
        }
        levels = self._apply_levels(parts)
        pieces: list[tuple[_Stage, str, Any, list]] = []
        for stage in self._stages:
            prog = stage.program
            pieces.append((stage, "forward", None, prog.part("forward")))
            pieces.append((stage, "backward", None, prog.part("backward")))
            apply = prog.part("apply")
            for level in sorted(set(levels[prog.index])):
                eqns = [pe for pe, lv in zip(apply, levels[prog.index], strict=True) if lv == level]
                pieces.append((stage, "apply", level, eqns))
        reads = []
        for stage, kind, _, eqns in pieces:
            r = free_vars(eqns)
            if kind == "backward":
                inner = {x for _, e in eqns for x in e.outvars}
                r += [g for g in stage.program.grads if isinstance(g, Var) and g not in r]
                r = [v for v in r if v not in inner]
            reads.append(r)
        for n, (stage, kind, level, eqns) in enumerate(pieces):
            defined = [v for _, e in eqns for v in e.outvars]
            elsewhere = {v for m, r in enumerate(reads) if m != n for v in r}
            writes = [v for v in dict.fromkeys(defined) if v in elsewhere or v in outputs]
            name = f"stage{stage.program.index}.{kind}" + ("" if level is None else f"{level}")
            if kind == "forward":
                stage.forward = _Segment(
                    name, self._segment_fn(stage, eqns, reads[n], writes), reads[n], writes
                )
            elif kind == "apply":
                stage.apply[level] = _Segment(
                    name, self._segment_fn(stage, eqns, reads[n], writes), reads[n], writes
                )
            else:
                for first in (True, False):
                    for last in (True, False):
                        fn = self._backward_fn(stage, eqns, reads[n], writes, first, last)
                        stage.backward[first, last] = _Segment(
                            name, fn, reads[n], writes, donate=() if first else (0,)
                        )

    def _apply_levels(self, parts: StepParts) -> list[list[int]]:
        """Per stage, the level of each apply eqn: one more than any other stage's apply result
        it reads (see the module docstring)."""
        eqns = parts.closed.jaxpr.eqns
        placement: StagePlacement = self._placement
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
            [level_of[s, e.outvars[0]] if e.outvars else 0 for _, e in stage.program.part("apply")]
            for s, stage in enumerate(self._stages)
        ]

    def _count_readers(self) -> dict[Var, int]:
        """How many per-micro-batch tasks read each variable (to free it after the last one)."""
        counts: dict[Var, int] = {}
        for stage in self._stages:
            for segment in (stage.forward, stage.backward[True, True]):
                for v in segment.reads:
                    counts[v] = counts.get(v, 0) + 1
        return counts

    # ------------------------------------------------------------------ running

    def __call__(self, *args: Any) -> Any:
        dynamic = [a for i, a in enumerate(args) if i not in self._traced.static_argnums]
        return self.call_flat(jax.tree_util.tree_leaves(dynamic))

    def call_flat(self, flat: Sequence[Any]) -> Any:
        """Run one step on the flattened dynamic arguments; returns the outputs as a pytree."""
        jaxpr = self._traced.closed_jaxpr.jaxpr
        k = self._k
        env: dict[tuple[Var, int | None], dict[int, Any]] = {}
        for v, x in zip(jaxpr.invars, flat, strict=True):
            if v in self._batch_vars:  # micro-batch j: rows j, j+k, ... (as in accumulate.py)
                host = np.asarray(x)
                for j in range(k):
                    env[v, j] = {HOST: host[j::k]}
            else:
                env[v, None] = {HOST: x}
        remaining: dict[tuple[Var, int], int] = {}
        acc: dict[int, Any] = {}
        for row in self.schedule.clocks:
            for task in row:
                if task is not None and task.kind is not TaskKind.APPLY:
                    self._run_task(task, env, remaining, acc)
        # The apply clock: every stage's apply segments, level by level.
        for level in sorted({lv for st in self._stages for lv in st.apply}):
            for stage in self._stages:
                if level in stage.apply:
                    self._run(stage, stage.apply[level], None, env, remaining)
        outs = []
        for v, s in zip(jaxpr.outvars, self._placement.output_stage, strict=True):
            if isinstance(v, Literal):
                outs.append(jnp.asarray(v.val))
            elif s is None:
                outs.append(next(iter(env[v, None].values())))
            else:
                outs.append(env[v, None][s])
        return jax.tree_util.tree_unflatten(self._traced.out_tree, outs)

    def _fetch(self, stage: _Stage, v: Var, j: int | None, env, remaining) -> Any:
        key = (v, j) if (v, j) in env else (v, None)
        copies = env[key]
        s = stage.program.index
        target = stage.input_sharding.get(v)
        value = copies.get(s)
        if value is None or (target is not None and value.sharding != target):
            source = value if value is not None else next(iter(copies.values()))
            value = jax.device_put(source, target)
            copies[s] = value
        if key[1] is not None:
            left = remaining.get(key, self._readers.get(v, 1)) - 1
            remaining[key] = left
            if left == 0:
                del env[key]
        return value

    def _run(self, stage: _Stage, segment: _Segment, j: int | None, env, remaining, *lead):
        """Run `segment` for micro-batch `j` (None: once per step); returns its extra result."""
        args = [self._fetch(stage, v, j, env, remaining) for v in segment.reads]
        outs, extra = segment(*lead, *args)
        s = stage.program.index
        for v, x in zip(segment.writes, outs, strict=True):
            env.setdefault((v, j), {})[s] = x
        return extra

    def _run_task(self, task: Task, env, remaining, acc) -> None:
        stage = self._stages[task.stage]
        j = task.micro_batch
        if task.kind is TaskKind.FORWARD:
            self._run(stage, stage.forward, j, env, remaining)
            return
        first, last = j == 0, j == self._k - 1
        segment = stage.backward[first, last]
        total = self._run(stage, segment, j, env, remaining, acc.get(task.stage))
        if last:
            for v, mean in zip(stage.program.means, total, strict=True):
                env[v, None] = {task.stage: mean}
        else:
            acc[task.stage] = total

    # ------------------------------------------------------------------ inspection

    def _segments(self) -> list[_Segment]:
        found = []
        for stage in self._stages:
            found += [stage.forward, *stage.backward.values(), *stage.apply.values()]
        return [s for s in found if s.compiled is not None]

    def get_hlo_text(self) -> str:
        """The compiled HLO of every segment that has run, each under a ``// segment`` line."""
        return "\n".join(f"// {s.name}\n{s.compiled.as_text()}" for s in self._segments())

    def collectives(self) -> dict[str, list[int]]:
        """Per collective kind, the byte size of each such op over all compiled segments."""
        return collective_bytes(self.get_hlo_text())

    def memory_stats(self) -> list[MemoryStats]:
        """Per stage, XLA's memory analysis of its largest compiled segment (after a call)."""
        stats = []
        for stage in self._stages:
            best = None
            for seg in [stage.forward, *stage.backward.values(), *stage.apply.values()]:
                if seg.compiled is None:
                    continue
                m = seg.compiled.memory_analysis()
                cur = MemoryStats(
                    int(m.argument_size_in_bytes),
                    int(m.output_size_in_bytes),
                    int(m.alias_size_in_bytes),
                    int(m.temp_size_in_bytes),
                )
                if best is None or cur.peak_bytes > best.peak_bytes:
                    best = cur
            stats.append(best)
        return stats

    @property
    def input_shardings(self) -> Any:
        """Sharding of each dynamic argument on the first stage that reads it (None: unread)."""
        jaxpr = self._traced.closed_jaxpr.jaxpr
        found = []
        for v in jaxpr.invars:
            found.append(
                next((st.input_sharding[v] for st in self._stages if v in st.input_sharding), None)
            )
        return jax.tree_util.tree_unflatten(self._traced.in_tree, found)
