"""What a weight gradient x^T·y costs on XLA:CPU by the width of its result: the evidence behind
`ClusterSpec.transposed_matmul_rate` (issue 20), on ONE real CPU device.

A weight gradient's lhs contracts its major dimension, which XLA:CPU leaves to Eigen; Eigen
packs that transposed lhs before it multiplies, a cost per lhs element that the result's
columns do not share. This times x^T·y for an lhs of (rows, `LHS_COLUMNS`) and rhs of (rows, N)
at several N and two row counts, each the least over `ROUNDS` rounds of `CALLS` back-to-back
calls of one jitted function, against the rate the roofline reads off the two widths that
`autopar.profile_cluster()` times (64 and 256 columns): R·N / (N + N½).

    python benchmarks/cpu_weight_gradients.py

Writes benchmarks/results/cpu_weight_gradients.{json,md}.
"""

from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from cost_model import one_cpu_device, save_results  # noqa: E402

ROUNDS, CALLS = 7, 10
LHS_COLUMNS = 256
ROWS = (4096, 16384)
COLUMNS = (16, 32, 48, 64, 96, 128, 192, 256, 512, 1024)


def _seconds(x, y) -> float:
    gradient = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((0,), (0,)), ((), ()))))
    jax.block_until_ready(gradient(x, y))
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            out = gradient(x, y)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / CALLS)
    return best


def main() -> None:
    if len(jax.devices()) != 1:
        raise SystemExit("run with ONE device (unset XLA_FLAGS device counts)")
    from autopar.planner.cluster import TRANSPOSED_MATMUL_COLUMNS, ClusterSpec
    from autopar.runtime.microbench import ProfileSizes, measure_transposed_matmul

    one = jax.devices()[:1]
    profile = {
        "transposed_matmul_flops": measure_transposed_matmul(one, ProfileSizes()).rate,
        "narrow_transposed_matmul_flops": measure_transposed_matmul(
            one, ProfileSizes(), TRANSPOSED_MATMUL_COLUMNS[0]
        ).rate,
    }
    spec = dataclasses.replace(ClusterSpec.local(1), **profile)
    rows = []
    for n in COLUMNS:
        row = {"columns": n, "law_gflops": spec.transposed_matmul_rate(n) / 1e9}
        for rows_ in ROWS:
            x = jnp.full((rows_, LHS_COLUMNS), 0.5, jnp.float32)
            y = jnp.full((rows_, n), 0.5, jnp.float32)
            row[f"gflops_{rows_}_rows"] = 2 * rows_ * LHS_COLUMNS * n / _seconds(x, y) / 1e9
        rows.append(row)
        measured = " ".join(f"{row[f'gflops_{r}_rows']:6.1f}" for r in ROWS)
        print(f"{n:5} columns: {measured} GFLOP/s, law {row['law_gflops']:6.1f}", flush=True)
    data = {
        "device": one_cpu_device(),
        "profile": profile,
        "rows": rows,
    }
    lines = [
        "# Weight gradients on XLA:CPU by the width of their result",
        "",
        f"`python benchmarks/cpu_weight_gradients.py` on {data['device']}: x^T·y with x of",
        f"(rows, {LHS_COLUMNS}) and y of (rows, columns), the least over {ROUNDS} rounds of "
        f"{CALLS} calls. `profile_cluster()` measured here: "
        f"{profile['transposed_matmul_flops'] / 1e9:.1f} GFLOP/s at 256 columns and "
        f"{profile['narrow_transposed_matmul_flops'] / 1e9:.1f} at 64 (x of 256 columns);",
        "the `law` column is the rate the roofline reads off them",
        "(`ClusterSpec.transposed_matmul_rate`).",
        "",
        "| columns | " + " | ".join(f"GFLOP/s, {r} rows" for r in ROWS) + " | law GFLOP/s |",
        "|---:|" + "---:|" * (len(ROWS) + 1),
    ]
    for row in rows:
        measured = " | ".join(f"{row[f'gflops_{r}_rows']:.1f}" for r in ROWS)
        lines.append(f"| {row['columns']} | {measured} | {row['law_gflops']:.1f} |")
    save_results("cpu_weight_gradients", data, lines)


if __name__ == "__main__":
    main()
