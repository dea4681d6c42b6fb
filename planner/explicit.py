"""Plans by explicit rule (no solver): data parallelism and ZeRO stages 2 and 3 (FSDP).

All three split every batch input along dim 0 over all mesh axes and keep the computation
data-parallel. They differ in what each device stores:

* DATA_PARALLEL: everything replicated; gradients all-reduced.
* ZERO2: parameters replicated; optimizer state and gradients split (gradients reduce-scattered,
  updated parameters all-gathered).
* ZERO3 (FSDP): parameters, gradients and optimizer state split; parameters all-gathered where
  used, again in the backward pass (never kept alive from the forward), gradients reduce-scattered.

A tensor is split along its largest dimension divisible by the device count (first one on ties);
tensors with no such dimension (scalars, odd sizes) stay replicated.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from autopar.markers import GRAD_BOUNDARY, PARAM_USE
from autopar.planner.cluster import ClusterSpec
from autopar.planner.cost import compute_cost, logical_mesh
from autopar.planner.errors import InvalidArgumentError
from autopar.planner.gradients import reduce_scatter_lowerings
from autopar.planner.graph import OpGraph, ValueKind, ValueRef, nodes_by_primitive, resolve_input
from autopar.planner.plan import MeshPlan, Plan, Predicted, Spec, StagePlan, replicated
from autopar.planner.program import Program


class ZeroStage(enum.Enum):
    """What a data-parallel plan stores split: nothing, optimizer state, or everything."""

    DATA_PARALLEL = "data_parallel"
    ZERO2 = "zero2"
    ZERO3 = "zero3"


def split_spec(shape: Sequence[int], axes: tuple[str, ...], n: int) -> Spec:
    """Split the largest dimension divisible by `n` over `axes`; replicated if there is none."""
    best = None
    for dim, size in enumerate(shape):
        if size % n == 0 and size >= n and (best is None or size > shape[best]):
            best = dim
    spec = list(replicated(len(shape)))
    if best is not None:
        spec[best] = axes
    return tuple(spec)


def param_inputs(graph: OpGraph) -> dict[int, int]:
    """Parameter index (of `autopar.grad`) → the step input that stores that parameter."""
    found: dict[int, int] = {}
    for node in nodes_by_primitive(graph, PARAM_USE):
        index = node.params["index"]
        if index not in found:
            source = resolve_input(graph, node.inputs[0])
            if source is not None:
                found[index] = source
    return found


def check_batch_divisible(program: Program, num_devices: int, num_micro_batches: int) -> None:
    """Each (micro-)batch input's dim 0 must split evenly over the devices."""
    sig = program.signature
    k = num_micro_batches
    for i in sig.batch_inputs:
        shape = sig.input_avals[i].shape
        if shape[0] % num_devices:
            full = (shape[0] * k, *shape[1:])
            raise InvalidArgumentError(
                f"batch input {sig.input_paths[i]} has shape {full}: its batch dimension "
                f"{full[0]} must be divisible by the number of devices ({num_devices}) x "
                f"num_micro_batches ({k}) = {num_devices * k}"
            )


