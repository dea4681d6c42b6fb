"""The pipeline stage options (Alpa's names): how the stage search may cut layers into stages
and place them on sub-meshes. They are planner inputs, so they live on the planner's floor;
`autopar.options` re-exports them beside the other options."""

from __future__ import annotations

import dataclasses
import math
import numbers

from autopar.planner.errors import InvalidArgumentError, check_positive_int

PHYSICAL_SPACES = ("power_of_two", "all")
LOGICAL_SPACES = (
    "single_node_model_parallel",
    "all",
    "same_as_physical",
    "data_parallel_only",
    "model_parallel_only",
)


def _shape_2d(name: str, shape: object) -> tuple[int, int]:
    if not (isinstance(shape, (tuple, list)) and len(shape) == 2):
        raise InvalidArgumentError(f"{name} must be a (rows, columns) pair, got {shape!r}")
    try:
        return (check_positive_int(name, shape[0]), check_positive_int(name, shape[1]))
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"{name} must be a positive integer pair, got {shape!r}"
        ) from None


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


StageOption = AutoStageOption | UniformStageOption | ManualStageOption
