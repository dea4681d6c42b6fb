"""Layer construction: boundary markers survive differentiation, manual and clustered layers,
rematerialisation, and the errors for layerings that cannot be built."""

import functools
import logging

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest
from conftest import relative_error

import autopar
from autopar.layering import layered
from autopar.markers import tracing_scope
from autopar.options import AutoLayerOption, ManualLayerOption
from autopar.planner.markers import LAYER_BOUNDARY, PARAM_USE

WIDTHS = (16, 16, 16, 16, 16)


def _params(widths=WIDTHS):
    keys = jax.random.split(jax.random.PRNGKey(0), len(widths))
    return {
        f"w{i}": jax.random.normal(keys[i], (widths[i], widths[i + 1])) * 0.3
        for i in range(len(widths) - 1)
    }


def _batch(width=WIDTHS[0], out=WIDTHS[-1]):
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    return {"x": jax.random.normal(kx, (8, width)), "y": jax.random.normal(ky, (8, out))}


def _loss(params, batch, marks=True):
    x = batch["x"]
    n = len(params)
    for i in range(n):
        x = jnp.tanh(x @ params[f"w{i}"])
        if marks and i < n - 1:
            autopar.mark_pipeline_boundary()
    return jnp.mean((x - batch["y"]) ** 2)


def _step(loss=_loss):
    def step(params, batch):
        return autopar.value_and_grad(loss)(params, batch)

    return step


def _layered_jaxpr(step, option, *args):
    with tracing_scope(
        regather_params=False, loss_transform=functools.partial(layered, option=option)
    ):
        # A fresh function: jax caches traces by function, and the scope changes what is traced.
        return jax.make_jaxpr(lambda *a: step(*a))(*args)


def _boundaries(jaxpr):
    return [
        (e.params["layer"], e.params["kind"])
        for e in jaxpr.eqns
        if e.primitive.name == LAYER_BOUNDARY
    ]


def _evaluate(jaxpr, *args):
    return jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *jax.tree.leaves(args))


@pytest.mark.parametrize(
    "option",
    [ManualLayerOption(), ManualLayerOption(remat_layer=True), AutoLayerOption(4)],
    ids=["manual", "manual-remat", "auto"],
)
def test_boundaries_mark_forward_and_backward(option):
    params, batch = _params(), _batch()
    jaxpr = _layered_jaxpr(_step(), option, params, batch)
    forward = [(k, "forward") for k in (1, 2, 3, 4)]
    backward = [(k, "backward") for k in (4, 3, 2, 1)]
    assert _boundaries(jaxpr) == forward + backward
    expected = jax.tree.leaves(jax.jit(_step())(params, batch))
    assert relative_error(_evaluate(jaxpr, params, batch), expected) <= 1e-6


def _count(jaxpr, name):
    """Eqns named `name` in `jaxpr` and every sub-jaxpr (e.g. checkpointed regions)."""
    total = 0
    for e in jaxpr.eqns:
        total += e.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            total += _count(sub, name)
    return total


def test_remat_recomputes_each_layer():
    params, batch = _params(), _batch()
    plain = _layered_jaxpr(_step(), ManualLayerOption(), params, batch)
    remat = _layered_jaxpr(_step(), ManualLayerOption(remat_layer=True), params, batch)
    assert _count(plain.jaxpr, "tanh") == 4
    assert _count(remat.jaxpr, "tanh") == 8  # each layer's tanh again in the backward pass
    expected = jax.tree.leaves(jax.jit(_step())(params, batch))
    assert relative_error(_evaluate(remat, params, batch), expected) <= 1e-6


def test_parameters_are_used_in_their_own_layer():
    """A parameter use floats to the layer that reads it instead of crossing from layer 0."""
    params, batch = _params(), _batch()
    jaxpr = _layered_jaxpr(_step(), ManualLayerOption(), params, batch)
    forward = [e for e in jaxpr.eqns if e.primitive.name in (PARAM_USE, LAYER_BOUNDARY)]
    order = [e.primitive.name for e in forward][:7]
    assert order == [PARAM_USE, LAYER_BOUNDARY, PARAM_USE, LAYER_BOUNDARY] + [
        PARAM_USE,
        LAYER_BOUNDARY,
        PARAM_USE,
    ]
    # Each boundary between layers carries only the activation (8x16), not parameters; the
    # last one carries the loss.
    carried = [
        [v.aval.shape for v in e.invars]
        for e in jaxpr.eqns
        if e.primitive.name == LAYER_BOUNDARY and e.params["kind"] == "forward"
    ]
    assert carried == [[(8, 16)]] * 3 + [[()]]


def _dot_layers(jaxpr) -> list[int]:
    """The layer of each dot_general, by the last forward boundary marker before it."""
    found, layer = [], 0
    for e in jaxpr.eqns:
        if e.primitive.name == LAYER_BOUNDARY and e.params["kind"] == "forward":
            layer = e.params["layer"]
        elif e.primitive.name == "dot_general":
            found.append(layer)
    return found


def test_clustering_balances_flops():
    """One layer 4x wider than the rest: 2 clustered layers put the wide matmuls apart from
    the others instead of splitting the matmul count evenly."""
    widths = (16, 64, 16, 16, 16, 16)
    params, batch = _params(widths), _batch(16, 16)
    loss = functools.partial(_loss, marks=False)
    jaxpr = _layered_jaxpr(_step(loss), AutoLayerOption(2), params, batch)
    forward_dots = _dot_layers(jaxpr)[:5]  # the backward dots come after
    # FLOPs per dot: 16*64, 64*16, then three 16*16: the cut goes after the two wide dots.
    assert forward_dots == [0, 0, 1, 1, 1]


