"""Around the train step: state created in place (CreateStateParallel), eval steps that follow
the train step's placement (FollowParallel), preshard_dynamic_args and prefetch_batches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import relative_error, serial_state

import autopar
from autopar.methods import ParallelMethod
from autopar.models import MLPConfig, mlp

CONFIG = MLPConfig(in_dim=64, hidden=64, out_dim=64, num_layers=4)
BATCH = 32
STEPS = 3
PIPELINE = autopar.PipeshardParallel(
    num_micro_batches=4,
    layer_option=autopar.AutoLayerOption(layer_num=4),
    stage_option=autopar.UniformStageOption(2),
)


def _serial():
    return serial_state(mlp, CONFIG, BATCH, STEPS)


def _train_step(method):
    return autopar.parallelize(mlp.make_train_step(autopar.value_and_grad), method=method)


def _eval_loss(state, batch):
    pred = state.apply_fn({"params": state.params}, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)


def _per_device_bytes(tree) -> dict:
    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


@pytest.mark.parametrize(
    "method,groups,share",
    # ZeRO-3 splits everything over 8 devices; this pipeline's stages replicate their half.
    [(autopar.Zero3Parallel(), 1, 0.25), (PIPELINE, 2, 0.51)],
    ids=["zero3", "pipeshard"],
)
def test_state_is_born_sharded(method, groups, share):
    train_step = _train_step(method)
    batch = mlp.make_batch(CONFIG, BATCH)
    create = autopar.parallelize(
        functools.partial(mlp.create_train_state, CONFIG, batch_size=2),
        method=autopar.CreateStateParallel(train_step, batch),
    )
    state = create()
    wanted = train_step.get_executable(state, batch).input_shardings[0]
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(wanted), strict=True):
        assert leaf.sharding == sharding
    assert len({frozenset(leaf.sharding.device_set) for leaf in jax.tree.leaves(state)}) == groups
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    assert max(_per_device_bytes(state).values()) <= share * total
    for _ in range(STEPS):
        state, _ = train_step(state, batch)
    assert relative_error(state.params, _serial().params) <= 1e-5


def test_create_state_checks_what_it_returns():
    train_step = _train_step(autopar.ShardParallel())
    batch = mlp.make_batch(CONFIG, BATCH)
    create = autopar.parallelize(
        lambda: {"w": jnp.zeros((3, 3))},
        method=autopar.CreateStateParallel(train_step, batch),
    )
    with pytest.raises(autopar.InvalidArgumentError, match="cannot take .* AttributeError"):
        create()
    assert isinstance(create.method, ParallelMethod)  # a method like the others, run, not planned
    with pytest.raises(autopar.InvalidArgumentError, match="CreateStateParallel is only called"):
        create.get_plan()
    with pytest.raises(autopar.InvalidArgumentError, match="autopar.parallelize"):
        autopar.parallelize(lambda: 0, method=autopar.CreateStateParallel(lambda s, b: s, batch))
    with pytest.raises(autopar.InvalidArgumentError, match="state_argnum"):
        autopar.CreateStateParallel(train_step, batch, state_argnum=5)


@pytest.mark.parametrize("takes", ["state", "params"])
def test_eval_follows_the_train_placement(takes):
    train_step = _train_step(autopar.Zero3Parallel())
    state = mlp.create_train_state(CONFIG, batch_size=2)
    batch = mlp.make_batch(CONFIG, BATCH)
    for _ in range(STEPS):
        state, _ = train_step(state, batch)
    if takes == "state":
        fn, arg = _eval_loss, state

    else:

        def fn(params, batch):
            return _eval_loss(state.replace(params=params), batch)

        arg = state.params
    eval_step = autopar.parallelize(fn, method=autopar.FollowParallel(train_step))
    loss = eval_step(arg, batch)
    train_shardings = train_step.get_executable(state, batch).input_shardings[0]
    eval_shardings = eval_step.get_executable(arg, batch).input_shardings[0]
    if takes == "params":
        train_shardings = train_shardings.params
    assert jax.tree.leaves(eval_shardings) == jax.tree.leaves(train_shardings)
    serial = _serial()
    expected = jax.jit(_eval_loss)(serial, batch)
    assert abs(float(loss) - float(expected)) <= 1e-5 * abs(float(expected))


def test_follow_needs_a_planned_single_mesh_step():
    batch = mlp.make_batch(CONFIG, BATCH)
    state = mlp.create_train_state(CONFIG, batch_size=2)
    unplanned = autopar.parallelize(_eval_loss, method=autopar.FollowParallel(_train_step(None)))
    with pytest.raises(autopar.InvalidArgumentError, match="no plan yet"):
        unplanned(state, batch)
    pipelined = _train_step(PIPELINE)
    pipelined.get_plan(state, batch)
    follow = autopar.parallelize(_eval_loss, method=autopar.FollowParallel(pipelined))
    with pytest.raises(autopar.InvalidArgumentError, match="single-mesh"):
        follow(state, batch)
    with pytest.raises(autopar.InvalidArgumentError, match="autopar.parallelize"):
        autopar.parallelize(_eval_loss, method=autopar.FollowParallel(_eval_loss))


def test_preshard_and_prefetch_place_batches():
    train_step = _train_step(autopar.DataParallel())
    state = mlp.create_train_state(CONFIG, batch_size=2)
    batch = mlp.make_batch(CONFIG, BATCH)
    placed_state, placed_batch = train_step.preshard_dynamic_args(state, batch)
    wanted = train_step.get_executable(state, batch).input_shardings
    assert [x.sharding for x in jax.tree.leaves(placed_batch)] == jax.tree.leaves(wanted[1])
    assert [x.sharding for x in jax.tree.leaves(placed_state)] == jax.tree.leaves(wanted[0])

    batches = [batch] * STEPS
    seen = 0
    for fed in autopar.prefetch_batches(train_step, batches, state, prefetch=2):
        assert [x.sharding for x in jax.tree.leaves(fed)] == jax.tree.leaves(wanted[1])
        np.testing.assert_array_equal(np.asarray(fed["x"]), batch["x"])
        state, _ = train_step(state, fed)
        seen += 1
    assert seen == STEPS
    assert relative_error(state.params, _serial().params) <= 1e-5
    with pytest.raises(autopar.InvalidArgumentError, match="prefetch"):
        next(autopar.prefetch_batches(train_step, batches, state, prefetch=0))
