"""What XLA:CPU copies into another layout around a contraction before its library kernel runs.

Its matmul kernels (YNNPACK, Eigen) multiply [batch, rows, k] by [batch, k, columns] buffers, and
read a side with one free and one contracting dim (a matrix) either way round. XLA's
`DotDecomposer` transposes any other operand into that order first: a copy of the whole operand,
a kernel of its own (the `copy_bitcast_fusion`s and `transpose_copy_fusion`s of a profile). What
counts is the order of the buffer under the jaxpr's transposes, which XLA folds into the dot.
The copies follow the jaxpr's operand order (the lhs is laid out [batch, free, contracting]),
even where XLA later swaps the operands to write a transposed result: (x^T·y)^T over two
contracting dims copies x. XLA sorts the contracting dims by one side's order where that spares
a copy. Where an element-wise fusion writes the operand, XLA fuses its loop into the copy (no
buffer of its own, the same strided pass, reading what the fusion reads), unless a reduction
also reads it (a bias gradient) or it is read elsewhere too and computes something expensive
(`_loop_fuses_into_copy`): XLA then writes it once and copies that.
XLA swaps a dot's operands to write its result transposed only where each side has one free
dim (a reshape of merged free dims stands between the dot and the transpose otherwise).
A convolution runs on an image laid out [batch, spatial..., feature] and a kernel
[spatial..., in, out], and writes its result like the image: a weight gradient's convolution
(batch and feature dims swapped) copies its image, its output gradient and its result.

The memory model counts the dot copies' buffers (held to XLA's memory analysis to the byte in
`tests/test_shard_parallel.py`), the roofline their time (`planner.roofline`). On the zoo of
`make bench-costmodel` these rules find 41 copies in the GPT step, 49 in MoE's, 21 in
transformers' GPT-2's, 27 in Llama's, 36 in the equinox transformer's and 33 in Wide-ResNet's,
against 47, 59, 39, 33, 44 and 25 copy and transpose fusions in XLA:CPU's HLO (plain copies,
mostly of parameters, left out; among the rest: transposes of results that element-wise ops
read, which the roofline prices as transposes). XLA:GPU's matmuls read strided operands and
make about half as many.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autopar.planner.graph import OpGraph, OpNode, ValueRef
from autopar.planner.groups import TRANSPARENT
from autopar.planner.markers import PARAM_USE
from autopar.planner.primitives import PRIMITIVES, FlopRule, names_where

_FUSED = names_where("fuses")  # element-wise: a loop fusion writes it
_REDUCTIONS = frozenset(n for n, info in PRIMITIVES.items() if info.flops is FlopRule.REDUCTION)
_EXPENSIVE = names_where("expensive")  # XLA's `IsExpensive`: not computed twice
_ADDS = frozenset({"add", "add_any"})
_MARKERS = (PARAM_USE, *TRANSPARENT)  # their outputs are their operands


@dataclasses.dataclass(frozen=True, slots=True)
class OperandLayout:
    """A contraction operand as the contraction reads it: the buffer behind the jaxpr's
    transposes and markers (`source`), and for each dim of the operand the dim of `source` it
    is (`order`)."""

    source: ValueRef
    order: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutCopy:
    """A copy XLA makes of operand `position` of a contraction (None: of its result, into the
    layout the jaxpr asks for): `source` laid out as `order` (dim i of the copy is dim order[i]
    of `source`). `strided` when the minor dim moves. `written_by_fusion` where XLA fuses the
    element-wise loop that writes the operand into the copy (`_loop_fuses_into_copy`): no
    buffer of its own, a strided pass over what that loop reads."""

    position: int | None
    source: ValueRef | None
    order: tuple[int, ...]
    written_by_fusion: bool = False

    @property
    def strided(self) -> bool:
        return self.order[-1] != len(self.order) - 1


def operand_layout(graph: OpGraph, ref: ValueRef, rank: int) -> OperandLayout:
    """What a contraction reading `ref` reads once XLA folds the transposes that produce it
    (markers pass their operands through)."""
    order = tuple(range(rank))
    while (producer := graph.producer(ref)) is not None:
        if producer.primitive == "transpose":
            permutation = producer.params["permutation"]
            order = tuple(permutation[d] for d in order)
            ref = producer.inputs[0]
        elif producer.primitive in _MARKERS:
            ref = producer.inputs[ref.index]
        else:
            break
    return OperandLayout(ref, order)


def swaps_free_dims(node: OpNode, permutation: Sequence[int]) -> bool:
    """Whether transposing dot `node`'s result by `permutation` only swaps the lhs's free dim
    with the rhs's (batch dims stay first, one free dim a side): XLA:CPU then computes the dot
    with its operands swapped and writes the result in that order, with no copy ('bsk,km->bsm'
    transposed to 'mbs' is copied: XLA merges b and s first, and the reshape stays)."""
    (lhs_c, rhs_c), (lhs_b, _) = node.params["dimension_numbers"]
    nb = len(lhs_b)
    lhs_free = len(node.in_avals[0].shape) - nb - len(lhs_c)
    rhs_free = len(node.in_avals[1].shape) - nb - len(rhs_c)
    swapped = [*range(nb), *range(nb + lhs_free, nb + lhs_free + rhs_free)]
    swapped += range(nb, nb + lhs_free)
    return list(permutation) == swapped and lhs_free == 1 and rhs_free == 1


def layout_copies(graph: OpGraph, node: OpNode) -> tuple[LayoutCopy, ...]:
    """What XLA copies into another layout around contraction `node` (see the module
    docstring): operands of a dot_general or a convolution, and a convolution's result."""
    if node.primitive == "conv_general_dilated":
        return _conv_copies(graph, node)
    if node.primitive != "dot_general":
        return ()
    return _dot_copies(graph, node)


