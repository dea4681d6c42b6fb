"""Scanned layers (a `jax.lax.scan` over stacked weights, Flax's `nn.scan`) on 8 simulated devices:
planned by ShardParallel, ZeRO-3 and a pipeline, SGD updates against the serial step; the scan
kept whole where the step is not pipelined and unrolled into stages where it is."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import relative_error

import autopar
from autopar.models import GPTConfig, gpt
from autopar.planner import _compat, graph
from autopar.planner.graph import build_graph

LAYERS, HIDDEN, BATCH = 4, 32, 16


def _mlp_params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "w_in": jax.random.normal(k[0], (8, HIDDEN)) / 3,
        "stack": {
            "w": jax.random.normal(k[1], (LAYERS, HIDDEN, HIDDEN)) / HIDDEN**0.5,
            "b": jnp.full((LAYERS, HIDDEN), 0.1),
        },
        "w_out": jax.random.normal(k[2], (HIDDEN, 4)) / HIDDEN**0.5,
    }


def _mlp_step(grad_fn):
    """A user's step: a tanh MLP whose hidden layers are one `lax.scan`, updated by SGD."""

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w_in"])

            def layer(h, weights):
                return jnp.tanh(h @ weights["w"] + weights["b"]), None

            h, _ = jax.lax.scan(layer, h, p["stack"])
            return jnp.mean((h @ p["w_out"] - batch["y"]) ** 2)

        loss, grads = grad_fn(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    return step


def _mlp_batch():
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((BATCH, 8), dtype=np.float32),
        "y": rng.standard_normal((BATCH, 4), dtype=np.float32),
    }


GPT_CONFIG = GPTConfig(num_layers=LAYERS, scan_layers=True)


def _gpt_state():
    state = gpt.create_train_state(GPT_CONFIG, batch_size=2)
    return state.replace(tx=optax.sgd(0.1), opt_state=optax.sgd(0.1).init(state.params))


def _case(model: str):
    """(step built around a grad function, its arguments, the parameters of its result)."""
    if model == "lax_scan_mlp":
        return _mlp_step, (_mlp_params(), _mlp_batch()), lambda out: out[0]
    return (
        gpt.make_train_step,
        (_gpt_state(), gpt.make_batch(GPT_CONFIG, BATCH)),
        lambda out: out[0].params,
    )


METHODS = {
    "shard": autopar.ShardParallel,
    "zero3": autopar.Zero3Parallel,
    "pipeline": lambda: autopar.PipeshardParallel(
        num_micro_batches=2,
        layer_option=autopar.AutoLayerOption(layer_num=LAYERS),
        stage_option=autopar.UniformStageOption(2),
    ),
}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("model", ["lax_scan_mlp", "nn_scan_gpt"])
def test_scanned_layers_match_the_serial_step(model, method):
    make_step, args, params_of = _case(model)
    expected = params_of(jax.jit(make_step(jax.value_and_grad))(*args))
    step = autopar.parallelize(make_step(autopar.value_and_grad), method=METHODS[method]())
    out = step(*args)
    assert relative_error(params_of(out), expected) <= 1e-5
    plan = step.get_plan(*args)
    if method == "pipeline":
        # LAYERS layers exist only once the scan is unrolled: the two outer dots are the only
        # other heavy ops; the stages run on disjoint halves of the devices.
        assert len(plan.stages) == 2 and plan.stages[-1].layers[1] == LAYERS
        groups = {frozenset(leaf.sharding.device_set) for leaf in jax.tree.leaves(params_of(out))}
        assert {len(g) for g in groups} == {4} and len(frozenset().union(*groups)) == 8
    else:
        assert "while" in step.get_executable(*args).get_hlo_text()  # the scan stays a loop
    if method == "zero3":  # the stacked weights are sharded like any other
        largest = max(jax.tree.leaves(params_of(out)), key=lambda leaf: leaf.size)
        assert largest.ndim == 3 and not largest.sharding.is_fully_replicated


def test_scan_operand_counts_read_the_installed_jax_layout():
    def scanned(scale, h, xs):
        return jax.lax.scan(lambda h, x: (h * scale + x, h), h, xs)

    closed = jax.make_jaxpr(scanned)(2.0, jnp.ones(3), jnp.ones((5, 3)))
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert _compat.scan_operand_counts(scan.params) == (1, 1)  # scale; h (then xs)
    with pytest.raises(_compat.UnknownParamLayout, match="scan params"):
        _compat.scan_operand_counts({"length": 5, "jaxpr": None})


def test_an_unknown_scan_layout_plans_it_replicated_with_a_warning(monkeypatch, caplog):
    """A scan whose parameters no supported jax uses (as a future release may lay them out) runs
    replicated, with one warning naming the primitive, instead of failing."""

    def unknown(params):
        raise _compat.UnknownParamLayout(f"scan params {sorted(params)}")

    monkeypatch.setattr("autopar.planner.leader_rules.scan_operand_counts", unknown)
    monkeypatch.setattr(_compat, "_warned_layouts", set())
    make_step, args, params_of = _case("lax_scan_mlp")
    expected = params_of(jax.jit(make_step(jax.value_and_grad))(*args))
    with caplog.at_level(logging.WARNING, logger="autopar.planner._compat"):
        step = autopar.parallelize(make_step(autopar.value_and_grad))
        out = step(*args)
    assert relative_error(params_of(out), expected) <= 1e-5
    warnings = [r.getMessage() for r in caplog.records if "'scan'" in r.getMessage()]
    assert len(warnings) == 1 and "replicated" in warnings[0]


def test_flops_of_a_primitive_whose_params_cannot_be_read_fall_back_with_a_warning(
    monkeypatch, caplog
):
    def broken(eqn):
        return eqn.params["a_parameter_no_jax_has"]

    monkeypatch.setattr(graph, "FLOP_RULES", {**graph.FLOP_RULES, "tanh": broken})
    monkeypatch.setattr(_compat, "_warned_layouts", set())
    with caplog.at_level(logging.WARNING, logger="autopar.planner._compat"):
        built = build_graph(jax.make_jaxpr(jnp.tanh)(jnp.ones((3, 5))))
    assert built.total_flops == 15  # one per output element
    assert any("'tanh'" in r.getMessage() for r in caplog.records)


def test_scan_layers_and_pipeline_boundaries_are_exclusive():
    with pytest.raises(ValueError, match="scan_layers"):
        GPTConfig(scan_layers=True, pipeline_boundaries=True)


def test_scanned_gpt_has_the_unrolled_gpts_parameter_count():
    state = gpt.create_train_state(GPT_CONFIG)
    count = sum(leaf.size for leaf in jax.tree.leaves(state.params))
    assert count == gpt.param_count(GPT_CONFIG)
