"""What XLA copies into another layout around a contraction before its library kernel runs.

XLA hands a matmul library (YNNPACK or Eigen on a CPU) plain matrices: a dot is *canonical* when
its batch dims lead both operands in order and each operand has at most one contracting and one
free dim; the library then reads either operand transposed. Any other dot goes through XLA's
`DotDecomposer`, which transposes the lhs to [batch, free, contracting] and the rhs to
[batch, contracting, free] and collapses each group into one dim. A transpose that the
operand is already in is a bitcast; any other is a copy of the whole operand, a kernel of its own
(the `copy_bitcast_fusion`s and `transpose_copy_fusion`s of XLA:CPU's profiles). Before that,
XLA folds the jaxpr's transposes into the dot that reads them (the dot reads the transpose's
operand with permuted dimension numbers), computes a dot whose result is transposed so that
only the two operands' free dims swap with its operands swapped, and sorts the contracting dims
by one side's order where that spares a copy.

A convolution likewise runs on an image laid out [batch, spatial..., feature], a kernel
[spatial..., in, out] and writes its result like the image: a weight gradient's convolution
(batch and feature dims swapped) copies its image, its output gradient and its result.

Counted on `make bench-costmodel`'s zoo, these rules find 44 copies (44 MiB) in the GPT step
where XLA:CPU's HLO has 47 copy kernels outside parameter copies (49 MiB), MoE 52 (42 MiB)
against 59 (49 MiB), transformers' GPT-2 34 (18 MiB) against 39 (26 MiB), Llama 40 against 33
the equinox transformer 42 against 44, and Wide-ResNet 33 copies (4.9 MiB) against 25 (4.8 MiB).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autopar.planner.graph import OpGraph, OpNode, ValueRef


@dataclasses.dataclass(frozen=True, slots=True)
class OperandLayout:
    """A dot operand as the dot reads it: the value behind the jaxpr's transposes (`source`), and
    for each dim of the operand the dim of `source` it is (`order`)."""

    source: ValueRef
    order: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutCopy:
    """A copy XLA makes of operand `position` of a contraction (None: of its result, into the
    layout the jaxpr asks for): `source` laid out as `order` (dim i of the copy is dim order[i]
    of `source`). `strided` when the minor dim moves."""

    position: int | None
    source: ValueRef | None
    order: tuple[int, ...]

    @property
    def strided(self) -> bool:
        return self.order[-1] != len(self.order) - 1


def operand_layout(graph: OpGraph, ref: ValueRef, rank: int) -> OperandLayout:
    """What a dot reading `ref` reads once XLA folds the transposes that produce it."""
    order = tuple(range(rank))
    producer = graph.producer(ref)
    while producer is not None and producer.primitive == "transpose":
        permutation = producer.params["permutation"]
        order = tuple(permutation[d] for d in order)
        ref = producer.inputs[0]
        producer = graph.producer(ref)
    return OperandLayout(ref, order)


def swaps_free_dims(node: OpNode, permutation: Sequence[int]) -> bool:
    """Whether transposing dot `node`'s result by `permutation` only swaps the lhs's free dims
    with the rhs's (batch dims stay first): XLA then computes the dot with its operands swapped
    and writes the result in that order, with no copy."""
    (lhs_c, rhs_c), (lhs_b, _) = node.params["dimension_numbers"]
    nb = len(lhs_b)
    lhs_free = len(node.in_avals[0].shape) - nb - len(lhs_c)
    rhs_free = len(node.in_avals[1].shape) - nb - len(rhs_c)
    swapped = [*range(nb), *range(nb + lhs_free, nb + lhs_free + rhs_free)]
    swapped += range(nb, nb + lhs_free)
    return list(permutation) == swapped and lhs_free > 0 and rhs_free > 0


def _result_swapped(graph: OpGraph, node: OpNode) -> bool:
    """Whether XLA computes `node` with its operands swapped: its one reader is a transpose that
    only swaps the operands' free dims (`swaps_free_dims`)."""
    readers = graph.consumers(node.id)
    if len(readers) != 1:
        return False
    reader = graph.node(readers[0][0])
    return reader.primitive == "transpose" and swaps_free_dims(node, reader.params["permutation"])


