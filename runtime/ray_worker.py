"""The Ray actor that drives one host's devices of one stage mesh (see `autopar.runtime.ray`).

A worker traces the step itself from a `StepSource` (the pickled function and abstract
arguments), checks it got the planned program, and binds its stage: a `StageRunner` for a
pipeline stage, a compiled `Executable` for a single-stage plan. Values are named by (variable
id in the traced jaxpr, micro-batch) within a step, by a string between steps; they cross
processes as the shard lists this host holds.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from autopar.planner.plan import Plan
from autopar.runtime.layout import Key, PipelineLayout
from autopar.runtime.schedules import TaskKind
from autopar.tracing import TracedStep, abstract_arguments

Shards = list[tuple[tuple[slice, ...], np.ndarray]]


@dataclasses.dataclass(frozen=True)
class StepSource:
    """What a worker needs to trace the step itself: the function and abstract arguments."""

    fun: Callable
    args: tuple[Any, ...]
    argnums: tuple[tuple[int, ...], ...]  # (static, batch, donate)

    def trace(self, plan: Plan) -> TracedStep:
        from autopar.plan_store import layer_option_of
        from autopar.tracing import trace_step

        static, batch, donate = self.argnums
        return trace_step(
            self.fun,
            self.args,
            static_argnums=static,
            batch_argnums=batch,
            donate_argnums=donate,
            regather_params=bool(plan.tracing.get("regather_params", False)),
            num_micro_batches=plan.num_micro_batches,
            layer_option=layer_option_of(plan),
        )

    @classmethod
    def of(cls, fun: Callable, args: Sequence[Any], argnums) -> StepSource:
        abstract = abstract_arguments(args, argnums[0])
        return cls(fun, abstract, tuple(tuple(a) for a in argnums))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class MeshWorker:
    """A Ray actor driving one host's devices of one stage mesh (see the module docstring)."""

    def __init__(self, num_local_devices: int, simulate_devices: bool) -> None:
        if simulate_devices:
            from autopar.context import simulate_cpu_devices

            simulate_cpu_devices(num_local_devices)
        self._simulated = simulate_devices
        self._values: dict[Any, Any] = {}
        self._timeline: list[tuple[str, int | None, float, float]] = []
        self._layout: PipelineLayout | None = None
        self._runner = None
        self._executable = None
        self._input_avals: list[Any] = []

    def ping(self) -> int:
        return os.getpid()

    def coordinator_address(self) -> str:
        import ray

        return f"{ray.util.get_node_ip_address()}:{_free_port()}"

    def join(self, address: str, num_processes: int, process_id: int) -> None:
        """Join the SPMD program of a mesh that spans `num_processes` workers."""
        if self._simulated:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(address, num_processes, process_id, initialization_timeout=120)

    def profile_cluster(self, sizes: Any) -> dict[str, Any]:
        """`autopar.profile_cluster` on this worker's devices (every host's once joined), as
        `ClusterProfile.to_dict()`; `sizes` is a `ProfileSizes`."""
        from autopar.runtime.cluster_profile import measure_cluster

        return measure_cluster(jax.devices(), sizes=sizes).to_dict()

    def build(self, step: StepSource, plan_json: str, stage: int, device_indices: list) -> str:
        """Trace the step, check it is the planned program, and bind this worker's stage."""
        from autopar.runtime.compile import compile_plan
        from autopar.runtime.stage import StageRunner

        plan = Plan.from_json(plan_json)
        traced = step.trace(plan)
        if traced.program.fingerprint != plan.fingerprint:
            raise RuntimeError(
                f"the worker traced program {traced.program.fingerprint}, not the planned "
                f"{plan.fingerprint}: the step must trace the same on every host"
            )
        devices = _devices_by_index(device_indices)
        if plan.pipeline_schedule is None:
            self._executable = compile_plan(traced, plan, devices)
            self._input_avals = traced.full_batch_avals()
        else:
            self._layout = PipelineLayout(traced, plan)
            self._runner = StageRunner(self._layout, stage, devices)
        return jax.devices()[0].platform

    # values are named by (variable id, micro-batch) within a step, by a str between steps

    def _key(self, vid: int, micro_batch: int | None) -> Key:
        return (self._layout.var_of[vid], micro_batch)

    def _aval(self, vid: int) -> Any:
        if self._layout is not None:
            return self._layout.var_of[vid].aval
        return self._input_avals[vid]

    def _hold(self, vid: int, micro_batch: int | None, value: Any) -> None:
        from autopar.runtime.stage import place

        if self._runner is not None:
            self._runner.place((self._layout.var_of[vid], micro_batch), value)
        else:
            self._values[vid] = place(value, self._executable.flat_input_shardings[vid])

    def place(self, vid: int, micro_batch: int | None, *parts: Any) -> None:
        """Hold a value given whole (one host array) or as the shard lists of its holders."""
        self._hold(vid, micro_batch, assemble(parts, self._aval(vid)))

    def place_kept(self, vid: int, micro_batch: int | None, name: str) -> None:
        """Hold a value kept from an earlier step on this mesh (no copy when placed alike)."""
        self._hold(vid, micro_batch, self._values[name])

    def export(self, keys: Sequence[tuple[int, int | None]]) -> list[Shards]:
        """This host's shards of each (variable id, micro-batch), for another stage."""
        return [_local_shards(self._runner.value(self._key(*key))) for key in keys]

    def export_kept(self, name: str) -> Shards:
        return _local_shards(self._values[name])

    def receive(self, keys: Sequence[tuple[int, int | None]], *exports: list[Shards]) -> None:
        """Hold values another stage exported: one `export` result per worker of that stage."""
        for n, (vid, micro_batch) in enumerate(keys):
            shards = [export[n] for export in exports]
            self._hold(vid, micro_batch, assemble(shards, self._aval(vid)))

    def run(
        self,
        stage: int,
        kind: str,
        level: int | None,
        micro_batch: int | None,
        frees: Sequence[tuple[int, int | None]] = (),
    ) -> None:
        """Drop `frees` (values no task reads any more), then run one task of this stage."""
        for key in frees:
            self._runner.free(self._key(*key))
        segment = self._layout.segment(stage, TaskKind(kind), level)
        start = time.perf_counter()
        outs = self._runner.run(segment, micro_batch)
        jax.block_until_ready(outs)
        self._timeline.append((segment.name, micro_batch, start, time.perf_counter()))

    def run_whole(self, num_inputs: int) -> None:
        start = time.perf_counter()
        outs = self._executable.call_flat([self._values.pop(i) for i in range(num_inputs)])
        leaves = jax.tree_util.tree_leaves(outs)
        jax.block_until_ready(leaves)
        self._values.update({("out", n): x for n, x in enumerate(leaves)})
        self._timeline.append(("step", None, start, time.perf_counter()))

    def keep(self, names: dict[str, Any]) -> None:
        """End a step: keep the named outputs, drop every other value of the step."""
        for name, where in names.items():
            if self._runner is not None:
                self._values[name] = self._runner.value(self._key(*where))
            else:
                self._values[name] = self._values[("out", where)]
        if self._runner is not None:
            self._runner.values.clear()
        for key in [k for k in self._values if not isinstance(k, str)]:
            del self._values[key]

    def drop(self, name: str) -> None:
        self._values.pop(name, None)

    def timeline(self) -> list[tuple[str, int | None, float, float]]:
        """(segment, micro-batch, start, end) of each task run, in seconds of this host's clock."""
        return list(self._timeline)

    def hlo_and_memory(self) -> tuple[str, Any]:
        """The compiled HLO text and the `MemoryStats` of the largest segment (None before a
        run)."""
        if self._runner is not None:
            return self._runner.hlo_text(), self._runner.memory_stats()
        return self._executable.get_hlo_text(), self._executable.memory_stats()


