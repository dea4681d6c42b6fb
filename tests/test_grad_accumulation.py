"""Gradients cross the network once per step: accumulated on each device over micro-batches and
reduced once, read off the compiled HLO (an op inside the micro-batch loop counts once per
micro-batch), held against the plan's predicted bytes and the serial step's numerics."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import relative_error
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.planner.intra import ShardingProblem
from autopar.planner.menus import Menu, MenuBuilder
from autopar.planner.plan import ONCE_PER_STEP, PER_MICRO_BATCH
from autopar.runtime.executable import collective_bytes
from autopar.runtime.interpreter import Unreduced, reduce_partial_sums

STEPS = 3
SCALAR_SLACK = 64  # bytes: the loss is still all-reduced per micro-batch (4 bytes each)


def _loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"])
    h = jax.nn.relu(h @ params["w2"])
    return jnp.mean((h @ params["w3"] - batch["y"]) ** 2)


def _sgd_step(value_and_grad):
    def step(params, batch):
        loss, grads = value_and_grad(_loss)(params, batch)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    return step


@functools.cache
def _problem(batch_size: int, width: int, hidden: int):
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {
        "w1": jax.random.normal(ks[0], (width, hidden)) * 0.05,
        "w2": jax.random.normal(ks[1], (hidden, hidden)) * 0.05,
        "w3": jax.random.normal(ks[2], (hidden, width)) * 0.05,
    }
    batch = {
        "x": jax.random.normal(ks[3], (batch_size, width)),
        "y": jax.random.normal(ks[4], (batch_size, width)),
    }
    serial = params
    for _ in range(STEPS):
        serial, _ = jax.jit(_sgd_step(jax.value_and_grad))(serial, batch)
    return params, batch, serial


# The batch split over the (only) mesh axis: these tests are about how a data-parallel axis
# reduces gradients; on the CPU spec the ILP finds other layouts of these small MLPs as fast.
DATA_AXIS = autopar.AutoShardingOption(force_batch_dim_to_mesh_dim=0)


def _run(method, shape=(64, 64, 128)):
    """STEPS steps of `method`; returns (executable, final params, serial params)."""
    params, batch, serial = _problem(*shape)
    step = autopar.parallelize(_sgd_step(autopar.value_and_grad), method=method)
    state = params
    for _ in range(STEPS):
        state, _ = step(state, batch)
    return step.get_executable(params, batch), state, serial


def _total(per_kind: dict[str, float]) -> float:
    return sum(per_kind.values())


def _wire_bytes(per_kind: dict[str, float], n: int) -> float:
    """Bytes a ring sends per device for collectives over `n` devices, from their result bytes:
    the same for a gradient all-reduced as for it reduce-scattered and the update all-gathered
    (the plan may pick either; result bytes count the second 1 + 1/n times)."""
    return (n - 1) * (
        2 * per_kind["all-reduce"] / n + per_kind["reduce-scatter"] + per_kind["all-gather"] / n
    )


def _once_counted(executable) -> float:
    """Collective result bytes of the HLO with every op counted once, loop or not."""
    return sum(sum(sizes) for sizes in collective_bytes(executable.get_hlo_text()).values())


DATA_PARALLEL_FAMILY = [autopar.DataParallel, autopar.Zero2Parallel, autopar.Zero3Parallel]


@pytest.mark.parametrize("method", DATA_PARALLEL_FAMILY)
def test_data_parallel_family_reduces_gradients_once_per_step(method):
    per_step = {}
    for k in (1, 4):
        executable, params, serial = _run(method(num_micro_batches=k))
        assert relative_error(params, serial) <= 1e-5
        per_step[k] = executable.collective_bytes_per_step()
        assert _total(per_step[k]) == pytest.approx(executable.plan.predicted.communication_bytes)
    reducing = "all-reduce" if method is autopar.DataParallel else "reduce-scatter"
    assert per_step[1][reducing] > 10_000  # the gradients: ~64 KiB per step
    assert per_step[4][reducing] == pytest.approx(per_step[1][reducing], abs=SCALAR_SLACK)
    plan = executable.plan
    assert set(plan.stages[0].gradient_reduction.values()) == {ONCE_PER_STEP}
    assert "3 once per step" in plan.summary()


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("method", DATA_PARALLEL_FAMILY)
def test_data_parallel_family_predicts_the_peak_memory_xla_compiles(method, k):
    """The predicted peak per device is XLA's (the tolerance the ILP's plans meet in
    `test_cost_model_against_xla`) on `make bench-grad`'s MLP: gradients whole before they are
    reduced (all-reduces combined into one after the last gradient), whole accumulators, and
    ZeRO-3's parameters gathered at each use, again in the backward pass of each micro-batch
    (the forward pass's gathered copy is not kept: 5 all-gathers per micro-batch, as k = 1)."""
    executable, params, serial = _run(method(num_micro_batches=k), (128, 256, 512))
    assert relative_error(params, serial) <= 1e-5
    predicted = executable.plan.predicted
    peak = executable.memory_stats().peak_bytes
    assert predicted.memory_per_device_bytes == pytest.approx(peak, rel=0.15)
    moved = executable.collective_bytes_per_step()
    assert _total(moved) == pytest.approx(predicted.communication_bytes)
    if method is autopar.Zero3Parallel:
        assert len(executable.collectives()["all-gather"]) == 5  # w1 is not needed backward


def test_shard_parallel_data_parallel_axis_reduces_once_and_predicts_the_hlo():
    """A plan that splits the batch: its gradient all-reduces leave the loop; the predicted bytes
    per step equal the HLO's for k = 1, 4 and 16."""
    per_step = {}
    for k in (1, 4, 16):
        executable, params, serial = _run(
            autopar.ShardParallel(num_micro_batches=k, auto_sharding_option=DATA_AXIS),
            (512, 64, 128),
        )
        stage = executable.plan.stages[0]
        assert any(spec[0] for spec in stage.input_specs[-2:])  # the batch is split
        assert relative_error(params, serial) <= 1e-5
        moved = executable.collective_bytes_per_step()
        predicted = executable.plan.predicted.communication_bytes
        assert _total(moved) == pytest.approx(predicted, rel=1e-3)
        if k > 1:
            assert sum(lowering.once_per_step for lowering in stage.partial_sums.values()) == 3
            # Only the loss's scalar all-reduce runs per micro-batch.
            assert _total(moved) - _once_counted(executable) <= SCALAR_SLACK
        per_step[k] = _wire_bytes(moved, 8)
    grads = sum(p.nbytes for p in params.values())
    assert per_step[1] >= 2 * grads * 7 / 8  # every gradient reduced (and any update gathered)
    for k in (4, 16):  # each gradient once per step, whatever k
        assert per_step[k] == pytest.approx(per_step[1], abs=2 * SCALAR_SLACK)


def test_pipeline_stages_reduce_gradients_once_per_step():
    """Two stages of four devices, data-parallel inside each: only the last micro-batch's
    backward reduces gradients; each stage's bytes per step equal its prediction and k = 1's."""
    per_stage = {}
    for k in (1, 4):
        method = autopar.PipeshardParallel(
            num_micro_batches=k,
            layer_option=autopar.AutoLayerOption(layer_num=2),
            stage_option=autopar.UniformStageOption(2),
            auto_sharding_option=DATA_AXIS,
        )
        executable, params, serial = _run(method, (512, 64, 128))
        assert relative_error(params, serial) <= 1e-5
        plan = executable.plan
        per_stage[k] = executable.collective_bytes_per_step()
        for stage, hlo in zip(plan.stages, per_stage[k], strict=True):
            assert stage.mesh.num_devices == 4
            assert _total(hlo) == pytest.approx(stage.predicted.communication_bytes, rel=1e-3)
    wire = {k: [_wire_bytes(b, 4) for b in per_stage[k]] for k in per_stage}
    assert all(b > 10_000 for b in wire[1])
    assert wire[4] == pytest.approx(wire[1], abs=2 * SCALAR_SLACK)
    grads = sum(p.nbytes for p in params.values())
    assert sum(wire[4]) == pytest.approx(2 * grads * 3 / 4, abs=2 * SCALAR_SLACK)  # each once
    middle = [text for name, text in _segments(executable.get_hlo_text()) if "[middle]" in name]
    assert len(middle) == 2  # one per stage
    assert all(
        size <= 4 for text in middle for sizes in collective_bytes(text).values() for size in sizes
    )


def _segments(hlo: str) -> list[tuple[str, str]]:
    """(segment name, its HLO) from a pipeline's ``// name``-headed HLO text."""
    found: list[tuple[str, list[str]]] = []
    for line in hlo.splitlines():
        if line.startswith("// "):
            found.append((line[3:], []))
        elif found:
            found[-1][1].append(line)
    return [(name, "\n".join(lines)) for name, lines in found]


def _zero3(device_memory: float):
    autopar.init(
        cluster_spec=dataclasses.replace(autopar.ClusterSpec.local(8), device_memory=device_memory)
    )
    try:
        return _run(autopar.Zero3Parallel(num_micro_batches=4), (64, 256, 512))
    finally:
        autopar.shutdown()


def test_zero3_reduces_once_with_memory_to_spare_and_per_micro_batch_when_tight():
    """Reducing a split gradient once per step needs a whole accumulator instead of a slice:
    the plan does so where the memory budget (the device memory) has room, largest first."""
    roomy, params, serial = _zero3(8e9)
    assert relative_error(params, serial) <= 1e-5
    assert set(roomy.plan.stages[0].gradient_reduction.values()) == {ONCE_PER_STEP}
    with pytest.raises(autopar.MemoryBudgetError) as nothing_fits:  # all sliced, still over
        _zero3(1e3)
    least = nothing_fits.value.least
    tight, params, serial = _zero3(least * 1.01)
    assert relative_error(params, serial) <= 1e-5
    assert set(tight.plan.stages[0].gradient_reduction.values()) == {PER_MICRO_BATCH}
    assert tight.plan.predicted.memory_per_device_bytes <= least * 1.01
    scattered = {
        name: ex.collective_bytes_per_step()["reduce-scatter"]
        for name, ex in (("roomy", roomy), ("tight", tight))
    }
    assert scattered["tight"] == pytest.approx(4 * scattered["roomy"])
    # XLA agrees: the whole accumulators cost (1 - 1/8) of the gradients' bytes.
    saved = roomy.memory_stats().temp_bytes - tight.memory_stats().temp_bytes
    grad_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert saved >= 0.8 * grad_bytes * (1 - 1 / 8)
    assert "per micro-batch" in tight.plan.summary()
    # Room for the largest gradient's accumulator (w2, 1 MiB) only.
    mixed, params, serial = _zero3(least + 1.05 * 2**20 * (1 - 1 / 8))
    assert relative_error(params, serial) <= 1e-5
    assert mixed.plan.stages[0].gradient_reduction == {
        "params['w1']": PER_MICRO_BATCH,
        "params['w2']": ONCE_PER_STEP,
        "params['w3']": PER_MICRO_BATCH,
    }


@pytest.mark.parametrize(
    "target",
    [
        P(),
        P("a"),
        P(None, "b"),
        P(("b", "a")),
        P(("a", "b")),
        P("b", "a"),
        P(None, ("a", "b")),
    ],
)
def test_reduce_partial_sums_into_any_layout(target):
    """Brute force over layouts on a 2x4 mesh: stacked partial sums over both axes reduce to
    their sum, laid out as asked."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    partials = np.random.default_rng(0).normal(size=(8, 8, 16)).astype(np.float32)
    value = Unreduced(jax.device_put(partials, NamedSharding(mesh, P(("a", "b")))), ("a", "b"))
    sharding = NamedSharding(mesh, target)
    out = jax.jit(lambda v: reduce_partial_sums(v, sharding, mesh))(value)
    np.testing.assert_allclose(np.asarray(out), partials.sum(0), rtol=1e-5, atol=1e-5)
    assert out.sharding.is_equivalent_to(sharding, 2)


def test_ilp_reduce_scatters_per_micro_batch_where_whole_accumulators_do_not_fit():
    """ShardParallel storing state split (ZeRO-3 forced; with a batch of 4096 the ILP
    reduce-scatters gradients rather than gathering activations to compute them whole): with
    memory to spare every gradient is reduced once per step; under a tighter budget the plan keeps
    per-micro-batch reduce-scatters for what does not fit, stays within the budget, and
    matches the serial step."""
    params, batch, serial = _problem(4096, 256, 512)

    def method(budget):
        option = autopar.AutoShardingOption(
            force_zero_stage_3=True, memory_budget_per_device=budget
        )
        return autopar.ShardParallel(num_micro_batches=4, auto_sharding_option=option)

    step = _sgd_step(autopar.value_and_grad)
    roomy = autopar.plan(step, params, batch, method=method(None))
    assert set(roomy.stages[0].gradient_reduction.values()) == {ONCE_PER_STEP}
    tight = None
    for fraction in (0.8, 0.75, 0.7, 0.65, 0.6):
        budget = fraction * roomy.predicted.memory_per_device_bytes
        plan = autopar.plan(step, params, batch, method=method(budget))
        assert plan.predicted.memory_per_device_bytes <= budget
        if PER_MICRO_BATCH in plan.stages[0].gradient_reduction.values():
            tight = budget
            break
    assert tight is not None
    executable, state, serial = _run(method(tight), (4096, 256, 512))
    assert relative_error(state, serial) <= 1e-5
    # Each gradient is reduce-scattered into its eighth as often as the plan says.
    reduced = executable.plan.stages[0].gradient_reduction
    runs = {ONCE_PER_STEP: 1, PER_MICRO_BATCH: 4}
    expected = sum(runs[reduced[f"params['{k}']"]] * w.nbytes / 8 for k, w in params.items())
    assert executable.collective_bytes_per_step()["reduce-scatter"] == expected


def test_the_ilp_itself_weighs_split_gradients_reduced_once_against_their_accumulators(
    monkeypatch,
):
    """Reducing a split-stored gradient once per step is one of the ILP's choices, with its whole
    accumulator in the ILP's memory: with no pass after the ILP, a roomy budget reduces every
    gradient once, and the plan of least memory keeps the largest per micro-batch."""

    def ilp_only(self, choice, budget, stage, predicted):
        return stage, predicted

    monkeypatch.setattr(ShardingProblem, "_scatter_once", ilp_only)
    params, batch, _ = _problem(4096, 256, 512)
    step = _sgd_step(autopar.value_and_grad)

    def plan(budget):
        option = autopar.AutoShardingOption(
            force_zero_stage_3=True, memory_budget_per_device=budget
        )
        method = autopar.ShardParallel(num_micro_batches=4, auto_sharding_option=option)
        return autopar.plan(step, params, batch, method=method)

    roomy = plan(None)
    assert set(roomy.stages[0].gradient_reduction.values()) == {ONCE_PER_STEP}
    with pytest.raises(autopar.MemoryBudgetError) as info:
        plan(1e3)
    least = plan(info.value.least * 1.001)
    reduced = least.stages[0].gradient_reduction
    assert reduced["params['w2']"] == PER_MICRO_BATCH  # the largest accumulator
    assert least.predicted.memory_per_device_bytes <= info.value.least * 1.001
    assert least.predicted.memory_per_device_bytes < roomy.predicted.memory_per_device_bytes


def test_whole_accumulators_are_counted_once_whoever_chose_them(monkeypatch):
    """The roomy ZeRO-3 plan reached by the ILP's menus and the same plan reached by the pass
    after an ILP without those choices predict the same memory and traffic."""
    params, batch, _ = _problem(4096, 256, 512)
    step = _sgd_step(autopar.value_and_grad)
    option = autopar.AutoShardingOption(force_zero_stage_3=True)
    method = autopar.ShardParallel(num_micro_batches=4, auto_sharding_option=option)
    by_ilp = autopar.plan(step, params, batch, method=method)
    with_twins = MenuBuilder._accumulate_sums

    def without_twins(self, group, menu):
        found = with_twins(self, group, menu)
        return Menu(found.strategies[: len(menu)], found.value_specs[: len(menu)])

    monkeypatch.setattr(MenuBuilder, "_accumulate_sums", without_twins)
    by_pass = autopar.plan(step, params, batch, method=method)
    assert by_ilp.stages[0].node_output_specs == by_pass.stages[0].node_output_specs
    assert set(by_pass.stages[0].gradient_reduction.values()) == {ONCE_PER_STEP}
    assert by_ilp.predicted == by_pass.predicted


@pytest.mark.parametrize(
    "method",
    [
        autopar.ShardParallel(num_micro_batches=16),
        autopar.PipeshardParallel(
            num_micro_batches=1,
            layer_option=autopar.AutoLayerOption(layer_num=2),
            stage_option=autopar.UniformStageOption(2),
        ),
    ],
    ids=["shard_parallel_k16", "two_stages_k1"],
)
def test_default_plans_predict_the_hlo_bytes(method):
    """Plans made with default options move the bytes they predict: a micro-batch's inputs stay
    in their planned layout inside the loop (else XLA lays them out for their first reader and
    regathers them for the backward pass), and a stage's backward executable reshards again
    what its forward one resharded."""
    executable, params, serial = _run(method, (128, 256, 512))
    assert relative_error(params, serial) <= 1e-5
    moved = executable.collective_bytes_per_step()
    stages = executable.plan.stages
    if isinstance(moved, dict):
        assert _total(moved) == pytest.approx(executable.plan.predicted.communication_bytes)
    else:
        for stage, hlo in zip(stages, moved, strict=True):
            assert _total(hlo) == pytest.approx(stage.predicted.communication_bytes)
    assert _total(moved if isinstance(moved, dict) else moved[0]) > 0


def test_a_tied_embedding_is_reduced_once_per_use_when_not_accumulated():
    """transformers' GPT-2 ties its LM head to the token embedding: with one micro-batch XLA
    reduces the embedding's gradient once per use (lookup and head), and the prediction says
    so; with micro-batches the local accumulator is reduced once, and the step moves less."""
    pytest.importorskip("transformers")
    from clients import gpt2

    client = gpt2(optax.sgd(0.1), 32)
    moved = {}
    for k in (1, 4):
        method = autopar.DataParallel(num_micro_batches=k)
        step = autopar.parallelize(client.step, method=method)
        step(*client.args)
        executable = step.get_executable(*client.args)
        moved[k] = _total(executable.collective_bytes_per_step())
        predicted = executable.plan.predicted.communication_bytes
        assert moved[k] == pytest.approx(predicted)
    assert moved[1] > moved[4]
