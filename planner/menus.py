"""What the ILP chooses from: each group's strategies with their costs, and each edge's resharding.

A group's strategy k is its leader's strategy k with every follower keeping what it follows (or
replicating, where it cannot). For each k the menu knows every member's `Strategy` and the spec
of every value the group produces. Costs are in seconds, per device, weighted by how often a node
runs per step (gradient accumulation runs the gradient part once per micro-batch):

* compute: each node's roofline (`planner.roofline`) with its FLOPs shared by the devices that
  split the work and the bytes its operands and outputs have per device: a replicated op costs
  n× the FLOPs and reads whole weights, a replicated optimizer update streams all the state;
* blocking communication: a node's own all-reduce/reduce-scatter and the resharding it needs;
* overlappable communication: gathers of step inputs (parameters stored split, FSDP), which can be
  issued ahead of use (prefetch), and the summing of gradients, which only the optimizer update
  waits for. The objective hides it behind compute (see `planner.ilp`) where the cluster runs
  collectives beside compute (`ClusterSpec.overlaps_communication`: GPUs, not CPUs).

With micro-batches, a gradient's all-reduce runs once per step (`Strategy.accumulated`): partial
sums are added up on each device and reduced after the last micro-batch, at no memory cost (the
accumulator is whole either way). A reduce-scatter may run either way: per micro-batch into a
slice of the gradient, or once per step from a whole accumulator, which costs memory; the menu
lists both and the ILP chooses within its memory budget.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from autopar.planner._compat import PARAM_LAYOUT_ERRORS, warn_unknown_params
from autopar.planner.cost import Collective, LogicalMesh, resharding_collectives, result_bytes
from autopar.planner.graph import OpNode
from autopar.planner.groups import Group, Grouping, Value, input_value
from autopar.planner.leader_rules import source_strategies
from autopar.planner.memory import value_aval
from autopar.planner.plan import Spec
from autopar.planner.roofline import Roofline, result_columns
from autopar.planner.sharding_rules import FOLLOW_RULES, LEADER_RULES
from autopar.planner.strategy import (
    Strategy,
    replicated_strategy,
    spec_axes,
    split_size,
)

logger = logging.getLogger(__name__)

LocalValue = tuple[int, int]
"""A value of a group: (member index, output index); member -1 is an input group's input."""


@dataclasses.dataclass(slots=True)
class Menu:
    """The strategies of one group class: per choice k, each member's strategy and value specs."""

    strategies: list[tuple[Strategy, ...]]
    value_specs: list[dict[LocalValue, Spec]]

    def __len__(self) -> int:
        return len(self.value_specs)


@dataclasses.dataclass(slots=True)
class Costs:
    """Per-choice cost vectors (seconds) and per-device collective result bytes."""

    compute: np.ndarray
    blocking: np.ndarray
    overlap: np.ndarray
    comm_bytes: np.ndarray

    @classmethod
    def zeros(cls, shape) -> Costs:
        return cls(*(np.zeros(shape) for _ in range(4)))

    def at(self, where) -> tuple[float, float, float, float]:
        """(compute, blocking, overlap, comm bytes) of one choice (or one matrix cell)."""
        return tuple(float(m[where]) for m in self._arrays())

    def add_comm(self, where, seconds: float, nbytes: float, overlappable: bool) -> None:
        (self.overlap if overlappable else self.blocking)[where] += seconds
        self.comm_bytes[where] += nbytes

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.compute, self.blocking, self.overlap, self.comm_bytes

    def add_at(self, where, values: tuple[float, float, float, float]) -> None:
        """Add (compute, blocking, overlap, comm bytes), as `at` gives them, to one choice."""
        for m, value in zip(self._arrays(), values, strict=True):
            m[where] += value

    def copy(self, source, target) -> None:
        """Choice `target`'s costs become choice `source`'s."""
        for m in self._arrays():
            m[target] = m[source]

    def add(self, other: Costs) -> None:
        for mine, theirs in zip(self._arrays(), other._arrays(), strict=True):
            mine += theirs


