"""Run a pipeshard plan on local devices: one sub-mesh per stage, tasks in schedule order.

`runtime.layout` cuts the stages into segments and walks the schedule; here every stage is a
`StageRunner` in this process. JAX's asynchronous dispatch lets stages on different devices run
at the same time. A value a stage reads from another stage is moved with `jax.device_put` to the
sharding the reading stage's plan gives it, once per value.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from autopar.planner.plan import Plan
from autopar.runtime.executable import MemoryStats, collective_bytes
from autopar.runtime.layout import HOST, Key, PipelineLayout, Segment, run_step
from autopar.runtime.stage import StageRunner
from autopar.tracing import TracedStep

logger = logging.getLogger(__name__)


class _LocalBackend:
    """`run_step`'s operations on stage runners of this process."""

    def __init__(self, runners: Sequence[StageRunner]) -> None:
        self.runners = runners

    def place_input(self, key: Key, value: Any, stage: int) -> None:
        self.runners[stage].place(key, value)

    def copy(self, key: Key, source: int, target: int) -> None:
        self.runners[target].place(key, self.runners[source].value(key))

    def run(self, segment: Segment, micro_batch: int | None) -> None:
        self.runners[segment.stage].run(segment, micro_batch)

    def free(self, key: Key, stages: Sequence[int]) -> None:
        for s in stages:
            self.runners[s].free(key)


class PipelineExecutable:
    """A pipeshard plan bound to local devices. Call it like the original step."""

    def __init__(self, traced: TracedStep, plan: Plan, devices: Sequence[jax.Device]) -> None:
        self.plan = plan
        self._traced = traced
        self.layout = PipelineLayout(traced, plan)
        self.schedule = self.layout.schedule
        self._runners = [
            StageRunner(self.layout, s, devices) for s in range(self.layout.num_stages)
        ]

    def __call__(self, *args: Any) -> Any:
        dynamic = [a for i, a in enumerate(args) if i not in self._traced.static_argnums]
        return self.call_flat(self._traced.in_tree.flatten(tuple(dynamic)))

    def call_flat(self, flat: Sequence[Any]) -> Any:
        """Run one step on the flattened dynamic arguments; returns the outputs as a pytree."""
        jaxpr = self._traced.closed_jaxpr.jaxpr
        inputs = dict(zip(jaxpr.invars, flat, strict=True))
        holders = run_step(self.layout, _LocalBackend(self._runners), flat)
        outs = []
        for v in jaxpr.outvars:
            if isinstance(v, Literal):
                outs.append(jnp.asarray(v.val))
            elif holders[v] == HOST:
                outs.append(inputs[v])
            else:
                outs.append(self._runners[holders[v]].value((v, None)))
        for runner in self._runners:  # step-wide values are not kept between steps
            runner.values.clear()
        return self._traced.out_tree.unflatten(outs)

    # ------------------------------------------------------------------ inspection

    def get_hlo_text(self) -> str:
        """The compiled HLO of every segment that has run, each under a ``// segment`` line."""
        return "\n".join(runner.hlo_text() for runner in self._runners if runner.compiled())

    def collectives(self) -> dict[str, list[int]]:
        """Per collective kind, the byte size of each such op over all compiled segments."""
        return collective_bytes(self.get_hlo_text())

    def collective_bytes_per_step(self) -> list[dict[str, float]]:
        """Per stage, per collective kind, the bytes its segments move per step per device
        (after a call; `StageRunner.collective_bytes_per_step`)."""
        return [runner.collective_bytes_per_step() for runner in self._runners]

    def memory_stats(self) -> list[MemoryStats | None]:
        """Per stage, XLA's memory analysis of its largest compiled segment (after a call)."""
        return [runner.memory_stats() for runner in self._runners]

    def _flat_input_shardings(self) -> list[Any]:
        """Sharding of each flat dynamic argument on the first stage that reads it (None:
        unread)."""
        return [
            next((r.input_sharding[v] for r in self._runners if v in r.input_sharding), None)
            for v in self._traced.closed_jaxpr.jaxpr.invars
        ]

    def place_flat(self, flat: Sequence[Any]) -> list[Any]:
        """The flattened dynamic arguments, each moved to the sharding its first reader reads
        it with (unread ones as they are)."""
        shardings = self._flat_input_shardings()
        return [
            x if s is None else jax.device_put(x, s) for x, s in zip(flat, shardings, strict=True)
        ]

    @property
    def input_shardings(self) -> Any:
        """Sharding of each dynamic argument on the first stage that reads it (None: unread)."""
        return self._traced.in_tree.unflatten(self._flat_input_shardings(), with_statics=False)
