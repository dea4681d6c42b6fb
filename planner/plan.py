"""The Plan: the contract between the planner and the runtime.

Plain, frozen, JSON-serialisable data. The planner produces it from a jaxpr and a ClusterSpec
without touching devices; the runtime executes it faithfully without deciding anything.

Sharding specs are tuples with one entry per tensor dimension: ``None`` (not split) or a tuple of
mesh axis names that split that dimension, e.g. ``(("data",), None)`` splits dim 0 over "data".
Nodes are named by the op-graph ids of `planner.graph` (eqn paths like ``"12"`` or ``"12/3"``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import InvalidArgumentError
from autopar.planner.schedules import PipelineSchedule, Schedule, make_schedule

Spec = tuple[tuple[str, ...] | None, ...]

PLAN_FORMAT_VERSION = 18
# Versions 6 to 17 lack fields added since, which load as their defaults: 6 the roofline's
# figures (memory bandwidth, dtype peaks, efficiencies, kernel floor), 7 the rates of
# transcendentals, convolutions and transposes, 8 the weight-gradient matmul rate and the fresh
# memory figures (all in the cluster dict, filled by `ClusterSpec.from_dict`), 9 the host's
# launch and buffer overheads and `Predicted.host_s` (0: not priced), 10 the host's update of
# each kernel (`ClusterSpec.kernel_update_s`), 11 matmuls' efficiency by size
# (`ClusterSpec.matmul_efficiency`: every size at the peak), 12 the rate of a GPU's column
# reductions (`ClusterSpec.column_reduction_rate`: not priced), 13 that of column reductions
# with fused outputs (`ClusterSpec.column_reduction_array_rate`: not priced), 14 the rates of
# pools and their gradients (`ClusterSpec.window_reduction_rate`, `select_and_scatter_rate`:
# priced by their bytes), 15 the rates of narrow weight gradients and of pool gradients in
# cache (`ClusterSpec.narrow_transposed_matmul_flops`, `cached_select_and_scatter_rate`: the
# rates of wide ones and beyond the caches), 16 the rates of element-wise loops fused into
# transposing copies at an aliasing row stride (`ClusterSpec.aliasing_stride`,
# `aliased_loop_rate`, `many_lines_aliased_loop_rate`: priced as any copy), 17 collectives'
# bandwidth within the caches (`ClusterSpec.collective_cache_bytes`,
# `cached_intra_host_bandwidth`: the link's bandwidth at every size).
READABLE_FORMAT_VERSIONS = (6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, PLAN_FORMAT_VERSION)


def replicated(ndim: int) -> Spec:
    """The spec of a tensor of `ndim` dimensions that is not split at all."""
    return (None,) * ndim


def format_spec(spec: Spec | None) -> str:
    """Short human form, like jax's PartitionSpec: ``P('data', None)``; ``auto`` for None."""
    if spec is None:
        return "auto"
    parts = []
    for entry in spec:
        if entry is None:
            parts.append("None")
        elif len(entry) == 1:
            parts.append(repr(entry[0]))
        else:
            parts.append(repr(tuple(entry)))
    return f"P({', '.join(parts)})"