@dataclasses.dataclass(slots=True)
class Edge:
    """Values of one group read by another: resharding cost per (producer spec, consumer need)."""

    producer: int  # group index
    consumer: int
    producer_choice: np.ndarray  # producer's choice k -> row a
    consumer_choice: np.ndarray  # consumer's choice k -> column b
    costs: Costs  # matrices [a, b]
    value: Value
    haves: list[Spec]  # row a: the producer's spec of the value
    needs: list[tuple[Spec | None, ...]]  # column b: the spec each read needs
    readers: tuple[int, ...]  # each read's consumer member; () for an output stored like its
    # input (`intra._alias_edges`), which no node reads
    kind: Hashable  # equal for edges that share their costs (`MenuBuilder._shared_edge`)


class MeshCache:
    """What building ILPs on one mesh finds that holds for any program planned there with the
    same options: group menus and costs by the groups' own structure (`Group.structure`, equal
    across programs within a process), the edges between such groups, and the resharding, copy
    and tile sizes of specs. A pipeline's layers of different structures (the first, with the
    embedding; the middle ones; the last, with the head) are mostly the same blocks: their ILPs
    on one mesh share them through one cache (`LayerCosts`; a forked worker fills its own copy):
    the 36 level-0 layer ILPs of a GPT-15B on 4x8 V100s built in 18.7 s against 27.8 s in one
    process, with the same plans."""

    def __init__(self) -> None:
        self.menus: dict[Hashable, Menu] = {}  # by `MenuBuilder.menu_key`
        self.costs: dict[tuple, Costs] = {}  # group_costs by menu key and members' context
        self.edges: dict[tuple, tuple | None] = {}  # `_resharding` by menu keys and reads
        self.reshard: dict[tuple, tuple[float, float]] = {}
        self.copies: dict[tuple, float] = {}  # `copy_bytes`
        self.tiles: dict[Spec, int] = {}  # devices a spec splits a tensor over
        self.node_costs: dict[tuple, tuple[float, float, float, float]] = {}  # `node_cost`


