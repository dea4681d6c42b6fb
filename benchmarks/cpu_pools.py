"""What max pools and their gradients cost on XLA:CPU: the evidence behind
`ClusterSpec.window_reduction_rate`, `select_and_scatter_rate` and
`cached_select_and_scatter_rate` (issue 20), on ONE real CPU device.

XLA:CPU runs a reduce-window as a scalar loop over each output's window, and expands max
pooling's gradient (`select_and_scatter_add`) into an int32 iota of the operand's shape per
dimension, a reduce-window over the operand and the iotas that picks each window's maximum and
its index, and a scatter of the gradient there. This times both over windows of 2x2 and 3x3, of
stride 1 and 2, on operands from 0.5 to 6 MiB, each the least over `ROUNDS` rounds of
`CALLS` back-to-back calls of one jitted step x -> x + pool'(x) (the gradient, added to x so
that a step keeps x's shape and its values spread) or, at stride 1, x -> pool(x); and prints
the time per window element (a pool) and per window (a gradient: one per element of the
pooled result), with what `autopar.profile_cluster()` measures and what the roofline prices
for each gradient (`ClusterSpec.select_and_scatter_rate_at` its operand's bytes):

    python benchmarks/cpu_pools.py

Writes benchmarks/results/cpu_pools.{json,md}.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from cost_model import one_cpu_device, save_results  # noqa: E402

ROUNDS, CALLS = 5, 10
# (window, stride, padding): a ResNet's pool, a VGG's, and one that keeps its operand's shape
WINDOWS = [
    (3, 2, ((0, 0), (1, 1), (1, 1), (0, 0))),
    (2, 2, "VALID"),
    (3, 1, "SAME"),
]
# NHWC operands: 0.5, 1, 1, 4, 4 and 6 MiB of float32
SHAPES = [
    (32, 16, 16, 16),
    (16, 32, 32, 16),
    (4, 32, 32, 64),
    (16, 32, 32, 64),
    (64, 32, 32, 16),
    (8, 56, 56, 64),
]


def _pool(window: int, stride: int, padding):
    def pool(x):
        dims, strides = (1, window, window, 1), (1, stride, stride, 1)
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, strides, padding)

    return pool


def _seconds(step, x, *consts) -> float:
    """Least time per call over `ROUNDS` rounds of `CALLS` chained calls x = step(x, ...)."""
    compiled = jax.jit(step)
    jax.block_until_ready(compiled(x, *consts))
    best = math.inf
    for _ in range(ROUNDS):
        y = x
        start = time.perf_counter()
        for _ in range(CALLS):
            y = compiled(y, *consts)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - start) / CALLS)
    return best


def _row(window: int, stride: int, padding, shape) -> dict:
    pool = _pool(window, stride, padding)
    x = jax.random.uniform(jax.random.key(0), shape)
    pooled = jax.eval_shape(pool, x)
    gradient = jnp.ones(pooled.shape, pooled.dtype)
    windows = math.prod(pooled.shape)
    row = {
        "window": f"{window}x{window}",
        "stride": stride,
        "shape": list(shape),
        "operand_mib": x.nbytes / 2**20,
        "windows": windows,
        "gradient_ms": 1e3 * _seconds(lambda x, g: x + jax.vjp(pool, x)[1](g)[0], x, gradient),
    }
    row["gradient_ns_per_window"] = 1e6 * row["gradient_ms"] / windows
    if stride == 1:  # the pool keeps its operand's shape: chainable
        row["pool_ms"] = 1e3 * _seconds(pool, x)
        row["pool_ns_per_window_element"] = 1e6 * row["pool_ms"] / (windows * window * window)
    return row


def main() -> None:
    if len(jax.devices()) != 1:
        raise SystemExit("run with ONE device (unset XLA_FLAGS device counts)")
    from autopar.planner.cluster import ClusterSpec
    from autopar.runtime.microbench import (
        ProfileSizes,
        measure_select_and_scatter,
        measure_window_reduction,
    )

    rows = []
    for window, stride, padding in WINDOWS:
        for shape in SHAPES:
            rows.append(_row(window, stride, padding, shape))
            r = rows[-1]
            pool = f", pool {r['pool_ns_per_window_element']:.2f} ns/element" if stride == 1 else ""
            print(
                f"{r['window']} s{stride} {shape} ({r['operand_mib']:.1f} MiB): gradient "
                f"{r['gradient_ms']:.2f} ms, {r['gradient_ns_per_window']:.1f} ns/window{pool}",
                flush=True,
            )
    one = jax.devices()[:1]
    profile = {
        "window_reduction_rate": measure_window_reduction(one, ProfileSizes()).rate,
        "select_and_scatter_rate": measure_select_and_scatter(one, ProfileSizes()).rate,
        "cached_select_and_scatter_rate": measure_select_and_scatter(
            one, ProfileSizes(), cached=True
        ).rate,
    }
    spec = dataclasses.replace(ClusterSpec.local(1), **profile)
    for r in rows:
        rate = spec.select_and_scatter_rate_at(r["operand_mib"] * 2**20)
        r["priced_ns_per_window"] = 1e9 / rate
    data = {
        "device": one_cpu_device(),
        "profile": profile,
        "rows": rows,
    }
    lines = [
        "# Max pools and their gradients on XLA:CPU",
        "",
        f"`python benchmarks/cpu_pools.py` on {data['device']}: the least over {ROUNDS} rounds",
        f"of {CALLS} chained calls of each jitted step. `profile_cluster()` measured here: max",
        f"pools at {profile['window_reduction_rate'] / 1e9:.2f} G window elements/s "
        f"({1e9 / profile['window_reduction_rate']:.2f} ns each), their gradients at "
        f"{profile['select_and_scatter_rate'] / 1e6:.1f} M windows/s over 4 MiB "
        f"({1e9 / profile['select_and_scatter_rate']:.1f} ns each) and "
        f"{profile['cached_select_and_scatter_rate'] / 1e6:.1f} M windows/s over 512 KiB "
        f"({1e9 / profile['cached_select_and_scatter_rate']:.1f} ns each); the roofline prices",
        "a gradient between the two in log bytes (the `priced` column).",
        "",
        "| window | stride | operand | MiB | windows | gradient ms | ns / window | "
        "priced ns / window | pool ns / window element |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        pool = f"{r['pool_ns_per_window_element']:.2f}" if "pool_ms" in r else "–"
        lines.append(
            f"| {r['window']} | {r['stride']} | {r['shape']} | {r['operand_mib']:.1f} | "
            f"{r['windows']} | {r['gradient_ms']:.2f} | {r['gradient_ns_per_window']:.1f} | "
            f"{r['priced_ns_per_window']:.1f} | {pool} |"
        )
    save_results("cpu_pools", data, lines)


if __name__ == "__main__":
    main()
