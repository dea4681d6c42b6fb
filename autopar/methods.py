"""Parallelization methods: what the user asks for. Plain configuration, checked when built."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import numpy as np
from jax.sharding import Mesh

from autopar.options import (
    LAYER_OPTION_NAMES,
    STAGE_OPTION_NAMES,
    AutoShardingOption,
    AutoStageOption,
    LayerOption,
    ManualLayerOption,
    StageOption,
    UniformStageOption,
)
from autopar.plan_store import layer_option_of, read_plan_file
from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import InvalidArgumentError
from autopar.planner.explicit import ZeroStage
from autopar.planner.plan import MeshPlan, Plan
from autopar.planner.schedules import (
    AUTO_SCHEDULE,
    SCHEDULES,
    PipelineSchedule,
    candidate_schedules,
)


def _check_micro_batches(value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidArgumentError(
            f"num_micro_batches must be a positive int or None, got {value!r}"
        )


def _check_mesh_rank(method: str, devices: Any) -> None:
    if isinstance(devices, Mesh) and len(devices.axis_names) > 2:
        raise InvalidArgumentError(
            f"{method} plans for 1D or 2D meshes; got a mesh with axes {devices.axis_names}"
        )


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Split the batch over all devices; replicate parameters and optimizer state.

    Args:
      devices: None (all devices of the runtime), a list of jax devices, or a `jax.sharding.Mesh`
        (every axis of it splits the batch).
      num_micro_batches: accumulate gradients over this many micro-batches per step; each
        device adds up its own partial sums and the step reduces them once, after the last
        micro-batch (ZeRO-2/3: where the device memory has room for whole accumulators, largest
        gradients first; the others are reduce-scattered per micro-batch).
    """

    devices: Any = None
    num_micro_batches: int | None = None
    zero_stage: ClassVar[ZeroStage] = ZeroStage.DATA_PARALLEL

    def __post_init__(self) -> None:
        _check_micro_batches(self.num_micro_batches)

    @property
    def regather_params(self) -> bool:
        """Whether parameters are stored split and must be gathered again in the backward pass."""
        return self.zero_stage is ZeroStage.ZERO3


@dataclasses.dataclass(frozen=True)
class Zero2Parallel(DataParallel):
    """ZeRO-2: like DataParallel, with optimizer state and gradients split over devices."""

    zero_stage: ClassVar[ZeroStage] = ZeroStage.ZERO2


@dataclasses.dataclass(frozen=True)
class Zero3Parallel(DataParallel):
    """ZeRO-3 / FSDP: parameters, gradients and optimizer state split; parameters gathered where
    used (and gathered again in the backward pass, as SimpleFSDP does)."""

    zero_stage: ClassVar[ZeroStage] = ZeroStage.ZERO3


@dataclasses.dataclass(frozen=True)
class ShardParallel:
    """Automatic intra-op parallelism: an ILP picks a sharding for every op (Alpa's intra-op pass).

    Args:
      devices: None (all devices of the runtime: a 1D mesh, or (hosts, devices per host) on a
        multi-host cluster), a list of jax devices (1D mesh), or a `jax.sharding.Mesh` whose
        (1D or 2D) shape and axis names the plan uses.
      num_micro_batches: accumulate gradients over this many micro-batches per step.
      auto_sharding_option: restricts or tunes the search (`AutoShardingOption`).
    """

    devices: Any = None
    num_micro_batches: int | None = None
    auto_sharding_option: AutoShardingOption = dataclasses.field(default_factory=AutoShardingOption)

    def __post_init__(self) -> None:
        _check_micro_batches(self.num_micro_batches)
        if not isinstance(self.auto_sharding_option, AutoShardingOption):
            raise InvalidArgumentError(
                f"auto_sharding_option must be an AutoShardingOption, got "
                f"{self.auto_sharding_option!r}"
            )
        _check_mesh_rank("ShardParallel", self.devices)

    @property
    def regather_params(self) -> bool:
        """Trace for FSDP: the ILP may store parameters split, so gather them again in backward."""
        return True


