"""Tests of planner.graph: jaxpr -> OpGraph, inlining, FLOPs and graph queries (no devices)."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.extend.core import Primitive

from autopar.planner.graph import (
    OpGraph,
    OpNode,
    TensorInfo,
    ValueKind,
    ValueRef,
    build_graph,
    inlined_body,
    is_checkpoint,
    nodes_by_primitive,
    resolve_input,
)

INLINED = {"jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "remat2"}
f32 = jnp.float32


def graph_of(fn, *args) -> OpGraph:
    return build_graph(jax.make_jaxpr(fn)(*args))


def node_ref(node_id: str, index: int = 0) -> ValueRef:
    return ValueRef(ValueKind.NODE, index, node_id)


def input_ref(index: int) -> ValueRef:
    return ValueRef(ValueKind.INPUT, index)


# ----------------------------------------------------------------------------- functions


def mlp_loss(params, x):
    (w1, w2) = params
    return jnp.sum(jnp.tanh(x @ w1) @ w2)


@jax.jit
def _inner(a):
    return jnp.sin(a) * 2.0


@jax.jit
def _middle(a):
    return _inner(jnp.cos(a)) + 1.0


def nested_jit(a, b):
    return _middle(jnp.exp(a * b + 1.0)) - a


@jax.custom_vjp
def sin_vjp(a):
    return jnp.sin(a)


sin_vjp.defvjp(lambda a: (jnp.sin(a), jnp.cos(a)), lambda cos_a, g: (cos_a * g,))

_CONST = np.arange(3.0, dtype=np.float32)
_X = jnp.ones((4, 3), f32)
_W = (jnp.ones((3, 5), f32), jnp.ones((5, 2), f32))

FAMILY = {
    "mlp_value_and_grad": (jax.value_and_grad(mlp_loss), (_W, _X)),
    "nested_jit": (nested_jit, (_X, _X)),
    "checkpoint_grad": (jax.grad(lambda a: jax.checkpoint(jnp.sin)(jnp.sin(a)).sum()), (_X,)),
    "nested_checkpoint": (jax.checkpoint(lambda a: jax.checkpoint(jnp.sin)(a) * 2), (_X,)),
    "relu_grad": (jax.grad(lambda a: jax.nn.relu(a).sum()), (_X,)),
    "gelu_exact": (lambda a: jax.nn.gelu(a, approximate=False), (_X,)),
    "custom_vjp_grad": (jax.grad(lambda a: sin_vjp(a).sum()), (_X,)),
    "scan": (
        lambda a: lax.scan(lambda c, y: (c + y @ y.T, None), a @ a.T, jnp.stack([a] * 5)),
        (_X,),
    ),
    "consts": (lambda a: jax.jit(lambda b: b + jnp.asarray(_CONST))(a) * _CONST, (_X,)),
}


def _walk_ids(jaxpr, prefix=""):
    """Leaf eqn paths, walked independently with `inlined_body` as the runtime interpreter does."""
    for j, eqn in enumerate(jaxpr.eqns):
        body = inlined_body(eqn)
        if body is None:
            yield f"{prefix}{j}", eqn.primitive.name
        else:
            yield from _walk_ids(body[0], f"{prefix}{j}/")


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_graph_invariants(name):
    fn, args = FAMILY[name]
    closed = jax.make_jaxpr(fn)(*args)
    graph = build_graph(closed)
    assert [(n.id, n.primitive) for n in graph.nodes] == list(_walk_ids(closed.jaxpr))
    assert not INLINED & {n.primitive for n in graph.nodes}
    seen: set[str] = set()
    for node in graph.nodes:
        for ref in node.inputs:
            assert ref.kind is not ValueKind.NODE or ref.node in seen  # topological order
        assert len(node.in_avals) == len(node.inputs)
        assert node.flops >= 0 and node.bytes_accessed >= 0
        seen.add(node.id)
    assert len(graph.outputs) == len(closed.jaxpr.outvars)
    assert graph.inputs == tuple(
        TensorInfo(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars
    )
    assert len(graph) == len(graph.nodes)
    assert graph.total_flops == pytest.approx(sum(n.flops for n in graph.nodes))


# ----------------------------------------------------------------------------- FLOPs


def test_mlp_loss_grad_dot_flops_exact():
    batch, d_in, hidden, d_out = 8, 16, 32, 4
    w = (jnp.ones((d_in, hidden)), jnp.ones((hidden, d_out)))
    graph = graph_of(jax.value_and_grad(mlp_loss), w, jnp.ones((batch, d_in)))
    layer1, layer2 = 2 * batch * d_in * hidden, 2 * batch * hidden * d_out
    # forward: both layers; backward: dW2 and dh through layer 2, only dW1 through layer 1.
    dots = nodes_by_primitive(graph, "dot_general")
    assert sorted(n.flops for n in dots) == sorted([layer1, layer2, layer2, layer2, layer1])
    first = dots[0]
    assert first.id == "0" and first.inputs == (input_ref(2), input_ref(0))
    assert [a.shape for a in first.in_avals] == [(batch, d_in), (d_in, hidden)]
    assert (
        first.in_avals[0].dtype == np.dtype("float32")
        and first.in_avals[0].nbytes == 4 * batch * d_in
    )
    assert first.bytes_accessed == 4 * (batch * d_in + d_in * hidden + batch * hidden)


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda a: a + 1.0, 12),
        (jnp.tanh, 12),
        (lambda a: lax.integer_pow(a, 3), 12),
        (lambda a: jnp.where(a > 0, a, 0.0), 12 + 12),  # gt + select_n
        (lambda a: a.sum(axis=1), 12),
        (jnp.argmax, 12),
        (lambda a: a.T.reshape(12)[2:5], 0),
        (lambda a: a.astype(jnp.bfloat16), 0),
    ],
)
def test_small_op_flops(fn, expected):
    assert graph_of(fn, _X).total_flops == expected


def test_scatter_add_counts_updates():
    graph = graph_of(lambda a: jnp.zeros(5).at[jnp.array([0, 1, 1])].add(a[0]), _X)
    (node,) = nodes_by_primitive(graph, "scatter-add")
    assert node.flops == 3


def test_literal_operands_count_no_bytes():
    (node,) = graph_of(lambda a: a + 1.0, _X).nodes
    assert node.inputs[1].kind is ValueKind.LITERAL and node.inputs[1].literal == 1.0
    assert node.bytes_accessed == 2 * 12 * 4


def test_conv_flops():
    lhs, rhs = jnp.ones((2, 6, 10, 10)), jnp.ones((8, 3, 3, 3))  # 2 feature groups of 3
    graph = graph_of(
        lambda a, k: lax.conv_general_dilated(a, k, (1, 1), "SAME", feature_group_count=2), lhs, rhs
    )
    (node,) = nodes_by_primitive(graph, "conv_general_dilated")
    assert node.flops == 2 * (2 * 8 * 10 * 10) * (3 * 3 * 3)


def test_scan_is_one_node_with_length_times_body_flops():
    graph = graph_of(FAMILY["scan"][0], _X)
    (scan,) = nodes_by_primitive(graph, "scan")
    body = 2 * 4 * 4 * 3 + 4 * 4  # dot + add per iteration (transpose is free)
    assert scan.flops == 5 * body
    assert not nodes_by_primitive(graph, "add")


def test_while_counts_body_once_and_keeps_dropped_outputs():
    def fn(a):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, a))[1]

    (loop,) = graph_of(fn, _X).nodes
    assert loop.primitive == "while"
    assert loop.flops == 1 + 12 + 1  # body add + mul, cond lt
    assert [a.shape for a in loop.out_avals] == [(), (4, 3)]  # the dropped counter still counts


def test_cond_takes_max_over_branches():
    def fn(a):
        return lax.cond(a.sum() > 0, lambda b: b @ b.T, lambda b: jnp.sin(b) @ b.T, a)

    (node,) = nodes_by_primitive(graph_of(fn, _X), "cond")
    assert node.flops == 2 * 4 * 4 * 3 + 12


def test_unknown_primitive_gets_zero_flops_and_a_debug_log(caplog):
    mystery_p = Primitive("mystery_op")
    mystery_p.def_abstract_eval(lambda aval: aval)
    with caplog.at_level(logging.DEBUG, logger="autopar.planner.graph"):
        graph = graph_of(lambda a: jnp.sin(mystery_p.bind(a)), _X)
    assert [(n.primitive, n.flops) for n in graph.nodes] == [("mystery_op", 0.0), ("sin", 12.0)]
    assert "mystery_op" in caplog.text


# ----------------------------------------------------------------------------- inlining


def test_nested_jit_is_inlined_with_path_ids():
    graph = graph_of(nested_jit, _X, _X)
    ids = [(n.id, n.primitive) for n in graph.nodes]
    assert ids == [
        ("0", "mul"), ("1", "add"), ("2", "exp"),
        ("3/0", "cos"), ("3/1/0", "sin"), ("3/1/1", "mul"), ("3/2", "add"),
        ("4", "sub"),
    ]  # fmt: skip
    assert graph.node("3/0").inputs == (node_ref("2"),)
    assert graph.node("3/2").inputs[0] == node_ref("3/1/1")
    assert graph.node("4").inputs == (node_ref("3/2"), input_ref(0))
    assert graph.outputs == (node_ref("4"),)


@pytest.mark.skipif(
    jax.extend.core.primitives.closed_call_p.name != "eval_jaxpr",
    reason="closed_call is eval_jaxpr from jax 0.11.1, which binds it on arrays directly",
)
def test_eval_jaxpr_call_is_inlined():
    body = jax.make_jaxpr(lambda a: jnp.sin(a) * 2.0)(_X)
    call = jax.extend.core.primitives.closed_call_p
    graph = graph_of(lambda a: call.bind(jnp.cos(a), call_jaxpr=body)[0] + 1.0, _X)
    assert [(n.id, n.primitive) for n in graph.nodes] == [
        ("0", "cos"), ("1/0", "sin"), ("1/1", "mul"), ("2", "add"),
    ]  # fmt: skip


def test_checkpoint_body_is_inlined_with_remat_region():
    closed = jax.make_jaxpr(FAMILY["checkpoint_grad"][0])(_X)
    (i,) = [i for i, e in enumerate(closed.jaxpr.eqns) if is_checkpoint(e)]
    graph = build_graph(closed)
    inside = [n for n in graph.nodes if n.id.startswith(f"{i}/")]
    assert inside and all(n.remat_region == str(i) for n in inside)
    assert all(n.remat_region is None for n in graph.nodes if n not in inside)


def test_nested_checkpoint_uses_innermost_region():
    graph = graph_of(FAMILY["nested_checkpoint"][0], _X)
    assert [(n.id, n.primitive, n.remat_region) for n in graph.nodes] == [
        ("0/0/0", "sin", "0/0"),
        ("0/1", "mul", "0"),
    ]


@pytest.mark.parametrize(
    "fn",
    [jax.nn.relu, jax.nn.gelu, lambda a: jax.nn.gelu(a, approximate=False), jax.nn.silu],
    ids=["relu", "gelu_tanh", "gelu_erf", "silu"],
)
def test_activations_are_inlined(fn):
    graph = graph_of(fn, _X)
    assert not INLINED & {n.primitive for n in graph.nodes}
    assert graph.total_flops >= 12
    assert graph.producer(graph.outputs[0]) is graph.nodes[-1]


def test_relu_custom_jvp_and_its_inner_jit_are_inlined():
    closed = jax.make_jaxpr(jax.nn.relu)(_X)
    assert closed.jaxpr.eqns[0].primitive.name == "custom_jvp_call"
    (node,) = build_graph(closed).nodes
    assert (node.id, node.primitive, node.inputs[0]) == ("0/0/0", "max", input_ref(0))


def test_custom_vjp_call_is_inlined():
    closed = jax.make_jaxpr(sin_vjp)(_X)
    assert closed.jaxpr.eqns[0].primitive.name == "custom_vjp_call"
    assert [(n.id, n.primitive) for n in build_graph(closed).nodes] == [("0/0", "sin")]


def test_custom_vjp_under_grad_uses_the_custom_rule():
    graph = graph_of(FAMILY["custom_vjp_grad"][0], _X)
    assert {"sin", "cos", "mul"} <= {n.primitive for n in graph.nodes}


def test_consts_top_level_and_inlined():
    graph = graph_of(FAMILY["consts"][0], _X)
    (inner_bcast, _), (add,), (mul,) = (
        nodes_by_primitive(graph, p) for p in ("broadcast_in_dim", "add", "mul")
    )
    assert inner_bcast.id == "0/0" and inner_bcast.inputs[0].kind is ValueKind.LITERAL
    np.testing.assert_array_equal(inner_bcast.inputs[0].literal, _CONST)  # inner const
    assert add.inputs == (input_ref(0), node_ref("0/0"))
    assert graph.node("1").inputs == (ValueRef(ValueKind.CONST, 0),)  # top-level const
    assert mul.inputs == (node_ref("0/1"), node_ref("1"))


# ----------------------------------------------------------------------------- queries


def test_consumers_producer_and_resolve_input():
    def fn(w, x):
        wb = w.astype(jnp.bfloat16).reshape(3, 5)
        h = x.astype(jnp.bfloat16) @ wb
        return jnp.sin(h), h * wb[0]

    graph = graph_of(fn, jnp.ones(15), _X)
    (dot,) = nodes_by_primitive(graph, "dot_general")
    assert [resolve_input(graph, ref) for ref in dot.inputs] == [1, 0]
    assert resolve_input(graph, dot.inputs[1], through=("reshape",)) is None
    assert resolve_input(graph, graph.outputs[0]) is None  # sin is not pass-through
    reshape = graph.producer(dot.inputs[1])
    assert reshape.primitive == "reshape"
    assert [graph.node(c).primitive for c, _ in graph.consumers(reshape.id)] == [
        "dot_general",
        "slice",
    ]
    assert graph.consumers(dot.id) == tuple(
        (n.id, p) for n in graph.nodes for p, r in enumerate(n.inputs) if r == node_ref(dot.id)
    )
    assert graph.input_consumers(0) == ((graph.nodes[0].id, 0),)
    assert graph.producer(input_ref(0)) is None
    with pytest.raises(KeyError, match="no node '99'"):
        graph.node("99")
    with pytest.raises(IndexError, match="input 2 out of range"):
        graph.input_consumers(2)


def test_opgraph_rejects_dangling_refs():
    info = TensorInfo((2,), np.dtype("float32"))
    node = OpNode("0", "sin", (node_ref("7"),), (info,), (info,), 2.0, 16.0, {}, None)
    with pytest.raises(ValueError, match="operand 0 of node '0' reads .* no earlier node"):
        OpGraph(inputs=(info,), nodes=(node,), outputs=())
    with pytest.raises(ValueError, match="graph output 0 reads input 3; OpGraph has 1"):
        OpGraph(inputs=(info,), nodes=(), outputs=(input_ref(3),))


# ----------------------------------------------------------------------------- flax + optax


def test_flax_adamw_train_step_flops():
    batch, d_in, hidden, d_out = 32, 64, 128, 16

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(d_out)(nn.relu(nn.Dense(hidden)(x)))

    model, tx = MLP(), optax.adamw(1e-3)
    x, y = jnp.ones((batch, d_in)), jnp.ones((batch, d_out))
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    opt_state = jax.eval_shape(tx.init, params)

    def train_step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    graph = graph_of(train_step, params, opt_state, x, y)
    dense1, dense2 = 2 * batch * d_in * hidden, 2 * batch * hidden * d_out
    dot_flops = sum(n.flops for n in nodes_by_primitive(graph, "dot_general"))
    # forward 1×, backward 2× per dense, minus dx of the first layer (x is not differentiated).
    assert dot_flops == 3 * (dense1 + dense2) - dense1
    num_params = d_in * hidden + hidden + hidden * d_out + d_out
    elementwise_budget = 30 * (num_params + batch * (hidden + d_out))
    assert dot_flops < graph.total_flops < dot_flops + elementwise_budget


def test_autopar_markers_are_free_and_pass_through():
    from autopar import markers

    def step(w, x):
        return markers.value_and_grad(mlp_loss)(w, x)

    graph = graph_of(step, _W, _X)
    marker_nodes = nodes_by_primitive(graph, "autopar_param_use") + nodes_by_primitive(
        graph, "autopar_grad_boundary"
    )
    assert len(marker_nodes) == 3 and all(n.flops == 0 for n in marker_nodes)
    first_dot = nodes_by_primitive(graph, "dot_general")[0]
    assert [resolve_input(graph, r) for r in first_dot.inputs] == [2, 0]


def test_extended_dtype_inputs():
    graph = graph_of(lambda k: jax.random.split(k), jax.random.key(0))
    (info,) = graph.inputs
    assert jax.dtypes.issubdtype(info.dtype, jax.dtypes.extended)
    assert info.shape == () and info.nbytes == info.dtype.itemsize


def test_fingerprint_tells_literals_apart_by_value_and_dtype():
    """Literals are hashed by their bytes (not printed): another constant, or the same value in
    another dtype, is another program; the same program traced again hashes alike."""
    from autopar.planner.fingerprint import jaxpr_fingerprint

    def scaled(c):
        return lambda x: x * c + 1.0

    x = jnp.ones((4,), f32)
    fingerprint = jaxpr_fingerprint(jax.make_jaxpr(scaled(np.float32(2.0)))(x))
    assert fingerprint == jaxpr_fingerprint(jax.make_jaxpr(scaled(np.float32(2.0)))(x))
    assert fingerprint != jaxpr_fingerprint(jax.make_jaxpr(scaled(np.float32(3.0)))(x))
    ints = jax.make_jaxpr(lambda x: x + np.int32(1))(jnp.ones((4,), jnp.int32))
    halves = jax.make_jaxpr(lambda x: x + np.int16(1))(jnp.ones((4,), jnp.int16))
    assert jaxpr_fingerprint(ints) != jaxpr_fingerprint(halves)
