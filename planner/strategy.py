"""Sharding strategies: the ways one op can run on a device mesh, and the rules that list them.

A `Strategy` fixes the spec each operand must arrive in, the spec of each output, and the mesh
axes over which output 0 is left as partial sums (a contraction split over them). The planner
prices each strategy (compute per device, the node's own all-reduce or reduce-scatter) and the
resharding between what a producer yields and what a consumer needs; the ILP picks one per node.

Two kinds of rules, registered per primitive name:

* `LEADER_RULES[prim](node, mesh) -> list[Strategy]`: the full menu of a heavy op (dot_general,
  conv, gather, ...). Every menu contains the all-replicated strategy, so any plan stays feasible.
* `FOLLOW_RULES[prim](node, operand, spec, mesh) -> Strategy | None`: for cheap ops (element-wise,
  reshape, reduce, ...) the strategy that keeps operand `operand` in `spec`, without moving it;
  None when the op cannot keep it. The planner merges such a *follower* into the op it follows.

A node with no rule gets `replicated_strategy` and a logged warning: always correct (the planner
only ever emits sharding constraints, so XLA keeps the numerics), possibly slow, and priced so.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence

from autopar.planner.cost import LogicalMesh
from autopar.planner.graph import OpNode, ValueKind
from autopar.planner.plan import Spec, replicated

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run a node: operand specs it needs, output specs it yields, partial-sum axes.

    ``in_specs[k]`` is None for operands that are literals (nothing to place). When
    ``partial_axes`` is non-empty, output 0 is first computed as partial sums over those axes;
    if ``out_specs[0]`` splits a dim over them the sums are reduce-scattered, else all-reduced.
    ``accumulated`` (a gradient's sum, with micro-batches): each device adds up its partial sums
    over the micro-batches and they are reduced once per step, not once per micro-batch.
    """

    in_specs: tuple[Spec | None, ...]
    out_specs: tuple[Spec, ...]
    partial_axes: Axes = ()
    accumulated: bool = False

    @property
    def reduce_scatters(self) -> bool:
        """Whether the partial sums are reduce-scattered (output split over the partial axes)."""
        return bool(self.partial_axes) and set(self.partial_axes) <= set(
            spec_axes(self.out_specs[0])
        )

    def mesh_axes(self) -> set[str]:
        """Every mesh axis that splits the computation (operands or outputs)."""
        used = set(self.partial_axes)
        for spec in (*self.in_specs, *self.out_specs):
            if spec is not None:
                used.update(spec_axes(spec))
        return used


LeaderRule = Callable[[OpNode, LogicalMesh], list[Strategy]]
FollowRule = Callable[[OpNode, int, Spec, LogicalMesh], Strategy | None]
LEADER_RULES: dict[str, LeaderRule] = {}
FOLLOW_RULES: dict[str, FollowRule] = {}


def leader_rule(*names: str) -> Callable[[LeaderRule], LeaderRule]:
    """Register a leader rule for the primitives `names`."""

    def register(rule: LeaderRule) -> LeaderRule:
        LEADER_RULES.update(dict.fromkeys(names, rule))
        return rule

    return register


def follow_rule(*names: str) -> Callable[[FollowRule], FollowRule]:
    """Register a follow rule for the primitives `names`."""

    def register(rule: FollowRule) -> FollowRule:
        FOLLOW_RULES.update(dict.fromkeys(names, rule))
        return rule

    return register


# ----------------------------------------------------------------------------- spec helpers


def spec_axes(spec: Spec) -> list[str]:
    """The mesh axes a spec uses, in dim order."""
    return [a for entry in spec if entry for a in entry]


def without_axes(spec: Spec, axes: Iterable[str]) -> Spec:
    """`spec` with `axes` taken out of every dim (what the other axes split)."""
    return tuple(tuple(a for a in e if a not in axes) or None if e else None for e in spec)


def axis_choices(mesh: LogicalMesh) -> list[Axes]:
    """The ways to split one dim: over each axis alone, and over all axes (major first)."""
    singles = [(name,) for name in mesh.axis_names]
    return singles + ([tuple(mesh.axis_names)] if len(singles) > 1 else [])


def split_size(mesh: LogicalMesh, axes: Iterable[str]) -> int:
    return math.prod(mesh.axis_size(a) for a in axes)


def divides(size: int, axes: Axes, mesh: LogicalMesh) -> bool:
    """Whether a dim of `size` splits evenly over `axes` (autopar never pads)."""
    n = split_size(mesh, axes)
    return size >= n and size % n == 0


def make_spec(ndim: int, splits: dict[int, Axes]) -> Spec:
    """A spec of `ndim` dims with `splits[dim]` axes on the given dims, None elsewhere."""
    return tuple(splits.get(d) or None for d in range(ndim))


def spec_fits(shape: Sequence[int], spec: Spec, mesh: LogicalMesh) -> bool:
    """Whether every split dim of `shape` divides evenly under `spec`."""
    pairs = zip(shape, spec, strict=True)
    return all(entry is None or divides(size, entry, mesh) for size, entry in pairs)


def storage_specs(shape: Sequence[int], mesh: LogicalMesh) -> list[Spec]:
    """Replicated, and every split of `shape` that divides evenly: how a value may be stored."""
    specs = [replicated(len(shape))]
    for dim, size in enumerate(shape):
        for axes in axis_choices(mesh):
            if divides(size, axes, mesh):
                specs.append(make_spec(len(shape), {dim: axes}))
    if len(mesh.axis_names) == 2:  # two dims split, one per axis
        for d0, d1 in itertools.permutations(range(len(shape)), 2):
            a0, a1 = (mesh.axis_names[0],), (mesh.axis_names[1],)
            if divides(shape[d0], a0, mesh) and divides(shape[d1], a1, mesh):
                specs.append(make_spec(len(shape), {d0: a0, d1: a1}))
    return specs


