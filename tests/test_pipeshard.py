"""PipeshardParallel on 8 simulated devices: parameters after 3 steps against the serial step,
stages on disjoint sub-meshes (read off the outputs' shardings), the stage split, bad inputs."""

import dataclasses
import functools
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import parallel_steps, relative_error, serial_state

import autopar
from autopar.api import trace_for_method
from autopar.models import GPTConfig, MLPConfig, gpt, mlp
from autopar.planner import ilp as ilp_module
from autopar.planner import pipeshard as pipeshard_module
from autopar.planner.draw import _stages_of_device
from autopar.planner.errors import MemoryBudgetError
from autopar.planner.groups import group_graph
from autopar.planner.intra import (
    IntraOpConfig,
    ProgramAnalysis,
    ShardingProblem,
    Stash,
    plan_shard_parallel,
    program_structure,
)
from autopar.planner.memory import liveness, whole_peak_bytes
from autopar.planner.pipeline import place_stages, split_step
from autopar.planner.pipeshard import (
    LayerCosts,
    PipelineConfig,
    StageShape,
    _stage_cost,
    plan_pipeshard,
    range_program,
    stage_intra_config,
    stage_mesh,
    stage_shapes,
    stash_bytes,
    state_bytes,
)
from autopar.planner.schedules import PipelineSchedule, TaskKind
from autopar.runtime.profile import StageProfiler, measure_stage
from autopar.tracing import resolve_argnums, trace_step

BATCH = 32
MICRO_BATCHES = 4
STEPS = 3
FAMILIES = {
    "mlp": (mlp, MLPConfig(in_dim=64, hidden=64, out_dim=64, num_layers=4)),
    "gpt": (gpt, GPTConfig(num_layers=4)),
}


def _config(family: str, manual_layers: bool):
    module, config = FAMILIES[family]
    if manual_layers:
        config = type(config)(**{**config.__dict__, "pipeline_boundaries": True})
    return module, config


def serial_params(family: str):
    """Parameters after STEPS serial `jax.jit` full-batch steps."""
    return serial_state(*FAMILIES[family], BATCH, STEPS).params


def _run(family: str, method, manual_layers: bool = False, steps: int = STEPS):
    return parallel_steps(*_config(family, manual_layers), method, BATCH, steps)


def _method(stages: int, schedule: str, layers: str, **kwargs):
    layer_option = (
        autopar.ManualLayerOption() if layers == "manual" else autopar.AutoLayerOption(layer_num=4)
    )
    return autopar.PipeshardParallel(
        num_micro_batches=kwargs.pop("num_micro_batches", MICRO_BATCHES),
        layer_option=layer_option,
        stage_option=kwargs.pop("stage_option", None) or autopar.UniformStageOption(stages),
        pipeline_schedule=schedule,
        **kwargs,
    )


def _device_groups(tree) -> set[frozenset]:
    return {frozenset(leaf.sharding.device_set) for leaf in jax.tree.leaves(tree)}


def _check_stages(state, plan, num_stages: int) -> None:
    """Each stage's parameters live on its own sub-mesh; the sub-meshes split the 8 devices."""
    groups = _device_groups(state.params)
    assert len(groups) == num_stages
    assert sum(len(g) for g in groups) == 8 and len(frozenset().union(*groups)) == 8
    assert len(plan.stages) == num_stages
    covered = [k for s in plan.stages for k in range(*s.layers)]
    assert covered == list(range(plan.stages[-1].layers[1]))


# Every (schedule, layers) for the MLP on 2 stages and every schedule on 4 (the layer options
# cut the same way whatever the stage count); for GPT, cases that cover each layer option and
# the schedules that split the backward or not.
CASES = [
    ("mlp", s, sched, lay)
    for s in (2, 4)
    for sched in ("1f1b", "gpipe", "zero_bubble")
    for lay in (("manual", "auto") if s == 2 else ("auto",))
] + [
    ("gpt", 2, "1f1b", "manual"),
    ("gpt", 2, "zero_bubble", "auto"),
]


@pytest.mark.parametrize("family,stages,schedule,layers", CASES)
def test_matches_serial_step(family, stages, schedule, layers):
    method = _method(stages, schedule, layers)
    step, state, metrics, batch = _run(family, method, manual_layers=layers == "manual")
    assert np.isfinite(float(metrics["loss"]))
    assert relative_error(state.params, serial_params(family)) <= 1e-5
    plan = step.get_plan(state, batch)
    assert plan.pipeline_schedule == schedule
    _check_stages(state, plan, stages)


def test_zero_bubble_runs_weight_gradients_as_their_own_tasks():
    """The backward of each stage is cut in two: B computes what earlier stages read, W only
    the stage's parameter gradients (and accumulates them); stage 0 sends nothing back."""
    module, config = _config("gpt", False)
    step = autopar.parallelize(
        module.make_train_step(autopar.value_and_grad), method=_method(2, "zero_bubble", "auto")
    )
    state, batch = module.create_train_state(config, batch_size=2), module.make_batch(config, BATCH)
    layout = step.get_executable(state, batch).layout  # segments compile on their first call
    kinds = {kind for (_, kind, _) in layout.segments}
    assert TaskKind.BACKWARD not in kinds
    assert {TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT} <= kinds
    first, last = (layout.segment(s, TaskKind.BACKWARD_INPUT) for s in (0, 1))
    assert not first.eqns and last.eqns and last.writes  # stage 1's B feeds stage 0 and its W
    weights = layout.segment(1, TaskKind.BACKWARD_WEIGHT)
    assert weights.eqns and not weights.writes  # W only adds into the accumulators


