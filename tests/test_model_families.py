"""The MoE and Wide-ResNet families on 8 simulated devices (planned steps against the serial step,
experts split with all-to-all in the compiled HLO), Alpa's sizes (parameter counts, FLOP models
against XLA's cost analysis) and shape-only planning of every family with
`abstract_train_inputs`. Shared properties of all families are in test_models.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import relative_error, serial_state

import autopar
from autopar.models import (
    GPTConfig,
    MLPConfig,
    MoEConfig,
    WResNetConfig,
    abstract_train_inputs,
    gpt,
    mlp,
    moe,
    wresnet,
)

V100_NODE = autopar.ClusterSpec.preset("8xV100-p3")

# Big enough (8 experts, 2048 tokens) that splitting experts beats splitting their hidden dim.
MOE_EP = MoEConfig(hidden=128, num_experts=8, seq_len=64)
MOE_PIPE = MoEConfig(num_layers=2, pipeline_boundaries=True)
BATCH = 32


def _size(name: str) -> float:
    """'380M' -> 3.8e8, '1.3B' -> 1.3e9."""
    number, unit = re.fullmatch(r"([\d.]+)([MB])", name).groups()
    return float(number) * {"M": 1e6, "B": 1e9}[unit]


def _run(family, config, method, batch_size: int, steps: int):
    step = autopar.parallelize(family.make_train_step(autopar.value_and_grad), method=method)
    state = family.create_train_state(config, batch_size=2)
    batch = family.make_batch(config, batch_size)
    for _ in range(steps):
        state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    return step, state, batch


# ------------------------------------------------------------------ routing


def test_top2_gating_fills_expert_slots_in_order_and_drops_overflow():
    probs = [[0.6, 0.3, 0.1], [0.5, 0.1, 0.4], [0.2, 0.7, 0.1], [0.7, 0.2, 0.1]]
    combine, dispatch, aux_loss = moe.top2_gating(jnp.log(jnp.array([probs])), capacity=2)
    assert combine.shape == dispatch.shape == (1, 4, 3, 2)  # (groups, tokens, experts, slots)
    # First choices fill the slots first (expert 0: tokens 0 and 1; token 3 overflows), then
    # second choices after them (expert 1: token 0 in slot 1; token 3 overflows again).
    routes = {tuple(int(i) for i in ix[1:]) for ix in np.argwhere(np.asarray(dispatch))}
    assert routes == {(0, 0, 0), (1, 0, 1), (2, 1, 0), (0, 1, 1), (1, 2, 0)}
    expected = np.zeros((4, 3, 2))
    for (token, expert, slot), weight in {
        (0, 0, 0): 0.6 / 0.9,
        (0, 1, 1): 0.3 / 0.9,
        (1, 0, 1): 0.5 / 0.9,
        (1, 2, 0): 0.4 / 0.9,
        (2, 1, 0): 0.7 / 0.9,  # its second expert was full: it keeps only its first's weight
    }.items():
        expected[token, expert, slot] = weight
    np.testing.assert_allclose(combine[0], expected, rtol=1e-6, atol=1e-7)
    # E^2 * mean_e(first-choice fraction * mean probability), before capacity drops tokens.
    fraction, mean_prob = np.array([3, 1, 0]) / 4, np.mean(probs, axis=0)
    assert float(aux_loss) == pytest.approx(9 * np.mean(fraction * mean_prob), rel=1e-6)


def test_moe_group_size_must_divide_the_tokens():
    config = MoEConfig(expert_group_size=48)
    assert moe.group_size(config, 96) == 48
    assert moe.group_size(config, 32) == 32  # fewer tokens than a group: one group
    with pytest.raises(ValueError, match=r"expert_group_size \(48\) must divide .* \(64\)"):
        moe.group_size(config, 64)


@pytest.mark.parametrize(
    "family, config",
    [
        pytest.param(moe, MoEConfig(dtype=jnp.bfloat16), id="moe"),
        pytest.param(wresnet, WResNetConfig(dtype=jnp.bfloat16), id="wresnet"),
    ],
)
def test_bfloat16_compute_keeps_float32_parameters(family, config):
    state = jax.eval_shape(lambda: family.create_train_state(config))
    new_state, metrics = jax.eval_shape(family.train_step, state, family.make_batch(config, 2))
    assert {x.dtype for x in jax.tree.leaves(new_state.params)} == {jnp.dtype(jnp.float32)}
    assert metrics["loss"].dtype == jnp.float32


# ------------------------------------------------------------------ planned steps vs serial


def test_moe_shard_parallel_matches_serial_with_experts_split_by_all_to_all():
    """Compared under SGD (parameters then compare gradients): Adam turns rounding error in
    near-zero gradients into O(learning rate) steps."""
    sgd = optax.sgd(0.1)
    start = moe.create_train_state(MOE_EP, batch_size=2)
    start = start.replace(tx=sgd, opt_state=sgd.init(start.params))
    batch = moe.make_batch(MOE_EP, BATCH)
    step = autopar.parallelize(moe.make_train_step(autopar.value_and_grad))
    serial_step = jax.jit(moe.train_step)
    state, serial = start, start
    for _ in range(3):
        state, _ = step(state, batch)
        serial, _ = serial_step(serial, batch)
    assert relative_error(state.params, serial.params) <= 1e-5
    moe_params = state.params["block_0"]["moe"]
    for name in ("wi", "wo"):  # (experts, ...): experts split over the 8 devices
        assert moe_params[name].sharding.spec[0] == "x", moe_params[name].sharding.spec
    # What XLA compiled: the routed tokens (experts, groups, capacity, hidden) move between the
    # group-split and the expert-split layout by all-to-all, each of which holds one device's
    # eighth of that tensor (to the experts and back, in the forward and the backward pass).
    executable = step.get_executable(state, batch)
    assert "all-to-all" in executable.get_hlo_text()
    capacity = moe.expert_capacity(MOE_EP, MOE_EP.seq_len)  # groups are sequences
    routed_bytes = MOE_EP.num_experts * BATCH * capacity * MOE_EP.hidden * 4
    all_to_alls = executable.collectives()["all-to-all"]  # bytes of each, read off the HLO
    assert all_to_alls.count(routed_bytes // 8) >= 4, all_to_alls


@pytest.mark.slow
def test_moe_two_stage_pipeshard_matches_serial():
    method = autopar.PipeshardParallel(
        num_micro_batches=4,
        layer_option=autopar.ManualLayerOption(),
        stage_option=autopar.UniformStageOption(2),
    )
    step, state, batch = _run(moe, MOE_PIPE, method, BATCH, steps=3)
    assert relative_error(state.params, serial_state(moe, MOE_PIPE, BATCH, 3).params) <= 1e-5
    plan = step.get_plan(state, batch)
    assert [s.layers for s in plan.stages] == [(0, 1), (1, 2)]  # the MoE layer, the dense one
    devices = {frozenset(leaf.sharding.device_set) for leaf in jax.tree.leaves(state.params)}
    assert len(devices) == 2 and len(frozenset().union(*devices)) == 8


@pytest.mark.slow
def test_wresnet_shard_parallel_matches_serial():
    """Two steps, not three: the stem BatchNorm's bias has an almost-zero gradient (every path
    from it is normalised again by a BatchNorm; only relu and max pooling break the invariance),
    so Adam amplifies rounding noise in it step after step."""
    config = WResNetConfig()
    _, state, _ = _run(wresnet, config, None, 16, steps=2)
    serial = serial_state(wresnet, config, 16, 2)
    assert relative_error(state.params, serial.params) <= 1e-5
    assert relative_error(state.batch_stats, serial.batch_stats) <= 1e-5


# ------------------------------------------------------------------ Alpa's sizes


ALPA_SIZES = [
    pytest.param(moe, MoEConfig, name, id=f"moe-{name}") for name in moe.ALPA_MOE_SIZES
] + [
    pytest.param(wresnet, WResNetConfig, name, id=f"wresnet-{name}")
    for name in wresnet.ALPA_WRESNET_SIZES
]


@pytest.mark.parametrize("family, config_type, name", ALPA_SIZES)
def test_alpa_sizes_have_the_parameters_their_names_say(family, config_type, name):
    config = config_type.alpa(name)
    state = jax.eval_shape(lambda: family.create_train_state(config))  # shapes only
    count = sum(x.size for x in jax.tree.leaves(state.params))
    assert count == family.param_count(config)
    assert count == pytest.approx(_size(name), rel=0.15)


def test_alpa_configs():
    c = MoEConfig.alpa("7.1B")
    assert (c.hidden, c.num_layers, c.num_experts, c.num_heads) == (1280, 16, 32, 16)
    assert (c.seq_len, c.vocab_size, c.mlp_ratio, c.expert_group_size) == (1024, 32000, 8, 2048)
    assert moe.expert_capacity(c, 2048) == 128  # 2 * 2048 / 32
    w = WResNetConfig.alpa("13B")
    assert (w.depth, w.stage_sizes, w.channels, w.width_factor) == (101, (3, 4, 23, 3), 320, 16)
    assert (w.image_size, w.num_classes) == (224, 1024)
    assert WResNetConfig.alpa("250M").depth == 50
    with pytest.raises(ValueError, match=r"Unknown Alpa MoE size '1B'; known: \['380M', .*"):
        MoEConfig.alpa("1B")
    with pytest.raises(ValueError, match=r"Unknown Alpa Wide-ResNet size '3B'; known: \[.*"):
        WResNetConfig.alpa("3B")


@pytest.mark.parametrize(
    "family, config, batch_size",
    [
        pytest.param(moe, MoEConfig.alpa("380M"), 2, id="moe-380M"),
        pytest.param(wresnet, WResNetConfig.alpa("250M"), 2, id="wresnet-250M"),
    ],
)
def test_flop_models_match_xla_cost_analysis(family, config, batch_size):
    """The FLOP formulas against XLA's count for the whole lowered step (never compiled)."""
    step, state, batch = abstract_train_inputs(
        family, config, batch_size, grad_fn=jax.value_and_grad
    )
    xla = jax.jit(step).lower(state, batch).cost_analysis()["flops"]
    if family is moe:
        formula = moe.flops_per_token(config) * batch_size * config.seq_len
    else:
        formula = wresnet.flops_per_example(config) * batch_size
    assert xla == pytest.approx(formula, rel=0.05)


