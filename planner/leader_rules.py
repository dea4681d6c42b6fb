"""Leader rules for heavy ops other than dot_general, and the strategies of source ops.

Registered for conv_general_dilated, gather, scatter (all kinds), scan, while, cond, iota and
random_bits; `source_strategies` also serves any node that reads no placed value (see `strategy`).

Convolution, gather and scatter are described as a list of splittable *dims*, each sitting in some
operands and in the output (or in no output dim: a contraction, whose split leaves partial sums);
`_split_menu` then lets each mesh axis split one dim or none, as the dot_general rule does.
Spatial conv dims and sliced gather/scatter dims are never split: XLA would need halo exchanges
or gathers that these strategies do not price.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from autopar.planner._compat import scan_operand_counts
from autopar.planner.cost import LogicalMesh
from autopar.planner.graph import OpNode
from autopar.planner.plan import Spec
from autopar.planner.strategy import (
    Axes,
    Strategy,
    axis_choices,
    dedupe,
    divides,
    leader_rule,
    make_spec,
    operand_spec_or_none,
    reduce_scatter_variants,
    replicated_strategy,
    storage_specs,
)


@dataclasses.dataclass(frozen=True, slots=True)
class _Dim:
    """A dim one mesh axis may split: its size, (operand, dim) places, and its output dim.

    ``output`` None means the dim is reduced away: a split leaves output 0 as partial sums.
    """

    size: int
    operands: tuple[tuple[int, int], ...]
    output: int | None


def _split_menu(node: OpNode, mesh: LogicalMesh, dims: Sequence[_Dim]) -> list[Strategy]:
    """Replicated, plus each way for every mesh axis to split one of `dims` (or none) evenly.

    Partial sums also get their reduce-scattered variants.
    """
    out_shape = node.out_avals[0].shape
    strategies = [replicated_strategy(node)]
    for choice in itertools.product(range(-1, len(dims)), repeat=len(mesh.axis_names)):
        assignment: dict[int, Axes] = {}
        for axis, d in zip(mesh.axis_names, choice, strict=True):
            if d >= 0:
                assignment[d] = (*assignment.get(d, ()), axis)
        if not assignment or not all(divides(dims[d].size, a, mesh) for d, a in assignment.items()):
            continue
        in_splits: list[dict[int, Axes]] = [{} for _ in node.in_avals]
        out_split: dict[int, Axes] = {}
        partial: Axes = ()
        for d, axes in assignment.items():
            for k, dim in dims[d].operands:
                in_splits[k][dim] = axes
            if dims[d].output is None:
                partial += axes
            else:
                out_split[dims[d].output] = axes
        in_specs = tuple(
            operand_spec_or_none(node, k, make_spec(len(aval.shape), in_splits[k]))
            for k, aval in enumerate(node.in_avals)
        )
        strategy = Strategy(in_specs, (make_spec(len(out_shape), out_split),), partial)
        strategies += [strategy, *reduce_scatter_variants(strategy, out_shape, mesh)]
    return dedupe(strategies)


# ----------------------------------------------------------------------------- convolution


@leader_rule("conv_general_dilated")
def conv_strategies(node: OpNode, mesh: LogicalMesh) -> list[Strategy]:
    """Split the batch, the output features, or the input features (partial sums), or replicate.

    Grouped convolutions tie features to groups, so they only get the batch split; batch-grouped
    ones (the kernel gradient of a grouped conv) only replicate.
    """
    lhs, rhs = node.in_avals
    dn = node.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    dims = []
    if node.params["batch_group_count"] == 1:
        dims.append(_Dim(lhs.shape[lhs_spec[0]], ((0, lhs_spec[0]),), out_spec[0]))
        if node.params["feature_group_count"] == 1:
            dims.append(_Dim(rhs.shape[rhs_spec[0]], ((1, rhs_spec[0]),), out_spec[1]))
            dims.append(_Dim(lhs.shape[lhs_spec[1]], ((0, lhs_spec[1]), (1, rhs_spec[1])), None))
    return _split_menu(node, mesh, dims)


# ----------------------------------------------------------------------------- gather, scatter


@leader_rule("gather")
def gather_strategies(node: OpNode, mesh: LogicalMesh) -> list[Strategy]:
    """Split index batch dims, whole-slice operand dims, or indexed dims (partial sums).

    An index batch dim splits with its operand batching dim, if any. An indexed operand dim taken
    one row at a time may be split too: each device gathers the rows it holds and zeros the rest,
    so the output is partial sums (how XLA partitions an embedding lookup).
    """
    operand, indices = node.in_avals
    dn = node.params["dimension_numbers"]
    slice_sizes = node.params["slice_sizes"]
    out_rank = len(node.out_avals[0].shape)
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]  # indices dims [:-1]
    dims = []
    for i, o in enumerate(batch_out):
        places = ((1, i),)
        if i in dn.start_indices_batching_dims:
            places += ((0, dn.operand_batching_dims[dn.start_indices_batching_dims.index(i)]),)
        dims.append(_Dim(indices.shape[i], places, o))
    excluded = {*dn.collapsed_slice_dims, *dn.operand_batching_dims}
    window = [d for d in range(len(operand.shape)) if d not in excluded]
    for d, o in zip(window, dn.offset_dims, strict=True):
        if d not in dn.start_index_map and slice_sizes[d] == operand.shape[d]:
            dims.append(_Dim(operand.shape[d], ((0, d),), o))
    for d in dn.start_index_map:
        if slice_sizes[d] == 1:
            dims.append(_Dim(operand.shape[d], ((0, d),), None))
    return _split_menu(node, mesh, dims)


@leader_rule("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max")
def scatter_strategies(node: OpNode, mesh: LogicalMesh) -> list[Strategy]:
    """Split batching dims, whole-window dims or indexed dims; for scatter-add also index dims.

    Operand batching dims split with indices and updates; whole-window dims with updates. An
    indexed operand dim written one row at a time may be split: each device applies the updates
    that land in its rows. For scatter-add the index batch dims of indices and updates may be
    split as well: each device adds its updates, and the output is partial sums (an embedding
    gradient).
    """
    operand, indices, updates = node.in_avals
    dn = node.params["dimension_numbers"]
    update_scatter = [d for d in range(len(updates.shape)) if d not in dn.update_window_dims]
    dims = []
    for i, u in enumerate(update_scatter):  # indices dims [:-1]
        if i in dn.scatter_indices_batching_dims:
            d = dn.operand_batching_dims[dn.scatter_indices_batching_dims.index(i)]
            dims.append(_Dim(indices.shape[i], ((0, d), (1, i), (2, u)), d))
        elif node.primitive == "scatter-add":
            dims.append(_Dim(indices.shape[i], ((1, i), (2, u)), None))
    excluded = {*dn.inserted_window_dims, *dn.operand_batching_dims}
    window = dict(
        zip(
            [d for d in range(len(operand.shape)) if d not in excluded],
            dn.update_window_dims,
            strict=True,
        )
    )
    for d, u in window.items():
        if d not in dn.scatter_dims_to_operand_dims and updates.shape[u] == operand.shape[d]:
            dims.append(_Dim(operand.shape[d], ((0, d), (2, u)), d))
    for d in dn.scatter_dims_to_operand_dims:
        if d in dn.inserted_window_dims or updates.shape[window[d]] == 1:
            dims.append(_Dim(operand.shape[d], ((0, d),), d))
    return _split_menu(node, mesh, dims)


# ----------------------------------------------------------------------------- sources


@leader_rule("iota", "random_bits")
def source_strategies(node: OpNode, mesh: LogicalMesh) -> list[Strategy]:
    """Replicated, plus each output alone in each way to store it (`storage_specs`).

    For ops that read no placed value (iota, random bits, a broadcast literal): computing a slice
    of a source is local, so any split is free. Operands (a PRNG key) stay replicated.
    """
    base = replicated_strategy(node)
    strategies = [base]
    for k, aval in enumerate(node.out_avals):
        for spec in storage_specs(aval.shape, mesh)[1:]:
            out_specs = (*base.out_specs[:k], spec, *base.out_specs[k + 1 :])
            strategies.append(dataclasses.replace(base, out_specs=out_specs))
    return strategies


# ----------------------------------------------------------------------------- control flow


def _batch_menu(
    node: OpNode,
    mesh: LogicalMesh,
    in_first: Sequence[int | None],
    out_first: Sequence[int],
    candidates: Sequence[int],
) -> list[Strategy]:
    """Replicated, plus a guessed batch dim split through a control-flow op.

    The batch sizes b are the `in_first` dims of the `candidates` operands; for each b and axis
    choice, every operand and output is split on its first dim of size b at or after its
    `*_first` dim (None: never split). A loop body is opaque to the planner; a batch dim shared
    by everything is the split that is usually free inside, and XLA propagates it through.
    """
    sizes = sorted(
        {
            node.in_avals[k].shape[in_first[k]]
            for k in candidates
            if in_first[k] is not None and len(node.in_avals[k].shape) > in_first[k]
        }
    )
    strategies = [replicated_strategy(node)]
    for b, axes in itertools.product(sizes, axis_choices(mesh)):
        if divides(b, axes, mesh):
            in_specs = tuple(
                operand_spec_or_none(node, k, _split_first(aval.shape, first, b, axes))
                for k, (aval, first) in enumerate(zip(node.in_avals, in_first, strict=True))
            )
            out_specs = tuple(
                _split_first(aval.shape, first, b, axes)
                for aval, first in zip(node.out_avals, out_first, strict=True)
            )
            strategies.append(Strategy(in_specs, out_specs))
    return dedupe(strategies)


def _split_first(shape: Sequence[int], first: int | None, size: int, axes: Axes) -> Spec:
    """`shape` split over `axes` on its first dim of `size` from dim `first` on, if any."""
    dim = (
        None
        if first is None
        else next((d for d in range(first, len(shape)) if shape[d] == size), None)
    )
    return make_spec(len(shape), {} if dim is None else {dim: axes})


@leader_rule("scan")
def scan_strategies(node: OpNode, mesh: LogicalMesh) -> list[Strategy]:
    """Batch split guessed from the carries' dim 0 and the xs' dim 1 (dim 0 is the scan axis)."""
    n_consts, n_carry = scan_operand_counts(node.params)
    n_in = len(node.in_avals)
    in_first = [0] * (n_consts + n_carry) + [1] * (n_in - n_consts - n_carry)
    out_first = [0] * n_carry + [1] * (len(node.out_avals) - n_carry)
    return _batch_menu(node, mesh, in_first, out_first, range(n_consts, n_in))


@leader_rule("while")
def while_strategies(node: OpNode, mesh: LogicalMesh) -> list[Strategy]:
    """Batch split guessed from the carries' dim 0 (operands after the cond and body consts)."""
    n_consts = node.params["cond_nconsts"] + node.params["body_nconsts"]
    n_in = len(node.in_avals)
    return _batch_menu(node, mesh, [0] * n_in, [0] * len(node.out_avals), range(n_consts, n_in))


@leader_rule("cond")
def cond_strategies(node: OpNode, mesh: LogicalMesh) -> list[Strategy]:
    """Batch split guessed from the branch operands' dim 0; the branch index stays replicated."""
    n_in = len(node.in_avals)
    return _batch_menu(
        node, mesh, [None] + [0] * (n_in - 1), [0] * len(node.out_avals), range(1, n_in)
    )
