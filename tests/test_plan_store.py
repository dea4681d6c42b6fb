"""Plan files (`PlanFile`) run a saved plan without planning; the plan cache makes a second
parallelize of the same program skip planning and never trusts a bad entry."""

import json
import logging

import jax
import pytest
from conftest import relative_error, serial_state

import autopar
from autopar.models import MLPConfig, mlp
from autopar.plan_store import CACHE_ENV, check_plan_fits

CONFIG = MLPConfig(in_dim=64, hidden=64, out_dim=64, num_layers=4)
BATCH = 32
STEPS = 3
SOLVER_LOG = "sharding ILP:"


def _serial_params():
    return serial_state(mlp, CONFIG, BATCH, STEPS).params


def _train(method, steps=STEPS, batch_size=BATCH):
    step = autopar.parallelize(mlp.make_train_step(autopar.value_and_grad), method=method)
    state = mlp.create_train_state(CONFIG, batch_size=2)
    batch = mlp.make_batch(CONFIG, batch_size)
    for _ in range(steps):
        state, _ = step(state, batch)
    return step, state, batch


def _solver_runs(caplog) -> int:
    return sum(SOLVER_LOG in r.getMessage() for r in caplog.records)


PIPELINE = autopar.PipeshardParallel(
    num_micro_batches=4,
    layer_option=autopar.AutoLayerOption(layer_num=4),
    stage_option=autopar.UniformStageOption(2),
)


@pytest.mark.parametrize("method", [autopar.ShardParallel(), PIPELINE], ids=["shard", "pipeshard"])
def test_plan_file_runs_without_planning(tmp_path, caplog, method):
    step, state, batch = _train(method, steps=1)
    path = tmp_path / "plan.json"
    path.write_text(step.get_plan(state, batch).to_json())
    with caplog.at_level(logging.INFO, logger="autopar"):
        replay, state, batch = _train(autopar.PlanFile(path))
    assert _solver_runs(caplog) == 0
    assert relative_error(state.params, _serial_params()) <= 1e-5
    assert replay.get_plan(state, batch) == autopar.Plan.from_json(path.read_text())


def test_plan_file_for_another_program_names_the_mismatch(tmp_path):
    step, state, batch = _train(autopar.ShardParallel(), steps=1)
    path = tmp_path / "plan.json"
    path.write_text(step.get_plan(state, batch).to_json())
    with pytest.raises(autopar.InvalidArgumentError, match="was made for program .* differ"):
        _train(autopar.PlanFile(path), steps=1, batch_size=2 * BATCH)


def test_plan_file_needs_its_devices(tmp_path):
    step, state, batch = _train(autopar.ShardParallel(), steps=1)
    plan = step.get_plan(state, batch)
    paths = plan.input_paths
    with pytest.raises(autopar.InvalidArgumentError, match="needs 8 devices.* has 4"):
        check_plan_fits(plan, plan.fingerprint, paths, 4, "plan file 'p.json'")


@pytest.mark.parametrize(
    "content,match",
    [(None, "cannot read plan file"), ("{not json", "not an autopar plan file")],
)
def test_bad_plan_files(tmp_path, content, match):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(autopar.InvalidArgumentError, match=match):
        autopar.PlanFile(path)


def test_cache_skips_planning_and_ignores_corrupt_entries(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    method = autopar.ShardParallel()
    with caplog.at_level(logging.INFO, logger="autopar"):
        _train(method, steps=1)
        assert _solver_runs(caplog) == 1
        (entry,) = tmp_path.glob("*.json")

        caplog.clear()
        _, state, _ = _train(method)  # a new parallelize of the same program
        assert _solver_runs(caplog) == 0
        assert any("plan cache hit" in r.getMessage() for r in caplog.records)
        assert relative_error(state.params, _serial_params()) <= 1e-5

        caplog.clear()
        entry.write_text(entry.read_text()[:100])  # a torn write
        _, state, _ = _train(method)
        assert _solver_runs(caplog) == 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("ignoring plan cache entry" in r.getMessage() for r in warnings)
        assert relative_error(state.params, _serial_params()) <= 1e-5


def test_cache_key_covers_the_method(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    _train(autopar.ShardParallel(), steps=1)
    with caplog.at_level(logging.INFO, logger="autopar"):
        _train(autopar.ShardParallel(devices=jax.devices()[:4]), steps=1)
    assert _solver_runs(caplog) == 1
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_plan_method_and_schedule_are_enums_that_read_and_write_their_values():
    """A plan's method and schedule are enums; JSON holds their values, which compare equal."""
    from autopar.planner.plan import PlanMethod
    from autopar.planner.schedules import PipelineSchedule

    step = autopar.parallelize(mlp.make_train_step(autopar.value_and_grad), method=PIPELINE)
    plan = step.get_plan(
        mlp.create_train_state(CONFIG, batch_size=2), mlp.make_batch(CONFIG, BATCH)
    )
    assert plan.method is PlanMethod.PIPESHARD_PARALLEL and plan.method == "pipeshard_parallel"
    assert plan.pipeline_schedule is PipelineSchedule.ONE_F_ONE_B
    data = json.loads(plan.to_json())
    assert (data["method"], data["pipeline_schedule"]) == ("pipeshard_parallel", "1f1b")
    again = autopar.Plan.from_json(plan.to_json())
    assert again == plan and again.pipeline_schedule is PipelineSchedule.ONE_F_ONE_B
    data["method"] = "tensor_parallel"
    with pytest.raises(autopar.InvalidArgumentError, match="method='tensor_parallel' is unknown"):
        autopar.Plan.from_json(json.dumps(data))
