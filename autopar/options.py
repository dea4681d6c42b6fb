"""Options that restrict or tune the automatic planners (names follow Alpa's)."""

from __future__ import annotations

import dataclasses
import math
import numbers

from autopar.planner.errors import InvalidArgumentError, check_positive_int
from autopar.planner.ilp import DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S, SOLVERS
from autopar.planner.intra import IntraOpConfig
from autopar.planner.stages import LOGICAL_SPACES, PHYSICAL_SPACES


@dataclasses.dataclass(frozen=True)
class AutoShardingOption:
    """How ShardParallel's ILP searches for an intra-op sharding.

    Args:
      memory_budget_per_device: bytes each device may hold at peak (None: the cluster's device
        memory). Below what data parallelism needs, the ILP stores parameters split (FSDP).
      force_data_parallel: store state replicated and split batch inputs over all devices.
      force_zero_stage_3: like force_data_parallel, with parameters and optimizer state stored
        split (FSDP / ZeRO-3).
      prefer_reduce_scatter: store optimizer state split, so gradients are reduce-scattered and
        the update is sharded (ZeRO-2 style weight-update sharding).
      solver: "highs" (HiGHS, the default) or "cbc" (the CBC bundled with PuLP).
      time_limit_s: wall-clock limit per plan's ILP work, its rounds of memory cuts and budget
        corrections included (a round that starts past it gets a quarter of it); past it the
        best plan found is used, with a warning. That plan depends on the machine's speed and
        load, so it may differ between runs (each hit is logged; a ShardParallel plan's note
        says "time limit hit"). Solves that finish within the limit give the same plan run
        after run.
      reuse_repeated_layers: give identical layers one set of variables (smaller, faster ILP).
      force_batch_dim_to_mesh_dim: split every value's batch dim over this mesh axis (0 or 1)
        and no other: data parallel over that axis, the ILP choosing only the model
        parallelism over the other one of a 2-D mesh (Alpa's option; a much smaller ILP). An
        axis of one device forces nothing. None: free.
    """

    memory_budget_per_device: float | None = None
    force_data_parallel: bool = False
    force_zero_stage_3: bool = False
    prefer_reduce_scatter: bool = False
    solver: str = DEFAULT_SOLVER
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    reuse_repeated_layers: bool = True
    force_batch_dim_to_mesh_dim: int | None = None

    def __post_init__(self) -> None:
        budget = self.memory_budget_per_device
        if budget is not None and not (
            isinstance(budget, numbers.Real)
            and not isinstance(budget, bool)
            and math.isfinite(budget)
            and budget > 0
        ):
            raise InvalidArgumentError(
                f"memory_budget_per_device must be a positive number of bytes or None, got "
                f"{budget!r}"
            )
        if self.solver not in SOLVERS:
            raise InvalidArgumentError(f"solver must be one of {SOLVERS}, got {self.solver!r}")
        limit = self.time_limit_s
        if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or not limit > 0:
            raise InvalidArgumentError(f"time_limit_s must be a positive number, got {limit!r}")
        axis = self.force_batch_dim_to_mesh_dim
        if axis is not None and (isinstance(axis, bool) or axis not in (0, 1)):
            raise InvalidArgumentError(
                f"force_batch_dim_to_mesh_dim must be 0, 1 or None, got {axis!r}"
            )
        if self.force_data_parallel and self.force_zero_stage_3:
            raise InvalidArgumentError(
                "force_data_parallel and force_zero_stage_3 exclude each other; set one"
            )

    def to_config(self) -> IntraOpConfig:
        """The planner's view of these options."""
        return IntraOpConfig(**dataclasses.asdict(self))


def _shape_2d(name: str, shape: object) -> tuple[int, int]:
    if not (isinstance(shape, (tuple, list)) and len(shape) == 2):
        raise InvalidArgumentError(f"{name} must be a (rows, columns) pair, got {shape!r}")
    try:
        return (check_positive_int(name, shape[0]), check_positive_int(name, shape[1]))
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"{name} must be a positive integer pair, got {shape!r}"
        ) from None


REMAT_MODES = ("none", "coarse_grained")


@dataclasses.dataclass(frozen=True)
class ManualLayerOption:
    """Layers are the spans of the loss between `autopar.mark_pipeline_boundary()` calls.

    Args:
      remat_layer: recompute each layer's activations in the backward pass (saves memory).
    """

    remat_layer: bool = False


@dataclasses.dataclass(frozen=True)
class AutoLayerOption:
    """Cluster the loss's forward ops into `layer_num` FLOP-balanced layers that cut few bytes.

    Args:
      layer_num: how many layers (the unit the stage DP assigns to pipeline stages).
      remat_mode: "none", or "coarse_grained" to recompute each layer in the backward pass.
    """

    layer_num: int
    remat_mode: str = "none"

    def __post_init__(self) -> None:
        check_positive_int("layer_num", self.layer_num)
        if self.remat_mode not in REMAT_MODES:
            raise InvalidArgumentError(
                f"remat_mode must be one of {REMAT_MODES}, got {self.remat_mode!r}"
            )


