"""Per-device memory of a plan: which buffers exist, when they are live, and how big they are.

The model mirrors XLA's compiled memory analysis, so that predictions can be held against
`Executable.memory_stats()`: peak = arguments + outputs that do not reuse a donated argument +
the most temporary bytes live at any step. Steps are the graph's nodes in program order.

XLA fuses chains of element-wise ops, so their intermediates never exist as buffers. A node's
output is *materialized* unless it is an element-wise/layout op whose single reader fuses it
(another element-wise/layout op or a reduction), or an op that only relabels its operand's buffer
(`_ALIASES`), which extends that buffer's life instead. Element-wise ops of scalars (a broadcast
constant, an iota) are never materialized: XLA fuses them into every reader. Nor is a broadcast
whose readers all fuse their operands (a causal mask broadcast to every head): XLA duplicates
broadcasts into each fusion rather than keep the large result.
"""

from __future__ import annotations

import dataclasses

from autopar.markers import GRAD_BOUNDARY
from autopar.planner.follow_rules import ELEMENTWISE
from autopar.planner.graph import OpNode, TensorInfo, nodes_by_primitive
from autopar.planner.groups import Grouping, Value
from autopar.planner.program import StepSignature

# Ops whose output is their operand's buffer (no copy): markers, bitcasts, layout folded into use.
_ALIASES = frozenset({"autopar_param_use", "reshape", "squeeze", "transpose"})
_FUSED = frozenset(ELEMENTWISE) | {"broadcast_in_dim", "reshape", "squeeze", "iota"}
_FUSES_OPERANDS = _FUSED | {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "transpose",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Liveness:
    """Temporary buffers as (value, first step, last step), plus the step count and the outputs.

    Arguments are live throughout and are not listed; `outputs` are the values the step returns
    that do not reuse a donated argument's buffer. `step_of_node` is the schedule.
    """

    temporaries: tuple[tuple[Value, int, int], ...]
    num_steps: int
    outputs: tuple[Value, ...]
    step_of_node: dict[str, int]
    last_use: dict[Value, int]


def schedule(grouping: Grouping) -> list[OpNode]:
    """Program order, except that what follows the gradients (the update) runs as early as it can.

    XLA's scheduler updates each parameter as soon as its gradient exists, which frees the
    gradient; the jaxpr computes every gradient first. Memory follows XLA's order.
    """
    nodes = list(grouping.planned_nodes())
    graph = grouping.graph
    after_grads = {
        reader
        for b in nodes_by_primitive(graph, GRAD_BOUNDARY)
        for reader, _ in graph.consumers(b.id)
    }
    time: dict[str, float] = {}
    keys = []
    for index, node in enumerate(nodes):
        if node.id in after_grads:
            producers = [
                time[v[0]] for r in node.inputs if (v := grouping.value_of(r)) and v[0] is not None
            ]
            time[node.id] = max(producers, default=-1.0)
            after_grads.update(reader for reader, _ in graph.consumers(node.id))
        else:
            time[node.id] = float(index)
        keys.append((time[node.id], index))
    return [nodes[i] for _, i in sorted(keys)]


def liveness(grouping: Grouping, signature: StepSignature) -> Liveness:
    """Live ranges of the materialized temporary buffers of the step, in `schedule` order."""
    nodes = schedule(grouping)
    step_of = {n.id: t for t, n in enumerate(nodes)}
    graph = grouping.graph
    buffer: dict[Value, Value] = {}  # value -> the value whose buffer it is (through aliases)
    readers: dict[Value, list[str]] = {}
    for n in nodes:
        operands = [grouping.value_of(ref) for ref in n.inputs]
        for value in operands:
            if value is not None:
                readers.setdefault(buffer.get(value, value), []).append(n.id)
        if n.primitive in _ALIASES and operands[0] is not None:
            buffer[(n.id, 0)] = buffer.get(operands[0], operands[0])
    outputs = [grouping.value_of(ref) for ref in graph.outputs]
    output_set = {buffer.get(v, v) for v in outputs if v is not None}
    aliased = {
        outputs[j]
        for j, i in enumerate(signature.output_to_input)
        if i is not None and i in signature.donated_inputs
    }
    temporaries = []
    for n in nodes:
        for o in range(len(n.out_avals)):
            value = (n.id, o)
            if value in buffer or value in output_set:
                continue
            users = readers.get(value, [])
            if not users:
                continue
            fusing = all(graph.node(u).primitive in _FUSES_OPERANDS for u in users)
            fused = n.primitive in _FUSED and (
                all(not a.shape for a in n.in_avals)  # a constant: XLA recomputes it at each use
                or (fusing and (len(users) == 1 or n.primitive == "broadcast_in_dim"))
            )
            if not fused:
                temporaries.append((value, step_of[n.id], max(step_of[u] for u in users)))
    extra_outputs = tuple(
        v
        for j, v in enumerate(outputs)
        if v is not None and v not in aliased and v not in outputs[:j]
    )
    last_use = {v: max(step_of[u] for u in users) for v, users in readers.items()}
    return Liveness(tuple(temporaries), len(nodes), extra_outputs, step_of, last_use)


def value_aval(grouping: Grouping, value: Value) -> TensorInfo:
    node, i = value
    if node is None:
        return grouping.graph.inputs[i]
    return grouping.graph.node(node).out_avals[i]
