"""Gradients of a step differentiated without `autopar.grad`, found in its data flow and marked.

A parameter's gradient is a sum over the batch (`gradients.SUM_PRIMITIVES` reading a value that
carries the batch dim, with a result that does not), carried through layout-only ops and sums
(`gradients.passes_through`) to its *root*: the value the update reads. The root belongs to the
parameter whose new value (the step output that replaces it) it reaches through ops of the
parameter's shape only (the update: SGD, Adam's moments, weight decay; a global norm's scale
goes through a scalar and does not count), where the batch computation reads that parameter
(which tells it from optimizer state of the same shape).

The step's jaxpr is then rewritten with the markers `autopar.grad` leaves: a parameter use at
the top for each parameter found (read by everything before the gradients) and one gradient
boundary on the roots. Every method then plans and prices a `jax.grad` step as it does the same
step written with `autopar.grad` without regathering (ZeRO-3 keeps the forward pass's gathered
parameters for the backward pass, as XLA does for a plain step). The markers lower to nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from jax.extend.core import ClosedJaxpr, Jaxpr, Var, new_jaxpr_eqn

from autopar.planner.batch_dims import batch_dims
from autopar.planner.cost import LogicalMesh
from autopar.planner.gradients import SUM_PRIMITIVES, passes_through
from autopar.planner.graph import OpGraph, ValueKind, ValueRef, graph_with_refs
from autopar.planner.groups import group_graph
from autopar.planner.markers import GRAD_BOUNDARY, grad_boundary_p, param_use_p

logger = logging.getLogger(__name__)

# Beside the sums autopar lowers itself: a convolution's weight gradient (it contracts the
# batch) and loops (a scanned backward pass), each of whose results may be a sum.
_ALSO_SUMS = ("conv_general_dilated", "scan", "while")
# One device is enough to follow the batch dim: every size divides it.
_ONE_DEVICE = LogicalMesh((1,), ("batch",), (1.0,), (0.0,))


@dataclasses.dataclass(frozen=True)
class FoundGradient:
    """A gradient found in the data flow: its root (what the update reads) and its parameter."""

    root: ValueRef
    param: int  # the step input that stores the parameter


def _batch_sums(graph: OpGraph, batch_inputs: Sequence[int]) -> list[ValueRef]:
    """Results that sum over the batch: of a sum node (or `_ALSO_SUMS`) that reads a value
    carrying the batch dim and does not carry it itself."""
    grouping = group_graph(graph)
    batch = batch_dims(grouping, batch_inputs, _ONE_DEVICE, 0)
    found = []
    for node in grouping.planned_nodes():
        if node.primitive not in (*SUM_PRIMITIVES, *_ALSO_SUMS):
            continue
        outputs = range(1 if node.primitive in SUM_PRIMITIVES else len(node.out_avals))
        if any(grouping.value_of(ref) in batch for ref in node.inputs):
            found += [
                ValueRef(ValueKind.NODE, o, node.id) for o in outputs if (node.id, o) not in batch
            ]
    return found


def _root(graph: OpGraph, ref: ValueRef) -> ValueRef:
    """Where a sum stops passing through layout-only ops and sums of one reader."""
    while True:
        readers = graph.consumers(ref.node)
        if len(readers) != 1 or ref in graph.outputs:
            return ref
        reader = graph.node(readers[0][0])
        if not passes_through(reader) or len(reader.out_avals) != 1:
            return ref
        ref = ValueRef(ValueKind.NODE, 0, reader.id)


def _read_inputs(graph: OpGraph, node_ids: Sequence[str]) -> set[int]:
    """The step inputs the nodes `node_ids` depend on."""
    found: set[int] = set()
    seen: set[str] = set()
    stack = list(node_ids)
    while stack:
        node_id = stack.pop()
        if node_id in seen:
            continue
        seen.add(node_id)
        for ref in graph.node(node_id).inputs:
            if ref.kind is ValueKind.INPUT:
                found.add(ref.index)
            elif ref.kind is ValueKind.NODE:
                stack.append(ref.node)
    return found


def _outputs_reached(graph: OpGraph, root: ValueRef) -> set[int]:
    """The step outputs `root` reaches through ops whose result has its shape."""
    shape = graph.node(root.node).out_avals[root.index].shape
    position = {ref: j for j, ref in enumerate(graph.outputs)}
    reached: set[int] = set()
    seen: set[str] = set()
    stack = [root]
    while stack:
        ref = stack.pop()
        if ref in position:
            reached.add(position[ref])
        for reader, _ in graph.consumers(ref.node):
            node = graph.node(reader)
            if reader in seen or len(node.out_avals) != 1 or node.out_avals[0].shape != shape:
                continue
            seen.add(reader)
            stack.append(ValueRef(ValueKind.NODE, 0, reader))
    return reached


def find_gradients(
    graph: OpGraph, batch_inputs: Sequence[int], output_to_input: Sequence[int | None]
) -> list[FoundGradient]:
    """Each parameter's gradient root (module docstring); a parameter with none or with
    several is left out."""
    sums = _batch_sums(graph, batch_inputs)
    read = _read_inputs(graph, [ref.node for ref in sums]) - set(batch_inputs)
    roots = list(dict.fromkeys(_root(graph, s) for s in sums))
    by_param: dict[int, list[ValueRef]] = {}
    for root in roots:
        shape = graph.node(root.node).out_avals[root.index].shape
        for j in _outputs_reached(graph, root):
            param = output_to_input[j]
            if param in read and graph.inputs[param].shape == shape:
                by_param.setdefault(param, []).append(root)
    found = []
    for param, candidates in sorted(by_param.items()):
        if len(set(candidates)) == 1:
            found.append(FoundGradient(candidates[0], param))
        else:
            logger.debug("input %d: %d gradient roots reach its update", param, len(candidates))
    return found


def _eqn_index(node_id: str) -> int:
    """The top-level eqn a graph node comes from (nodes of an inlined body are `j/...`)."""
    return int(node_id.split("/", 1)[0])


def mark_found_gradients(
    closed: ClosedJaxpr, batch_inputs: Sequence[int], output_to_input: Sequence[int | None]
) -> ClosedJaxpr:
    """`closed` with the markers of the gradients found in it (module docstring); unchanged
    where it has a gradient boundary already or no gradient is found."""
    jaxpr = closed.jaxpr
    if any(eqn.primitive.name == GRAD_BOUNDARY for eqn in jaxpr.eqns):
        return closed
    graph, env = graph_with_refs(closed)
    var_of = {ref: v for v, ref in env.items() if isinstance(v, Var) and ref.kind is ValueKind.NODE}
    found = [g for g in find_gradients(graph, batch_inputs, output_to_input) if g.root in var_of]
    first_reader = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, Var):
                first_reader.setdefault(v, i)
    found.sort(key=lambda g: _eqn_index(g.root.node))
    # The boundary goes after the last root; a root read before that point is left unmarked.
    while found:
        position = _eqn_index(found[-1].root.node) + 1
        if all(first_reader.get(var_of[g.root], position) >= position for g in found):
            break
        found.pop()
    if not found:
        return closed
    logger.info("found %d parameter gradients in a step without autopar.grad", len(found))
    return ClosedJaxpr(_marked(jaxpr, found, var_of, position), closed.consts)


def _marked(
    jaxpr: Jaxpr, found: Sequence[FoundGradient], var_of: dict[ValueRef, Var], position: int
) -> Jaxpr:
    """The rewrite of `mark_found_gradients`: parameter uses first, the boundary at `position`."""
    params = sorted({g.param for g in found})
    index = {param: k for k, param in enumerate(params)}
    uses, used = [], {}
    for param in params:
        stored = jaxpr.invars[param]
        used[stored] = Var(stored.aval)
        uses.append(
            new_jaxpr_eqn([stored], [used[stored]], param_use_p, {"index": index[param]}, set())
        )
    roots = [var_of[g.root] for g in found]
    marked = {v: Var(v.aval) for v in roots}
    boundary = new_jaxpr_eqn(
        roots,
        [marked[v] for v in roots],
        grad_boundary_p,
        {"grad_of": tuple(index[g.param] for g in found)},
        set(),
    )

    def read(eqn, renames):
        return eqn.replace(
            invars=[renames.get(v, v) if isinstance(v, Var) else v for v in eqn.invars]
        )

    before = [read(eqn, used) for eqn in jaxpr.eqns[:position]]
    after = [read(eqn, marked) for eqn in jaxpr.eqns[position:]]
    outvars = [marked.get(v, v) if isinstance(v, Var) else v for v in jaxpr.outvars]
    return jaxpr.replace(eqns=[*uses, *before, boundary, *after], outvars=outvars)
