"""Where gradients are summed over the batch, so that the sums can be lowered explicitly.

A gradient is a sum over the batch: a `dot_general` contracting the batch, a `reduce_sum` over
it, or a `scatter-add` of per-example updates (an embedding). Walking from the gradient back to
those nodes passes through layout-only nodes (transpose, convert, copy, reshapes that only add or
drop size-1 dims, sums over size-1 dims) and sums (`add_any`): the gradient's *chain*.

Two lowerings (`PartialSumLowering`) compute such a node on local shards of the contracted
dimension and sum the partial results over the mesh axes themselves:

* per micro-batch, reduce-scattered: XLA's GPU pipeline turns "all-reduce, then keep my slice"
  into a reduce-scatter, its CPU pipeline does not, so the plan says it directly;
* once per step: with gradient accumulation, each device adds up its own partial sums over the
  micro-batches and the step reduces them once after the last one (what Alpa's XLA fork did with
  its gradient-accumulation rewrite). Exact only where every sum of the chain is lowered so and
  nothing else reads the chain (`GradientChain.complete`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from autopar.planner.graph import (
    OpGraph,
    OpNode,
    ValueKind,
    ValueRef,
    nodes_by_primitive,
    resolve_input,
)
from autopar.planner.markers import GRAD_BOUNDARY, PARAM_USE
from autopar.planner.plan import (
    ONCE_PER_STEP,
    PER_MICRO_BATCH,
    PartialSumLowering,
    Spec,
    replicated,
)

_SAME_LAYOUT = ("convert_element_type", "copy", "copy_p")
# Primitives whose partial sums `runtime.interpreter` can lower (compute locally, sum explicitly).
SUM_PRIMITIVES = ("dot_general", "reduce_sum", "scatter-add", "scatter_add")


@dataclasses.dataclass(frozen=True)
class GradientChain:
    """The nodes a gradient (operand `position` of the gradient boundary) is computed through.

    `sums` are the chain's leaves that sum over the batch; `complete` says that every leaf is
    such a sum and that nothing but the chain reads any of its nodes, so partial sums can travel
    it unreduced."""

    boundary: str  # the gradient boundary node
    position: int  # the gradient's operand there
    grad_of: int  # the parameter index (of `autopar.grad`)
    nodes: tuple[str, ...]
    sums: tuple[str, ...]
    complete: bool


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


def _is_size_one_sum(node: OpNode) -> bool:
    return node.primitive == "reduce_sum" and all(
        node.in_avals[0].shape[d] == 1 for d in node.params["axes"]
    )


def passes_through(node: OpNode) -> bool:
    """Whether a gradient keeps its layout through `node` (see the module docstring)."""
    if node.primitive in (*_SAME_LAYOUT, "transpose", "add_any") or _is_size_one_sum(node):
        return True
    return node.primitive == "reshape" and _only_size_one_changes(
        node.in_avals[0].shape, node.out_avals[0].shape
    )


def _only_size_one_changes(in_shape, out_shape) -> bool:
    return [s for s in in_shape if s != 1] == [s for s in out_shape if s != 1]


def gradient_chains(graph: OpGraph) -> list[GradientChain]:
    """The chain of every gradient operand of the gradient boundary (module docstring)."""
    outputs = {ref.node for ref in graph.outputs if ref.kind is ValueKind.NODE}
    chains = []
    for boundary in nodes_by_primitive(graph, GRAD_BOUNDARY):
        for position, (ref, of) in enumerate(
            zip(boundary.inputs, boundary.params["grad_of"], strict=True)
        ):
            if of < 0:
                continue
            nodes: list[str] = []
            sums: list[str] = []
            complete = ref.kind is ValueKind.NODE
            stack = [ref] if complete else []
            while stack:
                node = graph.producer(stack.pop())
                if node is None:
                    complete = False
                    continue
                nodes.append(node.id)
                if len(graph.consumers(node.id)) != 1 or node.id in outputs:
                    complete = False
                if node.primitive in SUM_PRIMITIVES and not _is_size_one_sum(node):
                    sums.append(node.id)
                elif passes_through(node):
                    stack.extend(node.inputs)
                else:
                    complete = False
            chains.append(
                GradientChain(boundary.id, position, of, tuple(nodes), tuple(sums), complete)
            )
    return chains


def _split(ndim: int, dim: int, axes: tuple[str, ...]) -> Spec:
    spec = list(replicated(ndim))
    spec[dim] = axes
    return tuple(spec)


def _first_divisible(dims: Iterable[int], shape: tuple[int, ...], n: int) -> int | None:
    return next((d for d in dims if shape[d] % n == 0), None)


def _dot_lowering(node: OpNode, out_spec: Spec, axes, n) -> PartialSumLowering | None:
    (lhs_contract, rhs_contract), _ = node.params["dimension_numbers"]
    lhs, rhs = node.in_avals
    for lc, rc in zip(lhs_contract, rhs_contract, strict=True):
        if lhs.shape[lc] % n == 0:
            return PartialSumLowering(
                operand_specs=(_split(len(lhs.shape), lc, axes), _split(len(rhs.shape), rc, axes)),
                output_spec=out_spec,
                partial_axes=axes,
            )
    return None


def _reduce_sum_lowering(node: OpNode, out_spec: Spec, axes, n) -> PartialSumLowering | None:
    (operand,) = node.in_avals
    dim = _first_divisible(node.params["axes"], operand.shape, n)
    if dim is None:
        return None
    return PartialSumLowering((_split(len(operand.shape), dim, axes),), out_spec, axes)


def _scatter_add_lowering(node: OpNode, out_spec: Spec, axes, n) -> PartialSumLowering | None:
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
            return PartialSumLowering(
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
    if not _only_size_one_changes(in_shape, out_shape):
        return None
    in_dims = [d for d, size in enumerate(in_shape) if size != 1]
    out_dims = [d for d, size in enumerate(out_shape) if size != 1]
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


def _sum_specs(graph: OpGraph, ref: ValueRef, spec: Spec) -> dict[str, Spec]:
    """The output spec of each sum node of a gradient's chain, given the gradient's `spec`."""
    found: dict[str, Spec] = {}

    def visit(ref: ValueRef, spec: Spec) -> None:
        node = graph.producer(ref)
        if node is None or node.id in found:
            return
        if node.primitive in _SAME_LAYOUT:
            visit(node.inputs[0], spec)
        elif node.primitive == "transpose":
            perm = node.params["permutation"]
            in_spec: list = [None] * len(perm)
            for out_dim, in_dim in enumerate(perm):
                in_spec[in_dim] = spec[out_dim]
            visit(node.inputs[0], tuple(in_spec))
        elif _is_size_one_sum(node):  # summing over size-1 dims only drops them
            in_spec = list(spec)
            for d in sorted(node.params["axes"]):
                in_spec.insert(d, None)
            visit(node.inputs[0], tuple(in_spec))
        elif node.primitive == "reshape":
            squeezed = _squeeze_map(node.in_avals[0].shape, node.out_avals[0].shape, spec)
            if squeezed is not None:
                visit(node.inputs[0], squeezed)
        elif node.primitive == "add_any":
            for operand in node.inputs:
                visit(operand, spec)
        elif node.primitive in _LOWERINGS:
            found[node.id] = spec

    visit(ref, spec)
    return found


def partial_sum_lowerings(
    graph: OpGraph,
    targets: Iterable[tuple[ValueRef, Spec, bool]],
    axes: tuple[str, ...],
    num_devices: int,
) -> dict[str, PartialSumLowering]:
    """For each (gradient, its spec, once per step?): the sums of its chain to lower, with the
    batch split over `axes` (`num_devices` devices). Once per step where asked and the chain is
    complete; otherwise reduce-scattered per micro-batch where the gradient is split, and left
    to XLA (an all-reduce) where it is not."""
    complete = {c.nodes[0]: c.complete for c in gradient_chains(graph) if c.nodes}
    found: dict[str, PartialSumLowering] = {}
    for ref, spec, once in targets:
        sums = _sum_specs(graph, ref, spec)
        lowerings = {
            node_id: _LOWERINGS[graph.node(node_id).primitive](
                graph.node(node_id), node_spec, axes, num_devices
            )
            for node_id, node_spec in sums.items()
        }
        once = once and complete.get(ref.node, False) and None not in lowerings.values()
        for node_id, lowering in lowerings.items():
            if lowering is not None and once:
                found[node_id] = dataclasses.replace(lowering, once_per_step=True)
            elif lowering is not None and any(sums[node_id]):
                found[node_id] = lowering
    return found


def gradient_reduction(
    graph: OpGraph, summed: set[str], once: set[str], input_paths: tuple[str, ...]
) -> dict[str, str]:
    """For each parameter (input path) whose gradient chain has sums over devices (`summed`):
    ONCE_PER_STEP if all of them are reduced once per step (`once`), else PER_MICRO_BATCH."""
    params = param_inputs(graph)
    found = {}
    for chain in gradient_chains(graph):
        sums = set(chain.sums) & summed
        if sums and chain.grad_of in params:
            how = ONCE_PER_STEP if sums <= once and set(chain.sums) <= once else PER_MICRO_BATCH
            found[input_paths[params[chain.grad_of]]] = how
    return found


def gradient_part(graph: OpGraph) -> set[str]:
    """Nodes the gradient boundary depends on: they run once per micro-batch."""
    found: set[str] = set()
    stack = [r for b in nodes_by_primitive(graph, GRAD_BOUNDARY) for r in b.inputs]
    while stack:
        ref = stack.pop()
        if ref.kind is ValueKind.NODE and ref.node not in found:
            found.add(ref.node)
            stack.extend(graph.node(ref.node).inputs)
    return found
