"""Run plans on Ray actors that drive device meshes, including meshes that span several hosts.

`autopar.init(cluster="ray")` connects to (or starts) Ray and reserves one placement-group bundle
per host (`RayCluster`). A plan's stage mesh gets one `MeshWorker` actor per host it covers, pinned
to that host's devices (its GPUs; on a CPU-only cluster the actor simulates its share of devices
with XLA's host-platform device count). A mesh over several hosts is one JAX SPMD program over its
actors, joined with `jax.distributed.initialize` (gloo collectives on CPU, NCCL on GPU).

The driver (`RayExecutable`) never holds the program's arrays. It traces and plans the step, then
each worker traces the same step again from the pickled function and abstract arguments and
checks it got the same program, so a variable is named across processes by its id in the traced
jaxpr. The driver walks the shared schedule (`runtime.layout.run_step`): each task is one actor
call; a value another stage reads moves as shard lists through Ray's object store straight from
actor to actor (the driver passes references, never the data). Step outputs stay on their meshes
as `RemoteArray` handles; passing them to the next step moves nothing.

Failures: every step waits for its calls with a timeout; an actor that dies or a task that raises
surfaces as `StageFailedError` naming the stage and host, a step over time as `StepTimeoutError`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import AutoparError, InvalidArgumentError
from autopar.planner.plan import Plan, format_spec
from autopar.runtime.layout import HOST, Key, PipelineLayout, Segment, run_step
from autopar.runtime.ray_worker import MeshWorker, StepSource, assemble
from autopar.tracing import TracedStep

logger = logging.getLogger(__name__)

DEFAULT_STEP_TIMEOUT_S = 600.0
_CONNECT_TIMEOUT_S = 5.0

Shards = list[tuple[tuple[slice, ...], np.ndarray]]


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
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
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

    def start_worker(self, host: int, num_devices: int) -> Any:
        """A `MeshWorker` actor on `host`'s bundle that drives `num_devices` of its devices."""
        import ray

        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        actor = (
            ray.remote(MeshWorker)
            .options(
                num_cpus=0,
                num_gpus=num_devices if self.use_gpus else 0,
                scheduling_strategy=strategy(self.placement_group, host),
                max_restarts=0,
            )
            .remote(num_devices, not self.use_gpus)
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
    return ClusterSpec.local(n)


# ----------------------------------------------------------------------------- the driver


class RemoteArray:
    """A step output that stays on its mesh's workers; `np.asarray(x)` fetches it."""

    def __init__(self, executable: RayExecutable, stage: int, name: str, aval: Any, spec: str):
        self._executable = executable
        self.stage = stage
        self.name = name
        self.aval = aval
        self.spec = spec
        actors = executable.actors[stage]
        weakref.finalize(self, _drop_remote, actors, name)

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


def _drop_remote(actors: Sequence[Any], name: str) -> None:
    import ray

    if ray.is_initialized():
        for actor in actors:
            try:
                actor.drop.remote(name)
            except Exception:  # the actor or Ray is already gone
                logger.debug("could not drop %s", name, exc_info=True)


@dataclasses.dataclass
class _Call:
    ref: Any
    stage: int
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
        self.last_dispatch_s = 0.0  # driver time spent submitting the last step's calls
        self.layout = PipelineLayout(traced, plan) if plan.pipeline_schedule else None
        self.schedule = self.layout.schedule if self.layout else None
        spec = cluster.cluster_spec
        needed = 1 + max(i for s in plan.stages for i in s.mesh.device_indices)
        if needed > spec.num_devices:
            raise InvalidArgumentError(
                f"the plan needs {needed} devices but the Ray cluster has {spec.num_devices} "
                f"({spec.num_hosts}x{spec.devices_per_host})"
            )
        self.actors: list[list[Any]] = []
        self.hosts: list[list[int]] = []
        for stage in plan.stages:
            by_host: dict[int, list[int]] = {}
            for index in stage.mesh.device_indices:
                by_host.setdefault(index // spec.devices_per_host, []).append(index)
            hosts = sorted(by_host.items())
            self.actors.append([cluster.start_worker(h, len(indices)) for h, indices in hosts])
            self.hosts.append(sorted(by_host))
        self._build(source)

    def _device_map(self, stage: int) -> list[tuple[int, int, int]]:
        """(global device index, process of the stage's mesh, position on that process) of
        each device of `stage`: how its workers find the plan's devices among theirs."""
        per_host = self._cluster.cluster_spec.devices_per_host
        indices = self.plan.stages[stage].mesh.device_indices
        entries = []
        for index in indices:
            host = index // per_host
            same_host = sorted(i for i in indices if i // per_host == host)
            entries.append((index, self.hosts[stage].index(host), same_host.index(index)))
        return entries

    def _build(self, source: StepSource) -> None:
        """Start the workers, join multi-host meshes, and have every worker bind its stage."""
        calls = []
        for s in range(len(self.actors)):
            calls += [_Call(a.ping.remote(), s, h, "starting") for a, h in self._pairs(s)]
        self._wait(calls, "starting the mesh workers")
        joins = []
        for s, actors in enumerate(self.actors):
            if len(actors) > 1:
                address = self._get(actors[0].coordinator_address.remote(), s)
                joins += [
                    _Call(a.join.remote(address, len(actors), p), s, h, "jax.distributed")
                    for p, (a, h) in enumerate(self._pairs(s))
                ]
        self._wait(joins, "joining multi-host meshes")
        plan_json = self.plan.to_json(indent=None)
        builds = [
            _Call(a.build.remote(source, plan_json, s, self._device_map(s)), s, h, "build")
            for s in range(len(self.actors))
            for a, h in self._pairs(s)
        ]
        self._wait(builds, "building the stages")

    def _pairs(self, stage: int) -> list[tuple[Any, int]]:
        return list(zip(self.actors[stage], self.hosts[stage], strict=True))

    # ------------------------------------------------------------------ calling

    def __call__(self, *args: Any) -> Any:
        dynamic = tuple(a for i, a in enumerate(args) if i not in self._traced.static_argnums)
        return self.call_flat(self._traced.in_tree.flatten(dynamic))

    def call_flat(self, flat: Sequence[Any]) -> Any:
        """Run one step; outputs come back as `RemoteArray`s that stay on their meshes."""
        if self._broken:
            raise RemoteError(
                f"this executable cannot run: {self._broken}; call autopar.shutdown() and "
                "autopar.init() again"
            )
        with self._lock:
            start = time.perf_counter()
            backend = _RayBackend(self)
            if self.layout is None:
                holders = backend.run_whole(flat)
            else:
                holders = run_step(self.layout, backend, flat)
            outs = backend.finish(holders, flat)
            self.last_dispatch_s = time.perf_counter() - start
            self._wait(backend.calls, "the step")
        return self._traced.out_tree.unflatten(outs)

    def fetch(self, array: RemoteArray) -> np.ndarray:
        """The whole value of a `RemoteArray`, gathered from its workers."""
        pairs = self._pairs(array.stage)
        refs = [a.export_kept.remote(array.name) for a, _ in pairs]
        parts = [self._get(ref, array.stage) for ref in refs]
        return assemble(parts, array.aval)

    # ------------------------------------------------------------------ waiting

    def _get(self, ref: Any, stage: int) -> Any:
        return self._wait([_Call(ref, stage, self.hosts[stage][0], "call")], "a call")[0]

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
                    f"stage {call.stage} (host {call.host}) failed during {what} "
                    f"({call.what}): {reason}"
                )
                raise StageFailedError(self._broken) from error
            if pending and time.monotonic() >= deadline:
                late = calls[min(index[ref] for ref in pending)]
                self._broken = (
                    f"{what} did not finish within step_timeout_s={timeout:g} s: stage "
                    f"{late.stage} (host {late.host}) was still running {late.what}"
                )
                raise StepTimeoutError(self._broken)
        return results

    # ------------------------------------------------------------------ inspection

    def timeline(self) -> list[tuple[int, str, int | None, float, float]]:
        """Every task run so far: (stage, segment, micro-batch, start, end) on the first host of
        each stage, in `time.perf_counter` seconds of that host (one clock per machine)."""
        rows = []
        for s in range(len(self.actors)):
            for name, j, start, end in self._get(self.actors[s][0].timeline.remote(), s):
                rows.append((s, name, j, start, end))
        return sorted(rows, key=lambda r: r[3])

    def _hlo_and_memory(self) -> list[tuple[str, Any]]:
        return [
            self._get(self.actors[s][0].hlo_and_memory.remote(), s) for s in range(len(self.actors))
        ]

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


class _RayBackend:
    """`run_step`'s operations as actor calls; collects them for `RayExecutable._wait`."""

    def __init__(self, executable: RayExecutable) -> None:
        import ray

        self._ray = ray
        self.ex = executable
        self.calls: list[_Call] = []
        self._host_refs: dict[int, Any] = {}  # id(value) -> object ref, one put per value
        self._incoming: dict[int, list[tuple[int, tuple[int, int | None]]]] = {}
        self._frees: dict[int, list[tuple[int, int | None]]] = {}

    def _submit(self, stage: int, what: str, method: str, *args: Any) -> None:
        for actor, host in self.ex._pairs(stage):
            ref = getattr(actor, method).remote(*args)
            self.calls.append(_Call(ref, stage, host, what))

    def _vid(self, key: Key) -> int:
        return self.ex.layout.var_id[key[0]]

    def _place_value(self, vid: int, micro_batch: int | None, value: Any, stage: int) -> None:
        if isinstance(value, RemoteArray):
            if value._executable is self.ex and value.stage == stage:
                self._submit(stage, "placing an input", "place_kept", vid, micro_batch, value.name)
                return
            # Another stage's, or another step's (an eval step reading the train state):
            # worker to worker through the object store.
            holders = value._executable.actors[value.stage]
            refs = [a.export_kept.remote(value.name) for a in holders]
            self._submit(stage, "placing an input", "place", vid, micro_batch, *refs)
            return
        ref = self._host_refs.get(id(value))
        if ref is None:
            scalar = isinstance(value, (bool, int, float, complex))  # keeps its weak type
            ref = self._ray.put(value if scalar else np.asarray(value))
            self._host_refs[id(value)] = ref
        self._submit(stage, "placing an input", "place", vid, micro_batch, ref)

    # StepBackend

    def place_input(self, key: Key, value: Any, stage: int) -> None:
        self._place_value(self._vid(key), key[1], value, stage)

    def copy(self, key: Key, source: int, target: int) -> None:
        self._incoming.setdefault(target, []).append((source, (self._vid(key), key[1])))

    def run(self, segment: Segment, micro_batch: int | None) -> None:
        stage = segment.stage
        by_source: dict[int, list[tuple[int, int | None]]] = {}
        for source, key in self._incoming.pop(stage, []):
            by_source.setdefault(source, []).append(key)
        for source, keys in by_source.items():  # one call per worker pair, not per value
            refs = [a.export.remote(keys) for a in self.ex.actors[source]]
            self._submit(stage, f"receiving from stage {source}", "receive", keys, *refs)
        what = segment.name + ("" if micro_batch is None else f" micro-batch {micro_batch}")
        frees = self._frees.pop(stage, [])
        args = (stage, segment.kind.value, segment.level, micro_batch, frees)
        self._submit(stage, what, "run", *args)

    def free(self, key: Key, stages: Sequence[int]) -> None:
        for s in stages:  # sent with the stage's next task; the step's end drops the rest
            self._frees.setdefault(s, []).append((self._vid(key), key[1]))

    # single-stage plans

    def run_whole(self, flat: Sequence[Any]) -> dict[int, int]:
        for n, value in enumerate(flat):
            self._place_value(n, None, value, 0)
        self._submit(0, "the step", "run_whole", len(flat))
        return {n: 0 for n in range(len(self.ex._traced.closed_jaxpr.jaxpr.outvars))}

    def finish(self, holders: dict[Any, int], flat: Sequence[Any]) -> list[Any]:
        """The step's outputs as RemoteArrays; every worker drops the step's other values."""
        jaxpr = self.ex._traced.closed_jaxpr.jaxpr
        inputs = dict(zip(jaxpr.invars, flat, strict=True))
        plan = self.ex.plan
        keep: list[dict[str, Any]] = [{} for _ in self.ex.actors]
        outs = []
        for n, v in enumerate(jaxpr.outvars):
            if self.ex.layout is None:
                stage, where, spec = 0, n, format_spec(plan.stages[0].output_specs[n])
            elif hasattr(v, "val"):  # a literal
                outs.append(jnp.asarray(v.val))
                continue
            else:
                stage = holders[v]
                if stage == HOST:
                    outs.append(inputs[v])
                    continue
                where = (self.ex.layout.var_id[v], None)
                spec = _output_spec(plan, self.ex.layout, stage, v)
            name = f"kept{next(RayExecutable._names)}"
            keep[stage][name] = where
            outs.append(RemoteArray(self.ex, stage, name, v.aval, spec))
        for s in range(len(self.ex.actors)):
            self._submit(s, "ending the step", "keep", keep[s])
        return outs


def _output_spec(plan: Plan, layout: PipelineLayout, stage: int, var: Any) -> str:
    outvars = layout.programs[stage].closed.jaxpr.outvars
    specs = plan.stages[stage].output_specs
    for v, spec in zip(outvars, specs, strict=True):
        if v is var:
            return format_spec(spec)
    return "auto"
