"""Shared-property tests over the bundled model families, plus GPT's Alpa sizes and FLOP model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.models import (
    ConvNetConfig,
    GPTConfig,
    MLPConfig,
    MoEConfig,
    WResNetConfig,
    convnet,
    gpt,
    mlp,
    moe,
    wresnet,
)

FAMILIES = [
    pytest.param(mlp, MLPConfig(), id="mlp"),
    pytest.param(gpt, GPTConfig(), id="gpt"),
    pytest.param(moe, MoEConfig(), id="moe"),
    pytest.param(convnet, ConvNetConfig(), id="convnet"),
    pytest.param(wresnet, WResNetConfig(), id="wresnet"),
]
BATCH_SIZE = 4


def abstract_state(family, config):
    """The train state's shapes without running the initialisers (fast on CPU)."""
    return jax.eval_shape(lambda: family.create_train_state(config))


@pytest.mark.parametrize("family, config", FAMILIES)
def test_param_count_matches_init(family, config):
    state = abstract_state(family, config)
    assert family.param_count(config) == sum(x.size for x in jax.tree.leaves(state.params))


@pytest.mark.parametrize(
    "family, config",
    [
        pytest.param(mlp, MLPConfig(num_layers=1), id="mlp-1layer"),
        pytest.param(mlp, MLPConfig(num_layers=4, hidden=24), id="mlp-4layers"),
        pytest.param(gpt, GPTConfig(num_layers=3, hidden=48, num_heads=6, mlp_ratio=2), id="gpt"),
        pytest.param(convnet, ConvNetConfig(channels=5, in_channels=1), id="convnet"),
        pytest.param(moe, MoEConfig(num_layers=3, num_experts=3, mlp_ratio=2), id="moe-3layers"),
        pytest.param(
            wresnet,
            WResNetConfig(channels=3, width_factor=3, stage_sizes=(2, 1, 1), in_channels=1),
            id="wresnet-3stages",
        ),
    ],
)
def test_param_count_matches_init_other_sizes(family, config):
    state = abstract_state(family, config)
    assert family.param_count(config) == sum(x.size for x in jax.tree.leaves(state.params))


@pytest.mark.parametrize("family, config", FAMILIES)
def test_make_batch_is_deterministic_numpy(family, config):
    a = family.make_batch(config, BATCH_SIZE, seed=3)
    b = family.make_batch(config, BATCH_SIZE, seed=3)
    c = family.make_batch(config, BATCH_SIZE, seed=4)
    assert a.keys() == b.keys()
    for key in a:
        assert isinstance(a[key], np.ndarray)
        assert a[key].shape[0] == BATCH_SIZE
        np.testing.assert_array_equal(a[key], b[key])
    assert any(not np.array_equal(a[key], c[key]) for key in a)


@pytest.mark.parametrize("family, config", FAMILIES)
def test_jitted_steps_reduce_loss_with_the_given_grad_fn(family, config):
    has_aux_calls = []

    def recording_value_and_grad(fun, argnums=0, has_aux=False):
        has_aux_calls.append(has_aux)
        return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    state = family.create_train_state(config, learning_rate=1e-2)
    step = jax.jit(family.make_train_step(recording_value_and_grad))
    batch = family.make_batch(config, BATCH_SIZE)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    assert int(state.step) == 3
    # Traced once; aux for BatchNorm's batch_stats and for MoE's balancing loss.
    assert has_aux_calls == [family in (convnet, wresnet, moe)]


def test_batch_shapes_and_dtypes():
    g, m, c = GPTConfig(), MLPConfig(), ConvNetConfig()
    tokens = gpt.make_batch(g, 2)
    assert tokens["tokens"].shape == tokens["targets"].shape == (2, g.seq_len)
    assert tokens["tokens"].dtype == tokens["targets"].dtype == np.int32
    np.testing.assert_array_equal(tokens["tokens"][:, 1:], tokens["targets"][:, :-1])
    xy = mlp.make_batch(m, 2)
    assert (xy["x"].shape, xy["y"].shape) == ((2, m.in_dim), (2, m.out_dim))
    assert xy["x"].dtype == xy["y"].dtype == np.float32
    images = convnet.make_batch(c, 2)
    assert images["images"].shape == (2, c.image_size, c.image_size, c.in_channels)
    assert images["images"].dtype == np.float32 and images["labels"].dtype == np.int32
    assert images["labels"].shape == (2,) and images["labels"].max() < c.num_classes


