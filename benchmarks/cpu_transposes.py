"""What a transposing element-wise kernel costs on XLA:CPU: the evidence behind how
`make bench-costmodel` prices MoE (issue 20), on ONE real CPU device.

The roofline prices a transpose that moves the minor dimension, and a layout copy, at one rate:
`ClusterSpec.transpose_bandwidth`, which `autopar.profile_cluster()` measures as back-to-back
swaps of 512x512 planes filling a 64 MiB buffer; except a copy that XLA fuses an element-wise
loop into at a row stride that aliases in the caches, priced by the loop's lines in flight
(`ClusterSpec.aliased_loop_s_at`). This times the cases those rates stand for, each the least of
`REPEATS` waited calls of one jitted function:

* the same transpose over 8 MiB (its result reuses the allocator's memory) and over 64 MiB (its
  result is mapped afresh every call, as the profile's is: glibc maps buffers from 32 MiB);
* the transposes of the MoE expert layer's activations, [4, 16, 32, 1024] -> [4, 1024, 16, 32]
  (read with a 4 KiB stride), with what XLA fuses into them: arrays only (x * z), a broadcast
  constant (x * 0.5, (1 + z) * x), and the GELU-gradient-like chain of the MoE step's slowest
  kernel;
* each of those element-wise chains without the transpose, streaming.

GB/s counts the bytes of every array read and of the result written.

Then the step of the MoE expert layer alone (the zoo MoE's shapes: 4 experts, 16 groups of 32
tokens, 128 -> 1024 -> 128; both einsums, their gradients and an SGD update) with each of four
activations, planned by `autopar.plan` with the `ClusterSpec` that `autopar.profile_cluster()`
measures here, predicted against measured (the median of `STEPS` steps, the least over
`ROUNDS`): where XLA fuses the activation's chain into the expert activations' layout copies.

Last, those transposing kernels alone, read off a profile of the expert step (`jax.profiler`,
the least of `STEPS` steps): their time per element and per array they read at expert widths
of 1000, 1024 and 2048 and 16, 31 or 32 tokens of capacity. Where the row stride (the width in
bytes) is a multiple of 4 KiB, the rows one output row reads all fall in the same cache sets,
and the time per element and array grows with the lines in flight: rows walked (groups x
capacity) x arrays read. A line a + b x lines is fitted to those rows. Each row also says how
much of the kernel's time another kernel ran beside it: XLA:CPU runs independent kernels side by
side, and then a kernel's time in a trace is not its own (a control of six matmuls shows it).

    python benchmarks/cpu_transposes.py

Writes benchmarks/results/cpu_transposes.{json,md}.
"""

from __future__ import annotations

import math
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from cost_model import kernel_times, one_cpu_device, save_results  # noqa: E402

REPEATS = 20
STEPS, ROUNDS = 15, 3
MOE = (4, 16, 32, 1024)  # (experts, groups, capacity, ffn) of the cost-model zoo's MoE
TO_FFN_MAJOR = (0, 3, 1, 2)


def _gelu_gradient_like(x, z, w):
    """Three arrays and broadcast constants, as the MoE step's slowest kernel reads."""
    return (w * (0.5 * (1 + x)) + 0.797 * (z * w * 0.5 * (1 - x) * x)) * (3 * z * z)


# (name, arrays it reads, the element-wise chain)
CHAINS = [
    ("x (a copy)", 1, lambda x, z, w: x),
    ("x * z", 2, lambda x, z, w: x * z),
    ("x * 0.5", 1, lambda x, z, w: x * 0.5),
    ("(1 + z) * x", 2, lambda x, z, w: (1 + z) * x),
    ("GELU-gradient-like, 3 arrays", 3, _gelu_gradient_like),
]


def _transposed(chain):
    return lambda x, z, w: jnp.transpose(chain(x, z, w), TO_FFN_MAJOR)