def test_interleaved_1f1b_shares_each_mesh_between_two_stages_and_matches(tmp_path):
    """2 sub-meshes x 2 virtual stages: stage s on the devices of stage s mod 2 (parameters
    read back from the outputs), each mesh's two stages planned within half its memory, the
    step priced by the interleaved formula. On the MLP: which task runs when does not depend on
    the model (GPT runs 1F1B and zero bubble in `test_matches_serial_step`)."""
    method = _method(2, "interleaved_1f1b", "auto")
    step, state, metrics, batch = _run("mlp", method)
    assert np.isfinite(float(metrics["loss"]))
    assert relative_error(state.params, serial_params("mlp")) <= 1e-5
    plan = step.get_plan(state, batch)
    assert plan.pipeline_schedule == "interleaved_1f1b"
    assert (len(plan.stages), plan.num_meshes) == (4, 2)
    meshes = [s.mesh.device_indices for s in plan.stages]
    assert meshes[2:] == meshes[:2] and set(meshes[0]).isdisjoint(meshes[1])
    assert len(_device_groups(state.params)) == 2
    latencies = [s.predicted.step_time_s / MICRO_BATCHES for s in plan.stages]
    loads = [latencies[0] + latencies[2], latencies[1] + latencies[3]]
    expected = sum(latencies) / 2 + (MICRO_BATCHES - 1 / 2) * max(loads)
    assert plan.predicted.step_time_s == pytest.approx(expected)
    assert "2 stages on each of 2 meshes" in plan.summary()
    devices = _stages_of_device(plan)
    assert devices[meshes[0][0]] == [0, 2] and devices[meshes[1][0]] == [1, 3]
    plan.draw(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_interleaved_1f1b_needs_a_stage_option_it_can_lay_out():
    option = autopar.ManualStageOption(((0, 1), (2, 3)), ((1, 4), (1, 4)), ((1, 4), (1, 4)))
    with pytest.raises(autopar.PlanningError, match="not ManualStageOption"):
        _plan(_method(2, "interleaved_1f1b", "auto", stage_option=option))
    with pytest.raises(autopar.PlanningError, match="a multiple of the n meshes"):
        _plan(_method(2, "interleaved_1f1b", "auto", num_micro_batches=3), batch_size=30)


def test_auto_schedule_plans_each_and_keeps_the_fastest():
    module, config = _config("mlp", False)
    state = module.create_train_state(config, batch_size=2)
    batch = module.make_batch(config, BATCH)
    train_step = module.make_train_step(autopar.value_and_grad)
    option = autopar.AutoStageOption()
    steps = {
        name: autopar.plan(
            train_step, state, batch, method=_method(0, name, "auto", stage_option=option)
        )
        for name in ("1f1b", "zero_bubble", "gpipe", "interleaved_1f1b", "auto")  # ties' order
    }
    auto = steps.pop("auto")
    assert auto.pipeline_schedule == min(steps, key=lambda name: steps[name].predicted.step_time_s)
    assert auto.predicted.step_time_s == pytest.approx(
        min(p.predicted.step_time_s for p in steps.values())
    )


def test_auto_stages_run_and_match():
    step, state, _, batch = _run(
        "mlp", _method(0, "1f1b", "auto", stage_option=autopar.AutoStageOption())
    )
    assert relative_error(state.params, serial_params("mlp")) <= 1e-5
    plan = step.get_plan(state, batch)
    devices = sorted(i for s in plan.stages for i in s.mesh.device_indices)
    assert devices == list(range(8))  # the DP uses every device exactly once
    _check_stages(state, plan, len(plan.stages))


def test_profiling_mode_measures_stages_and_matches(caplog):
    """AutoStageOption(profile=True): every candidate stage compiled and timed on the devices."""
    option = autopar.AutoStageOption(profile=True, submesh_logical_shape_space="same_as_physical")
    with caplog.at_level(logging.INFO, logger="autopar.runtime.profile"):
        step, state, _, batch = _run("mlp", _method(0, "1f1b", "manual", stage_option=option), True)
    assert relative_error(state.params, serial_params("mlp")) <= 1e-5
    (record,) = [r for r in caplog.records if "profiled" in r.getMessage()]
    measured = int(record.getMessage().split()[1])
    # 4 layers: 10 layer ranges on (1,1), (1,2), (1,4), (1,8); equal structures measured once.
    assert 4 <= measured <= 40
    _check_stages(state, step.get_plan(state, batch), len(step.get_plan(state, batch).stages))


def test_profiled_stage_cost():
    module, config = _config("mlp", manual_layers=True)
    state = module.create_train_state(config, batch_size=2)
    method = _method(2, "1f1b", "manual")
    traced = trace_for_method(
        module.make_train_step(autopar.value_and_grad),
        (state, module.make_batch(config, BATCH)),
        method,
        resolve_argnums((state, None), (), (1,), "auto"),
    )
    parts = split_step(traced.closed_jaxpr, traced.program.signature.batch_inputs)
    cluster = autopar.ClusterSpec.local(len(jax.devices()))
    config = PipelineConfig(MICRO_BATCHES, method.schedules, method.stage_option, IntraOpConfig())
    measure = functools.partial(measure_stage, devices=jax.devices())
    profiler = StageProfiler(parts, traced.program, cluster, config, measure)
    one, two = profiler(0, 1, (1, 2), (1, 2)), profiler(0, 2, (1, 2), (1, 2))
    profiler.close()
    assert one.latency_s > 0 and two.latency_s > 0
    # Two layers hold twice the weights (64x64 float32 + Adam state + gradient) and stash more.
    assert two.static_memory_bytes > one.static_memory_bytes > 0
    assert two.activation_memory_bytes > one.activation_memory_bytes > 0


class _EagerLayerCosts(LayerCosts):
    """Every squeeze level of every layer, whether a stage needs it or not."""

    def __call__(self, start, end, submesh, logical):
        for layer in range(start, end):
            self.layer_costs(layer, logical)
        return super().__call__(start, end, submesh, logical)


def _auto_stage_parts(
    num_micro_batches: int = MICRO_BATCHES, family: str = "mlp", layers: str = "manual"
):
    """The step traced for AutoStageOption (the MLP's marked layers by default), split into
    layers, and its PipelineConfig."""
    module, config = _config(family, manual_layers=layers == "manual")
    state = module.create_train_state(config, batch_size=2)
    method = _method(
        0,
        "1f1b",
        layers,
        stage_option=autopar.AutoStageOption(),
        num_micro_batches=num_micro_batches,
    )
    args = (state, module.make_batch(config, BATCH))
    traced = trace_for_method(
        module.make_train_step(autopar.value_and_grad),
        args,
        method,
        resolve_argnums(args, (), (1,), "auto"),
    )
    parts = split_step(traced.closed_jaxpr, traced.program.signature.batch_inputs)
    pipeline = PipelineConfig(
        num_micro_batches, method.schedules, method.stage_option, IntraOpConfig()
    )
    return traced, parts, pipeline


def test_default_logical_space_splits_the_batch_over_the_first_axis():
    """Alpa's single_node_model_parallel space: on a 2-D logical mesh a stage is data parallel
    over the first axis (the ILP chooses only the model parallelism); a first axis that does
    not divide the micro-batch (here 2 rows) makes the candidate unusable."""
    traced, parts, pipeline = _auto_stage_parts(num_micro_batches=16)
    signature, cluster = traced.program.signature, autopar.ClusterSpec.local(8)
    intra = stage_intra_config(pipeline, (2, 4), signature)
    assert intra.force_batch_dim_to_mesh_dim == 0
    assert stage_intra_config(pipeline, (8, 1), signature) == pipeline.intra  # 1-D: free
    assert stage_intra_config(pipeline, (4, 2), signature) is None
    costs = LayerCosts(parts, traced.program, cluster, pipeline, 8)
    assert costs(0, 1, (1, 8), (4, 2)) == ()
    assert costs(0, 1, (1, 8), (2, 4))
    stage = costs.layer_program(0)
    mesh = stage_mesh((2, 4), tuple(range(8)))
    plan = plan_shard_parallel(stage.program, mesh, cluster, intra, 16).stages[0]
    batch = [plan.input_specs[i] for i in stage.program.signature.batch_inputs]
    assert batch and all(spec[0] == ("x",) for spec in batch), batch


def test_prefetched_layer_plans_equal_sequential_ones():
    """The DP's candidates planned two ILPs at a time are the plans planned one by one."""
    traced, parts, pipeline = _auto_stage_parts()
    cluster = autopar.ClusterSpec.local(8)
    logicals = [(1, 2), (1, 8), (2, 4)]
    parallel = LayerCosts(parts, traced.program, cluster, pipeline, 8)
    parallel.prefetch(logicals, workers=2)
    solves = parallel.ilp_solves
    sequential = LayerCosts(parts, traced.program, cluster, pipeline, 8)
    for layer in range(parts.num_layers):
        for logical in logicals:
            assert parallel.layer_costs(layer, logical, 1) == sequential.layer_costs(
                layer, logical, 1
            )
    assert parallel.ilp_solves == solves == sequential.ilp_solves > 0


def _stages_within_a_host(parts) -> list[tuple]:
    """Every layer range on 2 and 4 devices of one host, as the DP's cost_fn takes them."""
    return [
        (start, end, (1, devices), (1, devices))
        for start in range(parts.num_layers)
        for end in range(start + 1, parts.num_layers + 1)
        for devices in (2, 4)
    ]


def test_layer_programs_placed_at_once_equal_each_layer_placed_alone():
    """LayerCosts places every layer on a stage of its own once; each layer's program is the
    one placed with the layers around it as two other stages (`range_program`): the same
    eqns (the optimizer update's included), inputs, outputs and signature."""
    traced, parts, pipeline = _auto_stage_parts(family="gpt", layers="auto")
    costs = LayerCosts(parts, traced.program, autopar.ClusterSpec.local(8), pipeline, 8)
    signature = traced.program.signature
    for layer in range(parts.num_layers):
        placed = costs.layer_program(layer)
        alone = range_program(parts, signature, layer, layer + 1)
        # the step's eqns themselves; each program makes its own boundary eqn (fresh variables
        # for the values it sends), equal in its operands and parameters
        b = placed.boundary_index
        eqns, others = placed.closed.jaxpr.eqns, alone.closed.jaxpr.eqns
        assert eqns[:b] + eqns[b + 1 :] == others[:b] + others[b + 1 :]
        assert eqns[b].invars == others[b].invars and eqns[b].params == others[b].params
        assert placed.closed.jaxpr.invars == alone.closed.jaxpr.invars
        assert placed.program.fingerprint == alone.program.fingerprint  # outputs, flow, avals
        assert (placed.grads, placed.means) == (alone.grads, alone.means)
        assert placed.per_micro_batch_inputs == alone.per_micro_batch_inputs
        mine, theirs = placed.program.signature, alone.program.signature
        assert mine.batch_inputs == theirs.batch_inputs
        assert mine.donated_inputs == theirs.donated_inputs
        assert mine.output_to_input == theirs.output_to_input
    assert parts.num_layers == 4 and parts.apply  # the update runs on the layers' stages


def test_layer_plans_in_forked_workers_equal_those_planned_here(monkeypatch, tmp_path):
    """The squeezed layer plans the DP asks for, planned in two forked worker processes
    (`LayerCosts.planning_processes`), are the plans planned one by one in this process; the
    workers planned them, at every level."""
    traced, parts, pipeline = _auto_stage_parts()
    cluster = autopar.ClusterSpec.local(8)
    pipeline = _tight(traced, parts, pipeline, cluster, 1.6)
    stages = _stages_within_a_host(parts)
    plan_level = LayerCosts._plan_level

    def logged(self, key, level):  # runs in the workers: each appends its pid and the key
        with open(tmp_path / "planned", "a") as log:
            log.write(f"{os.getpid()} {hash(key)} {level}\n")
        return plan_level(self, key, level)

    monkeypatch.setattr(LayerCosts, "_plan_level", logged)
    monkeypatch.setenv("AUTOPAR_PLANNING_PROCESSES", "2")
    forked = LayerCosts(parts, traced.program, cluster, pipeline, 8)
    with forked.planning_processes(logical for *_, logical in stages):
        forked.prefetch(logical for *_, logical in stages)
        forked.prefetch_squeezed(stages)
    monkeypatch.setattr(LayerCosts, "_plan_level", plan_level)
    here = LayerCosts(parts, traced.program, cluster, pipeline, 8)
    squeezed = [here(*stage) for stage in stages]
    assert any(len(alternatives) > 1 for alternatives in squeezed)
    assert [forked(*stage) for stage in stages] == squeezed
    assert forked.ilp_solves == here.ilp_solves
    planned = [line.split() for line in (tmp_path / "planned").read_text().splitlines()]
    assert len(planned) == forked.ilp_solves
    pids = {pid for pid, _, _ in planned}
    assert str(os.getpid()) not in pids
    assert len(pids) == 2  # both workers planned (a key may move to a free one: test_forked)
    assert any(level != "0" for _, _, level in planned)


def test_candidate_layer_ilps_run_without_presolve(monkeypatch):
    """The stage search's candidate layer ILPs stop at a quarter of the time limit by design,
    and HiGHS solves them without its presolve (`CANDIDATE_PRESOLVE`); a plan solved as emitted
    keeps it."""
    presolve = []
    run_highs = ilp_module._run_highs

    def recording(lp, options, start):
        presolve.append(options["presolve"])
        return run_highs(lp, options, start)

    monkeypatch.setattr(ilp_module, "_run_highs", recording)
    traced, parts, pipeline = _auto_stage_parts()
    costs = LayerCosts(parts, traced.program, autopar.ClusterSpec.local(8), pipeline, 8)
    assert costs.layer_costs(1, (1, 2), 1)
    candidates, presolve[:] = list(presolve), []
    assert _layer_problem((1, 2)).solve(2**40) is not None
    assert candidates and set(candidates) == {"off"} and set(presolve) == {"choose"}


def test_candidate_layer_ilps_round_the_lp_relaxation(monkeypatch):
    """A candidate layer's memory-cut rounds solve the LP relaxation and round it
    (`CANDIDATE_ROUNDING`), a MIP only right after a rounding that broke a cut; a plan solved
    as emitted runs the MIP itself, and its rounds never start from the relaxation."""
    solves = []
    solve = ilp_module.IntraOpIlp._solve

    def recorded(self, model, closed, limit, start, relaxed=False, first_plan=False, **kw):
        solves.append("relaxed" if relaxed else "mip")
        return solve(self, model, closed, limit, start, relaxed, first_plan, **kw)

    monkeypatch.setattr(ilp_module.IntraOpIlp, "_solve", recorded)
    traced, parts, pipeline = _auto_stage_parts()
    costs = LayerCosts(parts, traced.program, autopar.ClusterSpec.local(8), pipeline, 8)
    assert costs.layer_costs(1, (1, 2), 1)
    candidate, solves[:] = list(solves), []
    assert candidate[0] == "relaxed"
    assert all(candidate[i - 1] == "relaxed" for i, s in enumerate(candidate) if s == "mip")
    assert _layer_problem((1, 2)).solve(2**40) is not None
    assert solves and set(solves) == {"mip"}


def _ilp_arrays(problem: ShardingProblem) -> list:
    """The ILP a problem hands the solver, as arrays: choices, costs, edges, and memory per
    step of a few assignments."""
    ilp = problem.ilp
    rng = np.random.default_rng(0)
    picks = [np.array([rng.integers(n) for n in ilp.num_choices]) for _ in range(4)]
    return [
        ilp.num_choices,
        [dataclasses.astuple(c) for c in ilp.costs],
        [(e.producer, e.consumer, e.row_of, e.col_of, e.blocking, e.overlap) for e in ilp.edges],
        [ilp.memory.evaluate(p) for p in picks],
    ]


def test_each_layer_structure_is_analysed_once_for_every_mesh(monkeypatch):
    """A layer's mesh-independent analysis (groups, classes, liveness, gradient chains) is made
    once per layer structure and serves its ILPs on every mesh: each equals the ILP built
    with an analysis of its own."""
    made = []
    analyse = ProgramAnalysis.of.__func__

    def counted(cls, program, cluster, config):
        made.append(program)
        return analyse(cls, program, cluster, config)

    monkeypatch.setattr(ProgramAnalysis, "of", classmethod(counted))
    traced, parts, pipeline = _auto_stage_parts()
    costs = LayerCosts(parts, traced.program, autopar.ClusterSpec.local(8), pipeline, 8)
    meshes = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 2)]
    plans = {
        id(p): p
        for layer in range(parts.num_layers)
        for mesh in meshes
        if (p := costs._layer_plans(layer, mesh)) is not None
    }
    layers = range(parts.num_layers)
    structures = {program_structure(costs.layer_program(i).program) for i in layers}
    assert len(plans) > len(structures) == len(made)
    for built, layer_plans in enumerate(plans.values()):
        shared = layer_plans.problem
        assert len(made) == len(structures) + built  # built without analysing again
        alone = ShardingProblem(*layer_plans.build.args)
        assert len(made) == len(structures) + built + 1
        np.testing.assert_equal(_ilp_arrays(shared), _ilp_arrays(alone))


