"""Benchmark: per-device memory of DataParallel / ZeRO-2 / ZeRO-3 on the GPT example (8 simulated
devices, XLA's compiled memory analysis), and the per-step overhead of `@autopar.parallelize` on
one device versus plain `jax.jit` (median of alternating steps), on the GPT example and on a
host-bound step of many small buffers, where each call's dispatch is what is measured.

    python benchmarks/methods.py [--steps 30]

Writes benchmarks/results/methods.json and methods.md.
"""

import argparse
import json
import pathlib
import statistics
import time

import autopar

autopar.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

from autopar.models import GPTConfig, gpt  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
METHODS = {
    "DataParallel": autopar.DataParallel,
    "Zero2": autopar.Zero2Parallel,
    "Zero3": autopar.Zero3Parallel,
}
MiB = 2**20


def memory_table(config: GPTConfig, batch_size: int) -> list[dict]:
    state, batch = gpt.create_train_state(config), gpt.make_batch(config, batch_size)
    rows = []
    for name, method in tqdm(METHODS.items(), desc="memory"):
        step = autopar.parallelize(gpt.make_train_step(autopar.value_and_grad), method=method())
        exe = step.get_executable(state, batch)
        mem = exe.memory_stats()
        rows.append(
            {
                "method": name,
                "argument_mib": mem.argument_bytes / MiB,
                "temp_mib": mem.temp_bytes / MiB,
                "peak_mib": mem.peak_bytes / MiB,
                "predicted_mib": exe.plan.predicted.memory_per_device_bytes / MiB,
                "collectives": {k: len(v) for k, v in exe.collectives().items() if v},
            }
        )
    return rows


def _alternated(steps_by_name: dict, states: dict, batch, steps: int) -> dict[str, float]:
    """Median seconds of each step, their steps timed alternately so machine noise hits all."""
    times: dict[str, list[float]] = {name: [] for name in steps_by_name}
    for i in tqdm(range(steps + 2), desc="overhead"):
        for name, step in steps_by_name.items():
            start = time.perf_counter()
            states[name], metrics = step(states[name], batch)
            jax.block_until_ready((states[name], metrics))
            if i >= 2:  # the first two calls compile and warm up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def overhead(config: GPTConfig, batch_size: int, steps: int) -> dict:
    """Median step time of `jax.jit` and `@autopar.parallelize` (no `autopar.init`: the
    defaults) on one device."""
    device = jax.devices()[0]
    batch = jax.device_put(gpt.make_batch(config, batch_size), device)
    steps_by_name = {
        "jax_jit": jax.jit(gpt.make_train_step(jax.value_and_grad), donate_argnums=0),
        "autopar": autopar.parallelize(
            gpt.make_train_step(autopar.value_and_grad),
            method=autopar.DataParallel(devices=[device]),
        ),
    }
    states = {name: gpt.create_train_state(config) for name in steps_by_name}
    medians = _alternated(steps_by_name, states, batch, steps)
    plain, ours = medians["jax_jit"], medians["autopar"]
    return {"jax_jit_ms": plain * 1e3, "autopar_ms": ours * 1e3, "ratio": ours / plain}


def host_bound_overhead(layers: int, steps: int) -> dict:
    """The same on a step whose device work is nothing: `layers` 4x4 dense layers trained with
    Adam (3 buffers per weight and bias in the state), where each call's dispatch is the step."""
    device = jax.devices()[0]
    tx = optax.adam(1e-3)

    def loss(params, x):
        for layer in params:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return jnp.sum(x)

    def make_step(grad):
        def step(state, x):
            params, opt = state
            updates, opt = tx.update(grad(loss)(params, x), opt, params)
            return (optax.apply_updates(params, updates), opt), None

        return step

    def fresh_state():
        params = [{"w": jnp.full((4, 4), 0.1), "b": jnp.zeros(4)} for _ in range(layers)]
        return jax.device_put((params, tx.init(params)), device)

    steps_by_name = {
        "jax_jit": jax.jit(make_step(jax.grad), donate_argnums=0),
        "autopar": autopar.parallelize(
            make_step(autopar.grad), method=autopar.DataParallel(devices=[device])
        ),
    }
    states = {name: fresh_state() for name in steps_by_name}
    batch = jax.device_put(jnp.ones((8, 4)), device)
    medians = _alternated(steps_by_name, states, batch, steps)
    plain, ours = medians["jax_jit"], medians["autopar"]
    return {
        "layers": layers,
        "state_buffers": len(jax.tree.leaves(states["jax_jit"])),
        "jax_jit_ms": plain * 1e3,
        "autopar_ms": ours * 1e3,
        "ratio": ours / plain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    config, batch_size = GPTConfig(hidden=128, num_layers=2, vocab_size=512), 16
    rows = memory_table(config, batch_size)
    over = overhead(config, batch_size, args.steps)
    host_bound = host_bound_overhead(16, 10 * args.steps)
    result = {
        "model": {
            "hidden": 128,
            "layers": 2,
            "vocab": 512,
            "seq": config.seq_len,
            "params": gpt.param_count(config),
            "batch": batch_size,
        },
        "devices": 8,
        "memory": rows,
        "overhead_1_device": over,
        "host_bound_overhead_1_device": host_bound,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "methods.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Methods on the GPT example ({result['model']['params']:,} params, batch {batch_size}, "
        "8 simulated CPU devices)",
        "",
        "| method | argument MiB | temp MiB | peak MiB | predicted MiB | collectives |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['argument_mib']:.3f} | {r['temp_mib']:.3f} | "
            f"{r['peak_mib']:.3f} | {r['predicted_mib']:.3f} | {r['collectives']} |"
        )
    lines += [
        "",
        f"## `@autopar.parallelize` on 1 device vs `jax.jit` (medians of {args.steps} and "
        f"{10 * args.steps} alternated steps)",
        "",
        "| step | jax.jit ms | autopar ms | ratio |",
        "|---|---|---|---|",
        f"| the GPT example | {over['jax_jit_ms']:.3f} | {over['autopar_ms']:.3f} | "
        f"{over['ratio']:.3f} |",
        f"| {host_bound['layers']} layers of 4x4 with Adam ({host_bound['state_buffers']} state "
        f"buffers; host-bound) | {host_bound['jax_jit_ms']:.3f} | "
        f"{host_bound['autopar_ms']:.3f} | {host_bound['ratio']:.3f} |",
    ]
    table = "\n".join(lines)
    (RESULTS / "methods.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