def test_model_output_shapes():
    g, m, c = GPTConfig(), MLPConfig(), ConvNetConfig()
    gs = abstract_state(gpt, g)
    logits = jax.eval_shape(gs.apply_fn, {"params": gs.params}, gpt.make_batch(g, 3)["tokens"])
    assert logits.shape == (3, g.seq_len, g.vocab_size)
    ms = abstract_state(mlp, m)
    out = jax.eval_shape(ms.apply_fn, {"params": ms.params}, mlp.make_batch(m, 3)["x"])
    assert out.shape == (3, m.out_dim)
    cs = abstract_state(convnet, c)
    variables = {"params": cs.params, "batch_stats": cs.batch_stats}
    images = convnet.make_batch(c, 3)["images"]
    logits = jax.eval_shape(lambda v, x: cs.apply_fn(v, x, train=False), variables, images)
    assert logits.shape == (3, c.num_classes)


def test_gpt_attention_params_have_a_heads_dim():
    config = GPTConfig()
    attn = abstract_state(gpt, config).params["block_0"]["attn"]
    heads = (config.num_heads, config.head_dim)
    for name in ("query", "key", "value"):
        assert attn[name]["kernel"].shape == (config.hidden, *heads)
    assert attn["out"]["kernel"].shape == (*heads, config.hidden)


def test_gpt_is_causal():
    config = GPTConfig()
    state = gpt.create_train_state(config)
    tokens = gpt.make_batch(config, 1)["tokens"]
    changed = tokens.copy()
    changed[0, -1] = (changed[0, -1] + 1) % config.vocab_size
    apply = jax.jit(state.apply_fn)
    a = apply({"params": state.params}, tokens)
    b = apply({"params": state.params}, changed)
    np.testing.assert_allclose(a[0, :-1], b[0, :-1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[0, -1], b[0, -1])


def test_gpt_bfloat16_compute():
    config = GPTConfig(dtype=jnp.bfloat16)
    state = abstract_state(gpt, config)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    tokens = gpt.make_batch(config, 2)["tokens"]
    logits = jax.eval_shape(state.apply_fn, {"params": state.params}, tokens)
    assert logits.dtype == jnp.bfloat16


def test_convnet_step_updates_batch_stats():
    config = ConvNetConfig()
    state = convnet.create_train_state(config)
    new_state, _ = jax.jit(convnet.train_step)(state, convnet.make_batch(config, BATCH_SIZE))
    assert jax.tree.structure(new_state.batch_stats) == jax.tree.structure(state.batch_stats)
    for old, new in zip(
        jax.tree.leaves(state.batch_stats), jax.tree.leaves(new_state.batch_stats), strict=True
    ):
        assert not np.allclose(old, new)


def test_gpt_alpa_sizes():
    config = GPTConfig.alpa("1.3B")
    assert (config.hidden, config.num_layers, config.num_heads) == (2048, 24, 32)
    assert (config.seq_len, config.vocab_size, config.mlp_ratio) == (1024, 51200, 4)
    assert GPTConfig.alpa("125M", dtype=jnp.bfloat16).dtype == jnp.bfloat16
    for name in gpt.ALPA_GPT_SIZES:
        GPTConfig.alpa(name)  # every table entry is a valid config


def test_gpt_alpa_unknown_size_lists_known_names():
    with pytest.raises(ValueError, match=r"Unknown Alpa GPT size '7B'; known: \['125M', .*'76B'\]"):
        GPTConfig.alpa("7B")


def test_gpt_config_rejects_indivisible_heads():
    with pytest.raises(ValueError, match=r"hidden \(64\) must be divisible by num_heads \(5\)"):
        GPTConfig(num_heads=5)


def test_mlp_config_rejects_zero_layers():
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        MLPConfig(num_layers=0)


@pytest.mark.parametrize("name", ["125M", "1.3B", "39B"])
def test_gpt_flops_per_token_agrees_with_alpa_formula(name):
    """Alpa's `compute_gpt_tflops` (no remat), per token: 72 L h^2 (1 + S / 6h) + 6 h V."""
    c = GPTConfig.alpa(name)
    h, n_layers, s, v = c.hidden, c.num_layers, c.seq_len, c.vocab_size
    alpa = 72 * n_layers * h**2 * (1 + s / (6 * h)) + 6 * h * v
    assert gpt.flops_per_token(c) == pytest.approx(alpa, rel=1e-2)
