"""The runtime autopar runs on: which devices, and which cluster they stand for.

`autopar.init` sets it once per process (like `ray.init`); `autopar.shutdown` clears it. Without
`init`, autopar runs on all local jax devices with a ClusterSpec for them. With
`init(cluster="ray")` the devices are those of Ray mesh workers (`autopar.runtime.ray`): the
driver plans, the workers run.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os

import jax

from autopar.planner.cluster import CPU_SCHEDULER_FLAG, ClusterSpec
from autopar.planner.errors import InvalidArgumentError
from autopar.runtime.executors import Executor, LocalExecutor

logger = logging.getLogger(__name__)

SUPPORTED_CLUSTERS = ("local", "ray")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Devices to run on and the ClusterSpec that prices them.

    `session` tells runtimes apart (executables are cached per session); `executor` builds and
    runs the executables: this process's devices, or on a "ray" runtime the Ray mesh workers,
    whose devices live in worker processes (`devices` is empty).
    """

    kind: str
    devices: tuple[jax.Device, ...]
    cluster_spec: ClusterSpec
    session: int = 0
    executor: Executor = dataclasses.field(default_factory=LocalExecutor, compare=False)


_current: Runtime | None = None
_sessions = itertools.count(1)


def _local_runtime(num_devices: int | None, cluster_spec: ClusterSpec | None) -> Runtime:
    available = jax.devices()
    if num_devices is None:
        num_devices = len(available)
    if not isinstance(num_devices, int) or not 1 <= num_devices <= len(available):
        raise InvalidArgumentError(
            f"num_devices={num_devices!r} is not available: this process has {len(available)} "
            f"{available[0].platform} device(s) (simulate more CPU devices with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)"
        )
    devices = tuple(available[:num_devices])
    if cluster_spec is None:
        cluster_spec = ClusterSpec.local(num_devices)
    elif cluster_spec.num_devices != num_devices:
        raise InvalidArgumentError(
            f"cluster_spec describes {cluster_spec.num_devices} devices "
            f"({cluster_spec.num_hosts}x{cluster_spec.devices_per_host}) but {num_devices} local "
            "devices are used; pass num_devices to match"
        )
    return Runtime("local", devices, cluster_spec)


def simulate_cpu_devices(num_devices: int) -> None:
    """Make jax expose `num_devices` CPU devices. Call before jax runs anything.

    Also selects XLA's memory-minimising CPU scheduler: the default, concurrency-optimised one
    starts every collective as early as possible, which on simulated devices gathers all FSDP
    parameters at once and hides the memory FSDP saves (GPUs bound this with a memory limit).
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise InvalidArgumentError(f"num_devices must be a positive int, got {num_devices!r}")
    flags = os.environ.get("XLA_FLAGS", "").split()
    wanted = {
        "--xla_force_host_platform_device_count": str(num_devices),
        CPU_SCHEDULER_FLAG: "false",
    }
    flags = [f for f in flags if f.split("=")[0] not in wanted]
    flags += [f"{k}={v}" for k, v in wanted.items()]
    os.environ["XLA_FLAGS"] = " ".join(flags)
    jax.config.update("jax_num_cpu_devices", num_devices)


def init(
    cluster: str = "local",
    *,
    num_devices: int | None = None,
    address: str | None = None,
    cluster_spec: ClusterSpec | None = None,
    step_timeout_s: float | None = None,
) -> None:
    """Choose the devices autopar runs on.

    Example::

        autopar.init("ray", cluster_spec=autopar.ClusterSpec.preset("2x8xA100-80G"))
        ...
        autopar.shutdown()

    Args:
      cluster: "local" (this process's jax devices) or "ray" (Ray mesh workers: the GPUs of
        the Ray cluster's hosts, or simulated CPU devices where it has none).
      num_devices: "local": use the first `num_devices` local devices (default: all); "ray"
        without GPUs and without `cluster_spec`: simulate this many devices on one host
        (default 8).
      address: "ray" only: the Ray cluster to join ("auto" or host:port); None starts a local
        Ray instance unless Ray is already initialised in this process.
      cluster_spec: the cluster the devices stand for, so plans use its costs. On Ray without
        GPUs its (num_hosts, devices_per_host) are the simulated hosts.
      step_timeout_s: "ray" only: a step (or building its stages) that takes longer raises
        `StepTimeoutError` (default 600 s).
    """
    global _current
    if cluster not in SUPPORTED_CLUSTERS:
        raise InvalidArgumentError(
            f"cluster={cluster!r} is not supported; choose one of {SUPPORTED_CLUSTERS}"
        )
    if _current is not None:
        raise InvalidArgumentError(
            f"autopar.init was already called (cluster={_current.kind!r}); call "
            "autopar.shutdown() first"
        )
    if cluster == "local":
        for name, value in (("address", address), ("step_timeout_s", step_timeout_s)):
            if value is not None:
                raise InvalidArgumentError(f"{name}={value!r} has no meaning for cluster='local'")
        runtime = _local_runtime(num_devices, cluster_spec)
        _current = dataclasses.replace(runtime, session=next(_sessions))
        logger.info("autopar runs on %d local device(s)", len(_current.devices))
        return
    from autopar.runtime.ray import DEFAULT_STEP_TIMEOUT_S, RayCluster

    timeout = DEFAULT_STEP_TIMEOUT_S if step_timeout_s is None else step_timeout_s
    connection = RayCluster.connect(address, cluster_spec, num_devices, timeout)
    _current = Runtime("ray", (), connection.cluster_spec, next(_sessions), connection)


def shutdown() -> None:
    """Release the runtime set by `init`: on Ray, every mesh worker and the placement group (and
    Ray itself if `init` started it). A later call runs on the default local runtime."""
    global _current
    runtime, _current = _current, None
    if runtime is not None:
        runtime.executor.shutdown()


def current_runtime() -> Runtime:
    """The runtime set by `init`, or all local devices if `init` was not called (built once:
    every call of a parallelized step asks, and building it took 30-70 µs)."""
    return _current if _current is not None else _default_local_runtime()


@functools.cache
def _default_local_runtime() -> Runtime:
    return _local_runtime(None, None)
