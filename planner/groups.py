"""Merge follower ops into the op they follow, and find groups that repeat (identical layers).

The ILP decides one strategy per *group*: a leader (a step input, or a heavy op such as
dot_general) plus the cheap ops that follow it (element-wise, reshape, reduce, ...; those with a
`FOLLOW_RULES` entry and no `LEADER_RULES` one). A follower follows its largest operand (ties:
the one computed last), so chains of cheap ops ride on the heavy op that feeds them, as in
Alpa's graph simplification.

Groups whose structure and neighbourhood are identical (the same layer repeated) get the same
*class*, found by Weisfeiler-Lehman hashing of the op graph; the ILP gives a class one set of
strategy variables, so a 24-layer model costs about as much to solve as a few layers.

Identity markers that pass many values through (the gradient and layer boundaries,
`optimization_barrier`) are transparent: their outputs are their operands' values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

from autopar.planner.graph import OpGraph, OpNode, ValueKind, ValueRef
from autopar.planner.markers import GRAD_BOUNDARY, LAYER_BOUNDARY, PARAM_USE, PIPELINE_BOUNDARY
from autopar.planner.sharding_rules import FOLLOW_RULES, LEADER_RULES

TRANSPARENT = (GRAD_BOUNDARY, LAYER_BOUNDARY, PIPELINE_BOUNDARY, "optimization_barrier")
# Params that name *which* value an op is about, not what it does: layers that differ only in
# them are the same layer.
_IDENTITY_PARAMS = {PARAM_USE: frozenset({"index"})}

Value = tuple[str, int] | tuple[None, int]
"""A value: (node id, output index), or (None, i) for step input i."""


def input_value(i: int) -> Value:
    return (None, i)


@dataclasses.dataclass(slots=True)
class Group:
    """A leader and its followers. `follows[node]` is the operand position a follower keeps."""

    index: int
    leader: str | int  # node id, or step input index
    members: list[str] = dataclasses.field(default_factory=list)  # follower and leader node ids
    follows: dict[str, int] = dataclasses.field(default_factory=dict)
    cls: int = -1  # repeated-structure class (groups of one class share ILP variables)
    # a hash of the group alone, equal for such groups in other programs (`assign_classes`)
    structure: int | None = None

    @property
    def is_input(self) -> bool:
        return isinstance(self.leader, int)


@dataclasses.dataclass(slots=True)
class Grouping:
    """Groups of a graph, and which group produces each value."""

    graph: OpGraph
    groups: list[Group]
    group_of_node: dict[str, int]
    input_group: dict[int, int]

    def value_of(self, ref: ValueRef) -> Value | None:
        """The value `ref` reads, seen through transparent nodes; None for literals and consts."""
        while ref.kind is ValueKind.NODE:
            node = self.graph.node(ref.node)
            if node.primitive not in TRANSPARENT:
                return (ref.node, ref.index)
            ref = node.inputs[ref.index]
        return input_value(ref.index) if ref.kind is ValueKind.INPUT else None

    def group_of_value(self, value: Value) -> int:
        node, i = value
        return self.input_group[i] if node is None else self.group_of_node[node]

    def planned_nodes(self) -> Iterator[OpNode]:
        """Nodes that belong to a group (all but transparent ones), in program order."""
        for node in self.graph.nodes:
            if node.id in self.group_of_node:
                yield node


def _followed_operand(grouping: Grouping, node: OpNode, depth: dict) -> int | None:
    """The operand a follower keeps: the largest non-literal one, ties to the deepest."""
    best, best_key = None, None
    for k, ref in enumerate(node.inputs):
        value = grouping.value_of(ref)
        if value is None:
            continue
        key = (node.in_avals[k].size, depth.get(value, 0))
        if best_key is None or key > best_key:
            best, best_key = k, key
    return best


def group_graph(graph: OpGraph) -> Grouping:
    """Group every (non-transparent) node of `graph` with the op it follows, or as a leader."""
    grouping = Grouping(graph, [], {}, {})
    for i in range(len(graph.inputs)):
        grouping.input_group[i] = len(grouping.groups)
        grouping.groups.append(Group(len(grouping.groups), i))
    depth: dict[Value, int] = {}
    for node in graph.nodes:
        if node.primitive in TRANSPARENT:
            continue
        values = [grouping.value_of(r) for r in node.inputs]
        level = 1 + max((depth.get(v, 0) for v in values if v is not None), default=0)
        depth.update(((node.id, o), level) for o in range(len(node.out_avals)))
        follower = node.primitive in FOLLOW_RULES and node.primitive not in LEADER_RULES
        followed = _followed_operand(grouping, node, depth) if follower else None
        if followed is None:
            group = Group(len(grouping.groups), node.id)
            grouping.groups.append(group)
        else:
            group = grouping.groups[grouping.group_of_value(values[followed])]
            group.follows[node.id] = followed
        group.members.append(node.id)
        grouping.group_of_node[node.id] = group.index
    return grouping


# ----------------------------------------------------------------------------- repeated layers


def _params_key(node: OpNode) -> tuple:
    """A hashable digest of a node's params (sub-jaxprs by their size, not their identity)."""
    items = []
    ignored = _IDENTITY_PARAMS.get(node.primitive, frozenset())
    for name in sorted(set(node.params) - ignored):
        value = node.params[name]
        if hasattr(value, "eqns") or hasattr(value, "jaxpr"):
            jaxpr = getattr(value, "jaxpr", value)
            value = ("jaxpr", len(getattr(jaxpr, "eqns", ())))
        elif isinstance(value, (tuple, list)) and value and hasattr(value[0], "jaxpr"):
            value = ("jaxprs", len(value))
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        items.append((name, value))
    return tuple(items)