def _tight(traced, parts, pipeline, cluster, factor: float) -> PipelineConfig:
    """`pipeline` with a budget of `factor` times layer 1's fastest plan on 2 devices: tight
    enough that stages need squeezed alternatives."""
    fastest = LayerCosts(parts, traced.program, cluster, pipeline, 8).layer_costs(1, (1, 2), 1)[0]
    tight = factor * (fastest.state_bytes + fastest.stash_bytes + fastest.temporary_bytes)
    return dataclasses.replace(pipeline, intra=IntraOpConfig(memory_budget_per_device=tight))


def test_squeezed_layer_plans_prefetched_in_parallel_equal_lazy_ones():
    """Under a budget where stages need squeezed alternatives, planning the squeeze chains two
    at a time before the DP gives the DP the alternatives it would plan one by one."""
    traced, parts, pipeline = _auto_stage_parts()
    cluster = autopar.ClusterSpec.local(8)
    pipeline = _tight(traced, parts, pipeline, cluster, 1.6)
    stages = _stages_within_a_host(parts)
    parallel = LayerCosts(parts, traced.program, cluster, pipeline, 8)
    parallel.prefetch_squeezed(stages, workers=2)
    solves = parallel.ilp_solves
    lazy = LayerCosts(parts, traced.program, cluster, pipeline, 8)
    squeezed = [lazy(*stage) for stage in stages]
    assert any(len(alternatives) > 1 for alternatives in squeezed)
    assert [parallel(*stage) for stage in stages] == squeezed
    assert parallel.ilp_solves == solves == lazy.ilp_solves