# ------------------------------------------------------------------ shape-only planning


@pytest.mark.parametrize(
    "family, config, batch_size",
    [
        pytest.param(mlp, MLPConfig(in_dim=1024, hidden=8192, out_dim=1024), 1024, id="mlp"),
        pytest.param(gpt, GPTConfig.alpa("125M"), 16, id="gpt-125M"),
        pytest.param(moe, MoEConfig.alpa("380M"), 16, id="moe-380M"),
        pytest.param(wresnet, WResNetConfig.alpa("250M"), 32, id="wresnet-250M"),
    ],
)
def test_abstract_inputs_plan_for_a_cluster_without_allocating(family, config, batch_size):
    live_before = sum(x.nbytes for x in jax.live_arrays())
    step, state, batch = abstract_train_inputs(family, config, batch_size)
    leaves = jax.tree.leaves((state, batch))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert {k: v.shape[0] for k, v in batch.items()} == dict.fromkeys(batch, batch_size)
    plan = autopar.plan(step, state, batch, cluster_spec=V100_NODE)
    assert plan.num_devices == 8 and len(plan.stages) == 1
    assert plan.predicted.memory_per_device_bytes <= V100_NODE.device_memory
    # Nothing of the model's size was allocated (4 bytes a parameter, plus Adam's two moments).
    state_bytes = 12 * family.param_count(config)
    assert sum(x.nbytes for x in jax.live_arrays()) - live_before < state_bytes / 100
