"""The Ray runtime on a local Ray instance: mesh workers simulating CPU devices, a pipeline over
two workers, one SPMD stage mesh over two worker processes, failures and cleanup.

The module starts one Ray instance (2 CPUs, no dashboard) and shuts it down at the end; each test
opens and closes its own autopar runtime on it.
"""

import dataclasses
import functools
import logging
import re
import threading
import time

import jax
import numpy as np
import optax
import pytest
import ray
import ray._private.state
from conftest import parallel_steps, relative_error, serial_state

import autopar
from autopar.models import GPTConfig, MLPConfig, gpt, mlp
from autopar.runtime.ray import RemoteArray, StageFailedError, StepTimeoutError

BATCH = 32
STEPS = 3
GPT = GPTConfig(num_layers=4)
# ray.init starts its processes with fork+exec while jax's threads run; exec makes that safe.
pytestmark = [
    pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning"),
    pytest.mark.xdist_group("ray"),  # one local Ray instance at a time (`make test` runs -n 2)
]

MLP = MLPConfig(in_dim=32, hidden=32, out_dim=32, num_layers=4)


def _alive_actors() -> list[str]:
    """Actors Ray's control store (GCS) lists as alive."""
    return [k for k, v in ray._private.state.actors().items() if v["State"] == "ALIVE"]


def _placement_groups() -> list[str]:
    """Placement groups Ray's control store lists as not removed."""
    table = ray.util.placement_group_table()
    return [k for k, v in table.items() if v["state"] != "REMOVED"]


def _pipeline(stages: int = 2, schedule: str = "1f1b") -> autopar.PipeshardParallel:
    return autopar.PipeshardParallel(
        num_micro_batches=4,
        layer_option=autopar.AutoLayerOption(layer_num=4),
        stage_option=autopar.UniformStageOption(stages),
        pipeline_schedule=schedule,
    )


def _two_hosts_of_two() -> autopar.ClusterSpec:
    return dataclasses.replace(autopar.ClusterSpec.local(2), num_hosts=2, name="2x2-cpu")


def test_unreachable_address_is_a_clear_error():
    assert not ray.is_initialized()
    with pytest.raises(
        autopar.InvalidArgumentError, match=r"no Ray cluster answers.*127\.0\.0\.1:9"
    ):
        autopar.init("ray", address="127.0.0.1:9")
    with pytest.raises(autopar.InvalidArgumentError, match="is not 'auto' or host:port"):
        autopar.init("ray", address="nowhere")
    assert not ray.is_initialized()
    autopar.init("local")  # nothing was left half-initialised
    autopar.shutdown()


def test_simulated_hosts_are_planned_with_their_workers_scheduler(monkeypatch):
    """Without GPUs the workers simulate their devices, whose XLA runs the DFS memory scheduler
    (`simulate_cpu_devices`), whatever the driver's own flags: the default spec says so."""
    from autopar.runtime.ray import _cluster_spec

    monkeypatch.setenv("XLA_FLAGS", "")
    assert not autopar.ClusterSpec.local(4).dfs_schedule
    spec = _cluster_spec([], [], False, None, 4)
    assert spec.dfs_schedule and spec.num_devices == 4 and spec.platform == "cpu"


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)  # worker logs come to this process
    yield
    ray.shutdown()


@pytest.fixture
def on_ray(local_ray):
    """Run the test body on an autopar Ray runtime; `on_ray(spec, **init_kwargs)` opens it."""
    opened = []

    def open_runtime(cluster_spec=None, **kwargs):
        autopar.init("ray", cluster_spec=cluster_spec, **kwargs)
        opened.append(True)

    yield open_runtime
    if opened:
        autopar.shutdown()
    assert _alive_actors() == []
    assert _placement_groups() == []


def test_pipeline_on_two_workers_matches_serial(on_ray):
    on_ray(autopar.ClusterSpec.local(8))
    step, state, metrics, batch = parallel_steps(gpt, GPT, _pipeline(), BATCH, STEPS)
    executable = step.get_executable(state, batch)
    assert [len(a) for a in executable.actors] == [1, 1]  # one worker per stage (one host)
    leaves = jax.tree.leaves(state.params)
    assert all(isinstance(x, RemoteArray) for x in leaves)
    assert {x.stage for x in leaves} == {0, 1}  # parameters stay on their stage's worker
    params = jax.tree.map(np.asarray, state.params)
    assert relative_error(params, serial_state(gpt, GPT, BATCH, STEPS).params) <= 1e-5
    assert np.isfinite(np.asarray(metrics["loss"]))
    tasks = executable.timeline()
    assert {(t.stage, t.segment.split(".")[1]) for t in tasks} >= {
        (0, "forward"),
        (0, "backward"),
        (1, "forward"),
        (1, "backward"),
    }
    assert len(_alive_actors()) == 2