def _layer_problem(logical):
    """Layer 1 of the MLP step alone on a logical mesh, as an ILP."""
    traced, parts, _ = _auto_stage_parts()
    program = range_program(parts, traced.program.signature, 1, 2).program
    mesh = stage_mesh(logical, tuple(range(math.prod(logical))))
    cluster = autopar.ClusterSpec.local(8)
    config = IntraOpConfig()
    return ShardingProblem(program, mesh, cluster, config, MICRO_BATCHES)


def test_a_budget_the_ilp_cannot_meet_is_answered_without_the_least_memory_plan(monkeypatch):
    """The ILP's memory is a lower bound of the emitted plan's: where no choices fit the
    budget, `solve` says so without planning for the least memory (a second ILP)."""
    problem = _layer_problem((1, 2))
    budget = problem.ilp.least_memory() / 2

    def unexpected(self):
        raise AssertionError("planned the least-memory plan")

    monkeypatch.setattr(ShardingProblem, "_least_memory_plan", unexpected)
    assert problem.solve(budget) is None


def test_an_ilp_out_of_time_before_any_plan_falls_back_to_the_least_memory_plan(monkeypatch):
    """Where the ILP runs out of time before any plan under a budget the least-memory plan fits
    (a memory-bound stage's MIP can), and its LP relaxation gives none to round either, `solve`
    answers with that plan, not "nothing fits"."""
    problem = _layer_problem((1, 2))
    budget = 2 * problem.least_memory()
    solve = ilp_module.IntraOpIlp._solve

    def out_of_time(self, model, closed, time_limit_s, start, **kind):
        if "peak_mib" in model.names:  # the least-memory search still solves
            return solve(self, model, closed, time_limit_s, start, **kind)
        return ilp_module._Status.NO_SOLUTION, None  # nor its LP relaxation, to round

    monkeypatch.setattr(ilp_module.IntraOpIlp, "_solve", out_of_time)
    plan = problem.solve(budget)
    assert plan is not None and "least-memory plan" in plan.notes[0]
    assert plan.predicted.memory_per_device_bytes == pytest.approx(problem.least_memory())


def test_a_stacked_layer_counts_what_a_stage_of_like_layers_adds_up():
    """A layer planned as one of d like layers with more micro-batches in flight holds, at every
    step, the other layers' state (parameters, optimizer state, accumulated gradients) and the
    extra stashes on top of its own memory: exactly what the stage DP adds up per layer
    (`state_bytes`, `stash_bytes`), so a squeezed plan that fits its stack fits such a stage."""
    traced, parts, _ = _auto_stage_parts()
    stage = range_program(parts, traced.program.signature, 1, 2)
    problem = _layer_problem((1, 2))
    solution, _, plan, _ = problem._emitted(2.0**40, time.perf_counter() + 60, None)
    stacked = problem.stacked(3, Stash(stage.num_forward, 5))
    extra = stacked.memory.evaluate(solution.choices) - problem.memory.evaluate(solution.choices)
    expected = 2 * state_bytes(stage, plan) + 5 * stash_bytes(stage, plan)
    assert expected > 0 and np.allclose(extra, expected)
    # Under a budget the fastest plan's stack exceeds, the stack gets a tighter plan that fits.
    fastest_stack = float(stacked.memory.evaluate(solution.choices).max())
    budget = (stacked.ilp.least_memory() + fastest_stack) / 2
    assert budget < fastest_stack
    found = stacked.candidate(budget)
    assert found is not None and found.plan.predicted.memory_per_device_bytes <= budget


def test_a_layer_whose_ilp_finds_no_plan_in_time_falls_back_on_its_least_memory_plan(
    monkeypatch,
):
    """A candidate ILP that stops at its time limit without a plan, or whose plan asked for less
    by what the emission adds finds none, does not drop a layer that fits out of the stage search:
    its least-memory plan stands in where it fits the budget, and only there (not where the ILP
    proved that none fits)."""
    traced, parts, _ = _auto_stage_parts()
    stage = range_program(parts, traced.program.signature, 1, 2)
    stacked = _layer_problem((1, 2)).stacked(2, Stash(stage.num_forward, 3))
    least = stacked.least_memory()

    def out_of_time(ilp, *args, **kwargs):
        ilp.out_of_time = True

    monkeypatch.setattr(type(stacked.ilp), "solve", out_of_time)
    found = stacked.candidate(1.01 * least, correct=True)
    assert found is not None and found.plan.predicted.memory_per_device_bytes <= 1.01 * least
    assert found.strategies  # a start for a stage of such layers
    assert stacked.candidate(0.99 * least, correct=True) is None

    def proved_none(ilp, *args, **kwargs):
        ilp.out_of_time = False

    def unexpected(self):
        raise AssertionError("planned the least-memory plan")

    monkeypatch.setattr(type(stacked.ilp), "solve", proved_none)
    monkeypatch.setattr(ShardingProblem, "_least_memory_plan", unexpected)
    assert stacked.candidate(1.01 * least) is None  # the ILP proved none fits: no fallback