@dataclasses.dataclass(frozen=True)
class AutoStageOption:
    """Let the stage DP choose layer ranges, sub-meshes and logical meshes (Alpa §5).

    Args:
      submesh_physical_shape_space: "power_of_two": (1,1),(1,2),(1,4)..(1,M) inside a host and
        (2,M),(4,M).. whole hosts; "all": every (1,k) and (h,M).
      submesh_logical_shape_space: which logical meshes a sub-mesh of d devices may take:
        "single_node_model_parallel" (Alpa's default: (d/mp, mp) with mp at most the devices of
        a host, data parallel over the first axis, the ILP choosing the model parallelism over
        the second; (d,1) free), "all" (every factorisation, the ILP free on both axes: a
        larger search), "same_as_physical", "data_parallel_only" (d,1) or
        "model_parallel_only" (1,d).
      stage_imbalance_tolerance: skip max-stage-latency bounds that make the slowest stage more
        than this factor slower than the fastest (Alpa's knob); inf keeps all.
      profile: measure each candidate stage by compiling and timing it on the devices instead of
        predicting it with the cost model.
    """

    submesh_physical_shape_space: str = "power_of_two"
    submesh_logical_shape_space: str = "single_node_model_parallel"
    stage_imbalance_tolerance: float = math.inf
    profile: bool = False

    def __post_init__(self) -> None:
        if self.submesh_physical_shape_space not in PHYSICAL_SPACES:
            raise InvalidArgumentError(
                f"submesh_physical_shape_space must be one of {PHYSICAL_SPACES}, got "
                f"{self.submesh_physical_shape_space!r}"
            )
        if self.submesh_logical_shape_space not in LOGICAL_SPACES:
            raise InvalidArgumentError(
                f"submesh_logical_shape_space must be one of {LOGICAL_SPACES}, got "
                f"{self.submesh_logical_shape_space!r}"
            )
        tolerance = self.stage_imbalance_tolerance
        if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or tolerance < 1:
            raise InvalidArgumentError(
                f"stage_imbalance_tolerance must be a number >= 1, got {tolerance!r}"
            )


@dataclasses.dataclass(frozen=True)
class UniformStageOption:
    """`num_stages` stages of equally many layers on equal sub-meshes.

    Args:
      num_stages: how many stages (None: as many as layers).
      submesh_logical_shape: each stage's logical mesh (None: let the ILP's mesh be 1D).
    """

    num_stages: int | None = None
    submesh_logical_shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.num_stages is not None:
            check_positive_int("num_stages", self.num_stages)
        if self.submesh_logical_shape is not None:
            object.__setattr__(
                self,
                "submesh_logical_shape",
                _shape_2d("submesh_logical_shape", self.submesh_logical_shape),
            )


@dataclasses.dataclass(frozen=True)
class ManualStageOption:
    """Stages given by hand: stage i runs layers `forward_stage_layer_ids[i]` (consecutive, in
    order, covering every layer once) on a sub-mesh of physical shape
    `submesh_physical_shapes[i]` (hosts, devices per host) seen as logical mesh
    `submesh_logical_shapes[i]`. The sub-meshes must cover the cluster's devices exactly."""

    forward_stage_layer_ids: tuple[tuple[int, ...], ...]
    submesh_physical_shapes: tuple[tuple[int, int], ...]
    submesh_logical_shapes: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        ids = tuple(tuple(int(i) for i in stage) for stage in self.forward_stage_layer_ids)
        physical = tuple(
            _shape_2d("submesh_physical_shapes", s) for s in self.submesh_physical_shapes
        )
        logical = tuple(_shape_2d("submesh_logical_shapes", s) for s in self.submesh_logical_shapes)
        if not ids or len({len(ids), len(physical), len(logical)}) != 1:
            raise InvalidArgumentError(
                "forward_stage_layer_ids, submesh_physical_shapes and submesh_logical_shapes need "
                f"one entry per stage; got {len(ids)}, {len(physical)} and {len(logical)}"
            )
        flat = [i for stage in ids for i in stage]
        if any(not stage for stage in ids) or flat != list(range(len(flat))):
            raise InvalidArgumentError(
                "forward_stage_layer_ids must split layers 0..L-1 into non-empty consecutive "
                f"runs in order, got {ids}"
            )
        for i, (p, q) in enumerate(zip(physical, logical, strict=True)):
            if p[0] * p[1] != q[0] * q[1]:
                raise InvalidArgumentError(
                    f"stage {i}: logical mesh {q} has {q[0] * q[1]} devices but its sub-mesh "
                    f"{p} has {p[0] * p[1]}"
                )
        object.__setattr__(self, "forward_stage_layer_ids", ids)
        object.__setattr__(self, "submesh_physical_shapes", physical)
        object.__setattr__(self, "submesh_logical_shapes", logical)


LayerOption = ManualLayerOption | AutoLayerOption
StageOption = AutoStageOption | UniformStageOption | ManualStageOption

# Alpa's string forms of the pipeline options, converted once by `PipeshardParallel`.
LAYER_OPTION_NAMES = {"manual": ManualLayerOption, "auto": lambda: AutoLayerOption(layer_num=2)}
STAGE_OPTION_NAMES = {"auto": AutoStageOption, "uniform": UniformStageOption}