def test_clustering_shares_repeated_blocks_evenly():
    """Eight equal layers whose cuts all carry the same bytes: 4 clustered layers take 2 each
    (the FLOP cap alone would allow 3, 3, 1, 1)."""
    widths = (16,) * 9
    params, batch = _params(widths), _batch(16, 16)
    loss = functools.partial(_loss, marks=False)
    jaxpr = _layered_jaxpr(_step(loss), AutoLayerOption(4), params, batch)
    assert _dot_layers(jaxpr)[:8] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_markers_are_inert_outside_autopar():
    params, batch = _params(), _batch()
    marked = jax.jit(jax.value_and_grad(_loss))(params, batch)
    plain = jax.jit(jax.value_and_grad(functools.partial(_loss, marks=False)))(params, batch)
    assert relative_error(marked, plain) == 0
    assert jax.vmap(lambda x: _loss(params, {"x": x, "y": batch["y"][:1]}))(
        batch["x"][:, None]
    ).shape == (8,)


def test_shard_parallel_ignores_boundaries(caplog):
    params, batch = _params(), _batch()

    def step(params, batch):
        grads = autopar.grad(_loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    with caplog.at_level(logging.WARNING):
        out = autopar.parallelize(step)(params, batch)
    assert relative_error(out, jax.jit(step)(params, batch)) <= 1e-5
    assert "no sharding rules" not in caplog.text


def test_manual_layers_need_boundaries():
    params, batch = _params(), _batch()
    loss = functools.partial(_loss, marks=False)
    with pytest.raises(autopar.InvalidArgumentError, match="mark_pipeline_boundary"):
        _layered_jaxpr(_step(loss), ManualLayerOption(), params, batch)


def test_boundary_at_the_start_is_an_empty_layer():
    def loss(params, batch):
        autopar.mark_pipeline_boundary()
        return _loss(params, batch, marks=False)

    with pytest.raises(autopar.InvalidArgumentError, match="layer 0 of 2 computes nothing"):
        _layered_jaxpr(_step(loss), ManualLayerOption(), _params(), _batch())


def test_more_layers_than_heavy_ops_is_an_error():
    with pytest.raises(autopar.InvalidArgumentError, match=r"layer_num=9.*heavy ops.*4"):
        _layered_jaxpr(_step(), AutoLayerOption(9), _params(), _batch())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"layer_num": 0}, "layer_num"), ({"layer_num": 2, "remat_mode": "fine"}, "remat_mode")],
)
def test_bad_auto_layer_options(kwargs, message):
    with pytest.raises(autopar.InvalidArgumentError, match=message):
        AutoLayerOption(**kwargs)


def _stock_flax_gpt(num_blocks: int):
    """A small GPT written with Flax's stock layers (as `benchmarks/flax_gpt.py`): inside a block
    several places cut equally few bytes, and the cut before the head cuts fewer."""
    import flax.linen as nn
    import optax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h, mask=mask)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(h)))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(64, 16)
            x = embed(tokens)
            for _ in range(num_blocks):
                x = Block()(x)
            return embed.attend(nn.LayerNorm()(x))

    model, tokens = GPT(), jnp.zeros((4, 8), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]

    def loss(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"]).mean()

    return loss, params, {"tokens": tokens}


def _forward_layer_ops(jaxpr) -> list[list[tuple]]:
    """Each forward layer's eqns as (primitive, result shapes), in order."""
    layers, current = [], []
    for e in jaxpr.eqns:
        if e.primitive.name == LAYER_BOUNDARY:
            if e.params["kind"] != "forward":
                break
            layers.append(current)
            current = []
        else:
            current.append((e.primitive.name, *(tuple(v.aval.shape) for v in e.outvars)))
    return layers


@pytest.mark.parametrize(("num_blocks", "layer_num"), [(8, 4), (12, 5)])
def test_clustering_cuts_repeated_blocks_alike(num_blocks, layer_num):
    """The layers between the first and the last hold the same whole blocks, so they are one
    program to plan (the cuts of equal cost inside a block, and the cheaper one before the
    head, used to leave layers of 1 3/4, 2 1/4 and 2 1/2 blocks)."""
    loss, params, batch = _stock_flax_gpt(num_blocks)
    jaxpr = _layered_jaxpr(_step(loss), AutoLayerOption(layer_num), params, batch)
    layers = _forward_layer_ops(jaxpr.jaxpr)
    assert len(layers) == layer_num
    middle = layers[1:-1]
    assert all(ops == middle[0] for ops in middle)
    dots = sum(op[0] == "dot_general" for op in middle[0])
    assert dots % 8 == 0  # whole blocks of 8 matmuls (q, k, v, scores, values, out, 2 MLP)
    # The key bias's gradient is zero up to rounding, so compare all gradients as one vector.
    flat = lambda leaves: jnp.concatenate([jnp.ravel(x) for x in leaves])  # noqa: E731
    expected = flat(jax.tree.leaves(jax.jit(_step(loss))(params, batch)))
    assert relative_error(flat(_evaluate(jaxpr, params, batch)), expected) <= 1e-5


def test_clustering_cuts_where_only_the_residual_crosses():
    """Each boundary carries the residual stream alone: no layer norm output or projection
    that a cut right before a matmul would also carry (half the bytes between stages)."""
    from autopar.planner.layers import cluster_layers, crossing_values

    loss, params, batch = _stock_flax_gpt(8)
    jaxpr = jax.make_jaxpr(loss)(params, batch).jaxpr
    crossing = crossing_values(jaxpr, cluster_layers(jaxpr, 4))
    assert [[v.aval.shape for v in values] for values in crossing] == [[]] + [[(4, 8, 16)]] * 3
