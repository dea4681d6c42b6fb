"""Models other people wrote — transformers' Flax models, equinox, Flax NNX and linen — through
every method on 8 simulated devices, against the serial `jax.jit` step.

Updates are SGD so that parameters compare gradients. The reference is the full-batch serial
step, except for clients whose micro-batches differ from the full batch by design (dropout masks
drawn per micro-batch, batch norm statistics per micro-batch): with k micro-batches their
reference is the mean of k serial steps, one per micro-batch (micro-batch j holds examples j,
j+k, ...), which is what accumulating over micro-batches computes when the update is SGD.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import autopar

pytest.importorskip("transformers")
pytest.importorskip("equinox")

import clients  # noqa: E402

BATCH = 16
STEPS = 2
LR = 0.1

METHODS = {
    "shard": lambda: autopar.ShardParallel(),
    "zero3": lambda: autopar.Zero3Parallel(),
    "dp2": lambda: autopar.DataParallel(num_micro_batches=2),
    "pipe_auto": lambda: autopar.PipeshardParallel(
        num_micro_batches=2,
        layer_option=autopar.AutoLayerOption(layer_num=2),
        stage_option=autopar.AutoStageOption(),
    ),
    "pipe_uniform": lambda: autopar.PipeshardParallel(
        num_micro_batches=2,
        layer_option=autopar.AutoLayerOption(layer_num=2),
        stage_option=autopar.UniformStageOption(2),
    ),
}


def _float_leaves(tree) -> list:
    leaves = jax.tree.leaves(tree)
    return [
        np.asarray(x)
        for x in leaves
        if isinstance(x, jax.Array | np.ndarray) and jax.dtypes.issubdtype(x.dtype, np.floating)
    ]


def _run(step, args, steps: int):
    for _ in range(steps):
        out = step(*args)
        args = (*out[:-1], args[-1])
    return args, out[-1]


def _micro_batch(batch, j: int, k: int):
    return jax.tree.map(lambda x: x[j::k], batch)


def _reference(client: clients.ClientStep, k: int):
    """Arguments after STEPS serial steps, full-batch or per micro-batch (module docstring)."""
    step = client.jit(client.step)
    args = client.args
    if k == 1 or not client.per_micro_batch:
        return _run(step, args, STEPS)[0]
    for _ in range(STEPS):
        outs = [step(*args[:-1], _micro_batch(args[-1], j, k)) for j in range(k)]
        averaged = jax.tree.map(
            lambda *xs: (
                sum(np.asarray(x, np.float64) for x in xs) / k
                if jax.dtypes.issubdtype(xs[0].dtype, np.floating)
                else xs[0]
            ),
            *[o[:-1] for o in outs],
        )
        args = (*averaged, args[-1])
    return args


@pytest.mark.slow
@pytest.mark.parametrize("method_name", list(METHODS))
@pytest.mark.parametrize("client_name", list(clients.CLIENTS))
def test_client_matches_serial(client_name: str, method_name: str):
    client = clients.CLIENTS[client_name](optax.sgd(LR), BATCH)
    method = METHODS[method_name]()
    k = method.num_micro_batches or 1
    batch_arg = len(client.args) - 1
    step = autopar.parallelize(client.step, method=method, batch_argnums=(batch_arg,))
    args, metrics = _run(step, client.args, STEPS)
    expected = _reference(client, k)
    assert np.isfinite(float(np.asarray(metrics["loss"])))
    assert _relative_error(_float_leaves(args[:-1]), _float_leaves(expected[:-1])) <= 1e-5


def test_equinox_hyperparameters_stay_static_under_adam():
    """A Module's Python floats (its dropout rate) are static, as `eqx.filter_jit` has them:
    traced, they were differentiated, so adam's state (built without them) broke the first step,
    and sgd's steps returned them as arrays. Each step's loss matches the serial step's: Adam
    turns the rounding noise of parameters with tiny gradients (here the attention's query and
    key projections) into steps of the learning rate's size, so the parameters themselves are
    compared under SGD (`test_client_matches_serial`)."""
    client = clients.equinox_transformer(optax.adam(LR), BATCH)
    step = autopar.parallelize(client.step, batch_argnums=(2,))
    serial = client.jit(client.step)
    args = expected = client.args
    for _ in range(STEPS):
        *state, metrics = step(*args)
        *serial_state, serial_metrics = serial(*expected)
        args, expected = (*state, args[-1]), (*serial_state, expected[-1])
        loss, serial_loss = float(metrics["loss"]), float(serial_metrics["loss"])
        assert abs(loss - serial_loss) <= 1e-5 * abs(serial_loss)
    assert isinstance(args[0].blocks[0].attention.dropout.p, float)


def _relative_error(actual: list, expected: list) -> float:
    """Largest per-leaf ||a - e|| / ||e||, where ||e|| is floored at 1e-3 of the whole state's
    norm: a parameter whose gradient is identically zero (an attention key bias, a bias before
    batch norm) holds rounding noise, whose relative error says nothing."""
    floor = 1e-3 * np.sqrt(sum(np.sum(np.square(e, dtype=np.float64)) for e in expected))
    return max(
        np.linalg.norm(np.asarray(a, np.float64) - e) / max(np.linalg.norm(e), floor)
        for a, e in zip(actual, expected, strict=True)
    )


# ----------------------------------------------------------------- what users write around steps

PIPELINE = dict(num_micro_batches=2, layer_option="auto", stage_option="uniform")  # Alpa's names


def _small() -> clients.ClientStep:
    return clients.nnx_functional(optax.sgd(LR), BATCH)


def test_alpa_option_strings_are_converted_once():
    method = autopar.PipeshardParallel(layer_option="manual", stage_option="auto")
    assert method.layer_option == autopar.ManualLayerOption()
    assert method.stage_option == autopar.AutoStageOption()
    method = autopar.PipeshardParallel(**PIPELINE)
    assert method.layer_option == autopar.AutoLayerOption(layer_num=2)
    assert method.stage_option == autopar.UniformStageOption()
    with pytest.raises(autopar.InvalidArgumentError, match=r"stage_option='fastest' is not one"):
        autopar.PipeshardParallel(stage_option="fastest")
    with pytest.raises(autopar.InvalidArgumentError, match=r"layer_option='layers' is not one"):
        autopar.PipeshardParallel(layer_option="layers")


@pytest.mark.parametrize("method", [autopar.ShardParallel(), autopar.PipeshardParallel(**PIPELINE)])
def test_constant_outputs(method):
    """A step that returns constants (a learning rate from a constant schedule)."""
    client = _small()
    schedule = optax.constant_schedule(1e-3)

    def step(params, opt_state, batch):
        *state, metrics = client.step(params, opt_state, batch)
        return (*state, {**metrics, "lr": schedule(0), "beta": 0.9})

    out = autopar.parallelize(step, method=method, batch_argnums=(2,))(*client.args)
    assert float(out[-1]["lr"]) == pytest.approx(1e-3, rel=1e-6)
    assert float(out[-1]["beta"]) == pytest.approx(0.9, rel=1e-6)


@pytest.mark.parametrize(
    "method",
    [
        autopar.ShardParallel(),
        autopar.DataParallel(num_micro_batches=2),
        autopar.PipeshardParallel(**PIPELINE),
    ],
    ids=["shard", "dp2", "pipe"],
)
def test_per_example_typed_keys_are_batch_inputs(method):
    """Typed keys in the batch (one per example) are split with it; results match serial."""
    client = _small()

    def step(params, opt_state, batch):
        noise = jax.vmap(lambda key: jax.random.normal(key, (16,)))(batch["keys"])
        return client.step(params, opt_state, {"x": batch["x"] + 0.1 * noise, "y": batch["y"]})

    batch = {**client.args[-1], "keys": jax.random.split(jax.random.key(3), BATCH)}
    args = (*client.args[:-1], batch)
    expected = jax.jit(step)(*args)
    parallel = autopar.parallelize(step, method=method, batch_argnums=(2,))
    out = parallel(*args)
    assert _relative_error(_float_leaves(out), _float_leaves(expected)) <= 1e-5
    if isinstance(method, autopar.DataParallel):
        key_sharding = parallel.get_executable(*args).input_shardings[-1]["keys"]
        assert key_sharding.spec[0] is not None  # split over the batch like the other leaves


def test_explicit_mesh_from_make_mesh():
    """A `jax.make_mesh` mesh with Explicit axes (jax's default since 0.9) as `devices=`."""
    mesh = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    client = _small()
    expected = jax.jit(client.step)(*client.args)
    for method in (autopar.ShardParallel(devices=mesh), autopar.DataParallel(devices=mesh)):
        out = autopar.parallelize(client.step, method=method, batch_argnums=(2,))(*client.args)
        assert _relative_error(_float_leaves(out), _float_leaves(expected)) <= 1e-5
        assert {d.id for d in jax.tree.leaves(out)[0].sharding.device_set} == set(range(8))


def test_weighted_mean_loss_warns_and_sum_count_is_exact(caplog):
    """A loss divided by a batch-dependent count is averaged per micro-batch (inexact): autopar
    warns, naming the line; the (sum, count) form of `clients.bert_mlm` gives no warning."""
    client = clients.bert_mlm(optax.sgd(LR), BATCH)
    model_call = client.args[0].apply_fn

    def weighted_mean_step(state, batch):
        def loss_fn(params):
            logits = model_call(batch["input_ids"], params=params).logits
            weights = (batch["labels"] != -100).astype(np.float32)
            labels = jax.numpy.maximum(batch["labels"], 0)
            xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return (xent * weights).sum() / weights.sum()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    method = autopar.DataParallel(num_micro_batches=2)
    with caplog.at_level("WARNING", logger="autopar"):
        autopar.parallelize(weighted_mean_step, method=method).get_plan(*client.args)
    assert "the loss divides by a count computed from the batch" in caplog.text
    assert "test_clients.py" in caplog.text  # the user's line
    caplog.clear()
    with caplog.at_level("WARNING", logger="autopar"):
        autopar.parallelize(client.step, method=method).get_plan(*client.args)
    assert "divides by a count" not in caplog.text


def test_batch_read_with_gradients_is_refused_with_the_users_names():
    client = _small()

    def step(params, opt_state, batch):
        def loss_fn(params):
            return jax.numpy.mean(batch["x"] @ params["inp"]["kernel"][...])

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        leaked = jax.numpy.sum(batch["y"]) * grads["inp"]["bias"][...].sum()
        return params, opt_state, {"loss": loss, "leaked": leaked}

    method = autopar.DataParallel(num_micro_batches=2)
    with pytest.raises(
        autopar.PlanningError, match=r"test_clients.py.*reads the batch \(batch\['y'\]\)"
    ):
        autopar.parallelize(step, method=method, batch_argnums=(2,)).get_plan(*client.args)


def test_unhashable_static_leaf_is_named():
    """Non-array leaves are part of the program (as `eqx.filter_jit` has them), so they must
    hash; the error names the leaf."""
    params, opt_state, batch = _small().args

    def step(params, opt_state, batch):
        return params

    with pytest.raises(autopar.InvalidArgumentError, match=r"opt_state\['tags'\] is neither"):
        state = {"tags": {"a", "b"}, "count": np.zeros(())}
        autopar.parallelize(step, batch_argnums=(2,))(params, state, batch)