def plan_data_parallel(
    program: Program,
    mesh: MeshPlan,
    cluster: ClusterSpec,
    *,
    stage: ZeroStage,
    num_micro_batches: int,
) -> Plan:
    """The plan of `stage` for `program` on `mesh` (all axes used for data parallelism)."""
    n = mesh.num_devices
    axes = mesh.axis_names
    check_batch_divisible(program, n, num_micro_batches)
    sig, graph = program.signature, program.graph
    params = param_inputs(graph)
    param_set = set(params.values())

    def storage(i: int) -> Spec:
        shape = sig.input_avals[i].shape
        if i in sig.batch_inputs:
            return (axes,) + replicated(len(shape) - 1)
        shard = stage is ZeroStage.ZERO3 or (stage is ZeroStage.ZERO2 and i not in param_set)
        return split_spec(shape, axes, n) if shard else replicated(len(shape))

    input_specs = tuple(storage(i) for i in range(len(sig.input_paths)))
    output_specs = tuple(
        input_specs[src] if src is not None else replicated(len(sig.output_avals[j].shape))
        for j, src in enumerate(sig.output_to_input)
    )
    param_use_specs = (
        {index: replicated(len(sig.input_avals[i].shape)) for index, i in params.items()}
        if stage is ZeroStage.ZERO3
        else {}
    )
    node_output_specs: dict[str, tuple[Spec | None, ...]] = {}
    rs_targets: list[tuple[ValueRef, Spec]] = []
    for node in nodes_by_primitive(graph, GRAD_BOUNDARY):
        specs: list[Spec | None] = []
        for operand, aval, of in zip(
            node.inputs, node.in_avals, node.params["grad_of"], strict=True
        ):
            if of < 0 or of not in params:
                specs.append(None)
                continue
            spec = (
                replicated(len(aval.shape))
                if stage is ZeroStage.DATA_PARALLEL
                else split_spec(aval.shape, axes, n)
            )
            specs.append(spec)
            if stage is not ZeroStage.DATA_PARALLEL and operand.kind is ValueKind.NODE:
                rs_targets.append((operand, spec))
        node_output_specs[node.id] = tuple(specs)

    stage_plan = StagePlan(
        index=0,
        mesh=mesh,
        input_specs=input_specs,
        output_specs=output_specs,
        param_use_specs=param_use_specs,
        node_output_specs=node_output_specs,
        reduce_scatter=reduce_scatter_lowerings(graph, rs_targets, n),
    )
    return Plan(
        method=stage.value,
        num_micro_batches=num_micro_batches,
        stages=(stage_plan,),
        predicted=predict(program, stage_plan, cluster, stage, params, num_micro_batches),
        cluster=cluster.to_dict(),
        input_paths=sig.input_paths,
        output_paths=sig.output_paths,
        donated_inputs=sig.donated_inputs,
        fingerprint=program.fingerprint,
    )


def _bytes_per_device(shape, itemsize, spec: Spec, mesh: MeshPlan) -> float:
    size = float(itemsize)
    for dim, entry in zip(shape, spec, strict=True):
        size *= dim / (mesh.axis_size(entry) if entry else 1)
    return size


def predict(
    program: Program,
    stage_plan: StagePlan,
    cluster: ClusterSpec,
    stage: ZeroStage,
    params: dict[int, int],
    num_micro_batches: int,
) -> Predicted:
    """Step time and memory of a data-parallel plan under the α-β cost model.

    Communication per step, for k micro-batches and P parameter bytes: DP k·all-reduce(P);
    ZeRO-2 k·reduce-scatter(P) + all-gather(P); ZeRO-3 k·(2·all-gather(P) + reduce-scatter(P)).
    Memory counts the stored state per device plus gradients (full for DP, split otherwise) and the
    batch inputs; activations are not counted here.
    """
    sig, mesh = program.signature, stage_plan.mesh
    lmesh = logical_mesh(cluster, mesh.shape, mesh.axis_names)
    axes = mesh.axis_names
    param_bytes = float(sum(sig.input_avals[i].nbytes for i in params.values()))
    k = num_micro_batches
    if stage is ZeroStage.DATA_PARALLEL:
        comm_bytes = k * param_bytes
        comm = k * lmesh.all_reduce_cost(param_bytes, axes)
    elif stage is ZeroStage.ZERO2:
        comm_bytes = (k + 1) * param_bytes
        comm = k * lmesh.reduce_scatter_cost(param_bytes, axes) + lmesh.all_gather_cost(
            param_bytes, axes
        )
    else:
        comm_bytes = 3 * k * param_bytes
        comm = k * (
            2 * lmesh.all_gather_cost(param_bytes, axes)
            + lmesh.reduce_scatter_cost(param_bytes, axes)
        )
    flops = k * program.graph.total_flops
    compute = compute_cost(flops / mesh.num_devices, cluster.device_flops)
    stored = sum(
        _bytes_per_device(a.shape, a.dtype.itemsize, s, mesh)
        for a, s in zip(sig.input_avals, stage_plan.input_specs, strict=True)
    )
    grads = param_bytes if stage is ZeroStage.DATA_PARALLEL else param_bytes / mesh.num_devices
    return Predicted(
        step_time_s=compute + comm,
        compute_s=compute,
        communication_s=comm,
        memory_per_device_bytes=stored + grads,
        communication_bytes=comm_bytes,
        flops=flops,
    )