def _copy(graph: OpGraph, position: int, layout: OperandLayout, wanted) -> LayoutCopy:
    """The copy of operand `position`, read as `layout`, into the operand dims order `wanted`."""
    fused = _loop_fuses_into_copy(graph, layout.source)
    return LayoutCopy(position, layout.source, tuple(layout.order[d] for d in wanted), fused)


def _loop_fuses_into_copy(graph: OpGraph, source: ValueRef) -> bool:
    """Whether XLA:CPU fuses the element-wise loop that writes `source` into a layout copy of
    it: not where a reduction also reads it (a bias gradient: XLA writes it once and copies
    that), nor where another reader needs it too and the loop computes what XLA does not
    compute twice (an `expensive` primitive: an exp, a divide) in its chain of element-wise
    operands that have no other reader (a GELU's gradient, whose tanh the forward pass wrote,
    is computed again inside the copy), nor where it adds a scatter-add's result (XLA scatters
    into the other addend in place: a cross-entropy's gradient, copied as written)."""
    producer = graph.producer(source)
    if producer is None or producer.primitive not in _FUSED:
        return False
    if producer.primitive in _ADDS and any(
        (p := graph.producer(ref)) is not None and p.primitive == "scatter-add"
        for ref in producer.inputs
    ):
        return False
    readers = [graph.node(r).primitive for r, _ in graph.consumers(source.node)]
    if any(r in _REDUCTIONS for r in readers):
        return False
    return len(readers) == 1 or not _computes_expensive(graph, producer)


def _computes_expensive(graph: OpGraph, node: OpNode) -> bool:
    """Whether `node` or an element-wise operand chain of it that only it reads is expensive."""
    stack, seen = [node], {node.id}
    while stack:
        n = stack.pop()
        if n.primitive in _EXPENSIVE:
            return True
        for ref in n.inputs:
            p = graph.producer(ref)
            if p is None or p.id in seen or p.primitive not in _FUSED:
                continue
            if len(graph.consumers(p.id)) == 1:
                seen.add(p.id)
                stack.append(p)
    return False


def _conv_copies(graph: OpGraph, node: OpNode) -> tuple[LayoutCopy, ...]:
    """A convolution runs on an image laid out [batch, spatial..., feature], a kernel
    [spatial..., in, out] and a result like the image (XLA's convolution canonicalization);
    an operand laid out otherwise is copied (a weight gradient's image and output gradient, an
    input gradient's flipped kernel), and so is a result asked for in another layout."""
    lhs_spec, rhs_spec, out_spec = node.params["dimension_numbers"]
    copies = []
    wanted_layouts = (
        (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]),
        (*rhs_spec[2:], *rhs_spec[1::-1]),
    )
    for position, wanted in enumerate(wanted_layouts):
        layout = operand_layout(graph, node.inputs[position], len(wanted))
        if tuple(layout.order[d] for d in wanted) != tuple(range(len(wanted))):
            copies.append(_copy(graph, position, layout, wanted))
    result = (out_spec[0], *out_spec[2:], out_spec[1])  # where the conv writes each dim
    if result != tuple(range(len(out_spec))):
        copies.append(LayoutCopy(None, None, tuple(result.index(d) for d in range(len(result)))))
    return tuple(copies)


def _dot_copies(graph: OpGraph, node: OpNode) -> tuple[LayoutCopy, ...]:
    """The operands of dot_general `node` that XLA copies into matmul order first."""
    (contracting, batch) = node.params["dimension_numbers"]
    layouts = [
        operand_layout(graph, ref, len(aval.shape))
        for ref, aval in zip(node.inputs, node.in_avals, strict=True)
    ]
    best: tuple[LayoutCopy, ...] | None = None
    pairs = range(len(contracting[0]))
    for by in (0, 1):  # XLA sorts the contracting pairs by one side's buffer order
        pair_order = sorted(pairs, key=lambda i, by=by: layouts[by].order[contracting[by][i]])
        copies = []
        for side, rows_first in ((0, True), (1, False)):  # the lhs gives the result's rows
            b, rank = list(batch[side]), len(layouts[side].order)
            c = [contracting[side][i] for i in pair_order]
            free = [d for d in range(rank) if d not in b and d not in c]
            matmul = [b + free + c] if rows_first else [b + c + free]
            if len(free) == 1 and len(c) == 1:  # a matrix: the library reads it transposed
                matmul.append(b + c + free if rows_first else b + free + c)
            stored = sorted(range(rank), key=layouts[side].order.__getitem__)
            if stored not in matmul:
                copies.append(_copy(graph, side, layouts[side], matmul[0]))
        if best is None or len(copies) < len(best):
            best = tuple(copies)
    return best or ()
