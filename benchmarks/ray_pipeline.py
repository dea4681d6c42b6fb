"""Benchmark: the Ray runtime's overhead and the pipeline bubble it achieves.

The same GPT pipeline plan (S meshes of 1x(8/S) simulated CPU devices, M micro-batches, 1F1B, or
interleaved 1F1B with two layer chunks per mesh) runs on the local executor and on Ray mesh
workers (one actor per mesh, one call per worker per step, activations and gradients worker to
worker). Per case, medians over the timed steps:

* wall step time of both, and (Ray - local) / M: the end-to-end overhead per micro-batch. On this
  2-core machine S worker processes share two cores, so wall time also counts the other workers'
  compute; it is an upper bound set by the machine. Also the slowest timed Ray step: a pause
  that hits one step in several (a worker's garbage collection) leaves the median alone.
* the driver's time submitting a step, per micro-batch; the bytes the driver puts in a step
  beyond the batch it is given (target 0) and the bytes the workers send each other.
* the workers' own timelines in device time (`ray_worker.DeviceClock`: each worker's CPU time,
  moved forward to a value's send time when it waits for it), which share of cores does not
  stretch:
  - the step's device span, and the span of the same schedule replayed with the same task
    durations and free, instant transfers (`_replay`); their difference / M is the runtime's own
    cost per micro-batch on the critical path (transfers, placing inputs, freeing, dispatch);
  - the bubble, 1 - (mean busy time of a mesh / span of the forward and backward tasks),
    measured, replayed (what the schedule gives these stage times), and (S-1)/(vM+S-1) (what it
    gives equal stages, v chunks per mesh).

    python benchmarks/ray_pipeline.py [--steps 5]

Writes benchmarks/results/ray_pipeline.json and ray_pipeline.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import autopar

autopar.simulate_cpu_devices(8)

import jax  # noqa: E402
import ray  # noqa: E402
from tqdm import tqdm  # noqa: E402

from autopar.models import GPTConfig, gpt  # noqa: E402
from autopar.planner.schedules import Schedule, TaskKind  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
CONFIG = GPTConfig(num_layers=4, hidden=128, seq_len=64)
# (meshes, schedule, micro-batches)
CASES = (
    (2, "1f1b", 8),
    (2, "1f1b", 16),
    (4, "1f1b", 8),
    (4, "1f1b", 16),
    (2, "interleaved_1f1b", 8),
    (2, "interleaved_1f1b", 16),
)


def _method(meshes: int, schedule: str, micro_batches: int) -> autopar.PipeshardParallel:
    return autopar.PipeshardParallel(
        num_micro_batches=micro_batches,
        layer_option=autopar.AutoLayerOption(layer_num=4),
        stage_option=autopar.UniformStageOption(meshes),
        pipeline_schedule=schedule,
    )


def _local_step_times(step, state, batch, steps: int) -> list[float]:
    state, _ = step(state, batch)  # compile
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return times


def _kind(task) -> TaskKind:
    return TaskKind(task.segment.split(".")[1].rstrip("0123456789"))


def _bubble(busy: dict[int, float], span: float) -> float:
    return 1 - statistics.mean(busy.values()) / span


def _replay(schedule: Schedule, durations: dict[tuple, float]) -> tuple[float, float]:
    """(Step span, bubble) of `schedule` with each task taking its measured device time and
    transfers free (`Schedule.timed`); each mesh applies after its last gradient task."""
    times = schedule.timed(lambda t: durations[t.stage, t.kind, t.micro_batch])
    mesh = schedule.mesh_of
    done = [0.0] * schedule.num_meshes
    for task, (_, end) in times.items():
        done[mesh(task.stage)] = max(done[mesh(task.stage)], end)
    applies = [0.0] * schedule.num_meshes
    busy = dict.fromkeys(range(schedule.num_meshes), 0.0)
    for (s, kind, _), d in durations.items():
        if kind is TaskKind.APPLY:
            applies[mesh(s)] += d
        else:
            busy[mesh(s)] += d
    span = max(d + a for d, a in zip(done, applies, strict=True))
    return span, _bubble(busy, max(done))


def _device_figures(tasks, schedule: Schedule) -> dict[str, float]:
    """One step's device-time figures from its task timeline (module docstring)."""
    durations: dict[tuple, float] = {}
    for t in tasks:
        key = (t.stage, _kind(t), t.micro_batch)
        durations[key] = durations.get(key, 0.0) + t.device_end - t.device_start
    compute = [t for t in tasks if _kind(t) is not TaskKind.APPLY]
    compute_span = max(t.device_end for t in compute) - min(t.device_start for t in compute)
    busy = dict.fromkeys(range(schedule.num_meshes), 0.0)
    for t in compute:
        busy[schedule.mesh_of(t.stage)] += t.device_end - t.device_start
    ideal_span, ideal_bubble = _replay(schedule, durations)
    return {
        "device_span_s": max(t.device_end for t in tasks),
        "ideal_span_s": ideal_span,
        "bubble_measured": _bubble(busy, compute_span),
        "bubble_replayed": ideal_bubble,
    }


