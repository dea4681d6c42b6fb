"""Parallelization methods: what the user asks for, checked when built, and how each plans.

Every method is a `ParallelMethod`: it says which mesh it plans for (`mesh`), how the step must
be traced for it (`regather_params`, `layer_option`, `num_micro_batches`), whether its plans may
be cached, and plans a traced step itself (`plan`). The API hands a `PlanRequest` to whichever
method it was given and never asks which kind it is (Alpa's `ParallelMethod` idea).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import jax
import numpy as np
from jax.sharding import Mesh

from autopar.options import (
    LAYER_OPTION_NAMES,
    STAGE_OPTION_NAMES,
    AutoLayerOption,
    AutoShardingOption,
    AutoStageOption,
    LayerOption,
    ManualLayerOption,
    StageOption,
    UniformStageOption,
)
from autopar.plan_store import check_plan_fits, layer_option_of, read_plan_file, tracing_record
from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import (
    InvalidArgumentError,
    MemoryBudgetError,
    check_memory_budget,
    check_positive_int,
)
from autopar.planner.explicit import ZeroStage, plan_data_parallel
from autopar.planner.intra import plan_shard_parallel
from autopar.planner.pipeline import split_step
from autopar.planner.pipeshard import (
    MEMORY_BOUND_SLOWDOWN,
    LayerCosts,
    PipelineConfig,
    plan_pipeshard,
    unbounded_step,
)
from autopar.planner.plan import MeshPlan, Plan, Spec
from autopar.planner.schedules import (
    AUTO_SCHEDULE,
    SCHEDULES,
    PipelineSchedule,
    candidate_schedules,
)
from autopar.planner.summary import format_bytes
from autopar.remat import RematTrace, plan_with_remat, recomputes_on
from autopar.tracing import TracedStep

logger = logging.getLogger(__name__)


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
class PlanRequest:
    """What a method plans from: the traced step, the mesh it plans for on `cluster`, the devices
    the plan will run on (none when planning abstractly or on Ray), the step traced again with
    its loss cut into recomputed layers (`autopar.remat`), for a method that needs that to fit,
    and where candidate stages are timed in profiling mode."""

    traced: TracedStep
    mesh: MeshPlan
    cluster: ClusterSpec
    devices: tuple[jax.Device, ...]
    remat_trace: RematTrace
    # Where profiling mode times candidate stages (`Executor.stage_timer` bound to this step);
    # None when planning without devices to run on (`autopar.plan`).
    stage_timer: Callable[[], AbstractContextManager[Any]] | None = None


class ParallelMethod:
    """What every method answers (the module docstring); the defaults suit a method that plans
    the step as traced, on its devices as one data axis, and whose plans may be cached."""

    devices: Any
    num_micro_batches: int | None
    cacheable: ClassVar[bool] = True  # plans may be kept in the plan cache
    returns_state: ClassVar[bool] = True  # a train step: by default it consumes the state
    traced_as_shard_parallel: ClassVar[bool] = False  # the trace ShardParallel's baselines use

    @property
    def regather_params(self) -> bool:
        """Whether parameters are stored split and must be gathered again in the backward pass."""
        return False

    layer_option: ClassVar[LayerOption | None] = None  # how the loss is cut into layers

    def mesh(
        self, cluster: ClusterSpec, devices: Sequence[jax.Device] | None = None
    ) -> tuple[MeshPlan, tuple[jax.Device, ...]]:
        """The mesh this method plans for, and the devices it runs on (none when planning
        abstractly): by default the devices as one axis "data", a `jax.sharding.Mesh` as it
        is."""
        if isinstance(self.devices, Mesh):
            return resolve_devices(self.devices, ())
        if self.devices is None and devices is None:
            n = cluster.num_devices
            return MeshPlan((n,), ("data",), tuple(range(n))), ()
        return resolve_devices(self.devices, devices or ())

    def plan_step(self, request: PlanRequest) -> tuple[TracedStep, Plan]:
        """The plan of `request.traced`, and the traced step it is for (`request.traced`, or the
        step traced again with recomputed layers)."""
        raise NotImplementedError

    def runner(self, fun: Callable) -> Callable | None:
        """What runs `fun` when a method places its outputs by another step's plan instead of
        planning it (`CreateStateParallel`); None: `fun` is traced, planned and compiled."""
        return None


@dataclasses.dataclass(frozen=True)
class DataParallel(ParallelMethod):
    """Split the batch over all devices; replicate parameters and optimizer state.

    Args:
      devices: None (all devices of the runtime), a list of jax devices, or a `jax.sharding.Mesh`
        (every axis of it splits the batch).
      num_micro_batches: accumulate gradients over this many micro-batches per step; each
        device adds up its own partial sums and the step reduces them once, after the last
        micro-batch (ZeRO-2/3: where the device memory has room for whole accumulators, largest
        gradients first; the others are reduce-scattered per micro-batch).
      memory_budget_per_device: bytes each device may hold at peak (None: the cluster's device
        memory); a plan predicted over it raises `MemoryBudgetError`.
    """

    devices: Any = None
    num_micro_batches: int | None = None
    memory_budget_per_device: float | None = None
    zero_stage: ClassVar[ZeroStage] = ZeroStage.DATA_PARALLEL

    def __post_init__(self) -> None:
        _check_micro_batches(self.num_micro_batches)
        check_memory_budget(self.memory_budget_per_device)

    @property
    def regather_params(self) -> bool:
        """Whether parameters are stored split and must be gathered again in the backward pass."""
        return self.zero_stage is ZeroStage.ZERO3

    @property
    def traced_as_shard_parallel(self) -> bool:  # FSDP traces as ShardParallel does
        return self.regather_params

    def plan_step(self, request: PlanRequest) -> tuple[TracedStep, Plan]:
        k = self.num_micro_batches or 1
        program = request.traced.program
        plan = plan_data_parallel(
            program,
            request.mesh,
            request.cluster,
            stage=self.zero_stage,
            num_micro_batches=k,
            memory_budget=self.memory_budget_per_device,
        )
        return request.traced, plan


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
class ShardParallel(ParallelMethod):
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

    traced_as_shard_parallel: ClassVar[bool] = True

    @property
    def regather_params(self) -> bool:
        """Trace for FSDP: the ILP may store parameters split, so gather them again in backward."""
        return True

    def mesh(
        self, cluster: ClusterSpec, devices: Sequence[jax.Device] | None = None
    ) -> tuple[MeshPlan, tuple[jax.Device, ...]]:
        """A `jax.sharding.Mesh` as it is; else the whole of a multi-host cluster as its
        physical (hosts, devices per host) mesh with axes ("x", "y"), any other devices as one
        axis "x"."""
        mesh, run_on = super().mesh(cluster, devices)
        if isinstance(self.devices, Mesh):
            return mesh, run_on
        n = mesh.num_devices
        if cluster.num_hosts > 1 and n == cluster.num_devices:
            return MeshPlan(cluster.physical_mesh_shape, ("x", "y"), mesh.device_indices), run_on
        return MeshPlan((n,), ("x",), mesh.device_indices), run_on

    def plan_step(self, request: PlanRequest) -> tuple[TracedStep, Plan]:
        """The ILP's plan; where nothing fits, the step traced again with recomputed layers."""
        config = self.auto_sharding_option.to_config()
        k = self.num_micro_batches or 1
        args = (request.mesh, request.cluster, config, k)
        try:
            return request.traced, plan_shard_parallel(request.traced.program, *args)
        except MemoryBudgetError as e:
            return plan_with_remat(request.remat_trace, *args, e)


