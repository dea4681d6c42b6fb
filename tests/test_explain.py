"""Seeing and comparing plans: the summary groups inputs by layer pattern and reports throughput,
`autopar.explain` prices DP / ZeRO-2 / ZeRO-3 / Megatron / pipeline baselines by the same cost
model (the ILP plan is never slower than the best that fits), draw() writes a PNG."""

import struct

import pytest

import autopar
from autopar.models import GPTConfig, MLPConfig, abstract_train_inputs, gpt, mlp
from autopar.planner.baselines import (
    TOLERANCE,
    Baseline,
    InputRole,
    LayoutStatus,
    baseline_pins,
    input_roles,
)
from autopar.planner.draw import pipeline_timeline
from autopar.planner.plan import MeshPlan
from autopar.planner.summary import bubble_fraction, format_ranges, group_paths

V100 = autopar.ClusterSpec.preset("8xV100-p3")
GPT_TINY = GPTConfig()
MLP_SMALL = MLPConfig(in_dim=64, hidden=128, out_dim=32, num_layers=4)


def _plan(family, config, batch, method=None, cluster=V100):
    step, state, data = abstract_train_inputs(family, config, batch)
    return autopar.plan(step, state, data, method=method, cluster_spec=cluster)


def _explain(family, config, batch, method=None, cluster=V100):
    step, state, data = abstract_train_inputs(family, config, batch)
    return autopar.explain(step, state, data, method=method, cluster_spec=cluster)


@pytest.fixture(scope="module")
def gpt_explained():
    return _explain(gpt, GPT_TINY, 16, autopar.ShardParallel(num_micro_batches=2))


@pytest.fixture(scope="module")
def gpt_plan(gpt_explained):
    return gpt_explained.chosen.plan


PIPELINE = autopar.PipeshardParallel(
    num_micro_batches=4,
    layer_option=autopar.AutoLayerOption(layer_num=2),
    stage_option=autopar.UniformStageOption(2),
)


@pytest.fixture(scope="module")
def pipeline_plan():
    return _plan(mlp, MLP_SMALL, 64, PIPELINE)


def _budget_explained():
    """An MLP whose replicated state does not fit: DP and Z2 need more than the budget."""
    config = MLPConfig(in_dim=512, hidden=1024, out_dim=512, num_layers=4)
    budget = 24 * 2**20
    option = autopar.AutoShardingOption(memory_budget_per_device=budget)
    method = autopar.ShardParallel(auto_sharding_option=option)
    return _explain(mlp, config, 64, method), budget


# ------------------------------------------------------------------ summary


def test_paths_collapse_by_layer_pattern():
    paths = [f"state.params['block_{i}']['attn']['kernel']" for i in range(48)]
    paths += ["state.params['wte']['embedding']", "state.opt_state[0].count"]
    specs = [(("x",), None)] * 48 + [(None, None), ()]
    specs[5] = (None, ("x",))  # one layer stored otherwise gets its own row
    groups = group_paths(paths, specs)
    assert [g.label for g in groups] == [
        "state.params['block_{0..4,6..47}']['attn']['kernel']",
        "state.params['block_5']['attn']['kernel']",
        "state.params['wte']['embedding']",
        "state.opt_state[0].count",
    ]
    assert [g.count for g in groups] == [47, 1, 1, 1]
    assert format_ranges([3, 1, 2, 7, 9, 8, 5]) == "1..3,5,7..9"


def test_summary_reports_stages_storage_and_throughput(gpt_plan):
    text = gpt_plan.summary()
    assert "stage 0: sub-mesh 1x8 (hosts x devices) = devices [0..7]" in text
    assert "state.opt_state[0].mu['block_{0..1}']['fc_in']['kernel']" in text
    assert "FLOP/s per device, MFU" in text
    assert len(text.splitlines()) < 80  # grouped: ~20 rows per parameter tree, not per leaf
    p = gpt_plan.predicted
    assert p.flops > 0 and gpt_plan.stages[0].op_costs


def test_plan_json_round_trip_keeps_flops_and_op_costs(gpt_plan, pipeline_plan):
    for plan in (gpt_plan, pipeline_plan):
        again = autopar.Plan.from_json(plan.to_json())
        assert again == plan
        assert again.predicted.flops == plan.predicted.flops > 0


