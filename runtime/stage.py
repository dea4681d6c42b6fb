"""One pipeline stage bound to its mesh: its jitted segments and the values it holds.

The local executor keeps one `StageRunner` per stage in its own process; on Ray, each mesh worker
keeps the runner of its stage (one SPMD program when the mesh spans several worker processes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Var
from jax.sharding import NamedSharding

from autopar.planner.schedules import GRADIENT_KINDS, TaskKind
from autopar.runtime.accumulate import add_micro_batch, mean_over_micro_batches
from autopar.runtime.executable import COLLECTIVES, MemoryStats, collective_bytes_per_step
from autopar.runtime.interpreter import (
    ShardingRules,
    build_mesh,
    constrain,
    evaluate_eqns,
    partition_spec,
    read,
)
from autopar.runtime.layout import Key, PipelineLayout, Segment

logger = logging.getLogger(__name__)


def place(value: Any, sharding: NamedSharding | None) -> Any:
    """`value` (a jax array, a Python scalar, or a host array every process holds whole) in
    `sharding`. A Python scalar stays weakly typed, as jax would trace it."""
    if sharding is None:
        return value
    if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim):
        return value  # kept from the last step where this step reads it: nothing to move
    if isinstance(value, jax.Array) or sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    if isinstance(value, (bool, int, float, complex)):
        return jax.jit(lambda: value, out_shardings=sharding)()
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class _Jitted:
    """A segment's function, compiled on its first call (shapes and shardings never change)."""

    def __init__(self, name: str, fn: Any, donate: tuple[int, ...] = ()) -> None:
        self.name = name
        self._jit = jax.jit(fn, donate_argnums=donate)
        self.compiled: jax.stages.Compiled | None = None

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.compiled = self._jit.lower(*args).compile()
        return self.compiled(*args)


class StageRunner:
    """Runs stage `stage` of `layout` on `devices` (indexed as the plan's device indices)."""

    def __init__(self, layout: PipelineLayout, stage: int, devices: Sequence[Any]) -> None:
        self.layout = layout
        self.stage = stage
        self.program = layout.programs[stage]
        stage_plan = layout.plan.stages[stage]
        self.mesh = build_mesh(stage_plan.mesh, devices)
        closed = self.program.closed
        self.input_sharding: dict[Var, NamedSharding] = {
            v: NamedSharding(self.mesh, partition_spec(s))
            for v, s in zip(closed.jaxpr.invars, stage_plan.input_specs, strict=True)
        }
        self.output_sharding: dict[Var, NamedSharding] = {
            v: NamedSharding(self.mesh, partition_spec(s))
            for v, s in zip(closed.jaxpr.outvars, stage_plan.output_specs, strict=True)
        }
        self._rules = ShardingRules.from_stage(stage_plan, self.mesh)
        self._consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        self.values: dict[Key, Any] = {}
        self._accumulated: list[Any] | None = None
        self._jitted: dict[tuple, _Jitted] = {}

    # ------------------------------------------------------------------ values

    def place(self, key: Key, value: Any) -> None:
        """Hold `value` as `key`, in the sharding this stage reads it with."""
        self.values[key] = place(value, self.input_sharding.get(key[0]))

    def value(self, key: Key) -> Any:
        return self.values[key]

    def free(self, key: Key) -> Any:
        """Stop holding `key`; its value (None if not held)."""
        return self.values.pop(key, None)

    # ------------------------------------------------------------------ running

    def run(self, segment: Segment, micro_batch: int | None) -> list[Any]:
        """Run one task of this stage; its outputs are held as `layout.writes_of` names them."""
        j = micro_batch
        args = [self.values[(v, j) if (v, j) in self.values else (v, None)] for v in segment.reads]
        if segment.kind in GRADIENT_KINDS:
            first, last = j == 0, j == self.layout.num_micro_batches - 1
            outs, self._accumulated = self._function(segment, first, last)(self._accumulated, *args)
            if last:
                means = self._accumulated
                self._accumulated = None
                outs = [*outs, *means]
        else:
            outs, _ = self._function(segment)(*args)
        for key, x in zip(self.layout.writes_of(segment, j), outs, strict=True):
            self.values[key] = x
        return outs

    def _function(self, segment: Segment, first: bool = False, last: bool = False) -> _Jitted:
        key = (segment.kind, segment.level, first, last)
        if key not in self._jitted:
            if segment.kind in GRADIENT_KINDS:
                fn = self._backward_fn(segment, first, last)
                variant = "".join(("[first]" if first else "", "[last]" if last else ""))
                name = segment.name + (variant or "[middle]")
                self._jitted[key] = _Jitted(name, fn, donate=() if first else (0,))
            else:
                self._jitted[key] = _Jitted(segment.name, self._segment_fn(segment))
        return self._jitted[key]

    def _segment_fn(self, segment: Segment):
        def run(*args):
            env = dict(self._consts)
            env.update(zip(segment.reads, args, strict=True))
            evaluate_eqns(segment.eqns, env, self._rules)
            outs = [constrain(read(env, v), self.output_sharding.get(v)) for v in segment.writes]
            return outs, None

        return run

    def _backward_fn(self, segment: Segment, first: bool, last: bool):
        """One micro-batch's backward, adding its gradients into the accumulators (unreduced
        partial sums where the plan reduces once per step); the last one yields the means."""
        grads, k = self.program.grads, self.layout.num_micro_batches
        boundary = self._rules.node_outputs.get(str(self.program.boundary_index))
        specs = boundary[: len(grads)] if boundary else (None,) * len(grads)

        def run(acc, *args):
            env = dict(self._consts)
            env.update(zip(segment.reads, args, strict=True))
            evaluate_eqns(segment.eqns, env, self._rules)
            new = [read(env, g) for g in grads]
            if not first:
                new = [add_micro_batch(a, g) for a, g in zip(acc, new, strict=True)]
            if last:
                new = [
                    mean_over_micro_batches(a, k, s, self.mesh)
                    for a, s in zip(new, specs, strict=True)
                ]
            outs = [constrain(read(env, v), self.output_sharding.get(v)) for v in segment.writes]
            return outs, new

        return run

    # ------------------------------------------------------------------ inspection

    def compiled(self) -> list[tuple[str, jax.stages.Compiled]]:
        """(segment name, compiled executable) of every segment variant that has run."""
        return [(j.name, j.compiled) for j in self._jitted.values() if j.compiled is not None]

    def hlo_text(self) -> str:
        """The compiled HLO of every segment variant that has run, each under a ``// name``."""
        return "\n".join(f"// {name}\n{compiled.as_text()}" for name, compiled in self.compiled())

    def collective_bytes_per_step(self) -> dict[str, float]:
        """Per collective kind, the bytes this stage's segments move per step per device: each
        compiled variant times how often a step runs it (backward: first and last micro-batch
        once each, the others k − 2 times)."""
        k = self.layout.num_micro_batches
        total = dict.fromkeys(COLLECTIVES, 0.0)
        for (kind, _, first, last), jitted in self._jitted.items():
            if jitted.compiled is None:
                continue
            if kind in GRADIENT_KINDS:
                runs = 1 if first or last else k - 2
            else:
                runs = 1 if kind is TaskKind.APPLY else k
            for name, nbytes in collective_bytes_per_step(jitted.compiled.as_text()).items():
                total[name] += runs * nbytes
        return total

    def memory_stats(self) -> MemoryStats | None:
        """XLA's memory analysis of this stage's largest compiled segment (None before a run)."""
        stats = [MemoryStats.of(compiled) for _, compiled in self.compiled()]
        return max(stats, key=lambda s: s.peak_bytes, default=None)