def run_case(meshes: int, schedule: str, micro_batches: int, steps: int) -> dict:
    batch = gpt.make_batch(CONFIG, 8 * micro_batches)
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch))
    train_step = gpt.make_train_step(autopar.value_and_grad)

    method = _method(meshes, schedule, micro_batches)
    local = autopar.parallelize(train_step, method=method)
    local_times = _local_step_times(local, gpt.create_train_state(CONFIG), batch, steps)

    autopar.init("ray", cluster_spec=autopar.ClusterSpec.local(8))
    try:
        remote = autopar.parallelize(train_step, method=method)
        state = gpt.create_train_state(CONFIG)
        state, _ = remote(state, batch)
        executable = remote.get_executable(state, batch)
        wall, dispatch, driver, sent, device = [], [], [], [], []
        for _ in range(steps):
            start = time.perf_counter()
            state, _ = remote(state, batch)
            wall.append(time.perf_counter() - start)
            dispatch.append(executable.last_dispatch_s)
            driver.append(executable.last_driver_bytes - batch_bytes)
            sent.append(executable.last_worker_bytes)
        timeline = executable.timeline()
        for step in sorted({t.step for t in timeline})[1:]:  # the first step compiled
            tasks = [t for t in timeline if t.step == step]
            device.append(_device_figures(tasks, executable.schedule))
    finally:
        autopar.shutdown()
    local_s, ray_s = statistics.median(local_times), statistics.median(wall)
    figures = {k: statistics.median(d[k] for d in device) for k in device[0]}
    runtime_s = figures["device_span_s"] - figures["ideal_span_s"]
    per_mesh = executable.schedule.stages_per_mesh
    return {
        "meshes": meshes,
        "schedule": schedule,
        "stages_per_mesh": per_mesh,
        "micro_batches": micro_batches,
        "local_step_s": local_s,
        "ray_step_s": ray_s,
        "slowest_ray_step_s": max(wall),
        "wall_overhead_per_micro_batch_ms": (ray_s - local_s) / micro_batches * 1e3,
        "dispatch_per_micro_batch_ms": statistics.median(dispatch) / micro_batches * 1e3,
        "remote_calls_per_step": sum(len(a) for a in executable.actors),
        "driver_bytes_beyond_batch": max(driver),
        "worker_bytes_per_step": statistics.median(sent),
        **figures,
        "runtime_per_micro_batch_ms": runtime_s / micro_batches * 1e3,
        "bubble_schedule": (meshes - 1) / (per_mesh * micro_batches + meshes - 1),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| meshes | schedule | micro-batches | local step (s) | Ray step (s) | slowest Ray step "
        "(s) | wall overhead / mb (ms) | driver dispatch / mb (ms) | calls / step | driver bytes "
        "beyond batch | worker bytes / step | device span (s) | replayed span (s) | runtime / mb, "
        "device (ms) | bubble measured | bubble replayed | (S-1)/(vM+S-1) |",
        "|" + "---|" * 17,
    ]
    for r in rows:
        lines.append(
            f"| {r['meshes']} | {r['schedule']} | {r['micro_batches']} | {r['local_step_s']:.3f} | "
            f"{r['ray_step_s']:.3f} | {r['slowest_ray_step_s']:.3f} | "
            f"{r['wall_overhead_per_micro_batch_ms']:.1f} | "
            f"{r['dispatch_per_micro_batch_ms']:.2f} | {r['remote_calls_per_step']} | "
            f"{r['driver_bytes_beyond_batch']} | {r['worker_bytes_per_step'] / 2**20:.1f} MiB | "
            f"{r['device_span_s']:.3f} | {r['ideal_span_s']:.3f} | "
            f"{r['runtime_per_micro_batch_ms']:.2f} | {r['bubble_measured']:.2f} | "
            f"{r['bubble_replayed']:.2f} | {r['bubble_schedule']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = [run_case(*case, args.steps) for case in tqdm(CASES, desc="pipelines")]
    finally:
        ray.shutdown()
    table = markdown(rows)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "model": repr(CONFIG),
        "steps": args.steps,
        "machine": "2 CPU cores, 8 simulated devices",
    }
    (RESULTS / "ray_pipeline.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (RESULTS / "ray_pipeline.md").write_text(
        "# Ray runtime: overhead and pipeline bubble\n\n"
        f"GPT {CONFIG.num_layers} layers, hidden {CONFIG.hidden}, seq {CONFIG.seq_len}, "
        f"batch 8 per micro-batch (mb); median of {args.steps} steps; "
        "`make bench-ray` (`benchmarks/ray_pipeline.py`, whose docstring defines each column).\n"
        "The stages' worker processes share this machine's 2 CPU cores: wall figures count the "
        "other workers' compute; device figures come from each worker's own clock.\n\n"
        + table
        + "\n"
    )


if __name__ == "__main__":
    main()