def test_a_stage_ilp_starts_from_its_layers_plans():
    """A stage's ILP starts from the strategies its layers' plans chose (`start_from`, matched by
    group structure, which a layer alone and in a stage share): every class of a structure the
    layers have (most of them: groups at a layer's edges may be cut differently) gets one, and a
    solve stopped at its first plan is no slower than the one from that start."""
    traced, parts, _ = _auto_stage_parts()
    signature, cluster = traced.program.signature, autopar.ClusterSpec.local(8)
    mesh = stage_mesh((2, 2), tuple(range(4)))

    def problem(start, end):
        program = range_program(parts, signature, start, end).program
        return ShardingProblem(program, mesh, cluster, IntraOpConfig(), MICRO_BATCHES)

    n = parts.num_layers
    layers = [problem(layer, layer + 1).candidate(2.0**40).strategies for layer in range(n)]
    stage = problem(0, n)
    start = stage.start_from(layers)
    known = set().union(*layers)
    groups = stage.problem.grouping.groups
    assert {g.cls for g in groups if g.structure in known} == set(start)
    assert len(start) > 0.75 * stage.problem.num_classes
    # A solve that stops at its time limit has its start's plan at least: here the best one.
    best = problem(0, n).ilp.solve(2.0**40)
    assert best.optimal
    config = dataclasses.replace(IntraOpConfig(), time_limit_s=1e-3)
    program = range_program(parts, signature, 0, n).program
    stopped = ShardingProblem(program, mesh, cluster, config, MICRO_BATCHES)
    found = stopped.ilp.solve(2.0**40, start=dict(enumerate(best.choices)))
    assert found is not None and list(found.choices) == list(best.choices)


def test_stage_shapes_follow_a_balanced_pipeline():
    """A mesh of m of N devices hosts one of N/m stages of a balanced pipeline: the squeezed
    plans fit that many layers, the first such stage's micro-batches in flight, and a shape
    halfway there; a mesh of more than half the devices holds the one stage of every layer."""
    config = PipelineConfig(64, (PipelineSchedule.ONE_F_ONE_B,), None, IntraOpConfig())
    assert stage_shapes(16, 64, 64, config) == (StageShape(16, 1),)
    assert stage_shapes(16, 64, 32, config) == (StageShape(3, 2), StageShape(8, 2))
    assert stage_shapes(16, 64, 8, config) == (StageShape(2, 3), StageShape(2, 8))
    assert stage_shapes(16, 64, 1, config) == (StageShape(1, 4), StageShape(1, 16))
    gpipe = dataclasses.replace(config, schedules=(PipelineSchedule.GPIPE,))
    assert stage_shapes(16, 64, 8, gpipe) == (StageShape(2, 8), StageShape(2, 64))
    with pytest.raises(ValueError, match="depth and flight"):
        StageShape(0, 1)


class _UnboundedLayerCosts(LayerCosts):
    """LayerCosts that squeezes every stage that may not fit, however slow."""

    @property
    def step_bound_s(self) -> float:
        return math.inf

    @step_bound_s.setter
    def step_bound_s(self, _: float) -> None:
        pass


def test_stages_slower_than_a_plan_within_hosts_are_not_squeezed():
    """On 2 hosts with slow links between them, a plan of stages within hosts bounds the step
    time: stages that span hosts and are too slow at their fastest are not squeezed into
    memory, and the plan is the same."""
    traced, parts, pipeline = _auto_stage_parts()
    cluster = dataclasses.replace(
        autopar.ClusterSpec.local(8), num_hosts=2, devices_per_host=4, inter_host_bandwidth=1e8
    )
    pipeline = _tight(traced, parts, pipeline, cluster, 1.6)
    _same_plan_fewer_solves(traced, parts, pipeline, cluster, (2, 4), _UnboundedLayerCosts)


def test_stages_slower_than_a_plan_at_the_fastest_layer_plans_are_not_squeezed():
    """On one host, the best plan of stages at their fastest layer plans (all planned before
    the DP) bounds the step time: slower stages are not squeezed, and the plan is the same."""
    traced, parts, pipeline = _auto_stage_parts()
    cluster = autopar.ClusterSpec.local(8)
    pipeline = _tight(traced, parts, pipeline, cluster, 1.6)
    _same_plan_fewer_solves(traced, parts, pipeline, cluster, (1, 8), _UnboundedLayerCosts)


def test_a_layer_over_its_memory_floor_builds_no_ilp():
    """Every value of a layer split over all n devices is the least any plan holds
    (`whole_peak_bytes` / n, at most the ILP's least memory): on a mesh where that exceeds the
    budget the layer has no candidate and no ILP is built or solved, while a mesh of more
    devices still gets its plan."""
    traced, parts, pipeline = _auto_stage_parts()
    cluster = autopar.ClusterSpec.local(8)
    stage = range_program(parts, traced.program.signature, 1, 2).program
    grouping = group_graph(stage.graph)
    whole = whole_peak_bytes(grouping, liveness(grouping, stage.signature, cpu=True))
    for logical in ((1, 2), (1, 8), (2, 4)):
        assert whole / math.prod(logical) <= _layer_problem(logical).ilp.least_memory()
    budget = whole / 3  # over the floor on 2 devices, under it on 8
    pipeline = dataclasses.replace(pipeline, intra=IntraOpConfig(memory_budget_per_device=budget))
    costs = LayerCosts(parts, traced.program, cluster, pipeline, 8)
    assert costs.layer_costs(1, (1, 2), 1) == ()
    assert costs.ilp_solves == 0 and not costs._plans
    assert _layer_problem((1, 2)).solve(budget) is None  # the ILP agrees
    assert costs.layer_costs(1, (1, 8), 1)
    assert costs.ilp_solves == 1


def test_squeezed_layer_plans_only_where_a_stage_may_not_fit():
    """With memory to spare the fastest layer plans always fit: the squeezed ones would never
    be picked, so planning them only where needed gives the same plan with fewer ILP solves."""
    traced, parts, pipeline = _auto_stage_parts()
    cluster = autopar.ClusterSpec.local(8)
    _same_plan_fewer_solves(traced, parts, pipeline, cluster, (1, 8), _EagerLayerCosts)


def _same_plan_fewer_solves(traced, parts, pipeline, cluster, cluster_shape, exhaustive):
    """LayerCosts finds the plan that `exhaustive` (a LayerCosts that prunes less) finds, with
    fewer ILP solves."""
    plans, solves = [], []
    for costs_class in (LayerCosts, exhaustive):
        costs = costs_class(parts, traced.program, cluster, pipeline, 8)
        plan = plan_pipeshard(parts, traced.program, cluster, cluster_shape, pipeline, costs)
        plans.append(dataclasses.replace(plan, notes=()))
        solves.append(costs.ilp_solves)
    assert plans[0] == plans[1]
    assert solves[0] < solves[1]