# ------------------------------------------------------------------ explain


def _check_explanation(explanation, names):
    text = str(explanation)
    listed = {b.name: b for b in explanation.baselines}
    assert set(names) <= set(listed)
    for name in names:
        assert name in text
    for result in explanation.baselines:
        if result.fits:
            assert result.step_time_s > 0 and result.memory_per_device_bytes > 0
    return listed


def test_explain_shard_plan_never_slower_than_a_fitting_baseline(gpt_explained):
    explanation = gpt_explained
    listed = _check_explanation(explanation, [b.value for b in Baseline])
    assert explanation.guaranteed
    fitting = [b for b in explanation.baselines if b.fits]
    assert fitting
    best = min(b.step_time_s for b in fitting)
    assert explanation.chosen.step_time_s <= best * (1 + TOLERANCE)
    assert explanation.chosen_over_best <= 1 + TOLERANCE
    assert all(listed[name].fits for name in ("DP", "Z3"))
    assert "costliest op groups" in str(explanation) and explanation.op_costs


def test_explain_shows_baselines_over_the_memory_budget():
    explanation, budget = _budget_explained()
    plan = explanation.chosen.plan
    listed = _check_explanation(explanation, ["DP", "Z2", "Z3", "Megatron"])
    dp = listed["DP"]
    assert dp.status is LayoutStatus.OOM and not dp.fits
    assert dp.least_memory_bytes > budget
    assert "no (OOM)" in str(explanation) and "needs" in str(explanation)
    assert plan.predicted.memory_per_device_bytes <= budget
    best = explanation.best_baseline
    assert best is not None and explanation.chosen.step_time_s <= best.step_time_s * (1 + TOLERANCE)


def test_explain_pipelined_and_multi_host_plans_add_pipeline_baselines(pipeline_plan):
    explanation = _explain(mlp, MLP_SMALL, 64, PIPELINE)
    assert explanation.chosen.plan == pipeline_plan
    _check_explanation(explanation, ["DP", "Megatron", "Pipeline 2xDP"])
    assert not explanation.guaranteed
    assert "not guaranteed" in str(explanation)
    two_hosts = autopar.ClusterSpec.preset("2x8xA100-80G")
    explanation = _explain(mlp, MLP_SMALL, 64, autopar.ShardParallel(), cluster=two_hosts)
    _check_explanation(explanation, ["Z3", "Pipeline 2xDP"])
    assert explanation.guaranteed


def test_a_train_step_explains_the_plan_it_runs():
    """`train_step.explain(*args)` prices the baselines beside the plan the step runs; the plan
    itself is plain data (it compares equal to its JSON round trip)."""
    from autopar.models import MLPConfig as Config

    config = Config(in_dim=32, hidden=64, out_dim=16, num_layers=2)
    step = autopar.parallelize(mlp.make_train_step(autopar.value_and_grad))
    state, batch = mlp.create_train_state(config, batch_size=2), mlp.make_batch(config, 32)
    explanation = step.explain(state, batch)
    plan = step.get_plan(state, batch)
    assert explanation.chosen.plan is plan
    assert {"DP", "Z3"} <= {b.name for b in explanation.baselines}
    assert autopar.Plan.from_json(plan.to_json()) == plan
    assert not hasattr(plan, "explain") and not hasattr(plan, "context")


# ------------------------------------------------------------------ baseline layouts


def _program(family, config, batch):
    from autopar.api import trace_for_method
    from autopar.tracing import resolve_argnums

    step, state, data = abstract_train_inputs(family, config, batch)
    args = (state, data)
    argnums = resolve_argnums(args, (), (1,), "auto")
    return trace_for_method(step, args, autopar.ShardParallel(), argnums).program


def _pins(program, baseline, mesh):
    return dict(baseline_pins(program, Baseline(baseline), mesh))


