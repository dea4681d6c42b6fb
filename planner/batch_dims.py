"""Which dimension of each value is the batch dimension (for forcing data parallelism on an axis).

Alpa's `force_batch_dim_to_mesh_dim` keeps only the strategies that split every op's batch
dimension over one mesh axis, so a 2-D logical mesh (dp, mp) means data parallel over dp and
model parallel over mp, and the ILP only chooses the model-parallel part. That needs the batch
dimension of every value: it starts at dim 0 of the batch inputs and is carried forward by
splitting that dim over the forced axis and letting each op's follow rule say where the split
lands (so it only travels where it divides and needs no resharding). Heavy ops that have no
follow rule map it by their dimension numbers (dot_general, convolution, gather).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from autopar.planner.cost import LogicalMesh
from autopar.planner.graph import OpNode
from autopar.planner.groups import Grouping, Value, input_value
from autopar.planner.sharding_rules import FOLLOW_RULES
from autopar.planner.strategy import divides, make_spec

logger = logging.getLogger(__name__)


def batch_dims(
    grouping: Grouping, batch_inputs: Iterable[int], mesh: LogicalMesh, axis: int
) -> dict[Value, int]:
    """The batch dim of every value derived from the batch inputs' leading dim, where that dim
    splits evenly over mesh axis `axis` all the way; values without one are absent."""
    graph = grouping.graph
    name = mesh.axis_names[axis]
    found: dict[Value, int] = {}
    for i in batch_inputs:
        shape = graph.inputs[i].shape
        if shape and divides(shape[0], (name,), mesh):
            found[input_value(i)] = 0
    for node in grouping.planned_nodes():
        for pos, ref in enumerate(node.inputs):
            value = grouping.value_of(ref)
            if value is None or value not in found:
                continue
            outputs = _output_batch_dims(node, pos, found[value], name, mesh)
            for o, dim in enumerate(outputs):
                if dim is not None and divides(node.out_avals[o].shape[dim], (name,), mesh):
                    found[(node.id, o)] = dim
            if any(d is not None for d in outputs):
                break
    return found


def _output_batch_dims(
    node: OpNode, operand: int, dim: int, axis: str, mesh: LogicalMesh
) -> list[int | None]:
    """Where operand `operand`'s batch dim `dim` lands in each output (None: nowhere)."""
    rule = _MAPPERS.get(node.primitive)
    if rule is not None:
        return [rule(node, operand, dim)] + [None] * (len(node.out_avals) - 1)
    follow = FOLLOW_RULES.get(node.primitive)
    if follow is not None:
        spec = make_spec(len(node.in_avals[operand].shape), {dim: (axis,)})
        strategy = follow(node, operand, spec, mesh)
        if strategy is not None:
            return [_dim_of(out, axis) for out in strategy.out_specs]
    # Unknown ops: an output of the operand's rank and batch size keeps the dim.
    size, rank = node.in_avals[operand].shape[dim], len(node.in_avals[operand].shape)
    return [
        dim if len(out.shape) == rank and out.shape[dim] == size else None for out in node.out_avals
    ]


def _dim_of(spec, axis: str) -> int | None:
    return next((d for d, entry in enumerate(spec) if entry == (axis,)), None)


def _dot_general(node: OpNode, operand: int, dim: int) -> int | None:
    (contract, batch) = node.params["dimension_numbers"]
    if operand > 1:
        return None
    if dim in contract[operand]:
        return None  # summed over the batch (e.g. a weight gradient): no batch dim left
    if dim in batch[operand]:
        return list(batch[operand]).index(dim)
    free = [
        d
        for d in range(len(node.in_avals[operand].shape))
        if d not in contract[operand] and d not in batch[operand]
    ]
    offset = len(batch[0])
    if operand == 1:
        offset += len(node.in_avals[0].shape) - len(contract[0]) - len(batch[0])
    return offset + free.index(dim)


def _convolution(node: OpNode, operand: int, dim: int) -> int | None:
    numbers = node.params["dimension_numbers"]
    if operand != 0 or dim != numbers.lhs_spec[0]:
        return None
    return numbers.out_spec[0]


def _gather(node: OpNode, operand: int, dim: int) -> int | None:
    numbers = node.params["dimension_numbers"]
    out_rank = len(node.out_avals[0].shape)
    batch_out = [d for d in range(out_rank) if d not in numbers.offset_dims]
    if operand == 1:  # an indices dim (the last one holds the index vector)
        indices_rank = len(node.in_avals[1].shape)
        return batch_out[dim] if dim < indices_rank - 1 else None
    if operand == 0 and dim in numbers.operand_batching_dims:
        k = numbers.operand_batching_dims.index(dim)
        return batch_out[numbers.start_indices_batching_dims[k]]
    return None


def _scatter(node: OpNode, operand: int, dim: int) -> int | None:
    """Where a scatter keeps a batch dim (the dims its leader rule splits with the output): an
    operand batching dim, or the index and update dims that go with one; a whole-window operand
    dim, or the update window dim that goes with one."""
    numbers = node.params["dimension_numbers"]
    operand_aval, _, updates = node.in_avals
    excluded = {*numbers.inserted_window_dims, *numbers.operand_batching_dims}
    window = [d for d in range(len(operand_aval.shape)) if d not in excluded]
    whole = {
        d: u
        for d, u in zip(window, numbers.update_window_dims, strict=True)
        if d not in numbers.scatter_dims_to_operand_dims
        and updates.shape[u] == operand_aval.shape[d]
    }
    if operand == 0:
        return dim if dim in numbers.operand_batching_dims or dim in whole else None
    if operand == 2 and dim in numbers.update_window_dims:
        return next((d for d, u in whole.items() if u == dim), None)
    scatter = [d for d in range(len(updates.shape)) if d not in numbers.update_window_dims]
    index = dim if operand == 1 else scatter.index(dim)
    if index not in numbers.scatter_indices_batching_dims:
        return None
    return numbers.operand_batching_dims[numbers.scatter_indices_batching_dims.index(index)]


_MAPPERS = {
    "dot_general": _dot_general,
    "conv_general_dilated": _convolution,
    "gather": _gather,
    **dict.fromkeys(
        ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"),
        _scatter,
    ),
}