class _LevelUnboundedLayerCosts(LayerCosts):
    """LayerCosts whose bound stays as it was before the first squeeze level."""

    def prefetch_squeezed(self, candidates, workers=None, best_step=None):
        super().prefetch_squeezed(candidates, workers)


def test_each_squeeze_level_is_bounded_by_the_best_plan_of_the_levels_before():
    """Before it squeezes stages a level deeper, the search lowers its bound to the step of the
    best plan of the levels planned so far (`LayerCosts.planned`: each stage at every level
    its layers have, planning nothing); the plan is the one it finds without that."""
    traced, parts, pipeline = _auto_stage_parts()
    cluster = autopar.ClusterSpec.local(8)
    pipeline = _tight(traced, parts, pipeline, cluster, 1.6)
    stages = _stages_within_a_host(parts)
    costs = LayerCosts(parts, traced.program, cluster, pipeline, 8)
    costs.step_bound_s = 1e9
    asked = []

    def best_step(cost_fn) -> float:
        solves = costs.ilp_solves
        for start, end, submesh, logical in stages:
            found = [costs._layer_plans(k, logical).found for k in range(start, end)]
            levels = range(max(map(len, found)))
            expected = tuple(_stage_cost(found, lv) for lv in levels) if all(found) else ()
            assert cost_fn(start, end, submesh, logical) == expected
        assert costs.ilp_solves == solves  # nothing planned
        asked.append(costs.ilp_solves)
        return 123.0

    costs.prefetch_squeezed(stages, best_step=best_step)
    assert len(asked) == 1 and 0 < asked[0] < costs.ilp_solves  # before level 2 only
    assert costs.step_bound_s == 123.0
    assert any(len(costs(*stage)) > 2 for stage in stages)  # level 2 was planned
    results = []
    for costs_class in (LayerCosts, _LevelUnboundedLayerCosts):
        costs = costs_class(parts, traced.program, cluster, pipeline, 8)
        plan = plan_pipeshard(parts, traced.program, cluster, (1, 8), pipeline, costs)
        results.append((dataclasses.replace(plan, notes=()), costs.ilp_solves))
    assert results[0][0] == results[1][0] and results[0][1] <= results[1][1]


def test_a_chosen_stage_that_does_not_fit_as_a_whole_is_searched_again(monkeypatch):
    """Where a chosen stage, planned as a whole, needs more memory than its layers' plans add up
    to, the search goes again knowing it (`LayerCosts.correct`): the plan avoids that stage with
    as many micro-batches in flight, and says it searched again; where it keeps happening, the
    stage's error reaches the user, naming the memory it needs."""
    traced, parts, pipeline = _auto_stage_parts()
    cluster = autopar.ClusterSpec.local(8)
    plan_stage = pipeshard_module._plan_stage
    refused = []

    def refusing_the_first(job, cluster, num_micro_batches, memory):
        if not refused or refused[0] == (job.stage.layers, job.mesh.shape, job.flight):
            refused[:1] = [(job.stage.layers, job.mesh.shape, job.flight)]
            return MemoryBudgetError(f"stage {job.stage.layers} needs more", memory, 2 * memory)
        return plan_stage(job, cluster, num_micro_batches, memory)

    monkeypatch.setattr(pipeshard_module, "_plan_stage", refusing_the_first)
    monkeypatch.setenv("AUTOPAR_PLANNING_PROCESSES", "0")  # `refused` is kept in this process
    costs = LayerCosts(parts, traced.program, cluster, pipeline, 8)
    plan = plan_pipeshard(parts, traced.program, cluster, (1, 8), pipeline, costs)
    flights = plan.pipeline_schedule.stage_in_flight(len(plan.stages), MICRO_BATCHES)
    found = [(s.layers, s.mesh.shape, f) for s, f in zip(plan.stages, flights, strict=True)]
    assert refused and refused[0] not in found
    assert "searches: chosen stages that did not fit as a whole" in plan.notes[0]

    monkeypatch.setattr(
        pipeshard_module,
        "_plan_stage",
        lambda job, *_, **__: MemoryBudgetError(
            f"stage {job.stage.layers} needs 9 GiB", 1.0, 9 * 2.0**30
        ),
    )
    with pytest.raises(MemoryBudgetError, match="needs 9 GiB"):
        plan_pipeshard(parts, traced.program, cluster, (1, 8), pipeline)


def test_a_chosen_stage_far_slower_as_a_whole_is_repriced(monkeypatch):
    """Where a chosen stage fits as a whole only with a plan far slower than its layers' plans
    add up to, the search goes again with the stage at that speed (`LayerCosts.reprice`): the
    plan avoids it and says so, and the plan's step is its stages' own (never the search's
    estimate); where every search is slower than the first, the first stands."""
    traced, parts, pipeline = _auto_stage_parts()
    cluster = autopar.ClusterSpec.local(8)
    plan_stage = pipeshard_module._plan_stage
    slowed = []

    def slowing(factor):
        def slowing_the_first(job, cluster, num_micro_batches, memory):
            plan = plan_stage(job, cluster, num_micro_batches, memory)
            stage = (job.stage.layers, job.mesh.shape, job.flight)
            if slowed and slowed[0] != stage:
                return plan
            slowed[:1] = [stage]
            slower = plan.predicted.step_time_s * factor
            return dataclasses.replace(
                plan, predicted=dataclasses.replace(plan.predicted, step_time_s=slower)
            )

        return slowing_the_first

    plain = plan_pipeshard(parts, traced.program, cluster, (1, 8), pipeline)
    assert "searches" not in plain.notes[0]
    monkeypatch.setenv("AUTOPAR_PLANNING_PROCESSES", "0")  # `slowed` is kept in this process

    monkeypatch.setattr(pipeshard_module, "_plan_stage", slowing(100.0))
    plan = plan_pipeshard(parts, traced.program, cluster, (1, 8), pipeline)
    flights = plan.pipeline_schedule.stage_in_flight(len(plan.stages), MICRO_BATCHES)
    found = [(s.layers, s.mesh.shape, f) for s, f in zip(plan.stages, flights, strict=True)]
    assert slowed and slowed[0] not in found
    assert "ran over 1.5 times slower than estimated, were repriced" in plan.notes[0]
    latencies = [s.predicted.step_time_s / MICRO_BATCHES for s in plan.stages]
    step = plan.pipeline_schedule.step_time(latencies, MICRO_BATCHES)
    assert plan.predicted.step_time_s == pytest.approx(max(step, plan.predicted.host_s))

    # Every stage ever slower than estimated: the searches stop after MAX_STAGE_CORRECTIONS
    # more, and the fastest of them by its stages' own plans is the plan.
    calls = []

    def all_slower(job, cluster, num_micro_batches, memory):
        plan = plan_stage(job, cluster, num_micro_batches, memory)
        calls.append(job.stage.layers)
        slower = plan.predicted.step_time_s * 4 * len(calls)
        return dataclasses.replace(
            plan, predicted=dataclasses.replace(plan.predicted, step_time_s=slower)
        )

    searches, search = [], pipeshard_module._Search

    def recorded(*args):
        searches.append(search(*args))
        return searches[-1]

    monkeypatch.setattr(pipeshard_module, "_plan_stage", all_slower)
    monkeypatch.setattr(pipeshard_module, "_Search", recorded)
    plan = plan_pipeshard(parts, traced.program, cluster, (1, 8), pipeline)
    assert len(searches) == pipeshard_module.MAX_STAGE_CORRECTIONS + 1
    assert f"({len(searches)} searches" in plan.notes[0]
    assert plan.predicted.step_time_s == min(s.step for s in searches)


