"""Run plans on Ray actors that drive device meshes, including meshes that span several hosts.

`autopar.init(cluster="ray")` connects to (or starts) Ray and reserves one placement-group bundle
per host (`RayCluster`). A plan's mesh gets one `MeshWorker` actor per host it covers, pinned
to that host's devices (its GPUs; on a CPU-only cluster the actor simulates its share of devices
with XLA's host-platform device count). A mesh over several hosts is one JAX SPMD program over its
actors, joined with `jax.distributed.initialize` (gloo collectives on CPU, NCCL on GPU).

The driver (`RayExecutable`) never holds the program's arrays. It traces and plans the step, then
each worker traces the same step again from the pickled function and abstract arguments and checks
it got the same program, so a variable is named across processes by its id in the traced jaxpr.
Each worker compiles its mesh's share of the schedule (its stage's, or with interleaved 1F1B its
virtual stages') into its own step program once (`runtime.worker_program`). A step is then one call
per worker, carrying the inputs that worker takes; activations and gradients go from worker to
worker (`runtime.transport`), never through the driver, which only waits for the calls to finish.
Step outputs stay on their meshes as `RemoteArray` handles; passing them to the next step moves
nothing, and the names of those that are garbage-collected travel with the next step's calls.

Failures: every step waits for its calls with a timeout; an actor that dies or a task that raises
surfaces as `StageFailedError` naming the stage and host, a step over time as `StepTimeoutError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import AutoparError, InvalidArgumentError
from autopar.planner.plan import Plan, format_spec
from autopar.runtime.executors import StepToBuild, StepToTime
from autopar.runtime.layout import HOST, PipelineLayout, PlaceInput
from autopar.runtime.ray_worker import (
    FromStage,
    HostKeys,
    Kept,
    MeshWorker,
    Pulled,
    StepSource,
    TaskTime,
)
from autopar.runtime.transport import from_parts, key_impl
from autopar.runtime.worker_program import taken_inputs, worker_programs
from autopar.tracing import TracedStep

logger = logging.getLogger(__name__)

DEFAULT_STEP_TIMEOUT_S = 600.0
_CONNECT_TIMEOUT_S = 5.0
_INLINE_BYTES = 64 * 1024  # host inputs up to this size travel inside the call, not as objects
_WORKER_THREADS = 4  # a step, exports to other executables and inspection at once


class RemoteError(AutoparError, RuntimeError):
    """A failure on the Ray cluster, reported by the driver."""


class StageFailedError(RemoteError):
    """A mesh worker died or raised while running a stage."""


class StepTimeoutError(RemoteError):
    """A step (or building its stages) did not finish within the configured timeout."""


# ----------------------------------------------------------------------------- the cluster


@dataclasses.dataclass
class RayCluster:
    """A connection to Ray: the hosts autopar uses, their placement group, the actors made."""

    cluster_spec: ClusterSpec
    use_gpus: bool
    placement_group: Any
    started_ray: bool
    step_timeout_s: float
    actors: list[Any] = dataclasses.field(default_factory=list)

    @classmethod
    def connect(
        cls,
        address: str | None,
        cluster_spec: ClusterSpec | None,
        num_devices: int | None,
        step_timeout_s: float,
    ) -> RayCluster:
        """Connect to Ray at `address` ("auto" or host:port; None: start a local instance),
        find the hosts and their devices, and reserve one bundle per host."""
        import ray
        from ray.util.placement_group import placement_group

        if not (isinstance(step_timeout_s, (int, float)) and step_timeout_s > 0):
            raise InvalidArgumentError(
                f"step_timeout_s must be a positive number of seconds, got {step_timeout_s!r}"
            )
        started = False
        if not ray.is_initialized():
            if address not in (None, "auto"):
                _check_reachable(address)
            try:
                ray.init(address=address, include_dashboard=False)
            except ConnectionError as e:
                raise InvalidArgumentError(
                    f"cannot connect to a Ray cluster at address={address!r}: {e}"
                ) from e
            started = True
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        gpus = [int(n["Resources"].get("GPU", 0)) for n in nodes]
        use_gpus = all(g > 0 for g in gpus)
        spec = _cluster_spec(nodes, gpus, use_gpus, cluster_spec, num_devices)
        bundle = {"GPU": spec.devices_per_host} if use_gpus else {"CPU": 0.01}
        group = placement_group(
            [dict(bundle) for _ in range(spec.num_hosts)],
            strategy="STRICT_SPREAD" if use_gpus else "PACK",
        )
        try:
            ray.get(group.ready(), timeout=60)
        except ray.exceptions.GetTimeoutError as e:
            ray.util.remove_placement_group(group)
            raise InvalidArgumentError(
                f"Ray cannot reserve {spec.num_hosts} host bundle(s) of {bundle} within 60 s"
            ) from e
        logger.info(
            "autopar on Ray: %d host(s) x %d %s device(s)",
            spec.num_hosts,
            spec.devices_per_host,
            "GPU" if use_gpus else "simulated CPU",
        )
        return cls(spec, use_gpus, group, started, float(step_timeout_s))

    holds_devices = False  # the Executor protocol: arrays live on the mesh workers

    def build(self, step: StepToBuild) -> RayExecutable:
        """The Executor protocol: the step's stages on mesh workers, which trace it again."""
        source = StepSource.of(step.fun, step.args, step.argnums)
        return RayExecutable(self, step.traced, step.plan, source)

    def check_devices_free(self, what: str) -> None:
        """Refuse `what` (which needs a profiling worker with the hosts' GPUs) while mesh
        workers hold them."""
        if self.use_gpus and self.actors:
            raise InvalidArgumentError(
                f"{what} on Ray needs the hosts' GPUs, but {len(self.actors)} mesh worker(s) "
                "hold them: do it before the first step, or autopar.shutdown() and "
                "autopar.init('ray') again"
            )

    @contextlib.contextmanager
    def stage_timer(self, step: StepToTime) -> Iterator[Any]:
        """The Executor protocol: candidate stages timed by a profiling worker on host 0 with
        all its devices, which traces the step itself; it stops when planning ends, before the
        step's mesh workers take the devices. A candidate may span hosts, which one worker
        cannot time: a cluster of several hosts is refused."""
        spec = self.cluster_spec
        if spec.num_hosts > 1:
            raise InvalidArgumentError(
                "AutoStageOption(profile=True) on Ray times candidate stages on one host's "
                f"devices, but the cluster has {spec.num_hosts} hosts and a stage may span "
                "them; use profile=False (the cost model)"
            )
        self.check_devices_free("AutoStageOption(profile=True)")
        worker = self.start_worker(0, spec.devices_per_host)
        try:
            self.wait([worker.prepare_profiling.remote(step)], "tracing the step to profile")

            def measure(stage: Any, plan: Any) -> tuple[float, float]:
                (timing,) = self.wait(
                    [worker.measure_stage.remote(stage.layers, plan)],
                    f"timing the stage of layers {stage.layers}",
                )
                return timing

            yield measure
        finally:
            self.stop_workers([worker])

    def start_worker(self, host: int, num_devices: int, stages: tuple[int, ...] = ()) -> Any:
        """A `MeshWorker` actor on `host`'s bundle that drives `num_devices` of its devices, for
        the pipeline `stages` on its mesh (none: a profiling worker); it logs at the level of
        this process's "autopar" logger."""
        import ray

        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        level = logging.getLogger("autopar").getEffectiveLevel()
        actor = (
            ray.remote(MeshWorker)
            .options(
                num_cpus=0,
                num_gpus=num_devices if self.use_gpus else 0,
                scheduling_strategy=strategy(self.placement_group, host),
                max_restarts=0,
                max_concurrency=_WORKER_THREADS,
            )
            .remote(num_devices, not self.use_gpus, host, stages, level)
        )
        self.actors.append(actor)
        return actor

    def stop_workers(self, actors: Sequence[Any]) -> None:
        """Kill `actors` (from `start_worker`) now instead of at `shutdown`."""
        import ray

        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:  # an actor that is already gone
                logger.debug("actor was already gone", exc_info=True)
            self.actors.remove(actor)

    def wait(self, refs: Sequence[Any], what: str) -> list[Any]:
        """Results of `refs`; a worker that dies or raises, or `step_timeout_s` passing, is a
        `RemoteError` naming `what` was being done."""
        import ray

        try:
            return ray.get(list(refs), timeout=self.step_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise StepTimeoutError(
                f"{what} did not finish within step_timeout_s={self.step_timeout_s:g} s"
            ) from e
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            raise RemoteError(f"{what} failed on Ray: {_first_line(e)}") from e

    def shutdown(self) -> None:
        """Kill every actor autopar made, release the placement group, stop Ray if we started it."""
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # an actor that is already gone
                logger.debug("actor was already gone", exc_info=True)
        self.actors.clear()
        ray.util.remove_placement_group(self.placement_group)
        if self.started_ray:
            ray.shutdown()


def _check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgumentError(
            f"address={address!r} is not 'auto' or host:port (e.g. '10.0.0.1:6379')"
        )
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise InvalidArgumentError(
            f"no Ray cluster answers at address={address!r} within {_CONNECT_TIMEOUT_S:.0f} s "
            f"({e.strerror or e})"
        ) from e


def _cluster_spec(
    nodes: list[dict],
    gpus: list[int],
    use_gpus: bool,
    cluster_spec: ClusterSpec | None,
    num_devices: int | None,
) -> ClusterSpec:
    """The cluster autopar plans for: the GPU hosts found, or simulated CPU hosts."""
    if use_gpus:
        found = (len(nodes), min(gpus))
        if cluster_spec is None:
            logger.warning(
                "no cluster_spec given: plans use placeholder costs for %d x %d GPUs; pass "
                "ClusterSpec.preset(...) for real figures",
                *found,
            )
            return dataclasses.replace(
                ClusterSpec.local(found[1]),
                num_hosts=found[0],
                name=f"ray-{found[0]}x{found[1]}",
                platform="gpu",
            )
        if cluster_spec.physical_mesh_shape != found:
            raise InvalidArgumentError(
                f"cluster_spec describes {cluster_spec.physical_mesh_shape} (hosts, GPUs per "
                f"host) but the Ray cluster has {found}"
            )
        return cluster_spec
    if cluster_spec is not None:
        if num_devices is not None and num_devices != cluster_spec.num_devices:
            raise InvalidArgumentError(
                f"num_devices={num_devices} differs from cluster_spec's {cluster_spec.num_devices}"
            )
        return cluster_spec
    n = 8 if num_devices is None else num_devices
    if not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"num_devices must be a positive int, got {num_devices!r}")
    # the workers simulate their devices (`simulate_cpu_devices`): XLA runs its DFS scheduler
    return dataclasses.replace(ClusterSpec.local(n), dfs_schedule=True)


