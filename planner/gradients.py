"""Where gradients are summed over the batch, so that the sum can be reduce-scattered.

A gradient wanted split (ZeRO/FSDP) is a sum over the batch: a `dot_general` contracting the
batch, a `reduce_sum` over it, or a `scatter-add` of per-example updates (an embedding). XLA's GPU
pipeline turns "all-reduce, then keep my slice" into a reduce-scatter; its CPU pipeline does not. So
the plan says it directly: compute that node on local shards of the contracted dimension and
reduce-scatter the partial sums (`ReduceScatterLowering`). Walking from the gradient back to those
nodes passes through layout-only nodes (transpose, convert, copy, reshapes that only add or drop
size-1 dims, sums over size-1 dims) and sums (`add_any`).
"""

from __future__ import annotations

from collections.abc import Iterable

from autopar.planner.graph import OpGraph, OpNode, ValueRef
from autopar.planner.plan import ReduceScatterLowering, Spec, replicated

_SAME_LAYOUT = ("convert_element_type", "copy", "copy_p")


def _split(ndim: int, dim: int, axes: tuple[str, ...]) -> Spec:
    spec = list(replicated(ndim))
    spec[dim] = axes
    return tuple(spec)


def _first_divisible(dims: Iterable[int], shape: tuple[int, ...], n: int) -> int | None:
    return next((d for d in dims if shape[d] % n == 0), None)


def _dot_lowering(node: OpNode, out_spec: Spec, axes, n) -> ReduceScatterLowering | None:
    (lhs_contract, rhs_contract), _ = node.params["dimension_numbers"]
    lhs, rhs = node.in_avals
    for lc, rc in zip(lhs_contract, rhs_contract, strict=True):
        if lhs.shape[lc] % n == 0:
            return ReduceScatterLowering(
                operand_specs=(_split(len(lhs.shape), lc, axes), _split(len(rhs.shape), rc, axes)),
                output_spec=out_spec,
                partial_axes=axes,
            )
    return None


def _reduce_sum_lowering(node: OpNode, out_spec: Spec, axes, n) -> ReduceScatterLowering | None:
    (operand,) = node.in_avals
    dim = _first_divisible(node.params["axes"], operand.shape, n)
    if dim is None:
        return None
    return ReduceScatterLowering((_split(len(operand.shape), dim, axes),), out_spec, axes)


def _scatter_add_lowering(node: OpNode, out_spec: Spec, axes, n) -> ReduceScatterLowering | None:
    numbers = node.params["dimension_numbers"]
    if numbers.operand_batching_dims:
        return None
    operand, indices, updates = node.in_avals
    update_scatter_dims = [
        d for d in range(len(updates.shape)) if d not in numbers.update_window_dims
    ]
    index_batch_dims = list(range(len(indices.shape) - 1))  # jax puts the index vector last
    if len(update_scatter_dims) != len(index_batch_dims):
        return None
    for u, i in zip(update_scatter_dims, index_batch_dims, strict=True):
        if updates.shape[u] % n == 0:
            return ReduceScatterLowering(
                operand_specs=(
                    replicated(len(operand.shape)),
                    _split(len(indices.shape), i, axes),
                    _split(len(updates.shape), u, axes),
                ),
                output_spec=out_spec,
                partial_axes=axes,
            )
    return None


def _squeeze_map(in_shape, out_shape, out_spec: Spec) -> Spec | None:
    """The input spec of a reshape that only adds or drops size-1 dims; None for other reshapes."""
    in_dims = [d for d, size in enumerate(in_shape) if size != 1]
    out_dims = [d for d, size in enumerate(out_shape) if size != 1]
    if [in_shape[d] for d in in_dims] != [out_shape[d] for d in out_dims]:
        return None
    in_spec: list = [None] * len(in_shape)
    for i, o in zip(in_dims, out_dims, strict=True):
        in_spec[i] = out_spec[o]
    return tuple(in_spec)


_LOWERINGS = {
    "dot_general": _dot_lowering,
    "reduce_sum": _reduce_sum_lowering,
    "scatter-add": _scatter_add_lowering,
    "scatter_add": _scatter_add_lowering,
}


def reduce_scatter_lowerings(
    graph: OpGraph, targets: Iterable[tuple[ValueRef, Spec]], num_devices: int
) -> dict[str, ReduceScatterLowering]:
    """For each (gradient value, wanted split spec), the nodes to compute as local partial sums."""
    found: dict[str, ReduceScatterLowering] = {}

    def visit(ref: ValueRef, spec: Spec) -> None:
        node = graph.producer(ref)
        if node is None or node.id in found:
            return
        axes = next((entry for entry in spec if entry), None)
        if axes is None:
            return
        if node.primitive in _SAME_LAYOUT:
            visit(node.inputs[0], spec)
        elif node.primitive == "transpose":
            perm = node.params["permutation"]
            in_spec = [None] * len(perm)
            for out_dim, in_dim in enumerate(perm):
                in_spec[in_dim] = spec[out_dim]
            visit(node.inputs[0], tuple(in_spec))
        elif node.primitive == "reduce_sum" and all(
            node.in_avals[0].shape[d] == 1 for d in node.params["axes"]
        ):  # summing over size-1 dims only drops them
            in_spec = list(spec)
            for d in sorted(node.params["axes"]):
                in_spec.insert(d, None)
            visit(node.inputs[0], tuple(in_spec))
        elif node.primitive == "reshape":
            in_spec = _squeeze_map(node.in_avals[0].shape, node.out_avals[0].shape, spec)
            if in_spec is not None:
                visit(node.inputs[0], in_spec)
        elif node.primitive == "add_any":
            for operand in node.inputs:
                visit(operand, spec)
        elif node.primitive in _LOWERINGS:
            lowering = _LOWERINGS[node.primitive](node, spec, axes, num_devices)
            if lowering is not None:
                found[node.id] = lowering

    for ref, spec in targets:
        visit(ref, spec)
    return found
