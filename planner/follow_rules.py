"""Follow rules: how cheap ops keep the sharding of the operand they follow (see `strategy`).

Each rule gets the node, the operand position it follows and that operand's spec, and returns the
strategy that leaves the operand where it is, or None when the op cannot (the planner then
replicates the op and prices the gather). A rule must describe what XLA's SPMD partitioner does
with those shardings, so rules are conservative: a split dim that the op slices, pads, reverses,
concatenates, scans, sorts or windows would need a halo exchange or a gather, and gets None.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from autopar.planner.cost import LogicalMesh
from autopar.planner.graph import OpNode
from autopar.planner.plan import Spec, replicated
from autopar.planner.primitives import names_where
from autopar.planner.strategy import (
    Axes,
    Strategy,
    follow_rule,
    operand_spec_or_none,
    split_size,
)

ELEMENTWISE = tuple(sorted(names_where("elementwise")))


def _replicated_operand(node: OpNode, k: int) -> Spec | None:
    """Operand k unsplit (None for a literal): indices, scalars, padding values."""
    return operand_spec_or_none(node, k, replicated(len(node.in_avals[k].shape)))


def _keeps_unsplit(spec: Spec, dims: Iterable[int]) -> bool:
    """Whether none of `dims` is split: the dims an op reorders, pads, slices or scans."""
    return not any(spec[d] for d in dims)


def _same_spec(node: OpNode, spec: Spec, out: Spec | None = None) -> Strategy:
    """Every operand takes `spec`, every output `out` (default `spec`): ops on aligned tensors."""
    in_specs = tuple(operand_spec_or_none(node, k, spec) for k in range(len(node.inputs)))
    return Strategy(in_specs, (spec if out is None else out,) * len(node.out_avals))


# ----------------------------------------------------------------------------- element-wise


@follow_rule(*ELEMENTWISE)
def follow_elementwise(
    node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh
) -> Strategy | None:
    """The output takes the followed spec; operands that broadcast (rank 0, or size-1 dims) don't.

    jax 0.10 lets operands of an element-wise op be scalars or have size-1 dims that broadcast, so
    each operand keeps the output's split only on the dims where it is full size. A followed
    scalar says nothing about the output: None.
    """
    out_shape = node.out_avals[0].shape
    in_shape = node.in_avals[operand].shape
    if in_shape != out_shape and (
        len(in_shape) != len(out_shape)
        or any(
            entry and size != o for entry, size, o in zip(spec, in_shape, out_shape, strict=True)
        )
    ):
        return None
    in_specs = tuple(
        operand_spec_or_none(node, k, _broadcast_view(spec, aval.shape, out_shape))
        for k, aval in enumerate(node.in_avals)
    )
    return Strategy(in_specs, (spec,) * len(node.out_avals))


def _broadcast_view(spec: Spec, shape: Sequence[int], out_shape: Sequence[int]) -> Spec:
    """The part of output spec `spec` an operand of `shape` sees: unsplit where it broadcasts."""
    if shape == out_shape:  # most operands: all of it (a hot path of building the menus)
        return spec
    if len(shape) != len(out_shape):
        return replicated(len(shape))
    return tuple(e if s == o else None for e, s, o in zip(spec, shape, out_shape, strict=True))


@follow_rule("bitcast_convert_type")
def follow_bitcast(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Same dims, plus or minus a trailing dim of bytes when the item size changes."""
    in_rank, out_rank = len(node.in_avals[0].shape), len(node.out_avals[0].shape)
    if out_rank < in_rank and spec[-1]:
        return None
    return Strategy((spec,), ((*spec, None)[:out_rank],))


# ----------------------------------------------------------------------------- layout