@dataclasses.dataclass(frozen=True, slots=True)
class _Signatures:
    """Weisfeiler-Lehman hashes: of every value, of every planned node, and each node's
    operand values and each value's readers (node, operand position); and before any round
    (`local`: of each node and step input alone)."""

    value: dict[Value, int]
    node: dict[str, int]
    operands: dict[str, list[Value | None]]
    readers: dict[Value, list[tuple[str, int]]]
    local: dict[Value | str, int]


def _signatures(grouping: Grouping, input_roles: dict[int, str], rounds: int) -> _Signatures:
    """Hashes equal for nodes and values whose neighbourhoods within `rounds` hops are equal.

    `input_roles` labels step inputs (e.g. "batch", "param"); inputs differ only by it and their
    aval."""
    graph = grouping.graph
    sig: dict[Value, int] = {}
    for i, aval in enumerate(graph.inputs):
        sig[input_value(i)] = hash(("input", aval.shape, aval.dtype, input_roles.get(i, "")))
    nodes = list(grouping.planned_nodes())
    base = {
        n.id: hash(
            (
                n.primitive,
                tuple((a.shape, a.dtype) for a in n.in_avals),
                tuple((a.shape, a.dtype) for a in n.out_avals),
                _params_key(n),
            )
        )
        for n in nodes
    }
    local: dict[Value | str, int] = {**sig, **base}
    operands = {n.id: [grouping.value_of(r) for r in n.inputs] for n in nodes}
    readers: dict[Value, list[tuple[str, int]]] = {}
    for n in nodes:
        for k, v in enumerate(operands[n.id]):
            if v is not None:
                readers.setdefault(v, []).append((n.id, k))
    node_sig = dict(base)
    for _ in range(rounds):
        for n in nodes:
            for o in range(len(n.out_avals)):
                sig[(n.id, o)] = hash((node_sig[n.id], o))
        new_sig = {}
        for n in nodes:
            ins = tuple(sig.get(v, 0) if v is not None else 0 for v in operands[n.id])
            outs = tuple(
                sorted(
                    (node_sig[r], k)
                    for o in range(len(n.out_avals))
                    for r, k in readers.get((n.id, o), ())
                )
            )
            new_sig[n.id] = hash((base[n.id], ins, outs))
        node_sig = new_sig
        for i in range(len(graph.inputs)):
            v = input_value(i)
            sig[v] = hash((sig[v], tuple(sorted((node_sig[r], k) for r, k in readers.get(v, ())))))
    return _Signatures(sig, node_sig, operands, readers, local)


def structure_signature(
    grouping: Grouping,
    input_roles: dict[int, str],
    output_to_input: Sequence[int | None],
    rounds: int = 3,
) -> int:
    """A hash equal for programs that are the same up to the order of their ops, inputs and
    outputs (e.g. one layer whose parameters sort as blocks_10, blocks_11, blocks_9 and one with
    blocks_6, blocks_7, blocks_8): the multisets of node and input hashes, and of outputs with
    the inputs they update.

    Per-micro-batch inputs that no op reads are left out, with the outputs that pass them on: a
    layer of a pipeline forwards such values from the layers before it to the ones after it
    (each BatchNorm's batch statistics, on their way to the step's new state), so the same block
    repeated would differ by them in every layer and plan once per layer instead of once."""
    found = _signatures(grouping, input_roles, rounds)
    passed = {
        input_value(i)
        for i in range(len(grouping.graph.inputs))
        if input_roles.get(i) == "batch" and input_value(i) not in found.readers
    }
    outputs = [
        (
            found.value.get(grouping.value_of(ref), 0),
            -1 if i is None else found.value[input_value(i)],
        )
        for ref, i in zip(grouping.graph.outputs, output_to_input, strict=True)
        if grouping.value_of(ref) not in passed
    ]
    inputs = [
        found.value[input_value(i)]
        for i in range(len(grouping.graph.inputs))
        if input_value(i) not in passed
    ]
    return hash((tuple(sorted(found.node.values())), tuple(sorted(inputs)), tuple(sorted(outputs))))


def assign_classes(grouping: Grouping, input_roles: dict[int, str], rounds: int = 3) -> int:
    """Give each group a class; equal classes mean the same structure within `rounds` hops.
    Its `structure` hashes the group alone (its members' ops, shapes and links, not their
    neighbours): equal for such groups in other programs too, such as a layer planned alone and
    in a stage of several, where the neighbourhoods at the layer's edges differ (within one
    process).

    `input_roles` labels step inputs (e.g. "batch", "param"); inputs differ only by it and their
    aval. Returns the number of classes.
    """
    found = _signatures(grouping, input_roles, rounds)
    classes: dict[tuple, int] = {}
    for group in grouping.groups:
        key = _group_key(group, found.value, found.node, found.operands)
        group.cls = classes.setdefault(key, len(classes))
        group.structure = hash(_group_key(group, found.local, found.local, found.operands))
    return len(classes)


def _group_key(
    group: Group,
    value_sig: Mapping[Value, int],
    node_sig: Mapping[str, int],
    operands: dict[str, list[Value | None]],
) -> tuple:
    """A group's head (its leader's or input's hash) and members (hashes, followed operands and
    which members their operands come from)."""
    local = {m: j for j, m in enumerate(group.members)}
    head = value_sig[input_value(group.leader)] if group.is_input else node_sig[group.leader]
    members = tuple(
        (
            node_sig[m],
            group.follows.get(m, -1),
            tuple(local.get(v[0], -1) if v is not None else -2 for v in operands[m]),
        )
        for m in group.members
    )
    return head, members