@dataclasses.dataclass(frozen=True, slots=True)
class MeshPlan:
    """A logical device mesh: its shape, axis names, and which devices (by index) fill it."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_indices: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axis_names):
            raise ValueError(f"mesh shape {self.shape} and axis names {self.axis_names} differ")
        size = 1
        for dim in self.shape:
            size *= dim
        if size != len(self.device_indices):
            raise ValueError(
                f"mesh shape {self.shape} needs {size} devices, got {len(self.device_indices)}"
            )

    @property
    def num_devices(self) -> int:
        return len(self.device_indices)

    def axis_size(self, axes: Sequence[str]) -> int:
        """Number of devices across the given axes."""
        size = 1
        for axis in axes:
            size *= self.shape[self.axis_names.index(axis)]
        return size


@dataclasses.dataclass(frozen=True, slots=True)
class PartialSumLowering:
    """Compute a node on local shards (operands split as given) and sum the partial results over
    `partial_axes` explicitly: reduce-scattered onto the dim that `output_spec` splits over
    them, else all-reduced.

    Used where a node sums a gradient over a split dimension (the batch). With micro-batches,
    `once_per_step` keeps each device's partial sums unreduced across micro-batches (a local,
    unsplit accumulator) and reduces them once after the last one; otherwise each micro-batch's
    sums are reduce-scattered as they are made (no full-size accumulator). All-reduces are
    lowered only once per step: per micro-batch, XLA emits them by itself.
    """

    operand_specs: tuple[Spec | None, ...]
    output_spec: Spec
    partial_axes: tuple[str, ...]
    once_per_step: bool = False


ONCE_PER_STEP = "once per step"
PER_MICRO_BATCH = "per micro-batch"


@dataclasses.dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage: a mesh and the shardings of the step's values on it.

    `node_output_specs[node]` pins a node's outputs; `node_input_specs[node]` reshards operands
    right before a node (None: leave that operand as it is); `param_use_specs[i]` pins where
    parameter i is used; `partial_sums[node]` sums a node's partial results explicitly.
    """

    index: int
    mesh: MeshPlan
    input_specs: tuple[Spec, ...]
    output_specs: tuple[Spec, ...]
    param_use_specs: Mapping[int, Spec] = dataclasses.field(default_factory=dict)
    node_output_specs: Mapping[str, tuple[Spec | None, ...]] = dataclasses.field(
        default_factory=dict
    )
    partial_sums: Mapping[str, PartialSumLowering] = dataclasses.field(default_factory=dict)
    node_input_specs: Mapping[str, tuple[Spec | None, ...]] = dataclasses.field(
        default_factory=dict
    )
    layers: tuple[int, int] | None = None  # pipeline stages: the layer range [start, end)
    input_paths: tuple[str, ...] = ()  # pipeline stages: names of input_specs (else the plan's)
    predicted: Predicted | None = None  # pipeline stages: this stage's share of the step
    op_costs: tuple[OpGroupCost, ...] = ()  # the costliest op groups (ILP plans), costliest first
    # With micro-batches: each parameter (input path) whose gradient is summed over devices,
    # and when: ONCE_PER_STEP or PER_MICRO_BATCH.
    gradient_reduction: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class Predicted:
    """Cost-model predictions for one training step, per device; `flops` is the whole step's
    arithmetic (all devices, all micro-batches, recomputation included), for TFLOP/s and MFU;
    `host_s` the host's launches of the step's programs (`ClusterSpec.launch_overhead_s`):
    added to a single program's step time, a lower bound of a pipeline's."""

    step_time_s: float
    compute_s: float
    communication_s: float
    memory_per_device_bytes: float
    communication_bytes: float = 0.0
    flops: float = 0.0
    host_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class OpGroupCost:
    """One class of op groups (a heavy op and the cheap ops that follow it; the groups of
    repeated layers form one class) and its predicted cost per step, per device.

    `description` names the leader op and its shapes, `first_node` the op-graph id of its first
    group, `count` how many groups the class has (e.g. one per layer)."""

    description: str
    first_node: str
    count: int
    compute_s: float
    communication_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s


@dataclasses.dataclass(frozen=True)
class TracingRecord:
    """How the step was traced for a plan, so that a plan file or a Ray worker traces the same
    program again: parameters regathered in the backward pass (FSDP), and the layer option as
    `{"kind": "manual" | "auto", **its fields}` (None: the loss is not cut into layers)."""

    regather_params: bool
    layer_option: Mapping[str, Any] | None = None