def _seconds(fun, *args) -> float:
    jitted = jax.jit(fun)
    jax.block_until_ready(jitted(*args))
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _row(case: str, shape, arrays: int, fun) -> dict:
    args = [jnp.full(shape, 0.5 + 0.1 * i, jnp.float32) for i in range(3)]
    seconds = _seconds(fun, *args)
    array_bytes = 4 * math.prod(shape)
    return {
        "case": case,
        "shape": list(shape),
        "arrays_read": arrays,
        "mib_per_array": array_bytes / 2**20,
        "ms": seconds * 1e3,
        "gb_per_s": array_bytes * (arrays + 1) / seconds / 1e9,
    }


ACTIVATIONS = {
    "identity": lambda h: h,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "gelu": jax.nn.gelu,  # the zoo's
}
# (activation, ffn width): each activation at the zoo's 1024, and GELU at widths around it
# (the expert activations' stride is ffn x 4 bytes; XLA places the step's 8 MiB temporaries at
# multiples of 8 MiB in one block, so at 1024 the arrays a transposing loop reads alias)
EXPERT_CASES = [*((name, MOE[-1]) for name in ACTIVATIONS), ("gelu", 1000), ("gelu", 1048)]


def _expert_step(activation):
    """An SGD step of the MoE expert layer, `egcm,emh->egch`, the activation, `egch,ehm->gecm`."""

    def loss(params, x):
        h = activation(jnp.einsum("egcm,emh->egch", x, params["wi"]))
        out = jnp.einsum("egch,ehm->gecm", h, params["wo"])
        return jnp.mean(out * out)

    def step(params, x):
        loss_value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss_value

    return step