def test_profiling_needs_the_devices():
    option = autopar.AutoStageOption(profile=True)
    with pytest.raises(autopar.InvalidArgumentError, match="profile=True"):
        _plan(_method(0, "1f1b", "auto", stage_option=option))


def test_manual_stages_with_2d_logical_meshes():
    option = autopar.ManualStageOption(
        forward_stage_layer_ids=((0, 1), (2, 3)),
        submesh_physical_shapes=((1, 4), (1, 4)),
        submesh_logical_shapes=((2, 2), (4, 1)),
    )
    step, state, _, batch = _run("mlp", _method(2, "1f1b", "manual", stage_option=option), True)
    assert relative_error(state.params, serial_params("mlp")) <= 1e-5
    plan = step.get_plan(state, batch)
    assert [s.mesh.shape for s in plan.stages] == [(2, 2), (4,)]
    assert [s.layers for s in plan.stages] == [(0, 2), (2, 4)]
    assert [s.mesh.device_indices for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_executable_exposes_segments_hlo_and_memory():
    step, state, _, batch = _run("mlp", _method(2, "gpipe", "auto"), steps=1)
    executable = step.get_executable(state, batch)
    assert isinstance(executable, autopar.PipelineExecutable)
    hlo = executable.get_hlo_text()
    for name in ("stage0.forward", "stage0.backward", "stage1.forward", "stage1.apply0"):
        assert f"// {name}" in hlo
    stats = executable.memory_stats()
    assert len(stats) == 2 and all(s.peak_bytes > 0 for s in stats)
    print(executable.schedule.to_text())


def test_plan_round_trips_through_json():
    module, config = _config("mlp", False)
    state = module.create_train_state(config, batch_size=2)
    batch = module.make_batch(config, BATCH)
    plan = autopar.plan(
        module.make_train_step(autopar.value_and_grad),
        state,
        batch,
        method=_method(2, "1f1b", "auto"),
    )
    assert autopar.Plan.from_json(plan.to_json()) == plan
    text = plan.summary()
    assert "1f1b pipeline" in text and "stage 1: layers [2,4)" in text


# ------------------------------------------------------------------ the stage split


def _traced(fun, args, layers=4):
    return trace_step(
        fun,
        args,
        static_argnums=(),
        batch_argnums=(1,),
        donate_argnums=(0,),
        regather_params=False,
        layer_option=autopar.AutoLayerOption(layer_num=layers),
    )


def _mlp_args():
    module, config = _config("mlp", False)
    return module, (module.create_train_state(config, batch_size=2), module.make_batch(config, 8))


def test_split_puts_every_live_eqn_in_one_part():
    module, args = _mlp_args()
    traced = _traced(module.make_train_step(autopar.value_and_grad), args)
    parts = split_step(traced.closed_jaxpr, traced.program.signature.batch_inputs)
    assert parts.num_layers == 4
    assigned = [i for p in (*parts.forward, *parts.backward) for i in p] + list(parts.apply)
    assert len(assigned) == len(set(assigned))
    assert all(parts.forward) and all(parts.backward)
    assert max(i for p in parts.forward for i in p) < min(i for p in parts.backward for i in p)
    assert parts.boundary < min(i for i in parts.apply if i > parts.boundary)


def test_update_runs_where_its_gradients_are():
    """Adam's moments of a parameter are updated on the parameter's stage; the step counter,
    which reads no gradient, is recomputed on each stage that needs it."""
    module, args = _mlp_args()
    traced = _traced(module.make_train_step(autopar.value_and_grad), args)
    parts = split_step(traced.closed_jaxpr, traced.program.signature.batch_inputs)
    placement = place_stages(parts, [(0, 2), (2, 4)])
    eqns = traced.closed_jaxpr.jaxpr.eqns
    shared = set(placement.apply[0]) & set(placement.apply[1])
    assert shared and all(eqns[i].primitive.name != "dot_general" for i in shared)
    only = [set(placement.apply[s]) - shared for s in (0, 1)]
    assert all(only)


def test_value_from_the_batch_outside_the_gradient_is_rejected():
    module, args = _mlp_args()

    def step(state, batch):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        prediction = state.apply_fn({"params": state.params}, batch["x"])
        return state.apply_gradients(grads=grads), prediction

    method = _method(2, "1f1b", "auto")
    with pytest.raises(autopar.PlanningError, match="one row per example"):
        autopar.plan(step, *args, method=method)


def test_a_batch_metric_scaled_by_the_gradients_is_rejected():
    """A mean of the batch (divided by a literal count) times a value of the gradients: the
    error names the batch input it reads."""
    module, args = _mlp_args()

    def step(state, batch):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        norm = sum(jnp.sum(g) for g in jax.tree.leaves(grads))
        return state.apply_gradients(grads=grads), jnp.mean(batch["y"]) * norm

    with pytest.raises(autopar.PlanningError, match=r"reads the batch \(batch\['y'\]\)"):
        autopar.plan(step, *args, method=_method(2, "1f1b", "auto"))


# ------------------------------------------------------------------ bad input


def _plan(method, family="mlp", batch_size=BATCH, manual_layers=False, grad=None):
    module, config = _config(family, manual_layers)
    state = module.create_train_state(config, batch_size=2)
    batch = module.make_batch(config, batch_size)
    step = module.make_train_step(grad or autopar.value_and_grad)
    return autopar.plan(step, state, batch, method=method)


def test_manual_stages_must_cover_the_devices():
    option = autopar.ManualStageOption(((0, 1), (2, 3)), ((1, 2), (1, 2)), ((1, 2), (2, 1)))
    with pytest.raises(autopar.InvalidArgumentError, match="8"):
        _plan(_method(2, "1f1b", "auto", stage_option=option))


def test_micro_batches_must_divide_the_batch():
    with pytest.raises(autopar.InvalidArgumentError, match="num_micro_batches=4"):
        _plan(_method(2, "1f1b", "auto"), batch_size=30)


def test_more_stages_than_layers():
    with pytest.raises(
        autopar.InvalidArgumentError, match="num_stages=8 is more than the 4 layers"
    ):
        _plan(_method(8, "1f1b", "auto"))


def test_stages_must_split_the_devices_evenly():
    with pytest.raises(autopar.InvalidArgumentError, match="num_stages=3"):
        _plan(_method(3, "1f1b", "auto"))


def test_manual_layers_need_markers():
    with pytest.raises(autopar.InvalidArgumentError, match="mark_pipeline_boundary"):
        _plan(_method(2, "1f1b", "manual"))


def test_jax_grad_cannot_be_pipelined():
    with pytest.raises(autopar.PlanningError, match="autopar.grad"):
        _plan(_method(2, "1f1b", "auto"), grad=jax.value_and_grad)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"pipeline_schedule": "interleaved"}, "pipeline_schedule"),
        ({"num_micro_batches": 0}, "num_micro_batches"),
        ({"layer_option": 4}, "layer_option"),
        ({"stage_option": "balanced"}, "stage_option"),
        ({"num_virtual_stages": 0}, "num_virtual_stages=0 must be a positive integer"),
        ({"num_virtual_stages": 2.0}, "num_virtual_stages=2.0"),
    ],
)
def test_bad_method_arguments(kwargs, match):
    with pytest.raises(autopar.InvalidArgumentError, match=match):
        autopar.PipeshardParallel(**kwargs)