class PlanMethod(enum.StrEnum):
    """What made a plan (compares equal to its value, which the JSON holds)."""

    SHARD_PARALLEL = "shard_parallel"
    PIPESHARD_PARALLEL = "pipeshard_parallel"
    DATA_PARALLEL = "data_parallel"
    ZERO2 = "zero2"
    ZERO3 = "zero3"


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """How to run one training step in parallel. See the module docstring. `method` and
    `pipeline_schedule` may be given as their values and are held as enums."""

    method: PlanMethod
    num_micro_batches: int
    stages: tuple[StagePlan, ...]
    predicted: Predicted
    cluster: ClusterSpec
    input_paths: tuple[str, ...]
    output_paths: tuple[str, ...]
    donated_inputs: tuple[int, ...] = ()
    fingerprint: str = ""
    notes: tuple[str, ...] = ()
    pipeline_schedule: PipelineSchedule | None = None  # pipelined plans only
    # How the step was traced for this plan; filled in by `autopar.api` (None: not recorded).
    tracing: TracingRecord | None = None

    def __post_init__(self) -> None:
        if self.method not in tuple(PlanMethod):
            raise InvalidArgumentError(
                f"plan method={self.method!r} is unknown; one of {[m.value for m in PlanMethod]}"
            )
        object.__setattr__(self, "method", PlanMethod(self.method))
        if self.pipeline_schedule is not None:
            schedule = PipelineSchedule.parse(self.pipeline_schedule)
            object.__setattr__(self, "pipeline_schedule", schedule)

    @property
    def num_devices(self) -> int:
        """Devices the plan runs on (over all stages)."""
        return len({i for stage in self.stages for i in stage.mesh.device_indices})

    @property
    def num_meshes(self) -> int:
        """Sub-meshes the stages run on: fewer than the stages where several share one
        (interleaved 1F1B's virtual stages: stage s on the mesh of stage s mod num_meshes)."""
        return len({stage.mesh.device_indices for stage in self.stages})

    def pipeline_table(self) -> Schedule:
        """The clock table a pipelined plan runs (InvalidArgumentError for other plans)."""
        if self.pipeline_schedule is None:
            raise InvalidArgumentError(
                f"a {self.method} plan has no pipeline schedule; only pipeshard plans do"
            )
        return make_schedule(
            self.pipeline_schedule, len(self.stages), self.num_micro_batches, self.num_meshes
        )

    def to_json(self, indent: int | None = 2) -> str:
        """Serialise to JSON (never pickle); `Plan.from_json` reads it back to an equal plan."""
        return json.dumps(
            {"format_version": PLAN_FORMAT_VERSION, **_to_jsonable(self)}, indent=indent
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        version = data.pop("format_version", None)
        if version not in READABLE_FORMAT_VERSIONS:
            raise ValueError(
                f"plan format version {version!r} is not supported (this autopar reads "
                f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))})"
            )
        return _plan_from_dict(data)

    def summary(self, max_rows: int = 60) -> str:
        """A text table: stages (sub-meshes, logical meshes, layers) with their predicted
        compute, communication and memory; how inputs are stored, grouped by layer pattern
        (at most `max_rows` rows per stage); predicted step time, TFLOP/s per device and MFU."""
        from autopar.planner.summary import plan_summary

        return plan_summary(self, max_rows=max_rows)

    def draw(self, path: str | os.PathLike[str]) -> None:
        """Write a PNG (matplotlib, Agg): the device grid coloured by stage and the pipeline
        schedule as a stage x time timeline with its predicted bubble fraction."""
        from autopar.planner.draw import draw_plan

        draw_plan(self, path)


def _to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_to_jsonable(v) for v in value]
    return value


def _spec(value: Any) -> Spec | None:
    if value is None:
        return None
    return tuple(None if entry is None else tuple(entry) for entry in value)


def _stage_from_dict(d: Mapping[str, Any]) -> StagePlan:
    return StagePlan(
        index=d["index"],
        mesh=MeshPlan(
            shape=tuple(d["mesh"]["shape"]),
            axis_names=tuple(d["mesh"]["axis_names"]),
            device_indices=tuple(d["mesh"]["device_indices"]),
        ),
        input_specs=tuple(_spec(s) for s in d["input_specs"]),
        output_specs=tuple(_spec(s) for s in d["output_specs"]),
        param_use_specs={int(k): _spec(v) for k, v in d["param_use_specs"].items()},
        node_output_specs={
            k: tuple(_spec(s) for s in v) for k, v in d["node_output_specs"].items()
        },
        partial_sums={
            k: PartialSumLowering(
                operand_specs=tuple(_spec(s) for s in v["operand_specs"]),
                output_spec=_spec(v["output_spec"]),
                partial_axes=tuple(v["partial_axes"]),
                once_per_step=v["once_per_step"],
            )
            for k, v in d["partial_sums"].items()
        },
        node_input_specs={k: tuple(_spec(s) for s in v) for k, v in d["node_input_specs"].items()},
        layers=None if d["layers"] is None else tuple(d["layers"]),
        input_paths=tuple(d["input_paths"]),
        predicted=None if d["predicted"] is None else Predicted(**d["predicted"]),
        op_costs=tuple(OpGroupCost(**c) for c in d["op_costs"]),
        gradient_reduction=dict(d["gradient_reduction"]),
    )


def _plan_from_dict(d: Mapping[str, Any]) -> Plan:
    return Plan(
        method=d["method"],
        num_micro_batches=d["num_micro_batches"],
        stages=tuple(_stage_from_dict(s) for s in d["stages"]),
        predicted=Predicted(**d["predicted"]),
        cluster=ClusterSpec.from_dict(d["cluster"]),
        input_paths=tuple(d["input_paths"]),
        output_paths=tuple(d["output_paths"]),
        donated_inputs=tuple(d["donated_inputs"]),
        fingerprint=d["fingerprint"],
        notes=tuple(d["notes"]),
        pipeline_schedule=d["pipeline_schedule"],
        tracing=TracingRecord(**d["tracing"]) if d["tracing"] else None,
    )