@follow_rule("broadcast_in_dim")
def follow_broadcast(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Operand dim i becomes output dim broadcast_dimensions[i]; new dims are unsplit."""
    in_shape, out_shape = node.in_avals[0].shape, node.out_avals[0].shape
    out: list[Axes | None] = [None] * len(out_shape)
    for i, d in enumerate(node.params["broadcast_dimensions"]):
        if spec[i] and in_shape[i] != out_shape[d]:
            return None
        out[d] = spec[i]
    return Strategy((spec,), (tuple(out),))


@follow_rule("transpose")
def follow_transpose(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy:
    """Output dim i is operand dim permutation[i]."""
    return Strategy((spec,), (tuple(spec[p] for p in node.params["permutation"]),))


@follow_rule("squeeze")
def follow_squeeze(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """The removed size-1 dims drop out of the spec."""
    dims = node.params["dimensions"]
    if not _keeps_unsplit(spec, dims):
        return None
    return Strategy((spec,), (tuple(e for d, e in enumerate(spec) if d not in dims),))


@follow_rule("reshape")
def follow_reshape(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Keeps the data in place where the split survives as contiguous blocks (`reshape_spec`)."""
    if node.params.get("dimensions") is not None:
        return None
    out = reshape_spec(node.in_avals[0].shape, node.out_avals[0].shape, spec, mesh)
    return None if out is None else Strategy((spec,), (out,))


def reshape_spec(
    in_shape: Sequence[int], out_shape: Sequence[int], spec: Spec, mesh: LogicalMesh
) -> Spec | None:
    """The output spec of a reshape that moves no data, or None.

    Size-1 dims aside, the dims of both shapes fall into groups with equal products (a merge, a
    split, or both). Each device then holds a contiguous block of a group's elements only if the
    group's split dims come first and all but the last of them are split down to single elements;
    the axes that cut the input group are dealt out, major first, to the output group's dims the
    same way. Example: (B·T, H) split on dim 0 over 4 → (B, T, H) split on B, if 4 divides B.
    """
    if 0 in in_shape:
        return replicated(len(out_shape))
    if any(entry for entry, size in zip(spec, in_shape, strict=True) if size == 1):
        return None
    in_dims = [d for d, size in enumerate(in_shape) if size != 1]
    out_dims = [d for d, size in enumerate(out_shape) if size != 1]
    out: list[Axes | None] = [None] * len(out_shape)
    i = o = 0
    while i < len(in_dims):
        group_in, group_out = [in_dims[i]], [out_dims[o]]
        p_in, p_out = in_shape[in_dims[i]], out_shape[out_dims[o]]
        while p_in != p_out:
            if p_in < p_out:
                i += 1
                group_in.append(in_dims[i])
                p_in *= in_shape[in_dims[i]]
            else:
                o += 1
                group_out.append(out_dims[o])
                p_out *= out_shape[out_dims[o]]
        axes = _block_axes([in_shape[d] for d in group_in], [spec[d] for d in group_in], mesh)
        entries = (
            None if axes is None else _deal_axes([out_shape[d] for d in group_out], axes, mesh)
        )
        if entries is None:
            return None
        for d, entry in zip(group_out, entries, strict=True):
            out[d] = entry
        i, o = i + 1, o + 1
    return tuple(out)


def _block_axes(
    sizes: Sequence[int], entries: Sequence[Axes | None], mesh: LogicalMesh
) -> Axes | None:
    """The axes cutting a dim group into contiguous blocks, major first; None if they don't."""
    axes: list[str] = []
    whole = True  # every dim so far is split down to single elements
    for size, entry in zip(sizes, entries, strict=True):
        if entry and not whole:
            return None
        axes += entry or ()
        whole = whole and split_size(mesh, entry or ()) == size
    return tuple(axes)


def _deal_axes(sizes: Sequence[int], axes: Axes, mesh: LogicalMesh) -> list[Axes | None] | None:
    """Spread `axes` (major first) over dims of `sizes` into the same contiguous blocks, or None."""
    rest = list(axes)
    entries: list[Axes | None] = []
    for size in sizes:
        taken: list[str] = []
        while rest and size % (split_size(mesh, taken) * mesh.axis_size(rest[0])) == 0:
            taken.append(rest.pop(0))
        if rest and split_size(mesh, taken) != size:
            return None
        entries.append(tuple(taken) or None)
    return entries


# ----------------------------------------------------------------------------- reductions


@follow_rule(
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor"
)
def follow_reduce(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy:
    """Reduced dims drop out; where they were split, the result is partial (all-reduced)."""
    axes = set(node.params["axes"])
    partial = tuple(a for d, entry in enumerate(spec) if d in axes and entry for a in entry)
    out = tuple(entry for d, entry in enumerate(spec) if d not in axes)
    return Strategy((spec,), (out,), partial)


@follow_rule("argmax", "argmin")
def follow_argmax(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Reduced dims drop out; they must be unsplit, since per-shard indices do not sum."""
    axes = node.params["axes"]
    if not _keeps_unsplit(spec, axes):
        return None
    return Strategy((spec,), (tuple(e for d, e in enumerate(spec) if d not in axes),))


@follow_rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def follow_cumulative(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Scans along `axis`, which must be unsplit; other dims keep their split."""
    return Strategy((spec,), (spec,)) if _keeps_unsplit(spec, [node.params["axis"]]) else None


@follow_rule("sort")
def follow_sort(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """All operands (keys and values) sort together along `dimension`, which must be unsplit."""
    return _same_spec(node, spec) if _keeps_unsplit(spec, [node.params["dimension"]]) else None


# ----------------------------------------------------------------------------- slicing, joining


@follow_rule("slice")
def follow_slice(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Only dims taken whole keep their split."""
    in_shape, out_shape = node.in_avals[0].shape, node.out_avals[0].shape
    cut = [d for d, (a, b) in enumerate(zip(in_shape, out_shape, strict=True)) if a != b]
    return Strategy((spec,), (spec,)) if _keeps_unsplit(spec, cut) else None


@follow_rule("dynamic_slice")
def follow_dynamic_slice(
    node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh
) -> Strategy | None:
    """Only dims taken whole keep their split; the start indices are replicated scalars."""
    if operand != 0:
        return None
    in_shape, sizes = node.in_avals[0].shape, node.params["slice_sizes"]
    cut = [d for d, (a, b) in enumerate(zip(in_shape, sizes, strict=True)) if a != b]
    if not _keeps_unsplit(spec, cut):
        return None
    indices = (_replicated_operand(node, k) for k in range(1, len(node.inputs)))
    return Strategy((spec, *indices), (spec,))


@follow_rule("dynamic_update_slice")
def follow_dynamic_update_slice(
    node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh
) -> Strategy | None:
    """Operand, update and output share the spec; dims the update covers partly are unsplit."""
    if operand > 1:
        return None
    shape, update = node.in_avals[0].shape, node.in_avals[1].shape
    partly = [d for d, (a, b) in enumerate(zip(shape, update, strict=True)) if a != b]
    if not _keeps_unsplit(spec, partly):
        return None
    indices = (_replicated_operand(node, k) for k in range(2, len(node.inputs)))
    in_specs = (operand_spec_or_none(node, 0, spec), operand_spec_or_none(node, 1, spec), *indices)
    return Strategy(in_specs, (spec,))


@follow_rule("pad")
def follow_pad(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Padded dims (edge or interior) must be unsplit; the padding value is a replicated scalar."""
    if operand != 0:
        return None
    padded = [d for d, cfg in enumerate(node.params["padding_config"]) if tuple(cfg) != (0, 0, 0)]
    if not _keeps_unsplit(spec, padded):
        return None
    return Strategy((spec, _replicated_operand(node, 1)), (spec,))


@follow_rule("concatenate")
def follow_concatenate(
    node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh
) -> Strategy | None:
    """All operands and the output share the spec; the joined dim must be unsplit."""
    return _same_spec(node, spec) if _keeps_unsplit(spec, [node.params["dimension"]]) else None


@follow_rule("split")
def follow_split(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Every piece keeps the spec; the cut dim must be unsplit."""
    return _same_spec(node, spec) if _keeps_unsplit(spec, [node.params["axis"]]) else None


@follow_rule("stack")
def follow_stack(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy:
    """All operands share the spec; the new output dim is unsplit."""
    axis = node.params["axis"]
    return _same_spec(node, spec, (*spec[:axis], None, *spec[axis:]))


@follow_rule("unstack")
def follow_unstack(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Each piece drops the unstacked dim, which must be unsplit."""
    axis = node.params["axis"]
    if not _keeps_unsplit(spec, [axis]):
        return None
    return _same_spec(node, spec, (*spec[:axis], *spec[axis + 1 :]))


@follow_rule("tile")
def follow_tile(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Repeated dims must be unsplit; the others keep their split."""
    repeated = [d for d, r in enumerate(node.params["reps"]) if r != 1]
    return Strategy((spec,), (spec,)) if _keeps_unsplit(spec, repeated) else None


@follow_rule("rev")
def follow_rev(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Reversed dims must be unsplit (reversing a split dim swaps shards between devices)."""
    return Strategy((spec,), (spec,)) if _keeps_unsplit(spec, node.params["dimensions"]) else None


# ----------------------------------------------------------------------------- windows (pooling)


def _windowed_dims(params: Mapping[str, Any]) -> list[int]:
    """Dims a window op mixes: any window, stride, padding or dilation other than the identity."""
    ndim = len(params["window_dimensions"])
    ones = (1,) * ndim
    return [
        d
        for d in range(ndim)
        if params["window_dimensions"][d] != 1
        or params["window_strides"][d] != 1
        or tuple(params["padding"][d]) != (0, 0)
        or params.get("base_dilation", ones)[d] != 1
        or params.get("window_dilation", ones)[d] != 1
    ]


@follow_rule(
    "reduce_window_sum",
    "reduce_window_max",
    "reduce_window_min",
    "select_and_scatter_add",
    "select_and_gather_add",
)
def follow_window(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy | None:
    """Pooling and its gradients: windowed dims must be unsplit (no halo exchange is priced)."""
    return _same_spec(node, spec) if _keeps_unsplit(spec, _windowed_dims(node.params)) else None


# ----------------------------------------------------------------------------- PRNG keys


@follow_rule("random_wrap")
def follow_random_wrap(
    node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh
) -> Strategy | None:
    """Key data (..., words) becomes keys (...): the trailing words dim must be unsplit."""
    return Strategy((spec,), (spec[:-1],)) if not spec[-1] else None


@follow_rule("random_unwrap")
def follow_random_unwrap(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy:
    """Keys (...) become key data (..., words), with the words dim unsplit."""
    return Strategy((spec,), ((*spec, None),))


@follow_rule("random_split")
def follow_random_split(node: OpNode, operand: int, spec: Spec, mesh: LogicalMesh) -> Strategy:
    """Keys (...) become keys (..., *shape), with the new dims unsplit."""
    return Strategy((spec,), ((*spec, *replicated(len(node.params["shape"]))),))