# ----------------------------------------------------------------------------- the driver


class RemoteArray:
    """A step output that stays on its mesh's workers; `np.asarray(x)` fetches it."""

    def __init__(self, executable: RayExecutable, stage: int, name: str, aval: Any, spec: str):
        self._executable = executable
        self.stage = stage
        self.name = name
        self.aval = aval
        self.spec = spec
        weakref.finalize(self, executable.unused[executable.mesh_of(stage)].append, name)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.aval.dtype)

    @property
    def ndim(self) -> int:
        return len(self.aval.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self._executable.fetch(self)
        return value if dtype is None else value.astype(dtype)

    def __repr__(self) -> str:
        return (
            f"RemoteArray(shape={self.shape}, dtype={self.dtype}, stage={self.stage}, "
            f"spec={self.spec})"
        )


@dataclasses.dataclass
class _Call:
    ref: Any
    mesh: int
    host: int
    what: str


class RayExecutable:
    """A plan bound to mesh workers on Ray. Call it like the original step."""

    _names = itertools.count()

    def __init__(
        self, cluster: RayCluster, traced: TracedStep, plan: Plan, source: StepSource
    ) -> None:
        self.plan = plan
        self._cluster = cluster
        self._traced = traced
        self._broken: str | None = None
        self._lock = threading.Lock()
        self._steps = itertools.count()
        self.last_dispatch_s = 0.0  # driver time spent submitting the last step's calls
        self.last_driver_bytes = 0  # bytes of host inputs the driver put in the last step
        self.last_worker_bytes = 0  # bytes the workers sent each other in the last step
        self.layout = PipelineLayout(traced, plan) if plan.pipeline_schedule else None
        self.schedule = self.layout.schedule if self.layout else None
        meshes = self.schedule.num_meshes if self.schedule else 1
        # the stages on each mesh: one, or v with interleaved 1F1B (stage s on mesh s mod n)
        self.mesh_stages = [tuple(range(m, len(plan.stages), meshes)) for m in range(meshes)]
        self._taken = self._inputs_taken()  # per mesh
        self._first_reader = self._first_readers()
        self.unused: list[list[str]] = [[] for _ in range(meshes)]  # kept names to drop
        spec = cluster.cluster_spec
        needed = 1 + max(i for s in plan.stages for i in s.mesh.device_indices)
        if needed > spec.num_devices:
            raise InvalidArgumentError(
                f"the plan needs {needed} devices but the Ray cluster has {spec.num_devices} "
                f"({spec.num_hosts}x{spec.devices_per_host})"
            )
        self.actors: list[list[Any]] = []  # per mesh, one worker per host it covers
        self.hosts: list[list[int]] = []
        for stages in self.mesh_stages:
            by_host: dict[int, list[int]] = {}
            for index in plan.stages[stages[0]].mesh.device_indices:
                by_host.setdefault(index // spec.devices_per_host, []).append(index)
            hosts = sorted(by_host.items())
            self.actors.append([cluster.start_worker(h, len(ix), stages) for h, ix in hosts])
            self.hosts.append(sorted(by_host))
        self._build(source)

    def mesh_of(self, stage: int) -> int:
        """The mesh whose workers run `stage`."""
        return stage % len(self.mesh_stages)

    def workers_of(self, stage: int) -> list[Any]:
        """The actors that run `stage` (one per host of its mesh)."""
        return self.actors[self.mesh_of(stage)]

    def _label(self, mesh: int) -> str:
        stages = self.mesh_stages[mesh]
        return f"stage {stages[0]}" if len(stages) == 1 else "stages " + "+".join(map(str, stages))

    def _device_map(self, mesh: int) -> list[tuple[int, int, int]]:
        """(global device index, process of the mesh, position on that process) of each device
        of `mesh`: how its workers find the plan's devices among theirs."""
        per_host = self._cluster.cluster_spec.devices_per_host
        indices = self.plan.stages[self.mesh_stages[mesh][0]].mesh.device_indices
        entries = []
        for index in indices:
            host = index // per_host
            same_host = sorted(i for i in indices if i // per_host == host)
            entries.append((index, self.hosts[mesh].index(host), same_host.index(index)))
        return entries

    def _build(self, source: StepSource) -> None:
        """Start the workers, join multi-host meshes, and have every worker bind its stages."""
        meshes = range(len(self.actors))
        calls = []
        for m in meshes:
            calls += [_Call(a.ping.remote(), m, h, "starting") for a, h in self._pairs(m)]
        self._wait(calls, "starting the mesh workers")
        authkey, timeout = secrets.token_bytes(16), self._cluster.step_timeout_s
        opens = [
            _Call(a.open_transport.remote(authkey, timeout), m, h, "opening its transport")
            for m in meshes
            for a, h in self._pairs(m)
        ]
        addresses = iter(self._wait(opens, "opening the stage transports"))
        by_mesh = [[next(addresses) for _ in actors] for actors in self.actors]
        peers = [by_mesh[self.mesh_of(s)] for s in range(len(self.plan.stages))]
        joins = []
        for m, actors in enumerate(self.actors):
            if len(actors) > 1:
                address = self._get(actors[0].coordinator_address.remote(), m)
                joins += [
                    _Call(a.join.remote(address, len(actors), p), m, h, "jax.distributed")
                    for p, (a, h) in enumerate(self._pairs(m))
                ]
        self._wait(joins, "joining multi-host meshes")
        plan_json = self.plan.to_json(indent=None)
        builds = [
            _Call(a.build.remote(source, plan_json, self._device_map(m), peers), m, h, "build")
            for m in meshes
            for a, h in self._pairs(m)
        ]
        self._wait(builds, "building the stages")

    def _inputs_taken(self) -> list[list[int]]:
        """Per mesh, the positions of the flat step inputs its workers take (every one for a
        single-stage plan; constants the workers have from their own trace)."""
        invars = self._traced.closed_jaxpr.jaxpr.invars
        if self.layout is None:
            return [list(range(len(invars)))]
        position = {v: n for n, v in enumerate(invars)}
        return [
            sorted({position[v] for v, _ in taken_inputs(program) if v in position})
            for program in worker_programs(self.layout)
        ]

    def _first_readers(self) -> dict[int, int]:
        """The first stage that reads each flat step input position (absent: none does)."""
        invars = self._traced.closed_jaxpr.jaxpr.invars
        if self.layout is None:
            return dict.fromkeys(range(len(invars)), 0)
        position = {v: n for n, v in enumerate(invars)}
        readers: dict[int, int] = {}
        for op in self.layout.walk.ops:
            if isinstance(op, PlaceInput) and op.key[0] in position:
                n = position[op.key[0]]
                readers[n] = min(readers.get(n, op.stage), op.stage)
        return readers

    def _pairs(self, mesh: int) -> list[tuple[Any, int]]:
        return list(zip(self.actors[mesh], self.hosts[mesh], strict=True))

    # ------------------------------------------------------------------ calling

    def __call__(self, *args: Any) -> Any:
        dynamic = tuple(a for i, a in enumerate(args) if i not in self._traced.static_argnums)
        return self.call_flat(self._traced.in_tree.flatten(dynamic))

    def call_flat(self, flat: Sequence[Any]) -> Any:
        """Run one step: one call per worker; outputs come back as `RemoteArray`s that stay on
        their meshes."""
        if self._broken:
            raise RemoteError(
                f"this executable cannot run: {self._broken}; call autopar.shutdown() and "
                "autopar.init() again"
            )
        with self._lock:
            start = time.perf_counter()
            step = next(self._steps)
            inputs, forwards, driver_bytes = self._step_inputs(flat)
            outs, keep = self._outputs(flat)
            calls = []
            for m in range(len(self.actors)):
                drops = self.unused[m][:]
                del self.unused[m][: len(drops)]
                args = (step, inputs[m], keep[m], forwards[m], drops)
                calls += [_Call(a.step.remote(*args), m, h, "the step") for a, h in self._pairs(m)]
            self.last_dispatch_s = time.perf_counter() - start
            self.last_driver_bytes = driver_bytes
            self.last_worker_bytes = sum(self._wait(calls, "the step"))
        return self._traced.out_tree.unflatten(outs)

    def _step_inputs(
        self, flat: Sequence[Any]
    ) -> tuple[list[dict[int, Any]], list[list[tuple[str, int, int]]], int]:
        """Per mesh, its inputs by variable id (`MeshWorker.step`) and the kept values it
        forwards to other meshes; and the bytes the driver put in Ray's object store."""
        inputs: list[dict[int, Any]] = [{} for _ in self.actors]
        forwards: list[list[tuple[str, int, int]]] = [[] for _ in self.actors]
        payloads = _Payloads()
        for m, positions in enumerate(self._taken):
            for n in positions:
                x, vid = flat[n], self._vid(n)
                if isinstance(x, RemoteArray) and x._executable is self:
                    held_here = self.mesh_of(x.stage) == m
                    if not held_here:
                        target = self.mesh_stages[m][0]
                        forwards[self.mesh_of(x.stage)].append((x.name, vid, target))
                    inputs[m][vid] = Kept(x.name) if held_here else FromStage(x.stage)
                else:
                    inputs[m][vid] = payloads.of(n, x)
        return inputs, forwards, payloads.driver_bytes

    @property
    def input_positions(self) -> tuple[Any, ...]:
        """Each dynamic argument's leaves as their positions among the flat step inputs (None
        for static leaves), as pytrees shaped like the arguments."""
        count = len(self._traced.closed_jaxpr.jaxpr.invars)
        return self._traced.in_tree.unflatten(list(range(count)), with_statics=False)

    def _vid(self, position: int) -> int:
        """The variable id (shared with the workers) of flat step input `position`."""
        if self.layout is None:
            return position
        return self.layout.var_id[self._traced.closed_jaxpr.jaxpr.invars[position]]

    def _reader(self, position: int) -> int | None:
        """The first stage that reads flat step input `position` (None: no stage does)."""
        return self._first_reader.get(position)

    def _remote(self, stage: int, position: int | None, aval: Any) -> RemoteArray:
        """A new `RemoteArray` for a value `stage` will keep: a step input (`position`) in the
        sharding the stage reads it with, or (None) a value no stage reads."""
        if position is None:
            spec = "unread"
        elif self.layout is None:
            spec = format_spec(self.plan.stages[0].input_specs[position])
        else:
            var = self._traced.closed_jaxpr.jaxpr.invars[position]
            spec = _spec(self.plan, self.layout, stage, var, inputs=True)
        return RemoteArray(self, stage, f"kept{next(RayExecutable._names)}", aval, spec)

    def place_flat(self, flat: Sequence[Any]) -> list[Any]:
        """The flat step inputs kept on the workers of the stage that reads each, as it reads
        them (`preshard_dynamic_args`); inputs no stage reads stay as they are."""
        payloads = _Payloads()
        held: list[dict[str, tuple[int, int, Any]]] = [{} for _ in self.actors]
        placed = list(flat)
        avals = self._traced.full_batch_avals()
        for n, x in enumerate(flat):
            s = self._reader(n)
            if s is None or (isinstance(x, RemoteArray) and x._executable is self and x.stage == s):
                continue
            placed[n] = self._remote(s, n, avals[n])
            held[self.mesh_of(s)][placed[n].name] = (s, self._vid(n), payloads.of(n, x))
        calls = [
            _Call(a.hold.remote(held[m]), m, h, "presharding inputs")
            for m in range(len(self.actors))
            if held[m]
            for a, h in self._pairs(m)
        ]
        self._wait(calls, "presharding the inputs")
        return placed

    def create_state(
        self, fun: Any, args: tuple[Any, ...], static: tuple[int, ...], positions: Sequence[Any]
    ) -> list[RemoteArray]:
        """Run a state-initialisation function on the workers: leaf i of its result is born on
        the stage that reads flat step input `positions[i]` (None: a leaf the step does not read,
        kept on stage 0), in that stage's sharding; returns the leaves as `RemoteArray`s."""
        import jax

        def bound(*dynamic):
            it = iter(dynamic)
            return fun(*(a if i in static else next(it) for i, a in enumerate(args)))

        abstract = jax.eval_shape(bound, *(a for i, a in enumerate(args) if i not in static))
        leaves: list[dict[str, tuple[int, int, int | None]]] = [{} for _ in self.actors]
        created = []
        for i, (leaf, n) in enumerate(zip(jax.tree.leaves(abstract), positions, strict=True)):
            s = 0 if n is None else self._reader(n)
            s, n = (0, None) if s is None else (s, n)
            aval = jax.core.ShapedArray(leaf.shape, leaf.dtype, weak_type=leaf.weak_type)
            array = self._remote(s, n, aval)
            vid = None if n is None else self._vid(n)
            leaves[self.mesh_of(s)][array.name] = (s, i, vid)
            created.append(array)
        calls = [
            _Call(a.create.remote(fun, args, static, leaves[m]), m, h, "creating the state")
            for m in range(len(self.actors))
            if leaves[m]
            for a, h in self._pairs(m)
        ]
        self._wait(calls, "creating the state")
        return created

    def _outputs(self, flat: Sequence[Any]) -> tuple[list[Any], list[dict[str, Any]]]:
        """The step's outputs (`RemoteArray`s named now, literals, inputs passed through) and,
        per mesh, the names its workers keep them by (name -> (stage, where))."""
        jaxpr = self._traced.closed_jaxpr.jaxpr
        inputs = dict(zip(jaxpr.invars, flat, strict=True))
        plan = self.plan
        keep: list[dict[str, Any]] = [{} for _ in self.actors]
        outs = []
        for n, v in enumerate(jaxpr.outvars):
            if self.layout is None:
                stage, where, spec = 0, n, format_spec(plan.stages[0].output_specs[n])
            elif hasattr(v, "val"):  # a literal
                outs.append(jnp.asarray(v.val))
                continue
            else:
                stage = self.layout.walk.holders[v]
                if stage == HOST:
                    outs.append(inputs[v])
                    continue
                where = (self.layout.var_id[v], None)
                spec = _spec(plan, self.layout, stage, v, inputs=False)
            name = f"kept{next(RayExecutable._names)}"
            keep[self.mesh_of(stage)][name] = (stage, where)
            outs.append(RemoteArray(self, stage, name, v.aval, spec))
        return outs, keep

    def fetch(self, array: RemoteArray) -> np.ndarray:
        """The whole value of a `RemoteArray`, gathered from its workers."""
        mesh = self.mesh_of(array.stage)
        refs = [a.export_kept.remote(array.name) for a, _ in self._pairs(mesh)]
        parts = [self._get(ref, mesh) for ref in refs]
        return from_parts(parts, array.aval)

    # ------------------------------------------------------------------ waiting

    def _get(self, ref: Any, mesh: int) -> Any:
        return self._wait([_Call(ref, mesh, self.hosts[mesh][0], "call")], "a call")[0]

    def _wait(self, calls: Sequence[_Call], what: str) -> list[Any]:
        """Results of `calls`; the first failure (in submission order) or a timeout raises."""
        import ray

        timeout = self._cluster.step_timeout_s
        deadline = time.monotonic() + timeout
        index = {c.ref: n for n, c in enumerate(calls)}
        results: list[Any] = [None] * len(calls)
        pending = [c.ref for c in calls]
        while pending:
            wait_s = max(0.0, min(1.0, deadline - time.monotonic()))
            ready, pending = ray.wait(
                pending, num_returns=len(pending), timeout=wait_s, fetch_local=False
            )
            failed = []
            for ref in ready:
                try:
                    results[index[ref]] = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    failed.append((index[ref], e))
            if failed:  # dependencies were submitted first: the earliest failure is a cause
                n, error = min(failed, key=lambda f: f[0])
                call = calls[n]
                reason = (
                    "its worker died"
                    if isinstance(error, ray.exceptions.RayActorError)
                    else f"it raised {_first_line(error)}"
                )
                if "ModuleNotFoundError" in reason:
                    reason += (
                        " (the workers import the module that defines the step: install it "
                        "there, ship it with ray.init(runtime_env={'py_modules': [...]}), or "
                        "define the step in the script you run)"
                    )
                self._broken = (
                    f"{self._label(call.mesh)} (host {call.host}) failed during {what} "
                    f"({call.what}): {reason}"
                )
                raise StageFailedError(self._broken) from error
            if pending and time.monotonic() >= deadline:
                late = calls[min(index[ref] for ref in pending)]
                self._broken = (
                    f"{what} did not finish within step_timeout_s={timeout:g} s: "
                    f"{self._label(late.mesh)} (host {late.host}) was still running {late.what}"
                )
                raise StepTimeoutError(self._broken)
        return results

    # ------------------------------------------------------------------ inspection

    def timeline(self) -> list[TaskTime]:
        """Every task run so far on the first host of each mesh, by wall start time (one
        `time.perf_counter` per machine; device clocks restart with each step)."""
        rows = [
            t
            for m in range(len(self.actors))
            for t in self._get(self.actors[m][0].timeline.remote(), m)
        ]
        return sorted(rows, key=lambda t: t.start)

    def _hlo_and_memory(self) -> list[tuple[str, Any]]:
        """Per stage, in stage order: (HLO text, memory stats) from its mesh's first host."""
        found = [
            row
            for m in range(len(self.actors))
            for row in self._get(self.actors[m][0].hlo_and_memory.remote(), m)
        ]
        return [(text, stats) for _, text, stats in sorted(found, key=lambda row: row[0])]

    def get_hlo_text(self) -> str:
        """The compiled HLO of every stage's segments that have run (first host of each mesh)."""
        return "\n".join(text for text, _ in self._hlo_and_memory())

    def collectives(self) -> dict[str, list[int]]:
        from autopar.runtime.executable import collective_bytes

        return collective_bytes(self.get_hlo_text())

    def memory_stats(self) -> list[Any]:
        """Per stage, XLA's memory analysis of its largest compiled segment (after a call)."""
        return [stats for _, stats in self._hlo_and_memory()]


def _first_line(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"


class _Payloads:
    """How host values and other executables' outputs travel to the workers in one call: each
    value once (put in Ray's object store when large), however many stages take it."""

    def __init__(self) -> None:
        self._made: dict[int, Any] = {}  # flat position -> payload
        self.driver_bytes = 0

    def of(self, position: int, x: Any) -> Any:
        import ray

        if position in self._made:
            return self._made[position]
        if isinstance(x, RemoteArray):  # another executable's (an eval step reading the state)
            made = Pulled(tuple(x._executable.workers_of(x.stage)), x.name)
        elif key_impl(x) is not None:
            made = HostKeys(np.asarray(jax.random.key_data(x)), key_impl(x))
        elif isinstance(x, (bool, int, float, complex)):
            made = x  # keeps its weak type
        else:
            host = np.asarray(x)
            made = host if host.nbytes <= _INLINE_BYTES else ray.put(host)
            self.driver_bytes += host.nbytes
        self._made[position] = made
        return made


def _spec(plan: Plan, layout: PipelineLayout, stage: int, var: Any, inputs: bool) -> str:
    """How pipeline stage `stage` stores `var`, an input or output of the step, as
    `format_spec` writes it."""
    stage_plan = plan.stages[stage]
    closed = layout.programs[stage].closed.jaxpr
    own, specs = (
        (closed.invars, stage_plan.input_specs)
        if inputs
        else (closed.outvars, stage_plan.output_specs)
    )
    for v, spec in zip(own, specs, strict=True):
        if v is var:
            return format_spec(spec)
    return "auto"