class MenuBuilder:
    """Builds menus, costs and edges for a grouping on a mesh, caching by class and, in
    `cache` (a `MeshCache` of the mesh and options, shared by the problems planned there, or
    this builder's own), by the groups' own structure."""

    def __init__(
        self,
        grouping: Grouping,
        mesh: LogicalMesh,
        roofline: Roofline,
        weights: dict[str, float],
        overlappable_nodes: set[str],
        input_specs: Callable[[int], list[Spec]],
        batch_dims: dict[Value, int] | None = None,
        batch_axis: str | None = None,
        accumulable: frozenset[str] = frozenset(),
        cache: MeshCache | None = None,
    ) -> None:
        self.grouping = grouping
        self.mesh = mesh
        self.roofline = roofline
        self.overlaps = roofline.cluster.overlaps_communication  # else nothing is hidden
        self.weights = weights
        self.overlappable_nodes = overlappable_nodes
        self.input_specs = input_specs
        self.batch_dims = batch_dims or {}
        self.batch_axis = batch_axis
        self.accumulable = accumulable  # gradient sums that may be reduced once per step
        self.cache = MeshCache() if cache is None else cache
        self._menu_keys: dict[int, Hashable] = {}  # class -> `menu_key`
        self._warned: set[str] = set()
        self._local_indices: dict[int, dict[str, int]] = {}  # group -> member -> position

    # ------------------------------------------------------------------ menus

    def menu(self, group: Group) -> Menu:
        key = self.menu_key(group)
        if key not in self.cache.menus:
            self.cache.menus[key] = self._build_menu(group)
        return self.cache.menus[key]

    def menu_key(self, group: Group) -> Hashable:
        """What `group`'s menu depends on besides the mesh and options: its own structure
        (its class where classes are not assigned, a key only for this builder's own cache),
        the dims of its values the forced batch axis splits, which of its gradient sums may
        be reduced once per step, and an input's storage specs."""
        key = self._menu_keys.get(group.cls)
        if key is None:
            graph = self.grouping.graph
            values = [input_value(group.leader)] if group.is_input else []
            values += [
                (member, o)
                for member in group.members[1 if group.is_input else 0 :]
                for o in range(len(graph.node(member).out_avals))
            ]
            key = self._menu_keys[group.cls] = (
                ("class", group.cls) if group.structure is None else group.structure,
                tuple(self.batch_dims.get(v) for v in values),
                tuple(member in self.accumulable for member in group.members),
                tuple(self.input_specs(group.leader)) if group.is_input else (),
            )
        return key

    def local_value(self, group: Group, value: Value) -> LocalValue:
        node, o = value
        return (-1, 0) if node is None else (self._local_index(group)[node], o)

    def _local_index(self, group: Group) -> dict[str, int]:
        index = self._local_indices.get(group.index)
        if index is None:  # asked for every value a menu or a cost reads
            index = self._local_indices[group.index] = {m: j for j, m in enumerate(group.members)}
        return index

    def _leader_strategies(self, node: OpNode) -> list[Strategy]:
        if node.primitive in LEADER_RULES:
            try:
                return LEADER_RULES[node.primitive](node, self.mesh)
            except PARAM_LAYOUT_ERRORS as error:
                warn_unknown_params(node.primitive, "sharding (replicated)", error)
                return [replicated_strategy(node)]
        if all(self.grouping.value_of(r) is None for r in node.inputs):
            return source_strategies(node, self.mesh)
        if node.primitive not in FOLLOW_RULES and node.primitive not in self._warned:
            self._warned.add(node.primitive)
            logger.warning(
                "no sharding rules for primitive %r; it runs replicated (correct, possibly slow)",
                node.primitive,
            )
        return [replicated_strategy(node)]

    def _follow(self, node: OpNode, operand: int, spec: Spec) -> Strategy | None:
        try:
            return FOLLOW_RULES[node.primitive](node, operand, spec, self.mesh)
        except PARAM_LAYOUT_ERRORS as error:
            warn_unknown_params(node.primitive, "sharding (replicated)", error)
            return None

    def _build_menu(self, group: Group) -> Menu:
        graph = self.grouping.graph
        local = self._local_index(group)
        if group.is_input:
            heads = [(None, {(-1, 0): spec}) for spec in self.input_specs(group.leader)]
        else:
            leader = graph.node(group.leader)
            heads = [
                (s, {(0, o): spec for o, spec in enumerate(s.out_specs)})
                for s in self._leader_strategies(leader)
            ]
        # Each follower reads the spec of one value of the group: where two heads give it the
        # same spec, it follows alike (a follow rule depends on the node and that spec only).
        first = 0 if group.is_input else 1
        followers = []
        for j in range(first, len(group.members)):
            node = graph.node(group.members[j])
            pos = group.follows[node.id]
            followers.append((j, node, pos, self._local(group, local, node.inputs[pos])))
        # (member, spec it reads) -> its strategy and the specs of its outputs
        followed: dict[tuple[int, Spec], tuple[Strategy, list]] = {}
        strategies, value_specs = [], []
        for head, specs in heads:
            chosen = [head] if head is not None else []
            specs = dict(specs)
            for j, node, pos, source in followers:
                have = specs[source]
                found = followed.get((j, have))
                if found is None:
                    s = self._follow(node, pos, have)
                    s = replicated_strategy(node) if s is None else s
                    outs = [((j, o), spec) for o, spec in enumerate(s.out_specs)]
                    found = followed[j, have] = s, outs
                chosen.append(found[0])
                specs.update(found[1])
            strategies.append(tuple(chosen))
            value_specs.append(specs)
        return self._accumulate_sums(
            group, self._batch_split_only(group, Menu(strategies, value_specs))
        )

    def _accumulate_sums(self, group: Group, menu: Menu) -> Menu:
        """The group's gradient sums reduced once per step instead of per micro-batch (module
        docstring): all-reduced ones in every choice; a choice that reduce-scatters one gets a
        twin that reduces it once too, appended, whose whole accumulator the memory model
        charges (`intra._Memory`), so the ILP weighs the traffic saved against that memory."""
        members = {j for j, m in enumerate(group.members) if m in self.accumulable}
        if not members:
            return menu

        def summed(j: int, s: Strategy) -> bool:
            return j in members and split_size(self.mesh, s.partial_axes) > 1

        strategies, value_specs = [], list(menu.value_specs)
        twins = []
        for choice, specs in zip(menu.strategies, menu.value_specs, strict=True):
            strategies.append(
                tuple(
                    dataclasses.replace(s, accumulated=True)
                    if summed(j, s) and not s.reduce_scatters
                    else s
                    for j, s in enumerate(choice)
                )
            )
            if any(summed(j, s) and s.reduce_scatters for j, s in enumerate(choice)):
                twins.append(
                    tuple(
                        dataclasses.replace(s, accumulated=True) if summed(j, s) else s
                        for j, s in enumerate(choice)
                    )
                )
                value_specs.append(specs)
        return Menu(strategies + twins, value_specs)

    def _batch_split_only(self, group: Group, menu: Menu) -> Menu:
        """With a forced batch axis, the choices that split the group's batch dims over exactly
        that axis (a value that no choice splits so is left free)."""
        if self.batch_axis is None:
            return menu
        if group.is_input:
            values = [((-1, 0), input_value(group.leader))]
        else:
            graph = self.grouping.graph
            values = [
                ((j, o), (member, o))
                for j, member in enumerate(group.members)
                for o in range(len(graph.node(member).out_avals))
            ]
        keep = range(len(menu))
        for local, value in values:
            dim = self.batch_dims.get(value)
            if dim is None:
                continue
            split = [k for k in keep if menu.value_specs[k][local][dim] == (self.batch_axis,)]
            keep = split or keep
        return Menu([menu.strategies[k] for k in keep], [menu.value_specs[k] for k in keep])

    def _local(self, group: Group, local: dict[str, int], ref) -> LocalValue:
        node, o = self.grouping.value_of(ref)
        return (-1, 0) if node is None else (local[node], o)

    # ------------------------------------------------------------------ costs

    def reshard(self, shape, itemsize: int, src: Spec, dst: Spec) -> tuple[float, float]:
        """(seconds, result bytes per device) to move a tensor from `src` to `dst`."""
        key = (shape, itemsize, src, dst)
        found = self.cache.reshard.get(key)
        if found is None:
            seconds = nbytes = 0.0
            for kind, b, axes in resharding_collectives(self.mesh, shape, itemsize, src, dst):
                seconds += self.mesh.collective_cost(kind, b, axes)
                nbytes += result_bytes(self.mesh, kind, b, axes)
            found = self.cache.reshard[key] = (seconds, nbytes)
        return found

    def copy_bytes(self, shape, itemsize: int, have: Spec, need: Spec, fused: bool) -> float:
        """Bytes per device of the buffer a tensor stored as `have` takes when read as `need`:
        its resharded copy; none for a no-op (size-1 axes) or, where the read is `fused`, a
        slice inside the reader's fusion. Cached: a layer ILP's memory model asks ~80k times
        for each few hundred pairs of specs."""
        key = (shape, itemsize, have, need, fused)
        found = self.cache.copies.get(key)
        if found is None:
            _, moved = self.reshard(shape, itemsize, have, need)
            size = self.spec_bytes(shape, itemsize, need)
            same = size == self.spec_bytes(shape, itemsize, have)
            found = self.cache.copies[key] = 0.0 if moved == 0 and (same or fused) else size
        return found

    def spec_bytes(self, shape, itemsize: int, spec: Spec) -> float:
        tiles = self.cache.tiles.get(spec)
        if tiles is None:  # cached: asked ~100k times per layer ILP, for a few hundred specs
            tiles = self.cache.tiles[spec] = math.prod(split_size(self.mesh, e) for e in spec if e)
        return math.prod(shape) * itemsize / tiles

    def group_costs(self, group: Group) -> Costs:
        """Compute, own communication and internal resharding of each choice of `group`; groups
        of one menu whose members weigh, overlap, count FLOPs and sit in their fusions alike
        (`Roofline.context`) share them (the same layer repeated). Read-only: a Costs may be
        shared."""
        menu = self.menu(group)
        if group.is_input:
            return Costs.zeros(len(menu))
        graph = self.grouping.graph
        key = (
            self.menu_key(group),
            tuple(
                (
                    self.weights.get(member, 1.0),
                    member in self.overlappable_nodes,
                    self.roofline.context(node := graph.node(member)),
                    node.flops,
                )
                for member in group.members
            ),
        )
        if key not in self.cache.costs:
            self.cache.costs[key] = self._priced(group, menu)
        return self.cache.costs[key]

    def _priced(self, group: Group, menu: Menu) -> Costs:
        """The costs of `group`'s choices, priced member by member."""
        costs = Costs.zeros(len(menu))
        graph = self.grouping.graph
        local = self._local_index(group)
        for j, member in enumerate(group.members):
            node = graph.node(member)
            weight = self.weights.get(member, 1.0)
            overlappable = member in self.overlappable_nodes
            internal = [
                (pos, self._local(group, local, ref))
                for pos, ref in enumerate(node.inputs)
                if self.grouping.value_of(ref) is not None
                and self.grouping.group_of_value(self.grouping.value_of(ref)) == group.index
            ]
            own = Costs.zeros(len(menu))  # the member's own costs, priced once per strategy
            first: dict[Strategy, int] = {}
            for k in range(len(menu)):
                s = menu.strategies[k][j]
                if (k0 := first.setdefault(s, k)) == k:
                    self.add_node_cost(own, k, node, s, weight, overlappable)
                else:  # choices that differ in other members only
                    own.copy(k0, k)
            costs.add(own)
            for k in range(len(menu)):
                for pos, lv in internal:
                    need = menu.strategies[k][j].in_specs[pos]
                    have = menu.value_specs[k][lv]
                    if need is not None and need != have:
                        aval = node.in_avals[pos]
                        seconds, nbytes = self.reshard(aval.shape, aval.dtype.itemsize, have, need)
                        costs.add_comm(k, weight * seconds, weight * nbytes, False)
        return costs

    def node_cost(
        self,
        group: Group,
        node: OpNode,
        s: Strategy,
        weight: float,
        overlappable: bool,
        own_sum: bool,
    ) -> tuple[float, float, float, float]:
        """`add_node_cost`'s (compute, blocking, overlap, comm bytes) for member `node` of
        `group`, found once for the members alike in their group's menu, position and
        surroundings (`Roofline.context`): an emission prices every node of its program, most
        of them repeated layers."""
        key = (
            self.menu_key(group),
            self._local_index(group)[node.id],
            s,
            weight,
            overlappable,
            own_sum,
            self.roofline.context(node),
            node.flops,
        )
        found = self.cache.node_costs.get(key)
        if found is None:
            scratch = Costs.zeros(())
            self.add_node_cost(scratch, (), node, s, weight, overlappable, own_sum)
            found = self.cache.node_costs[key] = scratch.at(())
        return found

    def add_node_cost(
        self,
        costs: Costs,
        where,
        node: OpNode,
        s: Strategy,
        weight: float,
        overlappable: bool,
        own_sum: bool = True,
    ) -> None:
        """A node's compute and (unless not `own_sum`) its own all-reduce/reduce-scatter under
        strategy `s`."""
        tiles = math.prod(self.mesh.axis_size(a) for a in s.mesh_axes())
        in_bytes = [
            None if spec is None else self.spec_bytes(a.shape, a.dtype.itemsize, spec)
            for spec, a in zip(s.in_specs, node.in_avals, strict=True)
        ]
        out_bytes = [
            self.spec_bytes(a.shape, a.dtype.itemsize, spec)
            for spec, a in zip(s.out_specs, node.out_avals, strict=True)
        ]
        columns = None
        if node.primitive == "dot_general":
            splits = [split_size(self.mesh, e) if e else 1 for e in s.out_specs[0]]
            columns = result_columns(node, splits)
        seconds = self.roofline.seconds(node, node.flops / tiles, in_bytes, out_bytes, columns)
        costs.compute[where] += weight * seconds
        if s.partial_axes and own_sum:
            out = node.out_avals[0]
            seconds, nbytes = self.sum_cost(
                out.shape, out.dtype.itemsize, s.out_specs[0], s.partial_axes
            )
            times = 1.0 if s.accumulated else weight  # reduced once per step, or per run
            costs.add_comm(where, times * seconds, times * nbytes, overlappable and self.overlaps)

    def sum_cost(self, shape, itemsize: int, spec: Spec, axes) -> tuple[float, float]:
        """(seconds, result bytes per device) to sum partial sums over `axes` into `spec`:
        reduce-scattered where `spec` splits over them, else all-reduced."""
        n = split_size(self.mesh, axes)
        if n == 1:  # a sum over one device: nothing to reduce
            return 0.0, 0.0
        nbytes = self.spec_bytes(shape, itemsize, spec)
        if set(axes) <= set(spec_axes(spec)):
            cost = self.mesh.collective_cost(Collective.REDUCE_SCATTER, nbytes * n, axes)
        else:
            cost = self.mesh.collective_cost(Collective.ALL_REDUCE, nbytes, axes)
        return cost, nbytes

    # ------------------------------------------------------------------ edges

    def edges(self) -> list[Edge]:
        """One edge per (producer group, value, consumer group) with a resharding choice."""
        grouping = self.grouping
        graph = grouping.graph
        readers: dict[tuple[int, Value, int], list[tuple[Value, int, int, float]]] = {}
        for group in grouping.groups:
            for j, member in enumerate(group.members):
                node = graph.node(member)
                for pos, ref in enumerate(node.inputs):
                    value = grouping.value_of(ref)
                    if value is None:
                        continue
                    producer = grouping.group_of_value(value)
                    if producer != group.index:
                        key = (producer, value, group.index)
                        weight = self.weights.get(member, 1.0)
                        readers.setdefault(key, []).append((value, j, pos, weight))
        edges = []
        for (producer, value, consumer), reads in readers.items():
            edge = self._edge(producer, value, consumer, reads)
            if edge is not None:
                edges.append(edge)
        return edges

    def _edge(self, producer: int, value: Value, consumer: int, reads) -> Edge | None:
        """The edge of the consumer's `reads` (value, member, operand, weight) of `value`."""
        group = self.grouping.groups[consumer]

        def needs() -> list[tuple[Spec | None, ...]]:
            menu = self.menu(group)
            return [
                tuple(menu.strategies[k][j].in_specs[pos] for _, j, pos, _ in reads)
                for k in range(len(menu))
            ]

        return self._shared_edge(
            producer,
            value,
            consumer,
            tuple((j, pos) for _, j, pos, _ in reads),
            tuple(w for *_, w in reads),
            needs,
            tuple(j for _, j, _, _ in reads),
        )

    def storage_edge(self, value: Value, stored: Group) -> Edge | None:
        """The edge that reshards `value`, the new value of the input of input group `stored`,
        into the spec that input is stored in (`intra._alias_edges`)."""

        def needs() -> list[tuple[Spec | None, ...]]:
            return [(specs[(-1, 0)],) for specs in self.menu(stored).value_specs]

        producer = self.grouping.group_of_value(value)
        return self._shared_edge(producer, value, stored.index, "stored", (1.0,), needs, ())

    def _shared_edge(
        self,
        producer: int,
        value: Value,
        consumer: int,
        reads: Hashable,
        weights: tuple[float, ...],
        needs: Callable[[], list[tuple[Spec | None, ...]]],
        readers: tuple[int, ...],
    ) -> Edge | None:
        """The edge where the consumer's choice k needs `value` as each spec in `needs()[k]`
        (one per read in `reads`, with its weight); None if no pair of choices costs anything.
        Edges between groups of the same menus read alike (the same layer repeated) share
        their costs: a GPT layer ILP has ~1,500 edges, about a third of them distinct."""
        h, g = self.grouping.groups[producer], self.grouping.groups[consumer]
        lv = self.local_value(h, value)
        key = (self.menu_key(h), lv, self.menu_key(g), reads, weights)
        if key not in self.cache.edges:
            self.cache.edges[key] = self._resharding(h, lv, value, needs(), weights)
        found = self.cache.edges[key]
        if found is None:
            return None
        row_of, col_of, costs, haves, columns = found
        return Edge(producer, consumer, row_of, col_of, costs, value, haves, columns, readers, key)

    def _resharding(
        self,
        h: Group,
        lv: LocalValue,
        value: Value,
        needs: list[tuple[Spec | None, ...]],
        weights: Sequence[float],
    ) -> tuple | None:
        """An edge's (producer_choice, consumer_choice, costs, haves, needs) from group `h`'s
        value `value` (its local `lv`) to reads needing `needs`; None where nothing costs."""
        rows, row_of = _index([specs[lv] for specs in self.menu(h).value_specs])
        cols, col_of = _index(needs)
        aval = value_aval(self.grouping, value)
        shape, itemsize = aval.shape, aval.dtype.itemsize
        hidden = h.is_input and self.overlaps
        costs = Costs.zeros((len(rows), len(cols)))
        for a, have in enumerate(rows):
            for b, specs in enumerate(cols):
                seconds = nbytes = 0.0
                for need, weight in zip(specs, weights, strict=True):
                    if need is not None and need != have:
                        s, n = self.reshard(shape, itemsize, have, need)
                        seconds, nbytes = seconds + weight * s, nbytes + weight * n
                if seconds or nbytes:
                    costs.add_comm((a, b), seconds, nbytes, hidden)
        if not (costs.blocking.any() or costs.overlap.any() or costs.comm_bytes.any()):
            return None
        return row_of, col_of, costs, rows, cols


def _index(items: list) -> tuple[list, np.ndarray]:
    """Distinct items in first-seen order, and each item's position among them."""
    position: dict = {}
    of = np.array([position.setdefault(item, len(position)) for item in items], dtype=np.int64)
    return list(position), of