@dataclasses.dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages on disjoint sub-meshes, each stage sharded by the ILP (Alpa's pipeshard).

    The loss that `autopar.grad` differentiates is cut into layers (`layer_option`), the layers
    are grouped into stages on sub-meshes (`stage_option`), and each stage is planned by the
    intra-op ILP on its logical mesh. Micro-batches run through the stages in
    `pipeline_schedule` order and gradients accumulate over them.

    Args:
      devices: None (all devices of the runtime: the cluster's (hosts, devices per host)), a
        list of jax devices (one host), or a 2-D `jax.sharding.Mesh` taken as (hosts, devices).
      num_micro_batches: micro-batches per step; must divide the batch.
      layer_option: `ManualLayerOption()` (layers from `autopar.mark_pipeline_boundary()`) or
        `AutoLayerOption(layer_num)` (FLOP-balanced clustering); Alpa's strings "manual" and
        "auto" (`AutoLayerOption(layer_num=2)`, Alpa's default) are accepted.
      stage_option: `UniformStageOption(num_stages)`, `AutoStageOption()` (Alpa's DP) or
        `ManualStageOption(...)`; or Alpa's strings "uniform" and "auto".
      pipeline_schedule: "1f1b" (at most n-i micro-batches in flight on stage i), "gpipe" (all
        in flight), "zero_bubble" (backward split into input and weight gradients, weight
        gradients filling the bubble, 1F1B's micro-batches in flight) or "auto" (the stage
        search plans each and keeps the fastest).
      auto_sharding_option: options of each stage's intra-op ILP.
    """

    devices: Any = None
    num_micro_batches: int = 1
    layer_option: LayerOption = dataclasses.field(default_factory=ManualLayerOption)
    stage_option: StageOption = dataclasses.field(default_factory=UniformStageOption)
    pipeline_schedule: str = "1f1b"
    auto_sharding_option: AutoShardingOption = dataclasses.field(default_factory=AutoShardingOption)

    def __post_init__(self) -> None:
        _check_micro_batches(self.num_micro_batches)
        if self.num_micro_batches is None:
            raise InvalidArgumentError("num_micro_batches must be a positive int, got None")
        named_options = (("layer_option", LAYER_OPTION_NAMES), ("stage_option", STAGE_OPTION_NAMES))
        for name, named in named_options:
            value = getattr(self, name)
            if isinstance(value, str):
                if value not in named:
                    raise InvalidArgumentError(
                        f"{name}={value!r} is not one of {tuple(named)} (Alpa's names) nor an "
                        "option object"
                    )
                object.__setattr__(self, name, named[value]())
        checks = (
            ("layer_option", LayerOption),
            ("stage_option", StageOption),
            ("auto_sharding_option", AutoShardingOption),
        )
        for name, kind in checks:
            if not isinstance(getattr(self, name), kind):
                raise InvalidArgumentError(
                    f"{name} must be one of {kind}, got {getattr(self, name)!r}"
                )
        if self.pipeline_schedule not in (*SCHEDULES, AUTO_SCHEDULE):
            raise InvalidArgumentError(
                f"pipeline_schedule must be one of {(*SCHEDULES, AUTO_SCHEDULE)}, got "
                f"{self.pipeline_schedule!r}"
            )
        _check_mesh_rank("PipeshardParallel", self.devices)

    @property
    def regather_params(self) -> bool:
        """Layers must stay visible to differentiation, so no whole-loss remat for FSDP."""
        return False

    @property
    def schedules(self) -> tuple[PipelineSchedule, ...]:
        """The schedule to plan for, or the candidates of "auto" in order of preference."""
        return candidate_schedules(self.pipeline_schedule)

    @property
    def profiles(self) -> bool:
        """Whether the stage DP measures candidate stages on the devices (profiling mode)."""
        return isinstance(self.stage_option, AutoStageOption) and self.stage_option.profile


@dataclasses.dataclass(frozen=True)
class PlanFile:
    """Run a plan saved as JSON (`Plan.to_json()`) without planning.

    The step is traced as the plan records (micro-batches, regathering, layers) on the runtime's
    devices; a plan made for another program, or for more devices than there are, is refused
    with the mismatch named.

    Args:
      path: the plan file.
    """

    path: str | os.PathLike
    plan: Plan = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", read_plan_file(self.path))

    devices: ClassVar[None] = None

    @property
    def num_micro_batches(self) -> int:
        return self.plan.num_micro_batches

    @property
    def regather_params(self) -> bool:
        return bool(self.plan.tracing["regather_params"])

    @property
    def layer_option(self) -> LayerOption | None:
        return layer_option_of(self.plan)


@dataclasses.dataclass(frozen=True)
class FollowParallel:
    """Compile another function (an eval step) so that it reads its inputs where `src` (a
    parallelized train step, already run or planned) stores them: no resharding between train
    and eval. Inputs whose path and shape match one of `src`'s inputs (the same argument name, or
    a sub-tree of it such as ``params`` of ``state.params``) keep `src`'s storage; the ILP plans
    the rest on `src`'s mesh. Single-mesh plans only (not PipeshardParallel).

    Args:
      src: the `ParallelizedFunc` to follow.
      num_micro_batches: micro-batches of the followed function itself (None: one).
    """

    src: Any
    num_micro_batches: int | None = None

    def __post_init__(self) -> None:
        _check_micro_batches(self.num_micro_batches)

    @property
    def devices(self) -> Any:
        return self.src.method.devices

    @property
    def regather_params(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class CreateStateParallel:
    """Compile a state-initialisation function so its outputs are born where `train_step`'s
    plan stores them: each device computes only its shards, and no device ever holds the whole
    state. The outputs must be the train state `train_step` takes as argument `state_argnum`.

    Args:
      train_step: the `ParallelizedFunc` whose plan places the state.
      other_args: `train_step`'s other arguments (e.g. an example batch; arrays or
        `jax.ShapeDtypeStruct`s), in order, without the state.
      state_argnum: where the state goes among `train_step`'s arguments.
    """

    train_step: Any
    other_args: tuple[Any, ...]
    state_argnum: int = 0

    def __init__(self, train_step: Any, *other_args: Any, state_argnum: int = 0) -> None:
        object.__setattr__(self, "train_step", train_step)
        object.__setattr__(self, "other_args", other_args)
        object.__setattr__(self, "state_argnum", state_argnum)
        if not isinstance(state_argnum, int) or not 0 <= state_argnum <= len(other_args):
            raise InvalidArgumentError(
                f"state_argnum must be an int in [0, {len(other_args)}], got {state_argnum!r}"
            )


Method = DataParallel | ShardParallel | PipeshardParallel | PlanFile | FollowParallel


def resolve_devices(
    devices: Any, default: Sequence[jax.Device]
) -> tuple[MeshPlan, tuple[jax.Device, ...]]:
    """A method's `devices` argument as a planned mesh and the device list its indices refer to."""
    if devices is None:
        devices = tuple(default)
    if isinstance(devices, Mesh):
        flat = tuple(np.asarray(devices.devices).flat)
        return (
            MeshPlan(
                tuple(devices.devices.shape), tuple(devices.axis_names), tuple(range(len(flat)))
            ),
            flat,
        )
    if (
        isinstance(devices, (list, tuple))
        and devices
        and all(isinstance(d, jax.Device) for d in devices)
    ):
        return MeshPlan((len(devices),), ("data",), tuple(range(len(devices)))), tuple(devices)
    raise InvalidArgumentError(
        f"devices must be None, a non-empty list of jax devices or a jax.sharding.Mesh; got "
        f"{devices!r}"
    )


def method_mesh(
    method: Method, cluster: ClusterSpec, devices: Sequence[jax.Device] | None = None
) -> tuple[MeshPlan, tuple[jax.Device, ...]]:
    """The mesh a method plans for, and the devices it runs on (none when planning abstractly).

    DataParallel and friends use one axis "data". ShardParallel on the whole of a multi-host
    cluster uses the physical (hosts, devices per host) mesh with axes ("x", "y"), else one
    axis "x". PipeshardParallel gets the (hosts, devices per host) grid its stages slice (a 1-D
    mesh or device list as the devices of the cluster's hosts, or of one host). Other methods use
    a `jax.sharding.Mesh` as it is. FollowParallel uses the mesh of the step it follows.
    """
    if isinstance(method, FollowParallel):
        return method_mesh(method.src.method, cluster, devices)
    if isinstance(method.devices, Mesh):
        mesh, run_on = resolve_devices(method.devices, ())
        if not isinstance(method, PipeshardParallel):
            return mesh, run_on
    elif method.devices is None and devices is None:
        n = cluster.num_devices
        mesh, run_on = MeshPlan((n,), ("data",), tuple(range(n))), ()
    else:
        mesh, run_on = resolve_devices(method.devices, devices or ())
    if isinstance(method, PipeshardParallel):  # the (hosts, devices per host) to slice
        n = mesh.num_devices
        if len(mesh.shape) == 2:
            return MeshPlan(mesh.shape, ("x", "y"), mesh.device_indices), run_on
        shape = cluster.physical_mesh_shape if n == cluster.num_devices else (1, n)
        return MeshPlan(tuple(shape), ("x", "y"), mesh.device_indices), run_on
    if isinstance(method, ShardParallel):
        n = mesh.num_devices
        if cluster.num_hosts > 1 and n == cluster.num_devices:
            mesh = MeshPlan(cluster.physical_mesh_shape, ("x", "y"), mesh.device_indices)
        else:
            mesh = MeshPlan((n,), ("x",), mesh.device_indices)
    return mesh, run_on
