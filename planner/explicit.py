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

import dataclasses
import enum
from collections.abc import Sequence

from autopar.markers import GRAD_BOUNDARY
from autopar.planner.batch_dims import batch_dims
from autopar.planner.cluster import ClusterSpec
from autopar.planner.cost import Collective, logical_mesh, result_bytes
from autopar.planner.errors import InvalidArgumentError
from autopar.planner.gradients import (
    gradient_chains,
    gradient_part,
    gradient_reduction,
    param_inputs,
    partial_sum_lowerings,
)
from autopar.planner.graph import ValueKind, ValueRef, nodes_by_primitive
from autopar.planner.groups import group_graph
from autopar.planner.memory import liveness
from autopar.planner.plan import MeshPlan, Plan, Predicted, Spec, StagePlan, replicated
from autopar.planner.program import Program
from autopar.planner.roofline import Roofline


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


@dataclasses.dataclass(frozen=True)
class _Gradient:
    """A parameter's gradient as the explicit plans see it."""

    boundary: str  # the gradient boundary node
    position: int  # its operand there
    operand: ValueRef
    spec: Spec  # how the summed gradient is stored
    nbytes: int  # of its parameter


def _gradients(program: Program, stage: ZeroStage, axes, n: int) -> list[_Gradient]:
    """Every parameter gradient at the gradient boundary, with the spec `stage` stores it in."""
    sig, graph = program.signature, program.graph
    params = param_inputs(graph)
    found = []
    for node in nodes_by_primitive(graph, GRAD_BOUNDARY):
        grad_of = node.params["grad_of"]
        for position, (operand, aval, of) in enumerate(
            zip(node.inputs, node.in_avals, grad_of, strict=True)
        ):
            if of < 0 or of not in params:
                continue
            spec = (
                replicated(len(aval.shape))
                if stage is ZeroStage.DATA_PARALLEL
                else split_spec(aval.shape, axes, n)
            )
            nbytes = sig.input_avals[params[of]].nbytes
            found.append(_Gradient(node.id, position, operand, spec, nbytes))
    return found


def _reduce_once_where_room(
    gradients: list[_Gradient], stage: ZeroStage, memory_without: float, budget: float, n: int
) -> list[bool]:
    """Which gradients to reduce once per step (k > 1). A gradient stored replicated always is
    (its accumulator is whole anyway). One stored split needs a whole accumulator instead of a
    slice: largest first, those that would take the plan over `budget` (predicted with every
    split gradient reduced per micro-batch: `memory_without`) are reduced per micro-batch."""
    if stage is ZeroStage.DATA_PARALLEL:
        return [True] * len(gradients)
    room = budget - memory_without
    once = [False] * len(gradients)
    for i in sorted(range(len(gradients)), key=lambda i: -gradients[i].nbytes):
        extra = gradients[i].nbytes * (1 - 1 / n)
        if extra <= room:
            once[i], room = True, room - extra
    return once