def _devices_by_index(device_indices: Sequence[tuple[int, int, int]]) -> list[Any]:
    """The run's device list for `build_mesh`: global index -> the jax device of (process, local
    position); indices of other stages stay None."""
    by_process: dict[int, list[Any]] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    for devices in by_process.values():
        devices.sort(key=lambda d: d.id)
    found: list[Any] = [None] * (1 + max(i for i, _, _ in device_indices))
    for index, process, position in device_indices:
        found[index] = by_process[process][position]
    return found


def _local_shards(x: Any) -> Shards:
    """The distinct shards of `x` this process holds (replica 0 of each), as host arrays."""
    if not isinstance(x, jax.Array):
        return [((), np.asarray(x))]
    return [
        (shard.index, np.asarray(shard.data))
        for shard in x.addressable_shards
        if shard.replica_id == 0
    ]


def assemble(parts: Sequence[Any], aval: Any) -> Any:
    """One host value from a whole one or from shard lists that together cover it."""
    if len(parts) == 1 and not isinstance(parts[0], list):
        return parts[0]  # a whole host array, or a Python scalar
    shards = [piece for part in parts for piece in part]
    if len(shards) == 1 and shards[0][0] == ():
        return shards[0][1]
    whole = np.empty(aval.shape, aval.dtype)
    for index, data in shards:
        whole[index] = data
    return whole
