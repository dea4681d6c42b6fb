"""Layout copies around dots (`planner.dot_layout`): which operands XLA copies into plain
matrices, checked on einsums whose HLO shows them, and what the roofline charges for them on a
CPU (nothing on a GPU)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.planner.cluster import ClusterSpec
from autopar.planner.dot_layout import layout_copies
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


def test_a_result_transposed_by_swapping_its_operands_copies_the_other_side():
    """(x^T·y)^T over two contracting dims: XLA computes y^T·x, so y is the operand laid out
    as a lhs, and it is y that is copied; the transpose after the dot is free."""
    x, y = BSHD.update(shape=(B, S, 64)), BSHD.update(shape=(B, S, 32))
    graph, (dot,) = _dots(lambda x, y: jnp.einsum("bsk,bsm->km", x, y).T, (x, y))
    assert {c.position: c.order for c in layout_copies(graph, dot)} == {1: (2, 0, 1)}


def _hlo_copies(fun, operands) -> int:
    """Copy kernels in the entry computation of `fun` compiled for this CPU."""
    text = jax.jit(fun).lower(*operands).compile().as_text()
    entry = text[text.index("ENTRY") :]
    names = re.findall(r"^\s+%?([\w.\-]+) = ", entry, re.M)
    return sum("copy" in n or "transpose" in n for n in names)


@pytest.mark.parametrize("name", ["heads after the sequence: both copied", "heads first: none"])
def test_xla_cpu_makes_the_copies_predicted(name):
    fun, operands, copied = CASES[name]
    assert _hlo_copies(fun, operands) == len(copied)


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