def test_stage_plan_counts_the_activations_of_micro_batches_in_flight():
    """A stage re-planned with micro-batches in flight counts their stashed activations in its
    memory: with memory to spare the plan is the same and its peak grows by exactly their
    bytes; within a budget that the stash-blind plan exceeds, the plan found fits."""
    traced, parts, pipeline = _auto_stage_parts()
    stage = range_program(parts, traced.program.signature, 0, 2)
    mesh = stage_mesh((1, 2), (0, 1))
    cluster = autopar.ClusterSpec.local(8)

    def problem(copies: int) -> ShardingProblem:
        stash = Stash(stage.num_forward, copies)
        return ShardingProblem(stage.program, mesh, cluster, IntraOpConfig(), MICRO_BATCHES, stash)

    blind = problem(0).solve(math.inf)
    held = stash_bytes(stage, blind.stages[0])
    assert held > 0
    aware = problem(3).solve(math.inf)
    assert aware.stages[0].input_specs == blind.stages[0].input_specs
    assert aware.predicted.memory_per_device_bytes == pytest.approx(
        blind.predicted.memory_per_device_bytes + 3 * held, rel=1e-9
    )
    budget = blind.predicted.memory_per_device_bytes + 1.5 * held
    tight = problem(3).solve(budget)
    assert tight is not None and tight.predicted.memory_per_device_bytes <= budget
    with pytest.raises(ValueError, match="counts >= 0"):
        Stash(stage.num_forward, -1)


def test_layer_state_counts_whole_accumulators_of_gradients_reduced_once():
    """A gradient stored split but reduce-scattered once per step waits whole on each device
    until the last micro-batch: the layer's state (what adds up over a stage's layers) counts
    its accumulator whole, not as the slice it is stored as."""
    traced, parts, pipeline = _auto_stage_parts()
    stage = range_program(parts, traced.program.signature, 0, 2)
    mesh = stage_mesh((4, 1), (0, 1, 2, 3))
    config = IntraOpConfig(force_batch_dim_to_mesh_dim=0)
    problem = ShardingProblem(stage.program, mesh, autopar.ClusterSpec.local(8), config, 4)
    fastest = problem.solve(math.inf).predicted.memory_per_device_bytes
    for fraction in (0.9, 0.8, 0.7, 0.6):  # the roomiest budget that scatters some gradient
        plan = problem.solve(fraction * fastest).stages[0]
        scattered = {n: s for n, s in plan.partial_sums.items() if not s.once_per_step}
        if scattered:
            break
    assert scattered
    node, lowering = next(iter(scattered.items()))
    aval = stage.program.graph.node(node).out_avals[0]
    once = dataclasses.replace(
        plan,
        partial_sums={**plan.partial_sums, node: dataclasses.replace(lowering, once_per_step=True)},
    )
    whole = math.prod(aval.shape) * aval.dtype.itemsize
    assert state_bytes(stage, once) - state_bytes(stage, plan) == pytest.approx(whole * 3 / 4)


def _stats_parts(uses_stats: bool):
    """A step over 5 like blocks split at manual boundaries, each block also computing a batch
    statistic (as BatchNorm does) that the loss returns for the new state: each layer forwards
    the statistics of the layers before it. With `uses_stats` each block also reads the last
    one's statistic, so the layers differ."""
    width, blocks = 16, 5

    def loss(params, x):
        stats, last = [], jnp.zeros(())
        for n in range(blocks):
            if n:
                autopar.mark_pipeline_boundary()
            x = jnp.tanh(x @ params[f"b{n}"] + (last if uses_stats else 0.0))
            last = jnp.mean(x)
            stats.append(last)
        return jnp.sum(x), stats

    def train_step(params, x):
        grads, stats = autopar.grad(loss, has_aux=True)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), stats

    params = {f"b{n}": jnp.full((width, width), 0.1) for n in range(blocks)}
    args = (params, jnp.ones((8, width)))
    method = _method(0, "1f1b", "manual", stage_option=autopar.AutoStageOption())
    traced = trace_for_method(train_step, args, method, resolve_argnums(args, (), (1,), "auto"))
    parts = split_step(traced.closed_jaxpr, traced.program.signature.batch_inputs)
    pipeline = PipelineConfig(MICRO_BATCHES, method.schedules, method.stage_option, IntraOpConfig())
    return LayerCosts(parts, traced.program, autopar.ClusterSpec.local(8), pipeline, 8), blocks


@pytest.mark.parametrize("uses_stats", [False, True])
def test_values_a_layer_only_forwards_leave_its_structure_alone(uses_stats):
    """The middle blocks forward 1, 2 and 3 earlier statistics: the same layer, planned once
    for all three (as a Wide-ResNet's blocks with their BatchNorm statistics); blocks that read
    the statistic they are handed are the same layer too, and differ from those that do not."""
    costs, blocks = _stats_parts(uses_stats)
    middle = [costs.layer_program(n).program for n in range(1, blocks - 1)]
    forwarded = [len(p.signature.input_avals) for p in middle]
    assert forwarded == sorted(set(forwarded))  # each forwards more than the one before
    assert len({program_structure(p) for p in middle}) == 1
    other, _ = _stats_parts(not uses_stats)
    assert program_structure(other.layer_program(2).program) != program_structure(middle[1])
    plans = {id(costs._layer_plans(n, (1, 2))) for n in range(1, blocks - 1)}
    assert len(plans) == 1


def test_uniform_stages_whose_layer_never_fits_name_the_layer_and_its_memory():
    """A stage of one layer on one device, under a budget below that layer's least memory: a
    MemoryBudgetError with the layer, the mesh and the figures, not "cost_fn rejected it"."""
    config = GPTConfig()
    state = gpt.create_train_state(config, batch_size=2)
    batch = gpt.make_batch(config, 16)
    method = autopar.PipeshardParallel(
        num_micro_batches=2,
        layer_option=autopar.AutoLayerOption(layer_num=8, remat_mode="none"),
        stage_option=autopar.UniformStageOption(num_stages=8),
        auto_sharding_option=autopar.AutoShardingOption(memory_budget_per_device=1e6),
    )
    step = gpt.make_train_step(autopar.value_and_grad)
    with pytest.raises(
        MemoryBudgetError, match=r"layer 0 alone needs at least .* logical mesh"
    ) as e:
        autopar.plan(step, state, batch, method=method)
    assert e.value.least > e.value.budget == 1e6