@pytest.mark.parametrize("stages", [2, 4])
def test_zero_bubble_on_workers_matches_serial(on_ray, stages):
    """Each worker runs its stage's forwards, input-gradient and weight-gradient tasks in the
    zero-bubble order; the input gradients go to the previous stage's worker."""
    on_ray(autopar.ClusterSpec.local(8))
    method = _pipeline(stages, "zero_bubble")
    step, state, _, batch = parallel_steps(mlp, MLP, method, BATCH, STEPS)
    params = jax.tree.map(np.asarray, state.params)
    assert relative_error(params, serial_state(mlp, MLP, BATCH, STEPS).params) <= 1e-5
    kinds = {t.segment.split(".")[1] for t in step.get_executable(state, batch).timeline()}
    assert {"backward_input", "backward_weight"} <= kinds and "backward" not in kinds


def test_profiling_mode_times_stages_on_a_profiling_worker_and_matches_serial(on_ray, monkeypatch):
    """AutoStageOption(profile=True) on Ray: a profiling worker traces the step and times each
    candidate stage on its devices (the driver holds none), then stops before the step's mesh
    workers start."""
    on_ray(autopar.ClusterSpec.local(2))
    calls = _count_remote_calls(monkeypatch)
    option = autopar.AutoStageOption(profile=True, submesh_logical_shape_space="same_as_physical")
    method = autopar.PipeshardParallel(
        num_micro_batches=4, layer_option=autopar.AutoLayerOption(layer_num=2), stage_option=option
    )
    _, state, _, _ = parallel_steps(mlp, MLP, method, BATCH, 1)
    params = jax.tree.map(np.asarray, state.params)
    assert relative_error(params, serial_state(mlp, MLP, BATCH, 1).params) <= 1e-5
    assert calls.count("prepare_profiling") == 1
    # 2 layers: 3 layer ranges on meshes of 1 and 2 devices, equal structures timed once.
    assert 2 <= calls.count("measure_stage") <= 6


def test_profiling_mode_across_hosts_is_refused_on_ray(on_ray):
    on_ray(_two_hosts_of_two())
    option = autopar.AutoStageOption(profile=True)
    method = autopar.PipeshardParallel(
        num_micro_batches=2, layer_option=autopar.AutoLayerOption(layer_num=2), stage_option=option
    )
    with pytest.raises(autopar.InvalidArgumentError, match="2 hosts .* profile=False"):
        parallel_steps(mlp, MLP, method, BATCH, 1)


def _count_remote_calls(monkeypatch) -> list[str]:
    """The names of the actor methods the driver submits from now on, in order."""
    submitted: list[str] = []
    real_remote = ray.actor.ActorMethod._remote

    def counted(self, *args, **kwargs):
        submitted.append(self._method_name)
        return real_remote(self, *args, **kwargs)

    monkeypatch.setattr(ray.actor.ActorMethod, "_remote", counted)
    return submitted


def test_interleaved_1f1b_runs_two_stages_per_worker_and_matches_serial(on_ray, monkeypatch):
    """2 meshes x 2 virtual stages: one worker per mesh hosts stages s and s+2, one call each
    per step; the state stays on the worker of the stage that reads it."""
    on_ray(autopar.ClusterSpec.local(8))
    step, state, _, batch = parallel_steps(mlp, MLP, _pipeline(2, "interleaved_1f1b"), BATCH, 1)
    executable = step.get_executable(state, batch)
    assert executable.mesh_stages == [(0, 2), (1, 3)]
    assert [len(a) for a in executable.actors] == [1, 1]
    assert {x.stage for x in jax.tree.leaves(state.params)} == {0, 1, 2, 3}
    submitted = _count_remote_calls(monkeypatch)
    for _ in range(STEPS - 1):
        submitted.clear()
        state, _ = step(state, batch)
        assert submitted == ["step"] * 2
    monkeypatch.undo()
    params = jax.tree.map(np.asarray, state.params)
    assert relative_error(params, serial_state(mlp, MLP, BATCH, STEPS).params) <= 1e-5
    stages_run = {t.stage for t in executable.timeline()}
    assert stages_run == {0, 1, 2, 3}
    assert len(executable.memory_stats()) == 4  # per stage, from its mesh's worker


