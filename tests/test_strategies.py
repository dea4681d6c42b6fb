"""Sharding rules: follow rules keep what they follow, leader menus list what XLA can run."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from autopar.planner.cost import LogicalMesh
from autopar.planner.follow_rules import reshape_spec
from autopar.planner.graph import OpNode, build_graph, nodes_by_primitive
from autopar.planner.leader_rules import source_strategies
from autopar.planner.strategy import (
    FOLLOW_RULES,
    LEADER_RULES,
    Strategy,
    replicated_strategy,
    spec_fits,
)

X, Y, XY = ("x",), ("y",), ("x", "y")
MESH4 = LogicalMesh(shape=(4,), axis_names=("x",), bandwidths=(1e11,), latencies=(1e-6,))
MESH8 = LogicalMesh(shape=(8,), axis_names=("x",), bandwidths=(1e11,), latencies=(1e-6,))
MESH22 = LogicalMesh(
    shape=(2, 2), axis_names=("x", "y"), bandwidths=(1e11, 1e11), latencies=(1e-6, 1e-6)
)
F32 = jnp.float32


def node_of(prim: str, fn, *args, index: int = 0) -> OpNode:
    """The `index`-th node of primitive `prim` in the graph of `fn(*args)`."""
    graph = build_graph(jax.make_jaxpr(fn)(*args))
    return nodes_by_primitive(graph, prim)[index]


def follow(node: OpNode, spec, operand: int = 0, mesh: LogicalMesh = MESH4) -> Strategy | None:
    """Run the node's follow rule, checking that a strategy keeps the followed operand's spec."""
    strategy = FOLLOW_RULES[node.primitive](node, operand, spec, mesh)
    if strategy is not None:
        assert strategy.in_specs[operand] == spec
        assert len(strategy.in_specs) == len(node.inputs)
        assert len(strategy.out_specs) == len(node.out_avals)
    return strategy


def arr(*shape, dtype=F32):
    return jnp.zeros(shape, dtype)


# ----------------------------------------------------------------------------- reshape


@pytest.mark.parametrize(
    ("in_shape", "out_shape", "spec", "mesh", "expected"),
    [
        ((4, 8, 6), (32, 6), (X, None, None), MESH4, (X, None)),  # merge, major split
        ((4, 8, 6), (32, 6), (None, X, None), MESH4, None),  # merge, minor split: not blocks
        ((32, 6), (4, 8, 6), (X, None), MESH4, (X, None, None)),  # split dims
        ((32, 6), (4, 8, 6), (X, None), MESH8, None),  # 8 blocks of 4 don't fit a dim of 4
        ((4, 1, 8), (4, 8), (None, None, X), MESH4, (None, X)),  # size-1 dims are skipped
        ((4, 8), (4, 1, 8), (X, None), MESH4, (X, None, None)),
        ((1, 8), (8, 1), (None, X), MESH4, (X, None)),
        ((6, 4), (4, 6), (("x",), None), LogicalMesh((2,), ("x",), (1.0,), (1.0,)), (X, None)),
        ((2, 4, 6), (8, 6), (X, Y, None), MESH22, (XY, None)),  # dim 0 split to single rows
        ((8, 6), (2, 4, 6), (XY, None), MESH22, (X, Y, None)),
        ((4, 4), (16,), (X, Y), MESH22, None),  # dim 0 only halved: blocks not contiguous
        ((), (1, 1), (), MESH4, (None, None)),
    ],
)
def test_reshape_spec(in_shape, out_shape, spec, mesh, expected):
    assert reshape_spec(in_shape, out_shape, spec, mesh) == expected


def test_follow_reshape_node():
    node = node_of("reshape", lambda x: x.reshape(32, 6), arr(4, 8, 6))
    assert follow(node, (X, None, None)).out_specs == ((X, None),)
    assert follow(node, (None, None, X), mesh=LogicalMesh((2,), ("x",), (1.0,), (1.0,))) == (
        Strategy(((None, None, X),), ((None, X),))
    )


# ----------------------------------------------------------------------------- element-wise


def test_elementwise_broadcasting_operands():
    node = node_of("add", lambda x, v: x + v[None, :], arr(8, 6), arr(6))
    assert node.in_avals[1].shape == (1, 6)  # jax 0.10 broadcasts size-1 dims in lax.add
    strategy = follow(node, (X, Y), mesh=MESH22)
    assert strategy.in_specs == ((X, Y), (None, Y))
    assert strategy.out_specs == ((X, Y),)


def test_elementwise_scalars():
    node = node_of("mul", lambda x: x * 2.0, arr(8, 6))
    assert follow(node, (X, None)).in_specs == ((X, None), None)  # literal: nothing to place
    node = node_of("mul", lambda s, x: s * x, arr(), arr(8, 6))
    assert follow(node, (), operand=0) is None  # a scalar says nothing about the output
    assert follow(node, (None, X), operand=1).in_specs == ((), (None, X))


def test_select_n_with_scalar_predicate_and_clamp():
    node = node_of("select_n", lax.select_n, arr(dtype=bool), arr(8, 4), arr(8, 4))
    assert follow(node, (X, None), operand=1).in_specs == ((), (X, None), (X, None))
    node = node_of("clamp", lambda x: lax.clamp(0.0, x, 1.0), arr(8, 4))
    assert follow(node, (None, X), operand=1) == Strategy((None, (None, X), None), ((None, X),))


def test_broadcast_in_dim():
    node = node_of("broadcast_in_dim", lambda v: lax.broadcast_in_dim(v, (8, 4), (0,)), arr(8))
    assert follow(node, (X,)).out_specs == ((X, None),)
    node = node_of("broadcast_in_dim", lambda v: jnp.broadcast_to(v, (4, 8)), arr(1, 8))
    assert follow(node, (None, X)).out_specs == ((None, X),)


def test_transpose_squeeze_and_bitcast():
    node = node_of("transpose", lambda x: x.T, arr(8, 4))
    assert follow(node, (X, None)).out_specs == ((None, X),)
    node = node_of("squeeze", lambda x: x[:, 0], arr(8, 1))
    assert follow(node, (X, None)).out_specs == ((X,),)
    node = node_of("bitcast_convert_type", lambda x: lax.bitcast_convert_type(x, jnp.uint8), arr(8))
    assert follow(node, (X,)).out_specs == ((X, None),)


# ----------------------------------------------------------------------------- reductions


def test_reduce_sum_partial_axes():
    node = node_of("reduce_sum", lambda x: x.sum(1), arr(8, 4))
    strategy = follow(node, (X, Y), mesh=MESH22)
    assert strategy.out_specs == ((X,),)
    assert strategy.partial_axes == ("y",)
    assert follow(node, (X, None), mesh=MESH22).partial_axes == ()


def test_argmax_and_cumulative_need_their_dim_unsplit():
    node = node_of("argmax", lambda x: jnp.argmax(x, 1), arr(8, 4))
    assert follow(node, (None, X)) is None
    assert follow(node, (X, None)) == Strategy(((X, None),), ((X,),))
    node = node_of("cumsum", lambda x: jnp.cumsum(x, 1), arr(8, 4))
    assert follow(node, (None, X)) is None
    assert follow(node, (X, None)).out_specs == ((X, None),)


def test_sort_multi_operand():
    node = node_of("sort", lambda x: jnp.argsort(x, axis=1), arr(8, 4))
    assert len(node.inputs) == 2  # keys and an iota of indices
    assert follow(node, (None, X)) is None
    assert follow(node, (X, None)) == Strategy(((X, None),) * 2, ((X, None),) * 2)


# ----------------------------------------------------------------------------- slicing, joining


def test_concatenate_needs_joined_dim_unsplit():
    node = node_of("concatenate", lambda a, b: jnp.concatenate([a, b], 1), arr(8, 4), arr(8, 4))
    assert follow(node, (None, X)) is None
    assert follow(node, (X, None), operand=1) == Strategy(((X, None),) * 2, ((X, None),))


def test_pad_and_slice():
    node = node_of("pad", lambda x: jnp.pad(x, ((0, 0), (1, 1))), arr(8, 4))
    assert follow(node, (None, X)) is None
    assert follow(node, (X, None)).in_specs == ((X, None), ())  # padding value: a scalar
    node = node_of("slice", lambda x: x[:, :2], arr(8, 4))
    assert follow(node, (None, X)) is None
    assert follow(node, (X, None)).out_specs == ((X, None),)


def test_dynamic_slices_rev_and_split():
    node = node_of("dynamic_slice", lambda x, i: lax.dynamic_slice_in_dim(x, i, 2, 1), arr(8, 4), 1)
    assert follow(node, (None, X)) is None
    assert follow(node, (X, None)).in_specs == ((X, None), None, ())  # literal 0, then i
    assert follow(node, (), operand=2) is None
    node = node_of(
        "dynamic_update_slice",
        lambda x, u: lax.dynamic_update_slice_in_dim(x, u, 2, 1),
        arr(8, 4),
        arr(8, 2),
    )
    assert follow(node, (None, X)) is None
    assert follow(node, (X, None), operand=1).in_specs[:2] == ((X, None), (X, None))
    node = node_of("rev", lambda x: jnp.flip(x, 1), arr(8, 4))
    assert follow(node, (None, X)) is None
    assert follow(node, (X, None)).out_specs == ((X, None),)
    node = node_of("split", lambda x: jnp.split(x, 2, 1), arr(8, 4))
    assert follow(node, (None, X)) is None
    assert follow(node, (X, None)).out_specs == ((X, None),) * 2


def test_pooling_windows():
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")  # noqa: E731
    node = node_of("reduce_window_max", pool, arr(8, 4, 4, 4))
    assert follow(node, (None, X, None, None)) is None
    assert follow(node, (X, None, None, None)).out_specs == ((X, None, None, None),)
    node = node_of("select_and_scatter_add", jax.grad(lambda x: pool(x).sum()), arr(8, 4, 4, 4))
    strategy = follow(node, (None, None, None, X), operand=1)
    assert strategy.in_specs == ((None, None, None, X),) * 2


# ----------------------------------------------------------------------------- convolution

NHWC = ("NHWC", "HWIO", "NHWC")


def conv(img, kernel, groups=1):
    return lax.conv_general_dilated(
        img, kernel, (1, 1), "SAME", dimension_numbers=NHWC, feature_group_count=groups
    )


def test_conv_nhwc_1d_mesh():
    menu = LEADER_RULES["conv_general_dilated"](
        node_of("conv_general_dilated", conv, arr(8, 8, 8, 4), arr(3, 3, 4, 8)), MESH4
    )
    r4 = (None,) * 4
    expected = [
        Strategy((r4, r4), (r4,)),
        Strategy(((X, None, None, None), r4), ((X, None, None, None),)),  # batch
        Strategy((r4, (None, None, None, X)), ((None, None, None, X),)),  # output features
        Strategy(((None, None, None, X), (None, None, X, None)), (r4,), ("x",)),  # contracting
        Strategy(
            ((None, None, None, X), (None, None, X, None)), ((X, None, None, None),), ("x",)
        ),  # ... reduce-scattered onto the batch
    ]
    for strategy in expected:
        assert strategy in menu
    assert all(s.in_specs[0][1:3] == (None, None) for s in menu)  # spatial dims never split


def test_conv_nhwc_2d_mesh():
    node = node_of("conv_general_dilated", conv, arr(8, 8, 8, 4), arr(3, 3, 4, 8))
    menu = LEADER_RULES["conv_general_dilated"](node, MESH22)
    # Batch over x, output features over y (Alpa's SbSj), and batch over both axes.
    assert Strategy(((X, None, None, None), (None, None, None, Y)), ((X, None, None, Y),)) in menu
    assert Strategy(((XY, None, None, None), (None,) * 4), ((XY, None, None, None),)) in menu
    assert len(menu) <= 48


def test_conv_kernel_gradient_is_partial_over_batch():
    grad = jax.grad(lambda k, x: conv(x, k).sum())
    node = node_of("conv_general_dilated", grad, arr(3, 3, 4, 8), arr(8, 8, 8, 4), index=1)
    assert node.out_avals[0].shape == (3, 3, 4, 8)
    menu = LEADER_RULES["conv_general_dilated"](node, MESH4)
    data_parallel = [s for s in menu if s.in_specs[0][0] == X and s.in_specs[1][0] == X]
    assert data_parallel
    assert all(s.partial_axes == ("x",) for s in data_parallel)


def test_grouped_conv_splits_only_the_batch():
    node = node_of(
        "conv_general_dilated", lambda x, k: conv(x, k, groups=2), arr(8, 8, 8, 4), arr(3, 3, 2, 8)
    )
    menu = LEADER_RULES["conv_general_dilated"](node, MESH4)
    assert len(menu) == 2
    assert menu[1].in_specs == ((X, None, None, None), (None,) * 4)


# ----------------------------------------------------------------------------- gather, scatter


def embed(table, ids):
    return table[ids]


def test_gather_embedding_lookup():
    node = node_of("gather", embed, arr(16, 8), arr(4, 6, dtype=jnp.int32))
    menu = LEADER_RULES["gather"](node, MESH4)
    r3 = (None,) * 3
    assert Strategy(((None, None), (X, None, None)), ((X, None, None),)) in menu  # batch
    assert Strategy(((None, X), r3), ((None, None, X),)) in menu  # hidden
    assert Strategy(((X, None), r3), (r3,), ("x",)) in menu  # vocab: partial sums
    assert Strategy(((X, None), r3), ((None, None, X),), ("x",)) in menu  # ... reduce-scattered
    menu = LEADER_RULES["gather"](node, MESH22)
    assert Strategy(((X, None), (Y, None, None)), ((Y, None, None),), ("x",)) in menu


def test_gather_with_batching_dims():
    node = node_of(
        "gather",
        lambda logits, labels: jnp.take_along_axis(logits, labels[..., None], axis=-1),
        arr(4, 6, 10),
        arr(4, 6, dtype=jnp.int32),
    )
    menu = LEADER_RULES["gather"](node, MESH4)
    assert Strategy(((X, None, None), (X, None, None, None)), ((X, None, None),)) in menu


def test_scatter_add_embedding_gradient():
    grad = jax.grad(lambda t, i: embed(t, i).sum())
    node = node_of("scatter-add", grad, arr(16, 8), arr(4, 6, dtype=jnp.int32))
    menu = LEADER_RULES["scatter-add"](node, MESH4)
    batch = ((None, None), (X, None, None), (X, None, None))
    assert Strategy(batch, ((None, None),), ("x",)) in menu  # each device adds its updates
    assert Strategy(batch, ((X, None),), ("x",)) in menu  # ... reduce-scattered over vocab
    r3 = (None,) * 3
    assert Strategy(((None, X), r3, (None, None, X)), ((None, X),)) in menu  # hidden
    assert Strategy(((X, None), r3, r3), ((X, None),)) in menu  # vocab: own rows only


def test_plain_scatter_has_no_partial_sums():
    node = node_of("scatter", lambda x, v: x.at[:, 2].set(v), arr(8, 4, 6), arr(8, 6))
    menu = LEADER_RULES["scatter"](node, MESH4)
    assert all(not s.partial_axes for s in menu)
    assert Strategy(((None, X, None), (None,), (None, None)), ((None, X, None),)) in menu


# ----------------------------------------------------------------------------- control flow


def scan_fn(carry, xs):
    return lax.scan(lambda c, x: (c * x, c.sum(1)), carry, xs)


def test_scan_batch_split():
    node = node_of("scan", scan_fn, arr(8, 4), arr(5, 8, 4))
    menu = LEADER_RULES["scan"](node, MESH4)
    assert menu[0] == replicated_strategy(node)
    assert Strategy(((X, None), (None, X, None)), ((X, None), (None, X))) in menu
    assert len(menu) == 2


def test_while_and_cond_batch_split():
    loop = lambda c: lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 2), (0, c))  # noqa: E731
    node = node_of("while", loop, arr(8, 4))
    menu = LEADER_RULES["while"](node, MESH4)
    assert Strategy((None, (X, None)), ((), (X, None))) in menu
    branch = lambda p, c: lax.cond(p, lambda c: c * 2, lambda c: c + 1, c)  # noqa: E731
    node = node_of("cond", branch, True, arr(8, 4))
    menu = LEADER_RULES["cond"](node, MESH22)
    assert all(s.in_specs[0] == () for s in menu)
    assert Strategy(((), (XY, None)), ((XY, None),)) in menu


def test_sources():
    node = node_of("iota", lambda: jnp.arange(8))
    assert source_strategies(node, MESH4) == [Strategy((), ((None,),)), Strategy((), ((X,),))]
    node = node_of("random_bits", lambda k: jax.random.bits(k, (8, 4)), jax.random.key(0))
    menu = LEADER_RULES["random_bits"](node, MESH22)
    assert all(s.in_specs == ((),) for s in menu)
    assert Strategy(((),), ((X, Y),)) in menu


# ----------------------------------------------------------------------------- menu properties

LEADERS = {
    "dot_general": lambda: node_of("dot_general", jnp.matmul, arr(8, 4), arr(4, 6)),
    "conv": lambda: node_of("conv_general_dilated", conv, arr(8, 8, 8, 4), arr(3, 3, 4, 8)),
    "conv_grad": lambda: node_of(
        "conv_general_dilated",
        jax.grad(lambda k, x: conv(x, k).sum()),
        arr(3, 3, 4, 6),
        arr(6, 8, 8, 4),
        index=1,
    ),
    "gather": lambda: node_of("gather", embed, arr(16, 8), arr(4, 6, dtype=jnp.int32)),
    "scatter-add": lambda: node_of(
        "scatter-add", jax.grad(lambda t, i: embed(t, i).sum()), arr(16, 6), arr(6, 4, dtype=int)
    ),
    "scan": lambda: node_of("scan", scan_fn, arr(8, 6), arr(3, 8, 6)),
    "iota": lambda: node_of("iota", lambda: lax.iota(jnp.int32, 12)),
}


@pytest.mark.parametrize("mesh", [MESH4, MESH22], ids=["4", "2x2"])
@pytest.mark.parametrize("name", sorted(LEADERS))
def test_leader_menu_properties(name, mesh):
    node = LEADERS[name]()
    menu = LEADER_RULES[node.primitive](node, mesh)
    assert replicated_strategy(node) in menu
    assert len(menu) == len(set(menu)) <= 64
    for strategy in menu:
        assert len(strategy.in_specs) == len(node.inputs)
        for spec, aval in zip(strategy.in_specs, node.in_avals, strict=True):
            assert spec is None or spec_fits(aval.shape, spec, mesh)
        for spec, aval in zip(strategy.out_specs, node.out_avals, strict=True):
            assert spec_fits(aval.shape, spec, mesh)
        axes = [
            a
            for spec in (*strategy.in_specs, *strategy.out_specs)
            if spec
            for e in spec
            if e
            for a in e
        ]
        assert set(axes) | set(strategy.partial_axes) <= set(mesh.axis_names)


def test_no_primitive_is_both_leader_and_follower():
    assert not set(LEADER_RULES) & set(FOLLOW_RULES)