def _dims(node: OpNode, position: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(contracting dims, batch dims) of operand `position` of dot `node`."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = node.params["dimension_numbers"]
    return (tuple(lhs_c), tuple(lhs_b)) if position == 0 else (tuple(rhs_c), tuple(rhs_b))


def _canonical(batch: Sequence[int], contracting: Sequence[int], rank: int) -> bool:
    """Batch dims leading in order, at most one contracting and one free dim."""
    return tuple(batch) == tuple(range(len(batch))) and len(contracting) <= 1 >= (
        rank - len(batch) - len(contracting)
    )


def layout_copies(graph: OpGraph, node: OpNode) -> tuple[LayoutCopy, ...]:
    """What XLA copies into another layout around contraction `node` (see the module
    docstring): operands of a dot_general or a convolution, and a convolution's result."""
    if node.primitive == "conv_general_dilated":
        return _conv_copies(graph, node)
    if node.primitive != "dot_general":
        return ()
    return _dot_copies(graph, node)


def _conv_copies(graph: OpGraph, node: OpNode) -> tuple[LayoutCopy, ...]:
    """A convolution runs on an image laid out [batch, spatial..., feature], a kernel
    [spatial..., in, out] and a result like the image (XLA's convolution canonicalization);
    an operand laid out otherwise is copied (a weight gradient's image and output gradient, an
    input gradient's flipped kernel), and so is a result asked for in another layout."""
    lhs_spec, rhs_spec, out_spec = node.params["dimension_numbers"]
    copies = []
    for position, (spec, canonical) in enumerate(
        (
            (lhs_spec, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])),
            (rhs_spec, (*rhs_spec[2:], *rhs_spec[1::-1])),
        )
    ):
        layout = operand_layout(graph, node.inputs[position], len(spec))
        wanted = tuple(layout.order[d] for d in canonical)
        if wanted != tuple(range(len(spec))):
            copies.append(LayoutCopy(position, layout.source, wanted))
    result = (out_spec[0], *out_spec[2:], out_spec[1])  # where the conv writes each dim
    if result != tuple(range(len(out_spec))):
        copies.append(LayoutCopy(None, None, tuple(result.index(d) for d in range(len(result)))))
    return tuple(copies)


def _dot_copies(graph: OpGraph, node: OpNode) -> tuple[LayoutCopy, ...]:
    """The operands of dot_general `node` that XLA copies into plain matrices."""
    layouts = [
        operand_layout(graph, ref, len(aval.shape))
        for ref, aval in zip(node.inputs, node.in_avals, strict=True)
    ]
    dims = [_dims(node, p) for p in (0, 1)]
    # in each source's own dims: contracting and batch dims
    contracting = [
        tuple(lay.order[d] for d in c) for lay, (c, _) in zip(layouts, dims, strict=True)
    ]
    batch = [tuple(lay.order[d] for d in b) for lay, (_, b) in zip(layouts, dims, strict=True)]
    ranks = [len(lay.order) for lay in layouts]
    if all(map(_canonical, batch, contracting, ranks)):
        return ()
    lhs, rhs = (1, 0) if _result_swapped(graph, node) else (0, 1)
    best: tuple[LayoutCopy, ...] | None = None
    pairs = range(len(contracting[0]))
    for by in (lhs, rhs):  # XLA sorts the contracting pairs by one side's dims
        order = sorted(pairs, key=lambda i, by=by: contracting[by][i])
        copies = []
        for p, free_first in ((lhs, True), (rhs, False)):
            c = tuple(contracting[p][i] for i in order)
            free = tuple(d for d in range(ranks[p]) if d not in c and d not in batch[p])
            wanted = batch[p] + (free + c if free_first else c + free)
            if wanted != tuple(range(ranks[p])):
                copies.append(LayoutCopy(p, layouts[p].source, wanted))
        if best is None or len(copies) < len(best):
            best = tuple(copies)
    return best or ()