def _measured_s(step, params, x) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            params, loss = step(params, x)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
        best = min(best, sorted(times)[len(times) // 2])
    return best


def expert_layer_rows() -> list[dict]:
    """The expert layer's step for each of `EXPERT_CASES`: predicted and measured ms."""
    import autopar

    experts, groups, capacity, _ = MOE
    model = 128
    spec = autopar.profile_cluster()
    x = jnp.full((experts, groups, capacity, model), 0.5, jnp.float32)
    rows = []
    autopar.init("local", cluster_spec=spec)
    try:
        for name, ffn in EXPERT_CASES:
            params = {  # a step donates them: each case starts from its own
                "wi": jnp.full((experts, model, ffn), 0.01, jnp.float32),
                "wo": jnp.full((experts, ffn, model), 0.01, jnp.float32),
            }
            parallel = autopar.parallelize(_expert_step(ACTIVATIONS[name]))
            predicted = parallel.get_plan(params, x).predicted.step_time_s
            measured = _measured_s(parallel, params, x)
            rows.append(
                {
                    "activation": name,
                    "ffn": ffn,
                    "predicted_ms": predicted * 1e3,
                    "measured_ms": measured * 1e3,
                    "ratio": predicted / measured,
                }
            )
    finally:
        autopar.shutdown()
    return rows


# (activation, ffn, capacity) of the kernel rows: strides of 4000, 4096 and 8192 bytes, and
# a capacity of 31 (arrays of 7.75 MiB: XLA's temporaries no longer lie at multiples of 8 MiB)
KERNEL_CASES = [
    *(
        (name, ffn, capacity)
        for name in ("identity", "relu", "gelu")
        for ffn in (1000, 1024, 2048)
        for capacity in (16, 32)
    ),
    ("gelu", 1024, 31),
]
ALIASING_STRIDE = 4096  # bytes: x86's usual L1 set span (this machine's: 48 KiB over 12 ways)


def transposing_kernel_rows() -> list[dict]:
    """Each transposing kernel of the expert step that writes [experts, ffn, tokens]."""
    experts, groups, _, _ = MOE
    rows = []
    for name, ffn, capacity in KERNEL_CASES:
        x = jnp.full((experts, groups, capacity, 128), 0.5, jnp.float32)
        params = {
            "wi": jnp.full((experts, 128, ffn), 0.01, jnp.float32),
            "wo": jnp.full((experts, ffn, 128), 0.01, jnp.float32),
        }
        jitted = jax.jit(_expert_step(ACTIVATIONS[name]))
        hlo = jitted.lower(params, x).compile().as_text()
        times = kernel_times(jitted, (params, x), STEPS)
        tokens = groups * capacity
        written = re.escape(f"f32[{experts},{ffn},{tokens}]")
        for m in re.finditer(rf"%(\S+) = {written}\{{2,1,0\}} fusion\(([^)]*)\)", hlo):
            arrays = len(m.group(2).split(","))
            us, _, beside = times.get(m.group(1), (math.nan, math.nan, math.nan))
            rows.append(
                {
                    "activation": name,
                    "ffn": ffn,
                    "rows_walked": tokens,
                    "kernel": m.group(1),
                    "arrays_read": arrays,
                    "lines_in_flight": tokens * arrays,
                    "aliasing": (4 * ffn) % ALIASING_STRIDE == 0,
                    "us": us,
                    "ns_per_element_array": us * 1e3 / (experts * ffn * tokens * arrays),
                    "share_beside_other_kernels": beside,
                }
            )
    return rows


def side_by_side_control() -> list[dict]:
    """Six matmuls in one jit, independent and chained: each matmul kernel's mean time in the
    trace, the share of it beside another kernel, and the whole jit's time."""
    x = jnp.full((1024, 256), 0.5, jnp.float32)
    w = jnp.full((256, 1024), 1 / 256, jnp.float32)

    def independent(x, w):
        return [jax.lax.optimization_barrier((x * (1 + i)) @ w) for i in range(6)]

    def chained(x, w):
        for _ in range(6):
            x = jax.lax.optimization_barrier((x @ w)[:, :256] * 0.5)
        return x

    rows = []
    for case, fun in (("independent", independent), ("chained", chained)):
        jitted = jax.jit(fun)
        times = {
            n: t for n, t in kernel_times(jitted, (x, w), STEPS).items() if "ynn" in n or "dot" in n
        }
        rows.append(
            {
                "case": case,
                "kernel_us": sorted(mean for _, mean, _ in times.values()),
                "share_beside": max(share for _, _, share in times.values()),
                "ms": _seconds(fun, x, w) * 1e3,
            }
        )
    return rows


def _law_covers(row: dict) -> bool:
    """Kernels at an aliasing stride that compute: plain copies (identity) XLA tiles."""
    return row["aliasing"] and row["activation"] != "identity" and math.isfinite(row["us"])


def fit_lines_law(rows: list[dict]) -> tuple[float, float]:
    """(a, b) of ns per element and array = a + b x lines in flight, least squares over the
    rows `_law_covers`."""
    covered = [r for r in rows if _law_covers(r)]
    slope, intercept = np.polyfit(
        [r["lines_in_flight"] for r in covered], [r["ns_per_element_array"] for r in covered], 1
    )
    return float(intercept), float(slope)


def main() -> None:
    if len(jax.devices()) != 1:
        raise SystemExit("run with ONE device (unset XLA_FLAGS device counts)")
    swap = lambda x, z, w: jnp.swapaxes(x, 1, 2)  # noqa: E731
    rows = [
        _row("512x512 planes swapped, 8 MiB", (8, 512, 512), 1, swap),
        _row("512x512 planes swapped, 64 MiB (the profile's)", (64, 512, 512), 1, swap),
    ]
    for name, arrays, chain in CHAINS:
        rows.append(_row(f"{name}, streaming", MOE, arrays, chain))
        rows.append(_row(f"{name}, transposed", MOE, arrays, _transposed(chain)))
    for r in rows:
        print(f"{r['case']:<52} {r['ms']:8.2f} ms {r['gb_per_s']:7.1f} GB/s", flush=True)
    experts = expert_layer_rows()
    for r in experts:
        print(
            f"expert layer, {r['activation']:<8} ffn {r['ffn']:<5} predicted "
            f"{r['predicted_ms']:7.2f} ms measured {r['measured_ms']:7.2f} ms "
            f"ratio {r['ratio']:.2f}",
            flush=True,
        )
    kernels = transposing_kernel_rows()
    a, b = fit_lines_law(kernels)
    for r in kernels:
        r["law_ns"] = a + b * r["lines_in_flight"] if _law_covers(r) else None
        print(
            f"{r['activation']:<8} ffn {r['ffn']:<5} rows {r['rows_walked']:<4} "
            f"{r['kernel']:<24} arrays {r['arrays_read']} {r['us']:8.0f} us "
            f"{r['ns_per_element_array']:5.2f} ns/element/array, "
            f"{r['share_beside_other_kernels']:.0%} beside other kernels",
            flush=True,
        )
    control = side_by_side_control()
    for r in control:
        each = ", ".join(f"{us:.0f}" for us in r["kernel_us"])
        print(f"six matmuls, {r['case']}: {each} us in the trace, the jit {r['ms']:.2f} ms")
    data = {
        "device": one_cpu_device(),
        "rows": rows,
        "expert_layer": experts,
        "transposing_kernels": kernels,
        "side_by_side_control": control,
        "lines_law_ns": {"a": a, "b": b},
    }
    lines = [
        "# Transposing element-wise kernels on XLA:CPU",
        "",
        f"`python benchmarks/cpu_transposes.py` on {data['device']}: the least of {REPEATS}",
        "waited calls of each jitted function; GB/s counts every array read and the result.",
        f"MoE shape {list(MOE)} transposed to {list(TO_FFN_MAJOR)} (8 MiB per array).",
        "",
        "| case | arrays read | ms | GB/s |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['case']} | {r['arrays_read']} | {r['ms']:.2f} | {r['gb_per_s']:.1f} |")
    lines += [
        "",
        "The MoE expert layer's SGD step (experts, groups, capacity = "
        f"{list(MOE[:3])}, model 128), planned with the spec `profile_cluster()` measured here:",
        "",
        "| activation | ffn | predicted ms | measured ms | predicted / measured |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in experts:
        lines.append(
            f"| {r['activation']} | {r['ffn']} | {r['predicted_ms']:.2f} | "
            f"{r['measured_ms']:.2f} | {r['ratio']:.2f} |"
        )
    lines += [
        "",
        "The expert step's kernels that write [experts, ffn, tokens] (the layout copies XLA fuses",
        f"the activation's chain into), each the least of {STEPS} profiled steps; at a stride that",
        f"is a multiple of {ALIASING_STRIDE} bytes, the law ns = {a:.3f} + {b:.5f} x lines in",
        "flight (rows walked x arrays read), fitted to the kernels there that compute. The last",
        "column is the share of the kernel's time another kernel ran beside it (0%: the time is",
        "its own):",
        "",
        "| activation | ffn | rows walked | kernel | arrays read | µs | ns per element and array "
        "| law | beside other kernels |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in kernels:
        law = "–" if r["law_ns"] is None else f"{r['law_ns']:.2f}"
        lines.append(
            f"| {r['activation']} | {r['ffn']} | {r['rows_walked']} | {r['kernel']} | "
            f"{r['arrays_read']} | {r['us']:.0f} | {r['ns_per_element_array']:.2f} | {law} | "
            f"{r['share_beside_other_kernels']:.0%} |"
        )
    lines += [
        "",
        "Why that column: six 1024x256x1024 matmuls in one jit, independent (XLA:CPU runs them "
        "side by side) and chained:",
        "",
        "| matmuls | each in the trace (mean), µs | beside other kernels | the jit, ms |",
        "|---|---|---:|---:|",
    ]
    for r in control:
        each = ", ".join(f"{us:.0f}" for us in r["kernel_us"])
        lines.append(f"| {r['case']} | {each} | {r['share_beside']:.0%} | {r['ms']:.2f} |")
    save_results("cpu_transposes", data, lines)


if __name__ == "__main__":
    main()