def test_four_stage_1f1b_runs_one_call_per_worker_and_moves_values_worker_to_worker(
    on_ray, monkeypatch
):
    on_ray(autopar.ClusterSpec.local(8))
    method = autopar.PipeshardParallel(
        num_micro_batches=16,
        layer_option=autopar.AutoLayerOption(layer_num=4),
        stage_option=autopar.UniformStageOption(4),
        pipeline_schedule="1f1b",
    )
    step, state, _, batch = parallel_steps(mlp, MLP, method, BATCH, 1)  # builds, compiles
    executable = step.get_executable(state, batch)
    assert [len(a) for a in executable.actors] == [1, 1, 1, 1]
    submitted = _count_remote_calls(monkeypatch)
    for _ in range(STEPS - 1):
        submitted.clear()
        state, metrics = step(state, batch)
        assert submitted == ["step"] * 4  # one call per worker, whatever the micro-batch count
        # Through the driver: the host batch only; activations and gradients went worker to
        # worker (16 micro-batches x 3 stage boundaries x 2 directions).
        assert executable.last_driver_bytes == sum(x.nbytes for x in jax.tree.leaves(batch))
        assert executable.last_worker_bytes > 0
    monkeypatch.undo()
    params = jax.tree.map(np.asarray, state.params)
    assert relative_error(params, serial_state(mlp, MLP, BATCH, STEPS).params) <= 1e-5
    tasks = [t for t in executable.timeline() if ".apply" not in t.segment]
    assert len(tasks) == STEPS * 4 * 16 * 2  # every forward and backward of every step
    # The workers' device clocks carry the schedule's dependencies: a stage's forward of a
    # micro-batch starts after the previous stage's ended, and its backward after the next's.
    done = {(t.step, t.stage, t.segment.split(".")[1], t.micro_batch): t for t in tasks}
    for (step_number, s, kind, j), task in done.items():
        before = (s - 1, "forward") if kind == "forward" else (s + 1, "backward")
        if (step_number, *before, j) in done:
            assert task.device_start >= done[step_number, *before, j].device_end
    assert len(_alive_actors()) == 4


def test_worker_logs_reach_the_driver_named_by_stage(on_ray, capfd):
    on_ray(autopar.ClusterSpec.local(8))
    logger = logging.getLogger("autopar")
    level = logger.level
    logger.setLevel(logging.INFO)  # the level workers log at is the driver's
    try:
        step = autopar.parallelize(mlp.make_train_step(autopar.value_and_grad), method=_pipeline())
        step(mlp.create_train_state(MLP, batch_size=2), mlp.make_batch(MLP, BATCH))
    finally:
        logger.setLevel(level)
    # Ray's log monitor forwards worker output in batches, and shows a line that differs
    # from another worker's only in its numbers once (RAY_DEDUP_LOGS): one stage's is enough.
    pattern = re.compile(r"MeshWorker\(stage \d, host 0\).*built with \d+ instruction")
    lines, deadline = "", time.monotonic() + 20
    while time.monotonic() < deadline and not pattern.search(lines):
        time.sleep(0.5)
        lines += capfd.readouterr().err
    assert pattern.search(lines)


def test_state_born_and_batch_presharded_on_the_workers_never_pass_the_driver(on_ray):
    on_ray(autopar.ClusterSpec.local(8))
    train_step = autopar.parallelize(
        mlp.make_train_step(autopar.value_and_grad), method=_pipeline()
    )
    batch = mlp.make_batch(MLP, BATCH)
    create = autopar.parallelize(
        functools.partial(mlp.create_train_state, MLP, batch_size=2),
        method=autopar.CreateStateParallel(train_step, batch),
    )
    state = create()
    leaves = jax.tree.leaves(state)
    assert all(isinstance(x, RemoteArray) for x in leaves)
    assert {x.stage for x in leaves} == {0, 1}  # each layer's parameters born on its stage
    initial = mlp.create_train_state(MLP, batch_size=2)
    assert relative_error(jax.tree.map(np.asarray, state), initial) == 0
    state, placed = train_step.preshard_dynamic_args(state, batch)
    assert [x.name for x in jax.tree.leaves(state)] == [x.name for x in leaves]  # already there
    assert all(isinstance(x, RemoteArray) for x in jax.tree.leaves(placed))
    executable = train_step.get_executable(state, batch)
    for _ in range(STEPS):
        state, _ = train_step(state, placed)
        assert executable.last_driver_bytes == 0
    serial = serial_state(mlp, MLP, BATCH, STEPS)
    assert relative_error(jax.tree.map(np.asarray, state.params), serial.params) <= 1e-5