def test_megatron_layout_of_gpt_and_of_unnamed_layers():
    mesh = MeshPlan((8,), ("x",), tuple(range(8)))
    program = _program(gpt, GPT_TINY, 16)
    pins = _pins(program, "Megatron", mesh)
    x = ("x",)
    block = "state.params['block_0']"
    assert pins[f"{block}['attn']['query']['kernel']"] == (None, None, x)  # 4 heads: head_dim
    assert pins[f"{block}['attn']['query']['bias']"] == (None, x)
    assert pins[f"{block}['attn']['out']['kernel']"] == (None, x, None)  # row-parallel
    assert pins[f"{block}['fc_in']['kernel']"] == (None, x)
    assert pins[f"{block}['fc_out']['kernel']"] == (x, None)
    assert pins[f"{block}['fc_out']['bias']"] == (None,)
    assert pins["state.params['wte']['embedding']"] == (x, None)  # vocab-parallel
    assert pins["state.params['lm_head']['kernel']"] == (None, x)
    assert pins["state.params['wpe']"] == (None, None)
    assert pins["state.opt_state[0].mu['block_0']['fc_in']['kernel']"] == (None, x)
    assert pins["batch['tokens']"] == (None, None)
    # MLP layers have no Megatron names: column, row, column, row in the order of use.
    pins = _pins(_program(mlp, MLP_SMALL, 16), "Megatron", mesh)
    kernels = [pins[f"state.params['dense_{i}']['kernel']"] for i in range(4)]
    assert kernels == [(None, x), (x, None), (None, x), (x, None)]
    assert pins["state.params['dense_0']['bias']"] == (x,)
    assert pins["state.params['dense_1']['bias']"] == (None,)


def test_zero_layouts_and_megatron_on_two_hosts():
    program = _program(mlp, MLP_SMALL, 16)
    roles = input_roles(program)
    paths = program.signature.input_paths
    role_of = dict(zip(paths, roles, strict=True))
    assert role_of["state.params['dense_0']['kernel']"] is InputRole.PARAM
    assert role_of["state.opt_state[0].mu['dense_0']['kernel']"] is InputRole.PARAM_STATE
    assert role_of["state.opt_state[0].count"] is InputRole.OTHER
    assert role_of["batch['x']"] is InputRole.BATCH
    mesh = MeshPlan((8,), ("x",), tuple(range(8)))
    kernel, moment = (
        "state.params['dense_1']['kernel']",
        "state.opt_state[0].nu['dense_1']['kernel']",
    )
    split = (("x",), None)
    expected = {"DP": (None, None), "Z2": (None, None), "Z3": split}
    for name, param_spec in expected.items():
        pins = _pins(program, name, mesh)
        assert pins["batch['x']"] == (("x",), None)
        assert pins[kernel] == param_spec
        assert pins[moment] == ((None, None) if name == "DP" else split)
    two_d = MeshPlan((2, 4), ("x", "y"), tuple(range(8)))
    pins = _pins(program, "Megatron", two_d)
    assert pins["batch['x']"] == (("x",), None)  # data parallel over hosts
    assert pins["state.params['dense_0']['kernel']"] == (None, ("y",))  # tensor parallel inside


# ------------------------------------------------------------------ draw


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("which", ["single", "pipeline"])
def test_draw_writes_a_png(tmp_path, gpt_plan, pipeline_plan, which):
    plan = gpt_plan if which == "single" else pipeline_plan
    path = tmp_path / "plan.png"
    plan.draw(path)
    width, height = _png_size(path)
    assert width >= 800 and height >= 250 and path.stat().st_size > 10_000


def test_timeline_follows_the_schedule(gpt_plan, pipeline_plan):
    blocks = pipeline_timeline(pipeline_plan)
    k, stages = pipeline_plan.num_micro_batches, len(pipeline_plan.stages)
    assert len(blocks) == 2 * k * stages
    for stage in range(stages):  # a stage runs one task at a time
        own = sorted((b for b in blocks if b.stage == stage), key=lambda b: b.start_s)
        assert all(a.end_s <= b.start_s * (1 + 1e-9) for a, b in zip(own, own[1:], strict=False))
    ends = {(b.stage, b.kind, b.micro_batch): b.end_s for b in blocks}
    for b in blocks:  # activations flow up the stages, gradients down
        if b.kind.value == "forward" and b.stage > 0:
            assert ends[(b.stage - 1, b.kind, b.micro_batch)] <= b.start_s * (1 + 1e-9)
    assert 0 < bubble_fraction(pipeline_plan) < 1
    assert bubble_fraction(gpt_plan) == pytest.approx(0.0, abs=1e-9)