def operand_spec_or_none(node: OpNode, k: int, spec: Spec) -> Spec | None:
    """`spec` for operand k, or None when that operand is a literal (nothing to place)."""
    return None if node.inputs[k].kind is ValueKind.LITERAL else spec


def replicated_strategy(node: OpNode) -> Strategy:
    """Every operand and output replicated: always valid, each device does all the work."""
    return Strategy(
        in_specs=tuple(
            operand_spec_or_none(node, k, replicated(len(a.shape)))
            for k, a in enumerate(node.in_avals)
        ),
        out_specs=tuple(replicated(len(a.shape)) for a in node.out_avals),
    )


def dedupe(strategies: Iterable[Strategy]) -> list[Strategy]:
    """Drop repeated strategies, keeping the first of each (order is deterministic)."""
    return list(dict.fromkeys(strategies))


# ----------------------------------------------------------------------------- parameter use


@leader_rule("autopar_param_use")
def param_use_strategies(node: OpNode, mesh: LogicalMesh) -> list[Strategy]:
    """Where a parameter is used, in any way it could be stored.

    A leader, not a follower of the stored parameter: when a parameter is stored split and used
    whole (FSDP), the gather happens at the use, which in the backward pass sits inside the
    rematerialised region, so the parameter is gathered again there instead of being kept alive
    from the forward pass (SimpleFSDP).
    """
    return [Strategy((spec,), (spec,)) for spec in storage_specs(node.in_avals[0].shape, mesh)]


# ----------------------------------------------------------------------------- dot_general


@leader_rule("dot_general")
def dot_general_strategies(node: OpNode, mesh: LogicalMesh) -> list[Strategy]:
    """Alpa's dot strategies, generalised: each mesh axis splits one dim or none.

    A dim is a batch dim (both operands and the output), a free dim of one operand (it and the
    output) or a contracting dim (both operands; the output is then a partial sum over that axis,
    all-reduced, or reduce-scattered onto a free output dim). Both axes may split the same dim.
    With axes x, y this covers SS = SR×RS, SR = SS×SR (+all-reduce), RS = RS×SS (+all-reduce),
    the batch splits SbSi, SbSj, SbSk, Sb over both axes, and RR.
    """
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = node.in_avals
    out = node.out_avals[0]
    lhs_free = [d for d in range(len(lhs.shape)) if d not in lc and d not in lb]
    rhs_free = [d for d in range(len(rhs.shape)) if d not in rc and d not in rb]
    # Every dim as (lhs dim, rhs dim, output dim), None where a side lacks it.
    dims: list[tuple[int | None, int | None, int | None]] = []
    dims += [(a, b, k) for k, (a, b) in enumerate(zip(lb, rb, strict=True))]
    dims += [(a, None, len(lb) + k) for k, a in enumerate(lhs_free)]
    dims += [(None, b, len(lb) + len(lhs_free) + k) for k, b in enumerate(rhs_free)]
    dims += [(a, b, None) for a, b in zip(lc, rc, strict=True)]

    def size(dim: tuple[int | None, int | None, int | None]) -> int:
        a, b, _ = dim
        return lhs.shape[a] if a is not None else rhs.shape[b]

    # Assignments: each axis to one dim or none; plus all axes together on one dim.
    names = mesh.axis_names
    options: list[dict[int, Axes]] = []
    for choice in itertools.product(range(-1, len(dims)), repeat=len(names)):
        assignment: dict[int, Axes] = {}
        for axis, d in zip(names, choice, strict=True):
            if d >= 0:
                assignment[d] = (*assignment.get(d, ()), axis)
        options.append(assignment)
    strategies = []
    for assignment in options:
        if not all(divides(size(dims[d]), axes, mesh) for d, axes in assignment.items()):
            continue
        lhs_split = {dims[d][0]: axes for d, axes in assignment.items() if dims[d][0] is not None}
        rhs_split = {dims[d][1]: axes for d, axes in assignment.items() if dims[d][1] is not None}
        out_split = {dims[d][2]: axes for d, axes in assignment.items() if dims[d][2] is not None}
        partial = tuple(a for d, axes in assignment.items() if dims[d][2] is None for a in axes)
        in_specs = (
            operand_spec_or_none(node, 0, make_spec(len(lhs.shape), lhs_split)),
            operand_spec_or_none(node, 1, make_spec(len(rhs.shape), rhs_split)),
        )
        strategies.append(Strategy(in_specs, (make_spec(len(out.shape), out_split),), partial))
        strategies.extend(reduce_scatter_variants(strategies[-1], out.shape, mesh))
    return dedupe(strategies)


def reduce_scatter_variants(
    strategy: Strategy, out_shape: Sequence[int], mesh: LogicalMesh
) -> list[Strategy]:
    """For a strategy with partial sums: the same, reduce-scattered onto each free output dim."""
    if not strategy.partial_axes:
        return []
    out = strategy.out_specs[0]
    variants = []
    for dim, entry in enumerate(out):
        if entry is None and divides(out_shape[dim], strategy.partial_axes, mesh):
            scattered = tuple(strategy.partial_axes if d == dim else e for d, e in enumerate(out))
            variants.append(dataclasses.replace(strategy, out_specs=(scattered,)))
    return variants
