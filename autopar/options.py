"""Options that restrict or tune the automatic planners (names follow Alpa's)."""

from __future__ import annotations

import dataclasses
import numbers

from autopar.planner.errors import InvalidArgumentError, check_memory_budget, check_positive_int
from autopar.planner.ilp import DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S, SOLVERS
from autopar.planner.intra import IntraOpConfig
from autopar.planner.stage_options import (
    AutoStageOption,
    ManualStageOption,
    StageOption,
    UniformStageOption,
)

__all__ = [
    "AutoLayerOption",
    "AutoShardingOption",
    "AutoStageOption",
    "LayerOption",
    "ManualLayerOption",
    "ManualStageOption",
    "StageOption",
    "UniformStageOption",
]


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
        check_memory_budget(self.memory_budget_per_device)
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


REMAT_MODES = ("auto", "none", "coarse_grained")


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
      remat_mode: "coarse_grained" recomputes each layer's activations in the backward pass
        (a stage keeps only its layers' inputs); "none" never does; "auto" (the default) plans
        without recomputation and, on a GPU cluster where no stage plan fits the memory,
        plans again with "coarse_grained" (the plan's notes say so).
    """

    layer_num: int
    remat_mode: str = "auto"

    def __post_init__(self) -> None:
        check_positive_int("layer_num", self.layer_num)
        if self.remat_mode not in REMAT_MODES:
            raise InvalidArgumentError(
                f"remat_mode must be one of {REMAT_MODES}, got {self.remat_mode!r}"
            )


LayerOption = ManualLayerOption | AutoLayerOption

# Alpa's string forms of the pipeline options, converted once by `PipeshardParallel`.
LAYER_OPTION_NAMES = {"manual": ManualLayerOption, "auto": lambda: AutoLayerOption(layer_num=2)}
STAGE_OPTION_NAMES = {"auto": AutoStageOption, "uniform": UniformStageOption}
