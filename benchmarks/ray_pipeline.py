"""Benchmark: the Ray runtime's driver overhead and the pipeline bubble it achieves.

The same GPT pipeline plan (2 or 4 stages of 1x(8/S) simulated CPU devices, M micro-batches,
1F1B) runs on the local executor and on Ray mesh workers (one actor per stage). Per case:

* step time (median after warm-up) of both, and the driver's per-micro-batch overhead on Ray:
  (Ray step - local step) / M, plus the time the driver spends submitting calls per micro-batch;
* the bubble fraction measured on Ray from the workers' task timeline (1 - busy time of a stage /
  span of the step's compute tasks, averaged over stages; apply excluded) next to the schedule's
  (S-1)/(M+S-1).

On this 2-core machine the stages' actors share two cores, so stages cannot all compute at once:
the measured bubble is an upper bound set by the machine, not by the schedule.

    python benchmarks/ray_pipeline.py [--steps 5] [--micro-batches 8]

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

RESULTS = pathlib.Path(__file__).parent / "results"
CONFIG = GPTConfig(num_layers=4, hidden=128, seq_len=64)


def _method(stages: int, micro_batches: int) -> autopar.PipeshardParallel:
    return autopar.PipeshardParallel(
        num_micro_batches=micro_batches,
        layer_option=autopar.AutoLayerOption(layer_num=4),
        stage_option=autopar.UniformStageOption(stages),
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


def _bubble(tasks, since: float, stages: int) -> float:
    compute = [t for t in tasks if t[3] >= since and ".apply" not in t[1]]
    span = max(t[4] for t in compute) - min(t[3] for t in compute)
    busy = [sum(t[4] - t[3] for t in compute if t[0] == s) for s in range(stages)]
    return 1 - statistics.mean(busy) / span


def run_case(stages: int, micro_batches: int, steps: int) -> dict:
    batch = gpt.make_batch(CONFIG, 8 * micro_batches)
    train_step = gpt.make_train_step(autopar.value_and_grad)

    local = autopar.parallelize(train_step, method=_method(stages, micro_batches))
    local_times = _local_step_times(local, gpt.create_train_state(CONFIG), batch, steps)

    autopar.init("ray", cluster_spec=autopar.ClusterSpec.local(8))
    try:
        remote = autopar.parallelize(train_step, method=_method(stages, micro_batches))
        state = gpt.create_train_state(CONFIG)
        state, _ = remote(state, batch)
        executable = remote.get_executable(state, batch)
        ray_times, dispatch, bubbles = [], [], []
        for _ in range(steps):
            start = time.perf_counter()
            state, _ = remote(state, batch)
            ray_times.append(time.perf_counter() - start)
            dispatch.append(executable.last_dispatch_s)
            bubbles.append(_bubble(executable.timeline(), start, stages))
    finally:
        autopar.shutdown()
    local_s, ray_s = statistics.median(local_times), statistics.median(ray_times)
    return {
        "stages": stages,
        "micro_batches": micro_batches,
        "local_step_s": local_s,
        "ray_step_s": ray_s,
        "overhead_per_micro_batch_ms": (ray_s - local_s) / micro_batches * 1e3,
        "dispatch_per_micro_batch_ms": statistics.median(dispatch) / micro_batches * 1e3,
        "bubble_measured": statistics.median(bubbles),
        "bubble_schedule": (stages - 1) / (micro_batches + stages - 1),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| stages | micro-batches | local step (s) | Ray step (s) | Ray overhead / micro-batch "
        "(ms) | driver dispatch / micro-batch (ms) | bubble measured | bubble (S-1)/(M+S-1) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stages']} | {r['micro_batches']} | {r['local_step_s']:.3f} | "
            f"{r['ray_step_s']:.3f} | {r['overhead_per_micro_batch_ms']:.1f} | "
            f"{r['dispatch_per_micro_batch_ms']:.2f} | {r['bubble_measured']:.2f} | "
            f"{r['bubble_schedule']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = [
            run_case(stages, args.micro_batches, args.steps)
            for stages in tqdm((2, 4), desc="pipelines")
        ]
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
        "# Ray runtime: driver overhead and pipeline bubble\n\n"
        f"GPT {CONFIG.num_layers} layers, hidden {CONFIG.hidden}, seq {CONFIG.seq_len}, "
        f"batch 8 per micro-batch, 1F1B; median of {args.steps} steps; "
        "`python benchmarks/ray_pipeline.py`.\n"
        "The stages' actors share this machine's 2 CPU cores.\n\n" + table + "\n"
    )


if __name__ == "__main__":
    main()
