"""Layout copies around dots (`planner.dot_layout`): which operands XLA copies into plain
matrices, checked on einsums whose HLO shows them, and what the roofline charges for them on a
CPU (nothing on a GPU)."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.planner.cluster import ClusterSpec
from autopar.planner.dot_layout import layout_copies, swaps_free_dims
from autopar.planner.graph import build_graph

CPU = dataclasses.replace(ClusterSpec.local(1), transpose_bandwidth=2e9)
B, S, H, D = 8, 32, 4, 16
BSHD = jax.ShapeDtypeStruct((B, S, H, D), jnp.float32)
BHSD = jax.ShapeDtypeStruct((B, H, S, D), jnp.float32)
MATRIX = jax.ShapeDtypeStruct((256, 64), jnp.float32)

# name: (function of two operands, operands, {operand position: copied layout})
CASES = {
    "a matmul": (jnp.matmul, (MATRIX, MATRIX.update(shape=(64, 32))), {}),
    "a weight gradient x^T·dy reads x transposed": (
        lambda x, y: jnp.einsum("nk,nm->km", x, y),
        (MATRIX, MATRIX),
        {},
    ),
    "heads after the sequence: both copied": (
        lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k),
        (BSHD, BSHD),
        {0: (0, 2, 1, 3), 1: (0, 2, 3, 1)},
    ),
    "heads first: none": (lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k), (BHSD, BHSD), {}),
    "a transpose to heads first is folded into the dot": (
        lambda q, k: jnp.einsum(
            "bhqd,bhkd->bhqk", q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        ),
        (BSHD, BSHD),
        {0: (0, 2, 1, 3), 1: (0, 2, 3, 1)},
    ),
    "two contracting dims in order: none": (
        lambda o, w: jnp.einsum("bshd,hdm->bsm", o, w),
        (BSHD, jax.ShapeDtypeStruct((H, D, 64), jnp.float32)),
        {},
    ),
    "two contracting dims as the lhs's majors: the lhs copied": (
        lambda x, y: jnp.einsum("bsk,bsm->km", x, y),
        (BSHD.update(shape=(B, S, 64)), BSHD.update(shape=(B, S, 32))),
        {0: (2, 0, 1)},
    ),
}


def _dots(fun, operands):
    graph = build_graph(jax.make_jaxpr(fun)(*operands))
    return graph, [n for n in graph.nodes if n.primitive == "dot_general"]


@pytest.mark.parametrize("fun, operands, copied", CASES.values(), ids=CASES.keys())
def test_operands_copied_into_plain_matrices(fun, operands, copied):
    graph, (dot,) = _dots(fun, operands)
    found = {c.position: c.order for c in layout_copies(graph, dot)}
    assert found == copied


# name: (function of two operands, operands): XLA:CPU copies the jaxpr's lhs into matmul order
# whether or not it then swaps the operands to write the result transposed
LHS_COPIED = {
    "(x^T·y)^T over two contracting dims": (
        lambda x, y: jnp.einsum("bsk,bsm->km", x, y).T,
        (BSHD.update(shape=(B, S, 64)), BSHD.update(shape=(B, S, 32))),
    ),
    "a batched weight gradient, transposed (an MoE expert's)": (
        lambda dz, x: jnp.transpose(
            jax.lax.dot_general(dz, x, (((1, 2), (1, 2)), ((0,), (0,)))), (0, 2, 1)
        ),
        (BSHD.update(shape=(4, 8, 16, 64)), BSHD.update(shape=(4, 8, 16, 32))),
    ),
}


def _hlo_copy_sizes(fun, operands) -> list[int]:
    """Elements of each copy kernel in the entry computation of `fun` compiled for this CPU."""
    text = jax.jit(fun).lower(*operands).compile().as_text()
    entry = text[text.index("ENTRY") :]
    kernel = r"^\s+(?:ROOT )?%?[\w.\-]*(?:copy|transpose)[\w.\-]* = \w+\[([\d,]*)\]"
    shapes = re.findall(kernel, entry, re.M)
    return sorted(math.prod(int(d) for d in shape.split(",")) for shape in shapes)


@pytest.mark.parametrize("fun, operands", LHS_COPIED.values(), ids=LHS_COPIED.keys())
def test_the_jaxprs_lhs_is_copied_even_where_xla_swaps_the_operands(fun, operands):
    graph, (dot,) = _dots(fun, operands)
    (copy,) = layout_copies(graph, dot)
    assert copy.position == 0
    assert _hlo_copy_sizes(fun, operands) == [dot.in_avals[0].size]


def test_a_result_transposed_is_free_only_where_each_side_has_one_free_dim():
    """XLA writes 'bqk,bkd->bqd' transposed by swapping its operands, but copies the result of
    'bsk,km->bsm' transposed to 'mbs' (it merges b and s first)."""
    p, v = BSHD.update(shape=(B, S, 64)), BSHD.update(shape=(B, 64, 16))
    x, w = BSHD.update(shape=(B, S, 64)), MATRIX.update(shape=(64, 128))
    cases = [
        (lambda p, v: jnp.einsum("bqk,bkd->bqd", p, v).transpose(0, 2, 1), (p, v), True),
        (lambda x, w: jnp.einsum("bsk,km->bsm", x, w).transpose(2, 0, 1), (x, w), False),
    ]
    for fun, operands, free in cases:
        graph, (dot,) = _dots(fun, operands)
        (transpose,) = [n for n in graph.nodes if n.primitive == "transpose"]
        assert swaps_free_dims(dot, transpose.params["permutation"]) is free
        assert _hlo_copy_sizes(fun, operands) == ([] if free else [dot.out_avals[0].size])


def test_a_fusion_writes_a_copied_operand_unless_a_reduction_reads_it():
    """The element-wise gradient of a weight gradient's lhs, from two arrays: XLA fuses its loop
    into the copy (the copy kernel reads both), except where a bias gradient also reduces it
    (the copy reads the gradient, written once)."""
    x, g = BSHD.update(shape=(B, S, 32)), BSHD.update(shape=(B, S, 64))
    dims = (((0, 1), (0, 1)), ((), ()))

    def weight_gradient(g, h, x):
        return jax.lax.dot_general(jnp.tanh(g) * h, x, dims)

    def with_bias(g, h, x):
        dz = jnp.tanh(g) * h
        return jax.lax.dot_general(dz, x, dims), dz.sum((0, 1))

    for fun, fused, operands_read in ((weight_gradient, True, 2), (with_bias, False, 1)):
        graph, (dot,) = _dots(fun, (g, g, x))
        (copy,) = layout_copies(graph, dot)
        assert copy.written_by_fusion is fused
        text = jax.jit(fun).lower(g, g, x).compile().as_text()
        entry = text[text.index("ENTRY") :]
        (copied,) = re.findall(r"%copy\S*fusion\S* = \S+ fusion\(([^)]*)\)", entry)
        assert len(copied.split(",")) == operands_read


@pytest.mark.parametrize("name", ["heads after the sequence: both copied", "heads first: none"])
def test_xla_cpu_makes_the_copies_predicted(name):
    fun, operands, copied = CASES[name]
    assert len(_hlo_copy_sizes(fun, operands)) == len(copied)


def _compute_s(fun, operands, spec: ClusterSpec) -> float:
    step = lambda w, x: (w, fun(x, w))  # noqa: E731
    return autopar.plan(step, operands[1], operands[0], cluster_spec=spec).predicted.compute_s


def test_a_cpu_pays_each_copy_a_gpu_none():
    """Scores with heads after the sequence, against the same scores over operands already laid
    out heads first: a CPU pays one plain and one strided copy of a (B, S, H, D) operand, each
    read and written, and a kernel each; a GPU pays nothing."""
    fun, operands, _ = CASES["heads after the sequence: both copied"]
    plain, _, _ = CASES["heads first: none"]
    nbytes = BSHD.size * 4
    plain_s = 2 * nbytes / (CPU.memory_bandwidth * CPU.memory_efficiency)
    strided_s = 2 * nbytes / CPU.transpose_bandwidth
    copies_s = plain_s + strided_s + 2 * CPU.kernel_overhead_s
    extra = _compute_s(fun, operands, CPU) - _compute_s(plain, (BHSD, BHSD), CPU)
    assert extra == pytest.approx(copies_s, rel=1e-6)
    gpu = ClusterSpec.preset("8xV100-p3").with_devices(1, 1)
    assert _compute_s(fun, operands, gpu) == pytest.approx(_compute_s(plain, (BHSD, BHSD), gpu))