def plan_data_parallel(
    program: Program,
    mesh: MeshPlan,
    cluster: ClusterSpec,
    *,
    stage: ZeroStage,
    num_micro_batches: int,
) -> Plan:
    """The plan of `stage` for `program` on `mesh` (all axes used for data parallelism).

    With micro-batches, gradients are accumulated on each device and reduced once per step
    where memory allows (`_reduced_once`), else reduce-scattered per micro-batch."""
    n = mesh.num_devices
    axes = mesh.axis_names
    k = num_micro_batches
    check_batch_divisible(program, n, k)
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
    gradients = _gradients(program, stage, axes, n)
    node_output_specs: dict[str, tuple[Spec | None, ...]] = {}
    for node in nodes_by_primitive(graph, GRAD_BOUNDARY):
        specs: list[Spec | None] = [None] * len(node.inputs)
        for g in gradients:
            if g.boundary == node.id:
                specs[g.position] = g.spec
        node_output_specs[node.id] = tuple(specs)
    once = [False] * len(gradients)
    if k > 1 and n > 1:
        without = _memory(sig, input_specs, mesh, gradients, once, n)
        once = _reduce_once_where_room(gradients, stage, without, cluster.device_memory, n)
    targets = [
        (g.operand, g.spec, o)
        for g, o in zip(gradients, once, strict=True)
        if g.operand.kind is ValueKind.NODE
    ]
    partial_sums = partial_sum_lowerings(graph, targets, axes, n)
    once_nodes = {node for node, lowering in partial_sums.items() if lowering.once_per_step}
    chains = {c.nodes[0]: c for c in gradient_chains(graph) if c.nodes}
    once = [
        g.operand.node in chains and set(chains[g.operand.node].sums) <= once_nodes
        for g in gradients
    ]
    summed = {node for c in chains.values() for node in c.sums} if n > 1 else set()
    stage_plan = StagePlan(
        index=0,
        mesh=mesh,
        input_specs=input_specs,
        output_specs=output_specs,
        param_use_specs=param_use_specs,
        node_output_specs=node_output_specs,
        partial_sums=partial_sums,
        gradient_reduction=(
            gradient_reduction(graph, summed, once_nodes, sig.input_paths) if k > 1 else {}
        ),
    )
    return Plan(
        method=stage.value,
        num_micro_batches=k,
        stages=(stage_plan,),
        predicted=predict(program, stage_plan, cluster, stage, gradients, once, k),
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


def _memory(
    sig, input_specs, mesh: MeshPlan, gradients: list[_Gradient], once: list[bool], n: int
) -> float:
    """Stored inputs plus gradient accumulators per device (whole where reduced once per step
    or stored replicated, a slice otherwise)."""
    stored = sum(
        _bytes_per_device(a.shape, a.dtype.itemsize, s, mesh)
        for a, s in zip(sig.input_avals, input_specs, strict=True)
    )
    grads = sum(
        g.nbytes if o or not any(g.spec) else g.nbytes / n
        for g, o in zip(gradients, once, strict=True)
    )
    return stored + grads


def predict(
    program: Program,
    stage_plan: StagePlan,
    cluster: ClusterSpec,
    stage: ZeroStage,
    gradients: list[_Gradient],
    once: list[bool],
    num_micro_batches: int,
) -> Predicted:
    """Step time and memory of a data-parallel plan under the α-β cost model.

    Communication per step (bytes as the HLO's collective results count them), for k
    micro-batches, gradients of G bytes reduced once per step and
    of g bytes per micro-batch, and P parameter bytes: DP all-reduce(G) + k·all-reduce(g);
    ZeRO-2 reduce-scatter(G) + k·reduce-scatter(g) + all-gather(P); ZeRO-3 the same with
    2k·all-gather(P) in place of one. Memory counts the stored state per device plus the
    gradient accumulators and the batch inputs; activations are not counted here.
    """
    sig, mesh = program.signature, stage_plan.mesh
    lmesh = logical_mesh(cluster, mesh.shape, mesh.axis_names)
    axes = mesh.axis_names
    k = num_micro_batches
    param_bytes = float(sum(g.nbytes for g in gradients))
    reduced_once = float(sum(g.nbytes for g, o in zip(gradients, once, strict=True) if o))
    per_micro_batch = param_bytes - reduced_once
    if stage is ZeroStage.DATA_PARALLEL:
        comm_bytes = reduced_once + k * per_micro_batch
        comm = lmesh.all_reduce_cost(reduced_once, axes) + k * lmesh.all_reduce_cost(
            per_micro_batch, axes
        )
    else:
        gathers = 1 if stage is ZeroStage.ZERO2 else 2 * k
        scattered = result_bytes(lmesh, Collective.REDUCE_SCATTER, 1.0, axes)  # per byte summed
        comm_bytes = (reduced_once + k * per_micro_batch) * scattered + gathers * param_bytes
        comm = (
            lmesh.reduce_scatter_cost(reduced_once, axes)
            + k * lmesh.reduce_scatter_cost(per_micro_batch, axes)
            + gathers * lmesh.all_gather_cost(param_bytes, axes)
        )
    flops, compute = _compute(program, cluster, stage, mesh.num_devices, k)
    memory = _memory(sig, stage_plan.input_specs, mesh, gradients, once, mesh.num_devices)
    return Predicted(
        step_time_s=compute + comm,
        compute_s=compute,
        communication_s=comm,
        memory_per_device_bytes=memory,
        communication_bytes=comm_bytes,
        flops=flops,
    )


def _compute(
    program: Program, cluster: ClusterSpec, stage: ZeroStage, n: int, k: int
) -> tuple[float, float]:
    """(FLOPs of the step over all devices, seconds per device): each op's roofline, run k times
    in the gradient part. An op touching the batch runs on 1/n of it; the update runs on 1/n of
    the state where ZeRO splits it, on all of it under data parallelism; parameters are read
    whole (ZeRO-3 gathers them before use)."""
    graph = program.graph
    grouping = group_graph(graph)
    live = liveness(grouping, program.signature, dot_operand_copies=cluster.platform == "cpu")
    roofline = Roofline(grouping, live.fused, cluster)
    batch = batch_dims(
        grouping, program.signature.batch_inputs, logical_mesh(cluster, (n,), ("batch",)), 0
    )
    per_micro_batch = gradient_part(graph)
    flops = seconds = 0.0
    for node in grouping.planned_nodes():
        runs = k if node.id in per_micro_batch else 1
        values = [grouping.value_of(ref) for ref in node.inputs]
        outputs = [(node.id, o) for o in range(len(node.out_avals))]
        split_update = node.id not in per_micro_batch and stage is not ZeroStage.DATA_PARALLEL
        share = n if split_update or any(v in batch for v in (*values, *outputs)) else 1
        in_bytes = [
            None if v is None else a.nbytes / (n if split_update or v in batch else 1)
            for v, a in zip(values, node.in_avals, strict=True)
        ]
        out_bytes = [
            a.nbytes / (n if split_update or v in batch else 1)
            for v, a in zip(outputs, node.out_avals, strict=True)
        ]
        flops += runs * node.flops
        seconds += runs * roofline.seconds(node, node.flops / share, in_bytes, out_bytes)
    return flops, seconds
