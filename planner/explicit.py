"""Plans by explicit rule (no solver): data parallelism and ZeRO stages 2 and 3 (FSDP).

All three split every batch input along dim 0 over all mesh axes and keep the computation
data-parallel. They differ in what each device stores:

* DATA_PARALLEL: everything replicated; gradients all-reduced.
* ZERO2: parameters replicated; optimizer state and gradients split (gradients reduce-scattered,
  updated parameters all-gathered).
* ZERO3 (FSDP): parameters, gradients and optimizer state split; parameters all-gathered where
  used, again in the backward pass (never kept alive from the forward), gradients reduce-scattered.
  Each use reads the parameter as stored: otherwise XLA moves the backward pass's gather of a
  micro-batch ahead of its recomputation barrier and keeps the forward pass's gathered copy.

A tensor is split along its largest dimension divisible by the device count (first one on ties);
tensors with no such dimension (scalars, odd sizes) stay replicated.

Memory is priced by the liveness model the ILP's plans use (`planner.memory`), with each value's
bytes per device as the plan holds it (`_value_spec`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence

from autopar.planner.batch_dims import batch_dims
from autopar.planner.cluster import ClusterSpec
from autopar.planner.cost import (
    Collective,
    LogicalMesh,
    logical_mesh,
    result_bytes,
    spec_bytes_per_device,
)
from autopar.planner.errors import InvalidArgumentError, MemoryBudgetError
from autopar.planner.gradients import (
    GradientChain,
    gradient_chains,
    gradient_part,
    gradient_reduction,
    param_inputs,
    partial_sum_lowerings,
)
from autopar.planner.graph import OpNode, ValueKind, ValueRef, nodes_by_primitive
from autopar.planner.groups import Grouping, Value, group_graph
from autopar.planner.markers import GRAD_BOUNDARY, PARAM_USE
from autopar.planner.memory import (
    Liveness,
    live_bytes,
    liveness,
    reduction_copy_bytes,
    unreduced_sum_bytes,
    value_aval,
)
from autopar.planner.plan import (
    MeshPlan,
    Plan,
    PlanMethod,
    Predicted,
    Spec,
    StagePlan,
    replicated,
)
from autopar.planner.program import Program
from autopar.planner.roofline import Roofline, fresh_memory_s, launch_s
from autopar.planner.strategy import without_axes
from autopar.planner.summary import format_bytes


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
    param: int  # the step input that stores its parameter
    nbytes: int  # of its parameter
    sums: tuple[str, ...]  # the sums of its chain (`GradientChain.sums`)


def _gradients(program: Program, stage: ZeroStage, axes, n: int) -> list[_Gradient]:
    """Every parameter gradient at the gradient boundary, with the spec `stage` stores it in."""
    sig, graph = program.signature, program.graph
    params = param_inputs(graph)
    sums = {(c.boundary, c.position): c.sums for c in gradient_chains(graph)}
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
            # A parameter used twice (a tied embedding) has a sum per use; XLA reduces each
            # where the gradient is not accumulated first.
            chain_sums = sums.get((node.id, position), ())
            found.append(
                _Gradient(node.id, position, operand, spec, params[of], nbytes, chain_sums)
            )
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


@dataclasses.dataclass(frozen=True)
class _Step:
    """The step as the pricing sees it: its ops grouped, their live ranges in XLA's order, the
    batch dim of each value computed from the batch, and the nodes run per micro-batch."""

    grouping: Grouping
    live: Liveness
    batch: dict[Value, int]
    per_micro_batch: set[str]

    @classmethod
    def of(cls, program: Program, cluster: ClusterSpec, n: int) -> _Step:
        grouping = group_graph(program.graph)
        cpu, dfs = cluster.platform == "cpu", cluster.dfs_schedule
        live = liveness(grouping, program.signature, cpu=cpu, dfs=dfs)
        mesh = logical_mesh(cluster, (n,), ("batch",))
        batch = batch_dims(grouping, program.signature.batch_inputs, mesh, 0)
        return cls(grouping, live, batch, gradient_part(program.graph))


def plan_data_parallel(
    program: Program,
    mesh: MeshPlan,
    cluster: ClusterSpec,
    *,
    stage: ZeroStage,
    num_micro_batches: int,
    memory_budget: float | None = None,
) -> Plan:
    """The plan of `stage` for `program` on `mesh` (all axes used for data parallelism).

    With micro-batches, gradients are accumulated on each device and reduced once per step
    where memory allows (`_reduce_once_where_room`), else reduce-scattered per micro-batch.
    A plan whose predicted peak exceeds `memory_budget` (default: the device memory) raises
    `MemoryBudgetError`."""
    budget = memory_budget or cluster.device_memory
    n = mesh.num_devices
    k = num_micro_batches
    check_batch_divisible(program, n, k)
    step = _Step.of(program, cluster, n)
    lmesh = logical_mesh(cluster, mesh.shape, mesh.axis_names)
    gradients = _gradients(program, stage, mesh.axis_names, n)
    once = [False] * len(gradients)
    if k > 1 and n > 1:
        per_micro_batch, _ = _stage_plan(program, mesh, stage, gradients, once, k)
        cpu = cluster.platform == "cpu"
        without = _memory(program, step, per_micro_batch, stage, lmesh, cpu, k)[0]
        once = _reduce_once_where_room(gradients, stage, without, budget, n)
    stage_plan, once = _stage_plan(program, mesh, stage, gradients, once, k)
    predicted = predict(program, step, stage_plan, cluster, stage, gradients, once, k)
    if predicted.memory_per_device_bytes > budget:
        raise _over_budget(stage, predicted, budget, n, k)
    sig = program.signature
    return Plan(
        method=PlanMethod(stage.value),
        num_micro_batches=k,
        stages=(stage_plan,),
        predicted=predicted,
        cluster=cluster,
        input_paths=sig.input_paths,
        output_paths=sig.output_paths,
        donated_inputs=sig.donated_inputs,
        fingerprint=program.fingerprint,
    )


_NEXT_STEP = {
    ZeroStage.DATA_PARALLEL: "Zero2Parallel or Zero3Parallel (optimizer state or parameters "
    "split over the devices)",
    ZeroStage.ZERO2: "Zero3Parallel (parameters split too)",
    ZeroStage.ZERO3: "ShardParallel (tensor parallelism as well)",
}


def _over_budget(
    stage: ZeroStage, predicted: Predicted, budget: float, n: int, k: int
) -> MemoryBudgetError:
    need = predicted.memory_per_device_bytes
    return MemoryBudgetError(
        f"the {stage.value} plan needs about {format_bytes(need)} per device on {n} devices, "
        f"over the memory budget of {format_bytes(budget)}: use {_NEXT_STEP[stage]}, "
        f"accumulate gradients over more micro-batches (num_micro_batches={2 * k}), cut the "
        "model into pipeline stages (PipeshardParallel), use more devices, or raise "
        "memory_budget_per_device",
        budget,
        need,
    )


def _storage_specs(program: Program, mesh: MeshPlan, stage: ZeroStage) -> tuple[Spec, ...]:
    """How `stage` stores each step input: the batch split on dim 0, the rest by `split_spec`
    where the stage splits it."""
    sig, axes, n = program.signature, mesh.axis_names, mesh.num_devices
    params = set(param_inputs(program.graph).values())

    def storage(i: int) -> Spec:
        shape = sig.input_avals[i].shape
        if i in sig.batch_inputs:
            return (axes,) + replicated(len(shape) - 1)
        shard = stage is ZeroStage.ZERO3 or (stage is ZeroStage.ZERO2 and i not in params)
        return split_spec(shape, axes, n) if shard else replicated(len(shape))

    return tuple(storage(i) for i in range(len(sig.input_paths)))


def _param_uses(
    program: Program, input_specs: tuple[Spec, ...], stage: ZeroStage
) -> tuple[dict[int, Spec], dict[str, tuple[Spec | None, ...]]]:
    """ZeRO-3's parameter uses: (parameter index → replicated spec; use node → its operand's
    stored spec, so that the gather runs at the use, see the module docstring)."""
    if stage is not ZeroStage.ZERO3:
        return {}, {}
    sig, graph = program.signature, program.graph
    params = param_inputs(graph)
    use_specs = {index: replicated(len(sig.input_avals[i].shape)) for index, i in params.items()}
    read_as_stored = {
        node.id: (input_specs[params[node.params["index"]]],)
        for node in nodes_by_primitive(graph, PARAM_USE)
        if node.params["index"] in params
    }
    return use_specs, read_as_stored


def _stage_plan(
    program: Program,
    mesh: MeshPlan,
    stage: ZeroStage,
    gradients: list[_Gradient],
    once: list[bool],
    k: int,
) -> tuple[StagePlan, list[bool]]:
    """The stage plan with the gradients `once` asks for reduced once per step, and which of
    them are (a gradient whose chain cannot stay unreduced is reduced per micro-batch)."""
    sig, graph = program.signature, program.graph
    axes, n = mesh.axis_names, mesh.num_devices
    input_specs = _storage_specs(program, mesh, stage)
    output_specs = tuple(
        input_specs[src] if src is not None else replicated(len(sig.output_avals[j].shape))
        for j, src in enumerate(sig.output_to_input)
    )
    param_use_specs, read_as_stored = _param_uses(program, input_specs, stage)
    node_output_specs: dict[str, tuple[Spec | None, ...]] = {}
    for node in nodes_by_primitive(graph, GRAD_BOUNDARY):
        specs: list[Spec | None] = [None] * len(node.inputs)
        for g in gradients:
            if g.boundary == node.id:
                specs[g.position] = g.spec
        node_output_specs[node.id] = tuple(specs)
    targets = [
        (g.operand, g.spec, o)
        for g, o in zip(gradients, once, strict=True)
        if g.operand.kind is ValueKind.NODE
    ]
    partial_sums = partial_sum_lowerings(graph, targets, axes, n)
    once_nodes = {node for node, lowering in partial_sums.items() if lowering.once_per_step}
    chains = {c.nodes[0]: c for c in gradient_chains(graph) if c.nodes}
    reduced_once = [
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
        node_input_specs=read_as_stored,
        partial_sums=partial_sums,
        gradient_reduction=(
            gradient_reduction(graph, summed, once_nodes, sig.input_paths) if k > 1 else {}
        ),
    )
    return stage_plan, reduced_once


def _value_spec(
    program: Program, step: _Step, plan: StagePlan, stage: ZeroStage, value: Value
) -> Spec:
    """How a data-parallel plan holds `value` on each device: a step input as stored; a
    parameter use as the plan gathers it (else as its parameter is stored); a gradient's sum
    as it is reduced into (whole where it is accumulated unreduced); a value computed from the
    batch split along its batch dim; under ZeRO the update's values split like the state they
    update (`split_spec`); the rest whole."""
    node_id, index = value
    if node_id is None:
        return plan.input_specs[index]
    node = program.graph.node(node_id)
    shape = node.out_avals[index].shape
    axes = plan.mesh.axis_names
    if node.primitive == PARAM_USE:
        use = plan.param_use_specs.get(node.params["index"])
        stored = step.grouping.value_of(node.inputs[0])
        if use is None and stored is not None:
            return _value_spec(program, step, plan, stage, stored)
        return use or replicated(len(shape))
    lowering = plan.partial_sums.get(node_id)
    if lowering is not None:
        if lowering.once_per_step:
            return without_axes(lowering.output_spec, lowering.partial_axes)
        return lowering.output_spec
    if value in step.batch:
        return tuple(axes if d == step.batch[value] else None for d in range(len(shape)))
    if node_id not in step.per_micro_batch and stage is not ZeroStage.DATA_PARALLEL:
        return split_spec(shape, axes, plan.mesh.num_devices)
    return replicated(len(shape))


def _value_bytes(
    program: Program,
    step: _Step,
    plan: StagePlan,
    stage: ZeroStage,
    mesh: LogicalMesh,
    value: Value,
    spec: Spec | None = None,
) -> float:
    """Bytes of `value` per device, in `spec` (default: `_value_spec`)."""
    aval = value_aval(step.grouping, value)
    spec = _value_spec(program, step, plan, stage, value) if spec is None else spec
    return spec_bytes_per_device(aval.shape, aval.dtype.itemsize, spec, mesh)


def _memory(
    program: Program,
    step: _Step,
    plan: StagePlan,
    stage: ZeroStage,
    mesh: LogicalMesh,
    cpu: bool,
    k: int,
) -> tuple[float, float]:
    """(Peak bytes per device, the stored inputs' share of it) under the liveness model: the
    stored inputs and the outputs that reuse no donated input throughout; each temporary while
    it lives (`_value_spec`); the gradients' buffers (`_gradient_buffers`); a parameter
    gathered at a use until that use's last reader."""
    graph, live = program.graph, step.live
    nbytes = functools.partial(_value_bytes, program, step, plan, stage, mesh)
    stored = sum(nbytes((None, i)) for i in range(len(plan.input_specs)))
    output_specs = {
        step.grouping.value_of(ref): spec
        for ref, spec in zip(graph.outputs, plan.output_specs, strict=True)
    }
    always = stored + sum(nbytes(v, output_specs[v]) for v in live.outputs)
    buffers = [(nbytes(v), start, end) for v, start, end in live.temporaries]
    if mesh.num_devices > 1:
        buffers += _gradient_buffers(program, step, plan, stage, mesh, cpu, k)
    for node, _ in _gathered_uses(program, plan):
        start = live.step_of_node[node.id]
        buffers.append((nbytes((node.id, 0)), start, live.last_use.get((node.id, 0), start)))
    per_step = always + live_bytes(live.num_steps, buffers)
    return float(per_step.max()) if live.num_steps else always, stored


def _gradient_buffers(
    program: Program,
    step: _Step,
    plan: StagePlan,
    stage: ZeroStage,
    mesh: LogicalMesh,
    cpu: bool,
    k: int,
) -> list[tuple[float, int, int]]:
    """The gradients' buffers beyond their values' live ranges, as (bytes, first, last step):
    a sum reduce-scattered as it is made has its whole partial sums at its node
    (`memory.unreduced_sum_bytes`); with micro-batches, each gradient its accumulator
    (`_accumulator`); the sums left to XLA's all-reduce, their combined reduction
    (`_combined_all_reduce`)."""
    live, axes = step.live, tuple(mesh.axis_names)
    grad_end = max((live.step_of_node.get(n, 0) for n in step.per_micro_batch), default=0)
    buffers: list[tuple[float, int, int]] = []
    left_to_xla: list[tuple[str, Spec]] = []
    for chain in gradient_chains(program.graph):
        for node_id in chain.sums:
            spec = _value_spec(program, step, plan, stage, (node_id, 0))
            lowering = plan.partial_sums.get(node_id)
            if lowering is None:
                left_to_xla.append((node_id, spec))
            elif not lowering.once_per_step:
                aval, at = program.graph.node(node_id).out_avals[0], live.step_of_node[node_id]
                buffers.append((unreduced_sum_bytes(mesh, aval, spec, axes, cpu), at, at))
        if k > 1:
            buffers += _accumulator(program, plan, chain, mesh, cpu, grad_end)
    return buffers + _combined_all_reduce(program, live, left_to_xla, mesh, cpu)


def _accumulator(
    program: Program,
    plan: StagePlan,
    chain: GradientChain,
    mesh: LogicalMesh,
    cpu: bool,
    grad_end: int,
) -> list[tuple[float, int, int]]:
    """A gradient's accumulator, from the step's start to its last gradient step: whole where
    it is reduced once per step (then, at the end, with the copies its reduction makes,
    `memory.reduction_copy_bytes`), else its slice."""
    aval = program.graph.node(chain.boundary).in_avals[chain.position]
    spec = plan.node_output_specs[chain.boundary][chain.position] or replicated(len(aval.shape))
    lowerings = [plan.partial_sums.get(n) for n in chain.sums]
    if not lowerings or not all(s is not None and s.once_per_step for s in lowerings):
        size = spec_bytes_per_device(aval.shape, aval.dtype.itemsize, spec, mesh)
        return [(size, 0, grad_end)]
    axes = tuple(mesh.axis_names)
    whole = spec_bytes_per_device(aval.shape, aval.dtype.itemsize, without_axes(spec, axes), mesh)
    copies = reduction_copy_bytes(mesh, aval, spec, axes, cpu)
    return [(whole, 0, grad_end), (copies, grad_end, grad_end)]


def _combined_all_reduce(
    program: Program,
    live: Liveness,
    sums: list[tuple[str, Spec]],
    mesh: LogicalMesh,
    cpu: bool,
) -> list[tuple[float, int, int]]:
    """Gradient sums (node, spec) left to XLA's all-reduce: XLA combines them into one after
    the last of them, so each one's partial sums live until then, and the copies of the
    reduction (`memory.reduction_copy_bytes`) are made then."""
    if not sums:
        return []
    axes = tuple(mesh.axis_names)
    combined = max(live.step_of_node[node_id] for node_id, _ in sums)
    buffers = []
    for node_id, spec in sums:
        aval = program.graph.node(node_id).out_avals[0]
        last = live.last_use.get((node_id, 0), combined)
        if last < combined:
            size = spec_bytes_per_device(aval.shape, aval.dtype.itemsize, spec, mesh)
            buffers.append((size, last + 1, combined))
        buffers.append((reduction_copy_bytes(mesh, aval, spec, axes, cpu), combined, combined))
    return buffers


def _gathered_uses(program: Program, plan: StagePlan) -> list[tuple[OpNode, int]]:
    """The parameter uses a plan gathers (stored split, used in another spec), each with the
    step input that stores its parameter."""
    params = param_inputs(program.graph)
    found = []
    for node in nodes_by_primitive(program.graph, PARAM_USE):
        use = plan.param_use_specs.get(node.params["index"])
        stored = plan.input_specs[params[node.params["index"]]]
        if use is not None and use != stored:
            found.append((node, params[node.params["index"]]))
    return found


def _gathers(
    program: Program, step: _Step, plan: StagePlan, gradients: list[_Gradient], k: int
) -> list[tuple[float, int]]:
    """The step's all-gathers as (bytes gathered, runs per step): a parameter gathered at each
    use (ZeRO-3: k runs where the use runs per micro-batch), and a parameter stored whole whose
    gradient is split, after its update (ZeRO-2)."""
    sig = program.signature
    at_uses = [
        (float(sig.input_avals[i].nbytes), k if node.id in step.per_micro_batch else 1)
        for node, i in _gathered_uses(program, plan)
    ]
    updates = [
        (float(g.nbytes), 1)
        for g in gradients
        if any(g.spec) and not any(plan.input_specs[g.param])
    ]
    return at_uses + updates


_REDUCES = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or")


def _partial_reductions(
    program: Program, step: _Step, plan: StagePlan, stage: ZeroStage, k: int
) -> list[tuple[float, int]]:
    """Reductions over a dim the plan splits that are not gradient sums (a loss's mean over the
    batch, batch norm's batch statistics, a gradient norm over split gradients): each
    all-reduces its result, as (bytes, runs per step)."""
    gradient_sums = {n for chain in gradient_chains(program.graph) for n in chain.sums}
    found = []
    for node in step.grouping.planned_nodes():
        if node.primitive not in _REDUCES or node.id in gradient_sums:
            continue
        operand = step.grouping.value_of(node.inputs[0])
        if operand is None:
            continue
        spec = _value_spec(program, step, plan, stage, operand)
        if any(spec[d] for d in node.params["axes"]):
            runs = k if node.id in step.per_micro_batch else 1
            found.append((float(node.out_avals[0].nbytes), runs))
    return found


def _summed_per_micro_batch(
    program: Program, gradients: list[_Gradient], once: list[bool]
) -> float:
    """Bytes the gradients reduced per micro-batch sum over devices per micro-batch: XLA
    reduces each sum of their chains by itself (a tied embedding's two uses twice; a sum that
    several parameters' gradients are sliced from once); a gradient without sums, whole."""
    graph = program.graph
    per_micro_batch = [g for g, o in zip(gradients, once, strict=True) if not o]
    distinct = {n for g in per_micro_batch for n in g.sums}
    return float(
        sum(graph.node(n).out_avals[0].nbytes for n in distinct)
        + sum(g.nbytes for g in per_micro_batch if not g.sums)
    )


def predict(
    program: Program,
    step: _Step,
    stage_plan: StagePlan,
    cluster: ClusterSpec,
    stage: ZeroStage,
    gradients: list[_Gradient],
    once: list[bool],
    num_micro_batches: int,
) -> Predicted:
    """Step time and memory of a data-parallel plan under the α-β cost model.

    Communication per step (bytes as the HLO's collective results count them), for k
    micro-batches, gradients of G bytes reduced once per step and of g bytes per micro-batch
    (each sum of a gradient's chain reduced by itself):
    DP all-reduce(G) + k·all-reduce(g); ZeRO-2 and ZeRO-3 reduce-scatter(G) + k·reduce-scatter(g)
    and their all-gathers (`_gathers`); every method the all-reduces of reductions over a dim it
    splits (`_partial_reductions`). Memory is the peak of the liveness model (`_memory`);
    compute adds the fresh-memory time of the temporaries (`roofline.fresh_memory_s`).
    """
    mesh = stage_plan.mesh
    lmesh = logical_mesh(cluster, mesh.shape, mesh.axis_names)
    axes = mesh.axis_names
    k = num_micro_batches
    reduced_once = float(sum(g.nbytes for g, o in zip(gradients, once, strict=True) if o))
    per_micro_batch = _summed_per_micro_batch(program, gradients, once)
    if stage is ZeroStage.DATA_PARALLEL:
        comm_bytes = reduced_once + k * per_micro_batch
        comm = lmesh.all_reduce_cost(reduced_once, axes) + k * lmesh.all_reduce_cost(
            per_micro_batch, axes
        )
    else:
        scattered = result_bytes(lmesh, Collective.REDUCE_SCATTER, 1.0, axes)  # per byte summed
        comm_bytes = (reduced_once + k * per_micro_batch) * scattered
        comm = lmesh.reduce_scatter_cost(reduced_once, axes) + k * lmesh.reduce_scatter_cost(
            per_micro_batch, axes
        )
    for nbytes, runs in _gathers(program, step, stage_plan, gradients, k):
        comm_bytes += runs * result_bytes(lmesh, Collective.ALL_GATHER, nbytes, axes)
        comm += runs * lmesh.all_gather_cost(nbytes, axes)
    for nbytes, runs in _partial_reductions(program, step, stage_plan, stage, k):
        comm_bytes += runs * result_bytes(lmesh, Collective.ALL_REDUCE, nbytes, axes)
        comm += runs * lmesh.all_reduce_cost(nbytes, axes)
    cpu = cluster.platform == "cpu"
    memory, stored = _memory(program, step, stage_plan, stage, lmesh, cpu, k)
    roofline = Roofline(step.grouping, step.live.fused, cluster)
    flops, compute = _compute(step, roofline, stage, mesh.num_devices, k)
    compute += fresh_memory_s(memory - stored, cluster)
    kernels = roofline.num_kernels(step.grouping.planned_nodes())
    host = launch_s(program.signature.num_buffers, kernels, cluster)
    return Predicted(
        step_time_s=compute + comm + host,
        compute_s=compute,
        communication_s=comm,
        memory_per_device_bytes=memory,
        communication_bytes=comm_bytes,
        flops=flops,
        host_s=host,
    )


def _compute(
    step: _Step, roofline: Roofline, stage: ZeroStage, n: int, k: int
) -> tuple[float, float]:
    """(FLOPs of the step over all devices, seconds per device): each op's roofline, run k times
    in the gradient part. An op touching the batch runs on 1/n of it; the update runs on 1/n of
    the state where ZeRO splits it, on all of it under data parallelism; parameters are read
    whole (ZeRO-3 gathers them before use)."""
    grouping, batch = step.grouping, step.batch
    flops = seconds = 0.0
    for node in grouping.planned_nodes():
        per_micro_batch = node.id in step.per_micro_batch
        runs = k if per_micro_batch else 1
        values = [grouping.value_of(ref) for ref in node.inputs]
        outputs = [(node.id, o) for o in range(len(node.out_avals))]
        split_update = not per_micro_batch and stage is not ZeroStage.DATA_PARALLEL
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