@dataclasses.dataclass(frozen=True)
class PipeshardParallel(ParallelMethod):
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
        gradients filling the bubble, 1F1B's micro-batches in flight), "interleaved_1f1b"
        (Megatron-LM's virtual stages: `num_virtual_stages` layer chunks on each of n equal
        sub-meshes, a v-fold smaller bubble for more activations in flight and more
        transfers; micro-batches a multiple of n) or "auto" (the stage search plans each and
        keeps the fastest).
      num_virtual_stages: v, the stages per sub-mesh under "interleaved_1f1b" (and "auto").
      auto_sharding_option: options of each stage's intra-op ILP.
    """

    devices: Any = None
    num_micro_batches: int = 1
    layer_option: LayerOption = dataclasses.field(default_factory=ManualLayerOption)
    stage_option: StageOption = dataclasses.field(default_factory=UniformStageOption)
    pipeline_schedule: str = "1f1b"
    auto_sharding_option: AutoShardingOption = dataclasses.field(default_factory=AutoShardingOption)
    num_virtual_stages: int = 2

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
        check_positive_int("num_virtual_stages", self.num_virtual_stages)

    # regather_params stays False: layers must stay visible to differentiation, so no
    # whole-loss remat for FSDP.

    @property
    def schedules(self) -> tuple[PipelineSchedule, ...]:
        """The schedule to plan for, or the candidates of "auto" in order of preference."""
        return candidate_schedules(self.pipeline_schedule)

    @property
    def profiles(self) -> bool:
        """Whether the stage DP measures candidate stages on the devices (profiling mode)."""
        return isinstance(self.stage_option, AutoStageOption) and self.stage_option.profile

    def mesh(
        self, cluster: ClusterSpec, devices: Sequence[jax.Device] | None = None
    ) -> tuple[MeshPlan, tuple[jax.Device, ...]]:
        """The (hosts, devices per host) grid its stages slice, axes ("x", "y"): a 2-D
        `jax.sharding.Mesh` as it is, other devices as the cluster's hosts when they are all of
        its devices, else as one host."""
        mesh, run_on = super().mesh(cluster, devices)
        if len(mesh.shape) == 2:
            return MeshPlan(mesh.shape, ("x", "y"), mesh.device_indices), run_on
        n = mesh.num_devices
        shape = cluster.physical_mesh_shape if n == cluster.num_devices else (1, n)
        return MeshPlan(tuple(shape), ("x", "y"), mesh.device_indices), run_on

    def plan_step(self, request: PlanRequest) -> tuple[TracedStep, Plan]:
        """Stages by the stage search (or as the stage option fixes them), each planned by the
        ILP; in profiling mode candidate stages are timed on the devices. Under
        `AutoLayerOption(remat_mode="auto")` on a GPU cluster the step is traced again with
        each layer recomputed and planned again where no stage plan fits, and where the plan
        that fits is memory-bound (`pipeshard.MEMORY_BOUND_SLOWDOWN`): the faster plan wins."""
        option = self.layer_option
        auto = (
            isinstance(option, AutoLayerOption)
            and option.remat_mode == "auto"
            and recomputes_on(request.cluster)
            and not self.profiles
        )
        try:
            plan, costs = self._plan_traced(request.traced, request)
        except MemoryBudgetError as without:
            if not auto:
                raise
            logger.info(
                "no stage plan fits without recomputation (%s); recomputing layers", without
            )
            return self._plan_recomputed(request, without)
        if not auto:
            return request.traced, plan
        unbounded_s = unbounded_step(costs, request.mesh.shape, plan.pipeline_schedule)
        slowdown = plan.predicted.step_time_s / unbounded_s
        if slowdown <= MEMORY_BOUND_SLOWDOWN:
            return request.traced, plan
        logger.info(
            "the plan without recomputation takes %.4g s per step, %.3gx its stages' step "
            "with device memory unbounded; planning with each layer recomputed too",
            plan.predicted.step_time_s,
            slowdown,
        )
        try:
            traced, recomputed = self._plan_recomputed(request, None)
        except MemoryBudgetError:
            return request.traced, plan
        if recomputed.predicted.step_time_s >= plan.predicted.step_time_s:
            return request.traced, plan
        return traced, recomputed

    def _plan_recomputed(
        self, request: PlanRequest, without: MemoryBudgetError | None
    ) -> tuple[TracedStep, Plan]:
        """The step traced with each layer recomputed, and its plan with a note saying why:
        `without` is the error of the plan without recomputation, None where that plan is
        memory-bound."""
        recomputed = dataclasses.replace(self.layer_option, remat_mode="coarse_grained")
        traced = request.remat_trace(recomputed)
        try:
            plan, _ = self._plan_traced(traced, request)
        except MemoryBudgetError as e:
            if without is None:
                raise
            least = (
                f"; of the stage plans it priced, the one that needs least needs "
                f"{format_bytes(e.least)} per device"
                if math.isfinite(e.least)
                else ""
            )
            raise MemoryBudgetError(
                f"no pipeline plan fits in {format_bytes(e.budget)} per device, neither as the "
                "step is nor with each layer recomputed in the backward pass "
                f"(AutoLayerOption(remat_mode='auto') tried both{least}); use more "
                f"micro-batches (num_micro_batches={2 * self.num_micro_batches}), more devices "
                "or pipeline stages, or raise AutoShardingOption(memory_budget_per_device=...)",
                e.budget,
                e.least,
            ) from None
        why = (
            "no stage plan fits without recomputation"
            if without is not None
            else "the plan without recomputation is memory-bound and slower"
        )
        note = f"{why}: each layer recomputed in the backward pass"
        plan = dataclasses.replace(
            plan, tracing=tracing_record(False, recomputed), notes=(*plan.notes, note)
        )
        return traced, plan

    def _plan_traced(
        self, traced: TracedStep, request: PlanRequest
    ) -> tuple[Plan, LayerCosts | None]:
        """The plan of `traced`, and the layer costs that priced its stages (None where the
        stages were measured on the devices)."""
        from autopar.runtime.profile import StageProfiler

        mesh, cluster = request.mesh, request.cluster
        config = PipelineConfig(
            num_micro_batches=self.num_micro_batches,
            schedules=self.schedules,
            stage_option=self.stage_option,
            intra=self.auto_sharding_option.to_config(),
            num_virtual_stages=self.num_virtual_stages,
        )
        parts = split_step(traced.closed_jaxpr, traced.program.signature.batch_inputs)
        if not self.profiles:
            costs = LayerCosts(parts, traced.program, cluster, config, mesh.num_devices)
            return plan_pipeshard(parts, traced.program, cluster, mesh.shape, config, costs), costs
        if request.stage_timer is None:
            raise InvalidArgumentError(
                "AutoStageOption(profile=True) times stages on the devices, but this plan is "
                "made without devices to run on (autopar.plan); use profile=False (the cost "
                "model) or plan through autopar.parallelize"
            )
        with request.stage_timer() as measure:
            profiler = StageProfiler(parts, traced.program, cluster, config, measure)
            try:
                plan = plan_pipeshard(parts, traced.program, cluster, mesh.shape, config, profiler)
            finally:
                profiler.close()
        return plan, None


@dataclasses.dataclass(frozen=True)
class PlanFile(ParallelMethod):
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
    cacheable: ClassVar[bool] = False  # nothing is planned

    @property
    def num_micro_batches(self) -> int:
        return self.plan.num_micro_batches

    @property
    def regather_params(self) -> bool:
        return self.plan.tracing.regather_params

    @property
    def layer_option(self) -> LayerOption | None:
        return layer_option_of(self.plan)

    def plan_step(self, request: PlanRequest) -> tuple[TracedStep, Plan]:
        """The file's plan, once checked against the traced program and the devices."""
        source = f"plan file {str(self.path)!r}"
        program = request.traced.program
        num_devices = len(request.devices) or request.cluster.num_devices
        fingerprint, paths = program.fingerprint, program.signature.input_paths
        check_plan_fits(self.plan, fingerprint, paths, num_devices, source)
        return request.traced, self.plan


