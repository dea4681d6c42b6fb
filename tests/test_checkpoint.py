"""Sharded checkpoints: save after 3 parallel steps, restore into the same plan, another device
count, another method or a pipeline's sub-meshes, train 3 more steps and match 6 serial steps;
restored arrays carry exactly the target shardings; bad inputs name the problem."""

import functools
import logging

import jax
import numpy as np
import pytest
from conftest import relative_error, serial_state
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import autopar
from autopar.models import MLPConfig, mlp
from autopar.planner._compat import single_device_sharding

CONFIG = MLPConfig(in_dim=64, hidden=64, out_dim=64, num_layers=4)
BATCH_SIZE = 32
BATCH = mlp.make_batch(CONFIG, BATCH_SIZE)
STEPS = 3
METHODS = {
    "shard8": autopar.ShardParallel(),
    "shard4": autopar.ShardParallel(devices=jax.devices()[:4]),
    "zero3": autopar.Zero3Parallel(),
    "pipeline": autopar.PipeshardParallel(
        num_micro_batches=4,
        layer_option=autopar.AutoLayerOption(layer_num=4),
        stage_option=autopar.UniformStageOption(2),
    ),
}


@functools.cache
def parallel_step(method: str):
    """One ParallelizedFunc per method, so each plan is compiled once for the whole file."""
    return autopar.parallelize(mlp.make_train_step(autopar.value_and_grad), method=METHODS[method])


def _train(step, state, steps: int = STEPS):
    for _ in range(steps):
        state, _ = step(state, BATCH)
    return state


def _target(method: str, example_state):
    return parallel_step(method).get_executable(example_state, BATCH).input_shardings[0]


def _saved(method: str, directory):
    """Train STEPS steps with `method` and save them; returns the saved state (on the host: a
    step donates its input buffers) and the plan's target shardings."""
    state = _train(parallel_step(method), mlp.create_train_state(CONFIG, batch_size=2))
    path = autopar.save_checkpoint(directory, state, STEPS)
    assert path == directory / str(STEPS) and path.is_dir()
    return jax.tree.map(np.asarray, state), _target(method, state)


@pytest.fixture(scope="module")
def shard_ckpt(tmp_path_factory):
    """A ShardParallel (8 devices) checkpoint of step 3: (directory, host state, shardings)."""
    directory = tmp_path_factory.mktemp("shard")
    return (directory, *_saved("shard8", directory))


def _resume_and_check(method: str, directory, target):
    restored = autopar.restore_checkpoint(directory, STEPS, target)
    assert type(restored) is TrainState
    assert restored.apply_fn is target.apply_fn and restored.tx is target.tx
    for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert leaf.sharding == sharding
    state = _train(parallel_step(method), restored)
    assert (
        relative_error(state.params, serial_state(mlp, CONFIG, BATCH_SIZE, 2 * STEPS).params)
        <= 1e-5
    )
    assert int(state.step) == 2 * STEPS


def test_resume_on_same_plan_and_on_four_devices(shard_ckpt, caplog):
    directory, saved, target8 = shard_ckpt
    with caplog.at_level(logging.INFO, logger="autopar.checkpoint"):
        _resume_and_check("shard8", directory, target8)
    assert any(f"restored step {STEPS}" in r.getMessage() for r in caplog.records)
    target4 = _target("shard4", saved)
    restored = autopar.restore_checkpoint(directory, STEPS, target4)
    assert {d.id for x in jax.tree.leaves(restored) for d in x.sharding.device_set} == {0, 1, 2, 3}
    _resume_and_check("shard4", directory, target4)


def test_pipeline_state_on_two_submeshes(tmp_path, shard_ckpt):
    _, target = _saved("pipeline", tmp_path)
    groups = {frozenset(s.device_set) for s in jax.tree.leaves(target)}
    assert len(groups) == 2 and all(len(g) == 4 for g in groups)
    _resume_and_check("pipeline", tmp_path, target)
    _resume_and_check("shard8", tmp_path, shard_ckpt[2])


def test_restored_arrays_carry_target_shardings(shard_ckpt):
    directory, saved, _ = shard_ckpt
    target = _target("zero3", saved).replace(step=None)
    restored = autopar.restore_checkpoint(directory, STEPS, target)
    assert restored.step.sharding == single_device_sharding(jax.local_devices()[0])
    sharded = 0
    for leaf, sharding, expected in zip(
        jax.tree.leaves(restored.replace(step=None)),
        jax.tree.leaves(target),
        jax.tree.leaves(saved.replace(step=None)),
        strict=True,
    ):
        assert leaf.sharding == sharding
        np.testing.assert_array_equal(np.asarray(leaf), expected)
        if not sharding.is_fully_replicated:
            sharded += 1
            per_device = {}
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
            assert max(per_device.values()) < leaf.nbytes
    assert sharded > 0


def test_bad_inputs(shard_ckpt, tmp_path):
    directory, saved, target = shard_ckpt
    err = autopar.InvalidArgumentError
    with pytest.raises(err, match=r"step=7 is not in .*saved steps: \[3\]"):
        autopar.restore_checkpoint(directory, 7, target)
    with pytest.raises(err, match="step=3 already exists"):
        autopar.save_checkpoint(directory, saved, STEPS)
    with pytest.raises(err, match="step=-1 must be a non-negative integer"):
        autopar.save_checkpoint(tmp_path / "new", saved, -1)
    with pytest.raises(err, match="step='4' must be a non-negative integer"):
        autopar.save_checkpoint(tmp_path / "new", saved, "4")
    with pytest.raises(err, match="state leaf lr is a float, not an array"):
        autopar.save_checkpoint(tmp_path / "new", {"lr": 0.1}, 0)
    assert not (tmp_path / "new").exists()
    with pytest.raises(err, match="is not a directory"):
        autopar.restore_checkpoint(tmp_path / "missing", STEPS, target)
    with pytest.raises(err, match=r"checkpoint leaf opt_state\.0\.count is not in target"):
        autopar.restore_checkpoint(directory, STEPS, {"params": target.params, "step": None})
    params = {**target.params, "dense_9": target.params["dense_0"]}
    with pytest.raises(err, match=r"target_shardings leaf params\.dense_9\.bias is not in the"):
        autopar.restore_checkpoint(directory, STEPS, target.replace(params=params))
    three = NamedSharding(Mesh(np.array(jax.devices()[:3]), ("x",)), PartitionSpec("x"))
    params = {**target.params, "dense_1": {**target.params["dense_1"], "kernel": three}}
    with pytest.raises(
        err, match=r"params\.dense_1\.kernel cannot hold its stored shape \(64, 64\)"
    ):
        autopar.restore_checkpoint(directory, STEPS, target.replace(params=params))
    with pytest.raises(err, match=r"leaf step is a str, not a jax\.sharding\.Sharding or None"):
        autopar.restore_checkpoint(directory, STEPS, target.replace(step="cpu:0"))
