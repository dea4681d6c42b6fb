"""DataParallel, Zero2 and Zero3 on 8 simulated devices: numerics against the serial step, shardings
read off the outputs, collectives read off the compiled HLO, memory from XLA's analysis."""

import functools

import jax
import numpy as np
import optax
import pytest
from conftest import relative_error

import autopar
from autopar.models import ConvNetConfig, GPTConfig, MLPConfig, convnet, gpt, mlp

BATCH = 32
STEPS = 3
FAMILIES = {
    "mlp": (mlp, MLPConfig()),
    "gpt": (gpt, GPTConfig(num_layers=2)),
    "convnet": (convnet, ConvNetConfig()),
}
METHODS = {
    "dp": autopar.DataParallel,
    "zero2": autopar.Zero2Parallel,
    "zero3": autopar.Zero3Parallel,
}


def _state(family: str):
    module, config = FAMILIES[family]
    return module.create_train_state(config, batch_size=2)


def _batch(family: str):
    module, config = FAMILIES[family]
    return module.make_batch(config, BATCH)


# Batch norm normalises each micro-batch with its own statistics, so accumulating over
# micro-batches is not the full-batch step; its reference is the serial step accumulated alike.
BATCH_STATISTICS = {"convnet"}


@functools.cache
def serial_params(family: str, num_micro_batches: int):
    """Parameters after STEPS serial `jax.jit` full-batch steps. For models with batch statistics
    and k > 1 micro-batches: the serial step under optax.MultiSteps over micro-batches j, j+k, ...
    (autopar's layout)."""
    module, _ = FAMILIES[family]
    state, batch = _state(family), _batch(family)
    k = num_micro_batches if family in BATCH_STATISTICS else 1
    if k > 1:
        state = state.replace(tx=optax.MultiSteps(state.tx, every_k_schedule=k))
        state = state.replace(opt_state=state.tx.init(state.params))
    step = jax.jit(module.train_step)
    for _ in range(STEPS):
        for j in range(k):
            state, metrics = step(state, jax.tree.map(lambda x, j=j: x[j::k], batch))
    return state.params


def _run(family: str, method, steps: int = STEPS):
    module, _ = FAMILIES[family]
    step = autopar.parallelize(module.make_train_step(autopar.value_and_grad), method=method)
    state, batch = _state(family), _batch(family)
    for _ in range(steps):
        state, metrics = step(state, batch)
    return step, state, metrics


@pytest.mark.parametrize("num_micro_batches", [None, 4])
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_serial_step(family, method, num_micro_batches):
    _, state, metrics = _run(family, METHODS[method](num_micro_batches=num_micro_batches))
    assert np.isfinite(float(metrics["loss"]))
    assert relative_error(state.params, serial_params(family, num_micro_batches or 1)) <= 1e-5


def _specs(tree):
    return [x.sharding.spec for x in jax.tree.leaves(tree)]


def test_output_shardings_follow_the_method():
    n = len(jax.devices())
    _, dp, _ = _run("gpt", autopar.DataParallel(), steps=1)
    assert all(all(e is None for e in s) for s in _specs(dp.params))

    _, z2, _ = _run("gpt", autopar.Zero2Parallel(), steps=1)
    assert all(all(e is None for e in s) for s in _specs(z2.params))
    mu = z2.opt_state[0].mu
    assert all("data" in s for s in _specs(mu))

    _, z3, _ = _run("gpt", autopar.Zero3Parallel(), steps=1)
    for tree in (z3.params, z3.opt_state[0].mu, z3.opt_state[0].nu):
        for leaf in jax.tree.leaves(tree):
            assert "data" in leaf.sharding.spec, leaf.sharding
            assert leaf.addressable_shards[0].data.size == leaf.size // n


@functools.cache
def _executable(method_name: str):
    step = autopar.parallelize(
        gpt.make_train_step(autopar.value_and_grad), method=METHODS[method_name]()
    )
    return step.get_executable(_state("gpt"), _batch("gpt"))


def test_data_parallel_collectives():
    coll = _executable("dp").collectives()
    assert coll["all-reduce"], "gradients must be all-reduced"
    assert not coll["all-gather"] and not coll["reduce-scatter"]