@dataclasses.dataclass(frozen=True)
class FollowParallel(ParallelMethod):
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
        if not isinstance(getattr(self.src, "method", None), ParallelMethod):
            raise InvalidArgumentError(
                f"FollowParallel follows a step made by autopar.parallelize, got {self.src!r}"
            )

    cacheable: ClassVar[bool] = False  # the plan depends on the followed step's, not cached
    returns_state: ClassVar[bool] = False  # an eval step: by default it donates nothing

    @property
    def devices(self) -> Any:
        return self.src.method.devices

    def mesh(
        self, cluster: ClusterSpec, devices: Sequence[jax.Device] | None = None
    ) -> tuple[MeshPlan, tuple[jax.Device, ...]]:
        """The mesh of the step it follows."""
        return self.src.method.mesh(cluster, devices)

    def plan_step(self, request: PlanRequest) -> tuple[TracedStep, Plan]:
        """The ILP's plan with the inputs `src` stores pinned to its storage."""
        option = getattr(self.src.method, "auto_sharding_option", AutoShardingOption())
        config = dataclasses.replace(
            option.to_config(), pinned_inputs=_followed_inputs(request.traced, self.src)
        )
        k = self.num_micro_batches or 1
        plan = plan_shard_parallel(request.traced.program, request.mesh, request.cluster, config, k)
        return request.traced, plan


