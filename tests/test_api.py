"""Public API: caching, plans without devices, plan files, markers, init, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import relative_error
from jax.extend.core import Primitive
from jax.interpreters import mlir

import autopar
from autopar.models import MLPConfig, mlp

CONFIG = MLPConfig()


def _step():
    return mlp.make_train_step(autopar.value_and_grad)


def test_bare_decorator_and_executable_cache():
    step = autopar.parallelize(_step())
    state = mlp.create_train_state(CONFIG)
    first = step.get_executable(state, mlp.make_batch(CONFIG, 16))
    assert step.get_executable(state, mlp.make_batch(CONFIG, 16, seed=1)) is first
    assert step.get_executable(state, mlp.make_batch(CONFIG, 32)) is not first
    assert isinstance(first.plan, autopar.Plan)
    assert first.plan.method == "shard_parallel"  # the default method
    assert first.input_shardings[1]["x"].mesh.size == 8


def test_repeated_calls_skip_the_signature_walk_and_still_tell_calls_apart(monkeypatch):
    """A call with the signature of an earlier one goes straight to its executable; a new
    shape or a new static value is planned as before."""

    def step(params, batch, scale):
        loss, grads = autopar.value_and_grad(lambda p: jnp.mean((batch @ p) ** 2) * scale)(params)
        return params - 0.1 * grads, loss

    parallel = autopar.parallelize(step, static_argnums=(2,), donate_argnums=(), batch_argnums=(1,))
    params = jnp.ones((4, 4))
    batch = np.arange(32.0, dtype=np.float32).reshape(8, 4) / 32
    first, _ = parallel(params, batch, 2.0)
    # An output's abstract value names its mesh, a fresh array's does not: one more walk, once.
    first, _ = parallel(first, batch, 2.0)
    planned = []
    key = type(parallel)._key
    monkeypatch.setattr(type(parallel), "_key", lambda *a: planned.append(a[2]) or key(*a))
    second, loss = parallel(first, batch, 2.0)
    assert planned == []  # same signature: no walk over the arguments
    expected = jnp.ones((4, 4))
    for _ in range(3):
        expected, expected_loss = jax.jit(step, static_argnums=2)(expected, batch, 2.0)
    assert relative_error(second, expected) <= 1e-6
    assert relative_error(loss, expected_loss) <= 1e-6
    _, other_loss = parallel(second, batch, 3.0)  # a static value is part of the program
    _, wider_loss = parallel(second, np.concatenate([batch, batch]), 2.0)  # a new shape
    assert len(planned) == 2
    assert float(other_loss) == pytest.approx(1.5 * float(parallel(second, batch, 2.0)[1]))
    assert float(wider_loss) == pytest.approx(float(parallel(second, batch, 2.0)[1]))


def test_inputs_already_in_place_are_passed_as_they_are(monkeypatch):
    """The state a step returns and a batch on the one device of a one-device plan (a single
    device's sharding, the plan's one-device mesh) go in without a device_put; a batch on
    another device is moved, and the results match `jax.jit`'s. Without `autopar.init` the
    default runtime is built once, not on every call."""
    from autopar.runtime import executable

    def step(params, batch):
        loss, grads = autopar.value_and_grad(lambda p: jnp.mean((batch @ p) ** 2))(params)
        return params - 0.1 * grads, loss

    devices = jax.devices()
    parallel = autopar.parallelize(step, method=autopar.DataParallel(devices=devices[:1]))
    batch = np.arange(32.0, dtype=np.float32).reshape(8, 4) / 32
    params, _ = parallel(jnp.ones((4, 4)), batch)
    on_device, elsewhere = (jax.device_put(batch, d) for d in devices[:2])
    moved = []
    put = executable.jax.device_put
    monkeypatch.setattr(executable.jax, "device_put", lambda *a: moved.append(a) or put(*a))
    params, _ = parallel(params, on_device)
    assert moved == []
    params, loss = parallel(params, elsewhere)
    assert len(moved) == 1 and moved[0][1].device_set == {devices[0]}
    expected = jnp.ones((4, 4))
    for _ in range(3):
        expected, expected_loss = jax.jit(step)(expected, batch)
    assert relative_error(params, expected) <= 1e-6
    assert relative_error(loss, expected_loss) <= 1e-6
    assert autopar.context.current_runtime() is autopar.context.current_runtime()


def test_markers_match_jax_outside_autopar():
    state, batch = mlp.create_train_state(CONFIG), mlp.make_batch(CONFIG, 8)
    ours = jax.jit(_step())(state, batch)
    theirs = jax.jit(mlp.train_step)(state, batch)
    assert relative_error(ours[0].params, theirs[0].params) == 0.0


def test_plan_without_devices_for_a_bigger_cluster_and_json_roundtrip():
    state = jax.eval_shape(lambda: mlp.create_train_state(CONFIG))
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in mlp.make_batch(CONFIG, 64).items()
    }
    cluster = autopar.ClusterSpec.preset("2x8xV100-p3")
    plan = autopar.plan(_step(), state, batch, method=autopar.Zero3Parallel(), cluster_spec=cluster)
    assert plan.stages[0].mesh.num_devices == 16
    assert plan.predicted.communication_s > 0
    assert autopar.Plan.from_json(plan.to_json()) == plan
    text = plan.summary()
    assert "zero3" in text and "batch['x']" in text


def test_unknown_primitive_runs():
    scale_p = Primitive("autopar_test_scale")
    scale_p.def_impl(lambda x: x * 2)
    scale_p.def_abstract_eval(lambda x: x)
    mlir.register_lowering(scale_p, mlir.lower_fun(lambda x: x * 2, multiple_results=False))

    def step(w, batch):
        return w + jnp.sum(scale_p.bind(batch["x"]), axis=0)

    w = jnp.zeros(CONFIG.in_dim)
    batch = mlp.make_batch(CONFIG, 16)
    out = autopar.parallelize(step, donate_argnums=())(w, batch)
    np.testing.assert_allclose(out, 2 * batch["x"].sum(0), rtol=1e-5)


def test_init_and_shutdown():
    autopar.init(num_devices=4)
    try:
        with pytest.raises(autopar.InvalidArgumentError, match="already called"):
            autopar.init()
        step = autopar.parallelize(_step())
        plan = step.get_plan(mlp.create_train_state(CONFIG), mlp.make_batch(CONFIG, 8))
        assert plan.stages[0].mesh.num_devices == 4
    finally:
        autopar.shutdown()
    with pytest.raises(autopar.InvalidArgumentError, match="num_devices=99"):
        autopar.init(num_devices=99)
    with pytest.raises(autopar.InvalidArgumentError, match="cluster='slurm'"):
        autopar.init("slurm")


def test_mesh_as_devices():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    step = autopar.parallelize(_step(), method=autopar.DataParallel(devices=mesh))
    state, _ = step(mlp.create_train_state(CONFIG), mlp.make_batch(CONFIG, 8))
    assert jax.tree.leaves(state.params)[0].sharding.mesh.shape == {"a": 2, "b": 2}


# --- bad input: each error names the argument and the sizes, and nothing runs ---------------


def test_batch_not_divisible_by_devices_times_micro_batches():
    step = autopar.parallelize(_step(), method=autopar.DataParallel(num_micro_batches=2))
    with pytest.raises(
        autopar.InvalidArgumentError, match=r"batch\['x'\].*\(24, 32\).*8\).*\(2\) = 16"
    ):
        step(mlp.create_train_state(CONFIG), mlp.make_batch(CONFIG, 24))


def test_batch_not_divisible_by_micro_batches():
    step = autopar.parallelize(_step(), method=autopar.DataParallel(num_micro_batches=3))
    with pytest.raises(autopar.InvalidArgumentError, match="not divisible by num_micro_batches=3"):
        step(mlp.create_train_state(CONFIG), mlp.make_batch(CONFIG, 16))


def test_non_array_leaf_in_batch():
    batch = {**mlp.make_batch(CONFIG, 8), "name": "train"}
    with pytest.raises(autopar.InvalidArgumentError, match=r"batch\['name'\] is a str"):
        autopar.parallelize(_step())(mlp.create_train_state(CONFIG), batch)


def test_batch_argnums_out_of_range():
    step = autopar.parallelize(_step(), batch_argnums=(2,))
    with pytest.raises(autopar.InvalidArgumentError, match=r"batch_argnums=\(2,\).*2 positional"):
        step(mlp.create_train_state(CONFIG), mlp.make_batch(CONFIG, 8))


def test_untraceable_function_says_why():
    def step(w, batch):
        if jnp.sum(batch["x"]) > 0:  # Python control flow on a traced value
            return w + 1
        return w

    with pytest.raises(autopar.TracingError, match="step.*jax.lax.cond.*static_argnums"):
        autopar.parallelize(step)(jnp.zeros(3), mlp.make_batch(CONFIG, 8))


def test_micro_batches_need_autopar_grad():
    step = autopar.parallelize(mlp.train_step, method=autopar.DataParallel(num_micro_batches=2))
    with pytest.raises(autopar.PlanningError, match="autopar.grad"):
        step(mlp.create_train_state(CONFIG), mlp.make_batch(CONFIG, 16))


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_num_micro_batches(bad):
    with pytest.raises(autopar.InvalidArgumentError, match="num_micro_batches"):
        autopar.Zero3Parallel(num_micro_batches=bad)


def test_bad_method_and_devices():
    with pytest.raises(autopar.InvalidArgumentError, match="method must be"):
        autopar.parallelize(_step(), method="fsdp")
    step = autopar.parallelize(_step(), method=autopar.DataParallel(devices="gpu:0"))
    with pytest.raises(autopar.InvalidArgumentError, match="devices must be"):
        step(mlp.create_train_state(CONFIG), mlp.make_batch(CONFIG, 8))