def test_zero3_collectives():
    exe = _executable("zero3")
    coll = exe.collectives()
    n = len(jax.devices())
    assert coll["all-gather"] and coll["reduce-scatter"]
    # Only the scalar loss is all-reduced; no gradient is.
    assert all(size <= 8 for size in coll["all-reduce"]), coll["all-reduce"]
    # Parameters are gathered in the forward pass and again in the backward pass.
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(_state("gpt").params))
    assert sum(coll["all-gather"]) >= 1.5 * param_bytes
    # Gradients arrive as shards: the reduce-scattered bytes are the parameters split n ways.
    assert sum(coll["reduce-scatter"]) == pytest.approx(param_bytes / n, rel=0.05)


def test_zero2_reduce_scatters_gradients_and_gathers_parameters():
    coll = _executable("zero2").collectives()
    assert coll["reduce-scatter"] and coll["all-gather"]
    assert all(size <= 8 for size in coll["all-reduce"]), coll["all-reduce"]


def test_zero3_memory_against_data_parallel():
    # The examples/gpt.py default size: parameters matter next to activations, as in real training.
    config = GPTConfig(hidden=128, num_layers=2, vocab_size=512)
    state, batch = gpt.create_train_state(config, batch_size=2), gpt.make_batch(config, 16)
    dp, z3 = (
        autopar.parallelize(gpt.make_train_step(autopar.value_and_grad), method=method)
        .get_executable(state, batch)
        .memory_stats()
        for method in (autopar.DataParallel(), autopar.Zero3Parallel())
    )
    n = len(jax.devices())
    print(f"\nDP   {dp}\nZeRO3 {z3}")
    assert z3.argument_bytes <= dp.argument_bytes / n * 1.05
    assert z3.temp_bytes <= dp.temp_bytes


def test_predicted_communication_orders_methods():
    plans = {m: _executable(m).plan for m in METHODS}
    assert (
        plans["dp"].predicted.memory_per_device_bytes
        > plans["zero2"].predicted.memory_per_device_bytes
    )
    assert (
        plans["zero2"].predicted.memory_per_device_bytes
        > plans["zero3"].predicted.memory_per_device_bytes
    )
    assert plans["zero3"].predicted.communication_bytes > plans["dp"].predicted.communication_bytes


BUDGETED = {
    "dp": lambda budget: autopar.DataParallel(memory_budget_per_device=budget),
    "zero2": lambda budget: autopar.Zero2Parallel(memory_budget_per_device=budget),
    "zero3": lambda budget: autopar.Zero3Parallel(memory_budget_per_device=budget),
    "shard": lambda budget: autopar.ShardParallel(
        auto_sharding_option=autopar.AutoShardingOption(memory_budget_per_device=budget)
    ),
}


@pytest.mark.parametrize("method", BUDGETED)
def test_every_method_refuses_a_plan_over_the_memory_budget(method):
    """The same budget means the same for every method: a plan predicted over it raises
    MemoryBudgetError with the figures, never a plan that cannot fit."""
    config = MLPConfig()
    state = mlp.create_train_state(config, batch_size=2)
    batch = mlp.make_batch(config, 16)
    fits = autopar.plan(mlp.train_step, state, batch, method=BUDGETED[method](None))
    need = fits.predicted.memory_per_device_bytes
    with pytest.raises(autopar.MemoryBudgetError, match="memory budget") as info:
        autopar.plan(mlp.train_step, state, batch, method=BUDGETED[method](need / 4))
    assert info.value.budget == need / 4 and info.value.least > need / 4
    budget = autopar.plan(mlp.train_step, state, batch, method=BUDGETED[method](need * 1.01))
    assert budget.predicted.memory_per_device_bytes <= need * 1.01


@pytest.mark.parametrize("budget", [0, -1.0, float("inf"), "1GB", True])
def test_data_parallel_rejects_a_bad_memory_budget(budget):
    with pytest.raises(autopar.InvalidArgumentError, match="memory_budget_per_device"):
        autopar.Zero3Parallel(memory_budget_per_device=budget)
