"""The Ray actor that drives one host's devices of one mesh (see `autopar.runtime.ray`).

A worker traces the step itself from a `StepSource` (the pickled function and abstract arguments),
checks it got the planned program, and binds its stages: a `StageRunner` per pipeline stage on its
mesh (one, or several with interleaved 1F1B) and its mesh's step program
(`runtime.worker_program`), or a compiled `Executable` for a single-stage plan. A step is one call
(`MeshWorker.step`): the worker takes its inputs, runs its program, and sends and receives the
values other stages share with it directly (`runtime.transport`). Values are named by (variable id
in the traced jaxpr, micro-batch) within a step, by a string between steps.

The actor is threaded: while one thread runs a step, others take deliveries from other workers.

A step runs with Python's cyclic garbage collector paused (`_collector_paused`), and what building
the stages left (the traced step, its programs) is frozen out of the collector's walks
(`gc.freeze`). A step allocates many short-lived objects, so the collector ran in the middle of
steps: in `make bench-ray`'s 2-mesh interleaved case a worker ran about 20 young collections and
2 middle ones a step (each also calling JAX's own collection hook), and a full collection every 5
or 6 steps that walked everything building had left for 0.18–0.29 s on this 2-core machine,
holding up the pipeline on every other mesh. Frozen, a full collection took 0.036 s; paused,
none runs inside a step, and what a step leaves behind is collected between steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from autopar.planner.plan import Plan, StagePlan, TracingRecord
from autopar.runtime.executors import StepToTime
from autopar.runtime.layout import Key, PipelineLayout, PlaceInput, RunTask, micro_batch_of
from autopar.runtime.transport import (
    Address,
    Part,
    SocketTransport,
    from_parts,
    key_impl,
    local_shards,
)
from autopar.runtime.worker_program import Copy, Free, Receive, Send, worker_programs
from autopar.tracing import TracedStep, abstract_arguments

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepSource:
    """What a worker needs to trace the step itself: the function and abstract arguments."""

    fun: Callable
    args: tuple[Any, ...]
    argnums: tuple[tuple[int, ...], ...]  # (static, batch, donate)

    def trace(self, plan: Plan) -> TracedStep:
        return self.trace_as(plan.tracing, plan.num_micro_batches)

    def trace_as(self, tracing: TracingRecord | None, num_micro_batches: int) -> TracedStep:
        """The step traced as `tracing` records (regathering, layers) with its micro-batches."""
        from autopar.plan_store import layer_option_in
        from autopar.tracing import trace_step

        static, batch, donate = self.argnums
        return trace_step(
            self.fun,
            self.args,
            static_argnums=static,
            batch_argnums=batch,
            donate_argnums=donate,
            regather_params=tracing is not None and tracing.regather_params,
            num_micro_batches=num_micro_batches,
            layer_option=layer_option_in(tracing),
        )

    @classmethod
    def of(cls, fun: Callable, args: Sequence[Any], argnums) -> StepSource:
        abstract = abstract_arguments(args, argnums[0])
        return cls(fun, abstract, tuple(tuple(a) for a in argnums))


@dataclasses.dataclass(frozen=True)
class Kept:
    """A step input that this worker kept from an earlier step, by name."""

    name: str


@dataclasses.dataclass(frozen=True)
class FromStage:
    """A step input kept on another stage of the same plan: its workers send it at the start of
    the step (`MeshWorker.step`'s `forwards`)."""

    stage: int


@dataclasses.dataclass(frozen=True)
class Pulled:
    """A step input kept by another executable's workers (an eval step reading the train state):
    fetched from them directly."""

    actors: tuple[Any, ...]
    name: str


@dataclasses.dataclass(frozen=True)
class HostKeys:
    """A typed PRNG key array passed in by the caller, as its raw data."""

    data: Any
    impl: str


@dataclasses.dataclass(frozen=True)
class TaskTime:
    """When a worker ran one task of a step: wall seconds of its host's `time.perf_counter`,
    and its device clock (`DeviceClock`) since the step started."""

    stage: int
    segment: str
    micro_batch: int | None
    step: int
    start: float
    end: float
    device_start: float
    device_end: float


class DeviceClock:
    """A worker's own time within a step, as if its devices were its own: advanced by the CPU
    time its process spends (computing, copying, sending), moved forward to the clock a value
    was sent at when the worker waits for it. On cores that several workers share, wall time
    counts the others' work as this worker's; this clock does not, so a pipeline's bubble read
    from it is the schedule's and the runtime's, not the machine's."""

    def __init__(self) -> None:
        self.now = 0.0
        self._mark = time.process_time()

    def restart(self) -> None:
        self.now, self._mark = 0.0, time.process_time()

    def tick(self) -> float:
        """Add the CPU time spent since the last tick; the clock's reading."""
        mark = time.process_time()
        self.now += mark - self._mark
        self._mark = mark
        return self.now

    def received(self, sent_at: float) -> None:
        """A value sent at `sent_at` arrived: the worker could not go on before then."""
        self.now = max(self.tick(), sent_at)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, then as it was (module docstring)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class MeshWorker:
    """A Ray actor driving one host's devices of one mesh (see the module docstring)."""

    def __init__(
        self,
        num_local_devices: int,
        simulate_devices: bool,
        host: int,
        stages: tuple[int, ...] = (),
        log_level: int = logging.WARNING,
    ) -> None:
        if simulate_devices:
            from autopar.context import simulate_cpu_devices

            simulate_cpu_devices(num_local_devices)
        handler = logging.StreamHandler(sys.stderr)  # Ray forwards it, prefixed with repr(self)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        autopar_logger = logging.getLogger("autopar")
        autopar_logger.addHandler(handler)
        autopar_logger.setLevel(log_level)
        autopar_logger.propagate = False  # Ray's own root handler would print it twice
        self.stages = tuple(stages)  # the pipeline stages on this mesh; () for profiling
        self.host = host
        self._simulated = simulate_devices
        self._values: dict[Any, Any] = {}
        self._released: list[Any] = []  # values a `Free` dropped, deleted when the worker waits
        self._timeline: list[TaskTime] = []
        self._clock = DeviceClock()
        self._step = -1
        self._layout: PipelineLayout | None = None
        self._program: tuple = ()
        self._runners: dict[int, Any] = {}  # stage -> StageRunner
        self._executable = None
        self._input_avals: list[Any] = []
        self._transport: SocketTransport | None = None
        self._profiled: tuple = ()  # (parts, signature) of the step profiling mode times

    def __repr__(self) -> str:
        stages = {0: "", 1: "stage "}.get(len(self.stages), "stages ")
        stages += "+".join(map(str, self.stages)) + (", " if self.stages else "")
        return f"MeshWorker({stages}host {self.host})"

    def ping(self) -> int:
        return os.getpid()

    def open_transport(self, authkey: bytes, timeout_s: float) -> Address:
        """Listen for values from other stages' workers (`runtime.transport`); the address."""
        import ray

        self._transport = SocketTransport(ray.util.get_node_ip_address(), authkey, timeout_s)
        return self._transport.address

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

    def prepare_profiling(self, step: StepToTime) -> None:
        """Trace the step whose candidate stages `measure_stage` times (profiling mode on Ray)
        and check it is the program the driver plans."""
        from autopar.planner.pipeline import split_step

        source = StepSource(step.fun, tuple(step.args), step.argnums)
        traced = source.trace_as(step.tracing, step.num_micro_batches)
        if traced.program.fingerprint != step.fingerprint:
            raise RuntimeError(
                f"the profiling worker traced program {traced.program.fingerprint}, not the "
                f"planned {step.fingerprint}: the step must trace the same on every host"
            )
        parts = split_step(traced.closed_jaxpr, traced.program.signature.batch_inputs)
        self._profiled = (parts, traced.program.signature)

    def measure_stage(self, layers: tuple[int, int], plan: StagePlan) -> tuple[float, float]:
        """`runtime.profile.measure_stage` of the traced step's layers [start, end) with its
        plan, on this worker's devices."""
        from autopar.planner.pipeshard import range_program
        from autopar.runtime.profile import measure_stage

        parts, signature = self._profiled
        return measure_stage(range_program(parts, signature, *layers), plan, jax.devices())

    def build(
        self,
        step: StepSource,
        plan_json: str,
        device_indices: list,
        peers: Sequence[Sequence[Address]],
    ) -> str:
        """Trace the step, check it is the planned program, and bind this worker's stage;
        `peers[s]` are the transport addresses of stage s's workers (`open_transport`)."""
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
        self._transport.connect(peers)
        if plan.pipeline_schedule is None:
            self._executable = compile_plan(traced, plan, devices)
            self._input_avals = traced.full_batch_avals()
        else:
            self._layout = PipelineLayout(traced, plan)
            self._runners = {s: StageRunner(self._layout, s, devices) for s in self.stages}
            mesh = self._layout.schedule.mesh_of(self.stages[0])
            self._program = worker_programs(self._layout)[mesh]
        logger.info("built with %d instruction(s) per step", len(self._program))
        gc.collect()
        gc.freeze()  # long-lived from here on: no later collection need walk it (module doc)
        return jax.devices()[0].platform

    # ------------------------------------------------------------------ a step

    def step(
        self,
        step: int,
        inputs: dict[int, Any],
        keep: dict[str, Any],
        forwards: Sequence[tuple[str, int, int]] = (),
        drops: Sequence[str] = (),
    ) -> int:
        """Run this worker's share of step number `step`; returns the bytes it sent.

        `inputs`: the step inputs this worker takes, by variable id (host values, object refs,
        `Kept`, `FromStage`, `Pulled`, `HostKeys`); `keep`: the step outputs to keep, by the
        name later steps and `RemoteArray`s use; `forwards`: (kept name, variable id, stage) to
        send to another stage first; `drops`: kept values no `RemoteArray` names any more."""
        with _collector_paused():
            return self._run_step(step, inputs, keep, forwards, drops)

    def _run_step(
        self,
        step: int,
        inputs: dict[int, Any],
        keep: dict[str, Any],
        forwards: Sequence[tuple[str, int, int]],
        drops: Sequence[str],
    ) -> int:
        for name in drops:
            self._values.pop(name, None)
        self._step = step
        self._clock.restart()
        transport = self._transport
        transport.mailbox.drop_before(step)
        sent = transport.bytes_sent
        for name, vid, target in forwards:
            transport.send((step, vid, None), self._values[name], target, self._clock.tick())
        values = self._resolve(step, inputs)
        if not self._runners:
            self._run_whole(values)
        else:
            self._run_program(step, values)
        self._keep(keep)
        transport.flush()
        return transport.bytes_sent - sent

    def _resolve(self, step: int, inputs: dict[int, Any]) -> dict[int, Any]:
        """The value of each input (object refs fetched together, first)."""
        import ray

        refs = {vid: x for vid, x in inputs.items() if isinstance(x, ray.ObjectRef)}
        fetched = dict(zip(refs, ray.get(list(refs.values())), strict=True)) if refs else {}
        values = {}
        for vid, x in inputs.items():
            if vid in fetched:
                values[vid] = fetched[vid]
            elif isinstance(x, Kept):
                values[vid] = self._values[x.name]
            elif isinstance(x, FromStage):
                tag, what = (step, vid, None), f"input {self._var_name(vid)}"
                values[vid], sent_at = self._transport.receive(tag, x.stage, self._aval(vid), what)
                self._clock.received(sent_at)
            elif isinstance(x, Pulled):
                parts = ray.get([actor.export_kept.remote(x.name) for actor in x.actors])
                values[vid] = from_parts(parts, self._aval(vid))
            elif isinstance(x, HostKeys):
                values[vid] = jax.random.wrap_key_data(x.data, impl=x.impl)
            else:
                values[vid] = x
        return values

    def _run_program(self, step: int, values: dict[int, Any]) -> None:
        layout, runners, k = self._layout, self._runners, self._layout.num_micro_batches
        closed = layout.traced.closed_jaxpr
        consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        clock = self._clock
        for instruction in self._program:
            if isinstance(instruction, RunTask):
                segment = instruction.segment
                j = instruction.micro_batch
                self._timed(segment.stage, segment.name, j, runners[segment.stage].run, segment, j)
                continue
            if isinstance(instruction, Free):  # deleted when the worker next waits, or at the end
                self._released += [runners[instruction.stage].free(key) for key in instruction.keys]
                continue
            var, j = instruction.key
            if isinstance(instruction, PlaceInput):
                whole = consts[var] if var in consts else values[layout.var_id[var]]
                value = whole if j is None else micro_batch_of(whole, j, k)
                runners[instruction.stage].place(instruction.key, value)
            elif isinstance(instruction, Copy):
                value = runners[instruction.source].value(instruction.key)
                runners[instruction.target].place(instruction.key, value)
            elif isinstance(instruction, Send):
                tag = (step, layout.var_id[var], j)
                value = runners[instruction.source].value(instruction.key)
                self._transport.send(tag, value, instruction.target, clock.tick())
            elif isinstance(instruction, Receive):
                tag = (step, layout.var_id[var], j)
                what = f"{var} of micro-batch {j}" if j is not None else str(var)
                if not self._transport.arrived(tag, instruction.source):
                    self._released.clear()
                value, sent_at = self._transport.receive(tag, instruction.source, var.aval, what)
                clock.received(sent_at)
                runners[instruction.stage].place(instruction.key, value)
        self._released.clear()

    def _run_whole(self, values: dict[int, Any]) -> None:
        from autopar.runtime.stage import place

        shardings = self._executable.flat_input_shardings
        flat = [place(values[n], shardings[n]) for n in range(len(values))]
        outs = self._timed(0, "step", None, self._executable.call_flat, flat)
        leaves = jax.tree_util.tree_leaves(outs)
        self._values.update({("out", n): x for n, x in enumerate(leaves)})

    def _timed(
        self, stage: int, name: str, micro_batch: int | None, run: Callable, *args: Any
    ) -> Any:
        """`run(*args)` (a task of `stage`) until its results are ready, in the timeline."""
        device_start, start = self._clock.tick(), time.perf_counter()
        outs = jax.block_until_ready(run(*args))
        end, device_end = time.perf_counter(), self._clock.tick()
        times = (start, end, device_start, device_end)
        self._timeline.append(TaskTime(stage, name, micro_batch, self._step, *times))
        return outs

    def _keep(self, names: dict[str, tuple[int, Any]]) -> None:
        """End a step: keep the named outputs (name -> (stage, where it is)), drop every other
        value of the step."""
        for name, (stage, where) in names.items():
            if self._runners:
                self._values[name] = self._runners[stage].value(self._key(*where))
            else:
                self._values[name] = self._values[("out", where)]
        for runner in self._runners.values():
            runner.values.clear()
        for key in [k for k in self._values if not isinstance(k, str)]:
            del self._values[key]

    # ------------------------------------------------------------------ values between steps

    def create(
        self,
        fun: Callable,
        args: tuple[Any, ...],
        static: tuple[int, ...],
        leaves: dict[str, tuple[int, int, int | None]],
    ) -> None:
        """Run a state-initialisation function and keep the leaves of its result this mesh
        stores (name -> (stage, leaf index, variable id; None for a leaf no stage reads)), each
        born in the sharding its stage reads it with (`CreateStateParallel` on Ray)."""
        dynamic = [a for i, a in enumerate(args) if i not in static]
        chosen = list(leaves.values())

        def select(*values):
            it = iter(values)
            state = fun(*(a if i in static else next(it) for i, a in enumerate(args)))
            flat = jax.tree_util.tree_leaves(state)
            return tuple(flat[i] for _, i, _ in chosen)

        shardings = tuple(self._input_sharding(stage, vid) for stage, _, vid in chosen)
        outs = jax.jit(select, out_shardings=shardings)(*dynamic)
        self._values.update(zip(leaves, outs, strict=True))

    def hold(self, values: dict[str, tuple[int, int, Any]]) -> None:
        """Keep step inputs ahead of a step (name -> (stage, variable id, input as `step` takes
        it)), placed where that stage reads them (`preshard_dynamic_args` on Ray)."""
        from autopar.runtime.stage import place

        resolved = self._resolve(-1, {vid: x for _, vid, x in values.values()})
        for name, (stage, vid, _) in values.items():
            self._values[name] = place(resolved[vid], self._input_sharding(stage, vid))

    def _input_sharding(self, stage: int, vid: int | None) -> Any:
        """The sharding `stage` reads step input `vid` with (None: as it comes; batch inputs of
        a pipeline are cut into micro-batches first)."""
        if vid is None:
            return None
        if not self._runners:
            return self._executable.flat_input_shardings[vid]
        var = self._layout.var_of[vid]
        if var in self._layout.batch_vars:
            return None
        return self._runners[stage].input_sharding.get(var)

    # ------------------------------------------------------------------ between workers

    def export_kept(self, name: str) -> Part:
        value = self._values[name]
        return key_impl(value), local_shards(value)

    def drop(self, name: str) -> None:
        self._values.pop(name, None)

    # ------------------------------------------------------------------ inspection

    def _key(self, vid: int, micro_batch: int | None) -> Key:
        return (self._layout.var_of[vid], micro_batch)

    def _aval(self, vid: int) -> Any:
        if self._layout is not None:
            return self._layout.var_of[vid].aval
        return self._input_avals[vid]

    def _var_name(self, vid: int) -> str:
        return str(self._layout.var_of[vid]) if self._layout is not None else f"#{vid}"

    def timeline(self) -> list[TaskTime]:
        """Every task this worker ran, in order."""
        return list(self._timeline)

    def hlo_and_memory(self) -> list[tuple[int, str, Any]]:
        """Per stage on this mesh: (stage, compiled HLO text, `MemoryStats` of its largest
        segment; None before a run)."""
        if self._runners:
            return [(s, r.hlo_text(), r.memory_stats()) for s, r in self._runners.items()]
        return [(0, self._executable.get_hlo_text(), self._executable.memory_stats())]


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