def _followed_inputs(traced: TracedStep, src: Any) -> tuple[tuple[str, Spec], ...]:
    """(input path, storage spec) of the inputs that FollowParallel keeps where `src` (a
    `ParallelizedFunc`) has them."""
    if not src._plans:
        raise InvalidArgumentError(
            "FollowParallel: the followed step has no plan yet; call it (or its get_plan) first"
        )
    src_traced, src_plan = next(reversed(src._plans.values()))  # the latest
    if src_plan.pipeline_schedule is not None or len(src_plan.stages) != 1:
        raise InvalidArgumentError(
            "FollowParallel follows single-mesh plans; the followed step is pipelined "
            f"({len(src_plan.stages)} stages)"
        )
    src_sig = src_traced.program.signature
    stored = {
        path: (spec, (aval.shape, aval.dtype))
        for path, spec, aval in zip(
            src_sig.input_paths, src_plan.stages[0].input_specs, src_sig.input_avals, strict=True
        )
    }
    pinned = []
    sig = traced.program.signature
    for path, aval in zip(sig.input_paths, sig.input_avals, strict=True):
        for src_path, (spec, shape) in stored.items():
            same = src_path == path or src_path.endswith("." + path)
            if same and shape == (aval.shape, aval.dtype):
                pinned.append((path, spec))
                break
    return tuple(pinned)


Method = ParallelMethod


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