def test_stage_mesh_spanning_two_workers_is_one_spmd_program(on_ray):
    on_ray(_two_hosts_of_two())
    config = GPTConfig(num_layers=2)
    step, state, _, batch = parallel_steps(gpt, config, autopar.ShardParallel(), BATCH, STEPS)
    plan = step.get_plan(state, batch)
    assert plan.stages[0].mesh.shape == (2, 2)  # (hosts, devices per host)
    executable = step.get_executable(state, batch)
    assert executable.hosts == [[0, 1]]  # one mesh, two worker processes
    params = jax.tree.map(np.asarray, state.params)
    serial = serial_state(gpt, config, BATCH, STEPS)
    assert relative_error(params, serial.params) <= 1e-5
    assert executable.collectives()["all-reduce"]  # gradients reduced across the processes

    # An eval step reads the train state where it lives: RemoteArrays of another executable.
    # (Defined here, so that it is pickled by value: the workers cannot import this module.)
    def _eval_loss(state, batch):
        logits = state.apply_fn({"params": state.params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    eval_step = autopar.parallelize(_eval_loss, method=autopar.FollowParallel(step))
    loss = eval_step(state, batch)
    assert relative_error(np.asarray(loss), jax.jit(_eval_loss)(serial, batch)) <= 1e-5


def test_killed_worker_names_its_stage_within_60s(on_ray):
    on_ray(autopar.ClusterSpec.local(8))
    step = autopar.parallelize(mlp.make_train_step(autopar.value_and_grad), method=_pipeline())
    state = mlp.create_train_state(MLP, batch_size=2)
    batch = mlp.make_batch(MLP, BATCH)
    errors = []

    def first_step():
        try:
            step(state, batch)
        except Exception as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    runner = threading.Thread(target=first_step)
    runner.start()
    while not step._executables and runner.is_alive():  # the workers are built: compiling now
        time.sleep(0.01)
    executable = next(iter(step._executables.values()))
    killed = time.monotonic()
    ray.kill(executable.actors[1][0])
    runner.join(timeout=90)
    assert not runner.is_alive()
    assert time.monotonic() - killed < 60
    assert len(errors) == 1 and isinstance(errors[0], StageFailedError)
    assert "stage 1 (host 0)" in str(errors[0]) and "worker died" in str(errors[0])
    with pytest.raises(autopar.RemoteError, match="cannot run: stage 1"):
        step(state, batch)


def test_step_over_its_timeout_is_an_error(on_ray):
    on_ray(autopar.ClusterSpec.local(8), step_timeout_s=0.2)
    step = autopar.parallelize(mlp.make_train_step(autopar.value_and_grad), method=_pipeline())
    state = mlp.create_train_state(MLP, batch_size=2)
    with pytest.raises(StepTimeoutError, match=r"step_timeout_s=0.2 s: stage \d \(host 0\)"):
        step(state, mlp.make_batch(MLP, BATCH))


def test_init_twice_and_bad_arguments(on_ray):
    with pytest.raises(autopar.InvalidArgumentError, match="step_timeout_s must be a positive"):
        autopar.init("ray", step_timeout_s=0)
    with pytest.raises(autopar.InvalidArgumentError, match="num_devices=3 differs"):
        autopar.init("ray", cluster_spec=autopar.ClusterSpec.local(8), num_devices=3)
    with pytest.raises(autopar.InvalidArgumentError, match="step_timeout_s=5 has no meaning"):
        autopar.init("local", step_timeout_s=5)
    on_ray(autopar.ClusterSpec.local(8))
    with pytest.raises(autopar.InvalidArgumentError, match="already called.*'ray'"):
        autopar.init("ray")
