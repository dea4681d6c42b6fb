"""The cost model held against measured step times: the truth table of `make bench-costmodel`.

Part 1, on ONE real CPU device (no simulated devices: they would share the cores and the timing
would not be honest): `autopar.profile_cluster()` measures the device, then for each model of a
zoo the plan that `autopar.parallelize` makes with default options is asked for its predicted
step time and the same compiled step is timed (`truth_table`: the least over `ROUNDS` rounds of
the median of `STEPS` steps at least, of a second of steps where they are short). The
zoo: the bundled MLP at a small-batch/wide and a large-batch/narrow shape, GPT, MoE and
Wide-ResNet, and where installed the client models of `tests/clients.py`: transformers' Flax GPT-2
and Llama (its tiny config), and an equinox transformer (its Module and optimizer state carried
from step to step; the batch is the last argument of every step). The batch is placed on the
device ahead of the timed steps (`preshard_dynamic_args`, what `autopar.prefetch_batches` does in
a training loop): moving a host batch is the input pipeline's cost, not the step's.
Reported: predicted, measured, their ratio per model, and Kendall's τ between the two orders.
On a GPU also the device's share of each step, from a profiler trace (the time its kernels
and copies keep it busy), against the predicted compute: what is left of the step is the host's
(Python, JAX's dispatch, XLA's launch), against the predicted launch cost.

Part 2, on 8 simulated CPU devices (a subprocess): the collectives that `profile_cluster()`
timed to fit its link (latency, bandwidth, and the bandwidth within the cache), each predicted
from the fitted figures against its own measurement; then collectives of 32 and 64 MiB, beyond
the sizes it fits to, against the same figures.

    python benchmarks/cost_model.py                      # one CPU device
    JAX_PLATFORMS=cuda python benchmarks/cost_model.py   # one GPU (part 1 only: no collectives)

Writes benchmarks/results/cost_model.{json,md} (on a GPU: cost_model_gpu.{json,md}).
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

os.environ["AUTOPAR_PLAN_CACHE"] = "off"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

RESULTS = pathlib.Path(__file__).parent / "results"
# Timed steps per model (median): at least STEPS, and more for steps under a few ms until
# MIN_TIMED_S have passed (a sub-ms step's median over 15 moved by 20% between runs), after
# WARMUP steps.
STEPS, MAX_STEPS, MIN_TIMED_S = 15, 1000, 1.0
WARMUP = 3
ROUNDS = 3  # each model's measured step: the least of its medians over the rounds
COLLECTIVES_FLAG = "--collectives"
# Collectives timed beyond the sizes the profile fits to (it stops where a run would take
# 50 ms: 16 MiB on a 2-core host), to show how its link extrapolates
BEYOND_PROFILE_BYTES = (32 * 2**20, 64 * 2**20)


def _bundled(module, config, batch_size: int):
    import autopar

    state = module.create_train_state(config, batch_size=2)
    step = module.make_train_step(autopar.value_and_grad)
    return step, (state, module.make_batch(config, batch_size))


def zoo():
    """(name, builder) pairs; a builder returns (train step, args)."""
    import optax

    from autopar.models import gpt, mlp, moe, wresnet

    zoo = [
        ("mlp small-batch wide", lambda: _bundled(mlp, mlp.MLPConfig(1024, 1024, 1024, 4), 8)),
        ("mlp large-batch narrow", lambda: _bundled(mlp, mlp.MLPConfig(64, 64, 64, 4), 16384)),
        (
            "gpt",
            lambda: _bundled(
                gpt, gpt.GPTConfig(vocab_size=1024, seq_len=64, hidden=256, num_layers=2), 16
            ),
        ),
        (
            "moe",
            lambda: _bundled(
                moe, moe.MoEConfig(vocab_size=1024, seq_len=64, hidden=128, num_layers=2), 16
            ),
        ),
        ("wide-resnet", lambda: _bundled(wresnet, wresnet.WResNetConfig(channels=16), 32)),
    ]
    try:
        import clients
    except ImportError:  # transformers not installed: the bundled zoo only
        return zoo
    sizes = {"seq": 64, "vocab": 1024, "hidden": 128}
    tx = optax.adam(1e-3)
    return zoo + [
        ("transformers gpt2", lambda: _client(clients.gpt2(tx, 16, **sizes))),
        ("transformers llama", lambda: _client(clients.llama(tx, 16))),
        ("equinox transformer", lambda: _client(clients.equinox_transformer(tx, 16))),
    ]


def _client(client):
    return client.step, client.args


def _built(build):
    """(step, args), or None where the model's library is not installed."""
    try:
        return build()
    except ImportError as err:
        print(f"  skipped: {err}", flush=True)
        return None


def _time_steps(step, args) -> tuple[float, tuple]:
    """Median seconds of one step (see `STEPS`), the state (every argument but the last, the
    batch) carried from step to step as training does; and the arguments of the next step."""
    import jax

    times: list[float] = []
    for i in itertools.count():
        start = time.perf_counter()
        out = step(*args)
        jax.block_until_ready(out)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
        args = (*out[: len(args) - 1], args[-1])
        if len(times) >= MAX_STEPS or (len(times) >= STEPS and sum(times) >= MIN_TIMED_S):
            return statistics.median(times), args


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def profiler_events(run: Callable[[], None]) -> list[dict]:
    """The events of a profiler trace of `run()` (Chrome trace format: "X" events are spans)."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python's own events would slow the host down
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True, profiler_options=options):
            run()
        (path,) = pathlib.Path(log_dir).rglob("perfetto_trace.json.gz")
        data = json.loads(gzip.decompress(path.read_bytes()))
    return data["traceEvents"] if isinstance(data, dict) else data


# XLA:CPU's kernels in a trace: not the executor's own events, nor an async op's "end: " half
_KERNEL_EVENT = re.compile(r"(?!end: )\S*(fusion|dot|copy|transpose|convolution)\S*$")


def kernel_times(jitted, args: tuple, calls: int) -> dict[str, tuple[float, float, float]]:
    """Each kernel of `jitted(*args)` on a CPU: its least and mean time in microseconds over
    `calls` profiled calls (after 3 unprofiled), and the share of its time another kernel ran
    beside it: XLA:CPU runs independent kernels side by side on its threads, and a kernel's time
    in the trace is then not its own."""
    import jax

    for _ in range(3):
        jax.block_until_ready(jitted(*args))

    def run() -> None:
        for _ in range(calls):
            jax.block_until_ready(jitted(*args))

    kernels = [
        e for e in profiler_events(run) if e.get("ph") == "X" and _KERNEL_EVENT.match(e["name"])
    ]
    least: dict[str, float] = {}
    beside: dict[str, list[float]] = {}  # name -> [time beside another kernel, time, calls]
    for e in kernels:
        start, stop = e["ts"], e["ts"] + e["dur"]
        overlaps = [
            (max(start, f["ts"]), min(stop, f["ts"] + f["dur"]))
            for f in kernels
            if f is not e and f["ts"] < stop and f["ts"] + f["dur"] > start
        ]
        least[e["name"]] = min(least.get(e["name"], math.inf), e["dur"])
        shared = beside.setdefault(e["name"], [0.0, 0.0, 0])
        shared[0] += busy_us(overlaps)
        shared[1] += e["dur"]
        shared[2] += 1
    return {n: (least[n], t / c, b / t if t else 0.0) for n, (b, t, c) in beside.items()}


def _device_busy_s(step, args, steps: int = 3) -> float | None:
    """Seconds per step the device is busy (the union of its kernels and copies in a profiler
    trace of `steps` waited steps); None where the trace holds no device (a CPU's ops run on
    host threads)."""
    import jax

    def run() -> None:
        nonlocal args
        for _ in range(steps):
            out = jax.block_until_ready(step(*args))
            args = (*out[: len(args) - 1], args[-1])

    events = profiler_events(run)
    devices = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and e["args"]["name"].startswith("/device:")
    }
    spans = [
        (e["ts"], e["ts"] + e.get("dur", 0.0))
        for e in events
        if e.get("ph") == "X" and e.get("pid") in devices
    ]
    return busy_us(spans) * 1e-6 / steps if spans else None


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's τ-a between two orderings of the same items (1: the same order)."""
    pairs = [(i, j) for i in range(len(xs)) for j in range(i + 1, len(xs))]
    if not pairs:
        return 1.0
    sign = [
        ((xs[i] - xs[j]) * (ys[i] - ys[j]) > 0) - ((xs[i] - xs[j]) * (ys[i] - ys[j]) < 0)
        for i, j in pairs
    ]
    return sum(sign) / len(pairs)


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    predicted_s: float
    measured_s: float
    compute_s: float
    communication_s: float
    host_s: float
    device_busy_s: float | None  # measured from a profiler trace (GPU only)

    @property
    def ratio(self) -> float:
        return self.predicted_s / self.measured_s


def truth_table(spec) -> list[Row]:
    """Each zoo model's predicted step against its measured one: the least of `ROUNDS` medians,
    the models timed in turn each round, so that a slow spell of a shared machine (noise only
    adds time, as the profile's least-time figures assume) does not land on one model alone."""
    import jax

    import autopar

    on_cpu = jax.devices()[0].platform == "cpu"
    autopar.init("local", cluster_spec=spec)
    try:
        models = []  # (name, parallelized step, predicted)
        step_args = []  # each model's arguments, carried from round to round
        for name, build in zoo():
            built = _built(build)
            if built is None:
                continue
            step, args = built
            parallel = autopar.parallelize(step, batch_argnums=(len(args) - 1,))
            models.append((name, parallel, parallel.get_plan(*args).predicted))
            step_args.append(parallel.preshard_dynamic_args(*args))
        measured = [float("inf")] * len(models)
        for _ in range(ROUNDS):
            for i, (_, parallel, _) in enumerate(models):
                seconds, step_args[i] = _time_steps(parallel, step_args[i])
                measured[i] = min(measured[i], seconds)
        rows = []
        for (name, parallel, predicted), args, seconds in zip(
            models, step_args, measured, strict=True
        ):
            rows.append(
                Row(
                    name,
                    predicted.step_time_s,
                    seconds,
                    predicted.compute_s,
                    predicted.communication_s,
                    predicted.host_s,
                    None if on_cpu else _device_busy_s(parallel, args),
                )
            )
            print(
                f"  {name:<24} predicted {predicted.step_time_s * 1e3:9.3f} ms  "
                f"measured {seconds * 1e3:9.3f} ms  ratio {rows[-1].ratio:.2f}",
                flush=True,
            )
    finally:
        autopar.shutdown()
    return rows


def collectives() -> dict:
    """In a process with 8 simulated devices: the profile's collective timings against what
    its fitted α/β predict."""
    out = subprocess.run(
        [sys.executable, __file__, COLLECTIVES_FLAG],
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _collectives_here() -> None:
    import jax

    from autopar.runtime.cluster_profile import measure_cluster, predicted_collective_s
    from autopar.runtime.microbench import ProfileSizes, measure_collectives, physical_mesh

    profile = measure_cluster()
    spec = profile.spec
    mesh, axes = physical_mesh(jax.devices())
    larger = ProfileSizes(collective_bytes=BEYOND_PROFILE_BYTES, max_run_s=10.0)
    beyond = measure_collectives(mesh, axes, larger, tick=lambda: None)

    def row(m) -> dict:
        predicted = predicted_collective_s(spec, m)
        return {
            "kind": m.kind.value,
            "num_bytes": m.num_bytes,
            "num_devices": m.num_devices,
            "seconds": m.seconds,
            "predicted_s": predicted,
            "ratio": predicted / m.seconds,
        }

    rows = [row(m) for m in profile.collectives]
    print(json.dumps({"spec": spec.to_dict(), "rows": rows, "beyond": [row(m) for m in beyond]}))


def main() -> None:
    import jax

    from autopar.runtime.cluster_profile import measure_cluster

    if len(jax.devices()) != 1:
        raise SystemExit("run with ONE device (unset XLA_FLAGS device counts)")
    device = jax.devices()[0]
    print(f"profiling this device ({device.device_kind}) ...", flush=True)
    profile = measure_cluster()
    spec = profile.spec
    print(json.dumps(spec.to_dict(), indent=1))
    rows = truth_table(spec)
    tau = kendall_tau([r.predicted_s for r in rows], [r.measured_s for r in rows])
    within = sum(0.75 <= r.ratio <= 1.25 for r in rows)
    print(f"Kendall tau {tau:.3f}; {within}/{len(rows)} within ±25%")
    on_cpu = device.platform == "cpu"
    if on_cpu:
        print("collectives on 8 simulated devices ...", flush=True)
    coll = collectives() if on_cpu else None  # one GPU: no collective to time
    described = "CPU device of this machine" if on_cpu else f"{device.device_kind} GPU"
    _write(spec, profile, rows, tau, coll, described, "cost_model" if on_cpu else "cost_model_gpu")


def one_cpu_device() -> str:
    """The device the CPU benchmarks time on, in their results' words."""
    import jax

    return f"one real CPU device ({jax.devices()[0].device_kind}), {os.cpu_count()} CPUs"


def save_results(stem: str, data: dict, lines: list[str]) -> None:
    """A benchmark's results: `data` as benchmarks/results/{stem}.json, `lines` as its .md."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / stem}.json and .md")


def _write(spec, profile, rows, tau, coll, device: str, stem: str) -> None:
    from autopar.runtime.cluster_profile import aliased_loop_text, efficiency_text

    data = {
        "device": f"one real {device}",
        "profile": profile.to_dict(),
        "rows": [{**dataclasses.asdict(r), "ratio": r.ratio} for r in rows],
        "kendall_tau": tau,
        "within_25_percent": sum(0.75 <= r.ratio <= 1.25 for r in rows),
        "collectives_8_simulated_devices": coll,
    }
    lines = [
        "# Cost model against measured step times",
        "",
        f"`make bench-costmodel` (`python benchmarks/cost_model.py`). ONE real {device}, the",
        "`ClusterSpec` that `autopar.profile_cluster()` measured there, default options; measured",
        f"= the least over {ROUNDS} rounds of the median of at least {STEPS} steps (of",
        f"{MIN_TIMED_S:.0f} s of steps where they are short, at most {MAX_STEPS}), after {WARMUP}",
        "warm-up steps.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| matmul fp32 (default precision) | {spec.tf32_flops / 1e9:.1f} GFLOP/s |",
        f"| matmul fp32 (highest precision) | {spec.fp32_flops / 1e9:.1f} GFLOP/s |",
        f"| matmul bf16 | {spec.device_flops / 1e9:.1f} GFLOP/s |",
        f"| matmul rate by size (share of the fp32 rate) | "
        f"{efficiency_text(spec.matmul_efficiency)} |",
        f"| memory bandwidth | {spec.memory_bandwidth / 1e9:.2f} GB/s |",
        f"| kernel floor | {spec.kernel_overhead_s * 1e6:.2f} µs |",
        f"| host: launching a program and waiting for it | {spec.launch_overhead_s * 1e6:.1f} µs "
        f"+ {spec.buffer_overhead_s * 1e6:.2f} µs per input or output buffer "
        f"+ {spec.kernel_update_s * 1e6:.2f} µs per kernel (graph update: the buffers moved) |",
        f"| transcendentals (exp) | {spec.transcendental_rate / 1e9:.2f} Gelement/s |",
        f"| convolution (3x3, 64 channels) | {spec.conv_flops / 1e9:.1f} GFLOP/s |",
        f"| transpose moving the minor dimension | {spec.transpose_bandwidth / 1e9:.2f} GB/s |",
        f"| weight-gradient matmul (x^T·y, fp32, 256 columns) | "
        f"{spec.transposed_matmul_flops / 1e9:.1f} GFLOP/s |",
        "| weight-gradient matmul (64 columns) | "
        + (
            "not measured"
            if spec.narrow_transposed_matmul_flops is None
            else f"{spec.narrow_transposed_matmul_flops / 1e9:.1f} GFLOP/s"
        )
        + " |",
        f"| max pool (3x3, 64 channels) | {spec.window_reduction_rate / 1e9:.2f} Gwindow "
        "element/s |",
        f"| max pool gradient (3x3, stride 2, 4 MiB) | {spec.select_and_scatter_rate / 1e6:.1f} "
        "Mwindow/s |",
        "| max pool gradient (512 KiB, in cache) | "
        + (
            "not measured"
            if spec.cached_select_and_scatter_rate is None
            else f"{spec.cached_select_and_scatter_rate / 1e6:.1f} Mwindow/s"
        )
        + " |",
        f"| first writes to fresh memory (from {spec.fresh_memory_threshold / 2**20:.0f} MiB) | "
        + (
            "free (pooled)"
            if spec.fresh_memory_rate is None
            else f"{spec.fresh_memory_rate / 1e9:.2f} GB/s"
        )
        + " |",
        "| column reduction (rows walked, one kernel) | "
        + (
            "at the memory bandwidth (not measured)"
            if spec.column_reduction_rate is None
            else f"{spec.column_reduction_rate / 1e9:.2f} Grows/s"
        )
        + " |",
        "| column reduction with fused outputs (rows walked per array it reads or writes) | "
        + (
            "by its bytes (not measured)"
            if spec.column_reduction_array_rate is None
            else f"{spec.column_reduction_array_rate / 1e9:.2f} Grows/s"
        )
        + " |",
        f"| element-wise loop fused into a transposing copy | {aliased_loop_text(spec)} |",
        "",
        "| model | predicted | measured | predicted / measured |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r.model} | {r.predicted_s * 1e3:.3f} ms | {r.measured_s * 1e3:.3f} ms "
        f"| {r.ratio:.2f} |"
        for r in rows
    ]
    lines += [
        "",
        f"Kendall τ between predicted and measured order: **{tau:.3f}**; "
        f"{data['within_25_percent']}/{len(rows)} models within ±25%.",
    ]
    if any(r.device_busy_s is not None for r in rows):
        lines += _split_lines(rows)
    if coll is not None:
        lines += _collective_lines(coll)
    save_results(stem, data, lines)


def _split_lines(rows: list[Row]) -> list[str]:
    """Each step split into the device's share (busy in the profiler trace) and the host's (the
    rest), each against its prediction."""
    lines = [
        "",
        "## Device and host shares of each step",
        "",
        "Device: the time the GPU is busy per step in a profiler trace (kernels and copies), "
        "against the predicted compute and communication. Host: the measured step less that, "
        "against the predicted launch cost (`launch_overhead_s` + `buffer_overhead_s` per input "
        "and output buffer + `kernel_update_s` per kernel the roofline counts).",
        "",
        "| model | device predicted | device busy | ratio "
        "| host predicted | host measured | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        device = r.compute_s + r.communication_s
        host = r.measured_s - r.device_busy_s
        lines.append(
            f"| {r.model} | {device * 1e3:.3f} ms | {r.device_busy_s * 1e3:.3f} ms "
            f"| {device / r.device_busy_s:.2f} | {r.host_s * 1e3:.3f} ms | {host * 1e3:.3f} ms "
            f"| {r.host_s / host:.2f} |"
        )
    return lines


def _collective_lines(coll: dict) -> list[str]:
    spec = coll["spec"]
    link = (
        f"latency {spec['intra_host_latency'] * 1e6:.0f} µs, bus bandwidth "
        f"{spec['intra_host_bandwidth'] / 1e9:.2f} GB/s"
    )
    if spec["cached_intra_host_bandwidth"] is not None:
        link += (
            f" ({spec['cached_intra_host_bandwidth'] / 1e9:.2f} GB/s for the bytes whose "
            f"buffers fit in {spec['collective_cache_bytes'] / 2**20:.3g} MiB of last-level "
            "cache per device)"
        )
    within = sum(0.7 <= c["ratio"] <= 1.3 for c in coll["rows"])
    return [
        "",
        "## Collectives on 8 simulated CPU devices",
        "",
        "Each collective `profile_cluster()` timed, predicted with the link it fitted to "
        f"all-reduce, all-gather and reduce-scatter ({link}; all-to-all: times its fitted "
        f"`all_to_all_factor`, {spec['all_to_all_factor']:.2f}). "
        f"**{within}/{len(coll['rows'])} within ±30%**.",
        "",
        *_collective_table(coll["rows"]),
        "",
        "Beyond the sizes the profile fitted to, the same link's predictions (not fitted):",
        "",
        *_collective_table(coll["beyond"]),
    ]


def _collective_table(rows: list[dict]) -> list[str]:
    return [
        "| collective | bytes | devices | predicted | measured | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ] + [
        f"| {c['kind']} | {c['num_bytes']:.0f} | {c['num_devices']} | "
        f"{c['predicted_s'] * 1e6:.1f} µs | {c['seconds'] * 1e6:.1f} µs | {c['ratio']:.2f} |"
        for c in rows
    ]


if __name__ == "__main__":
    if COLLECTIVES_FLAG in sys.argv:
        _collectives_here()
    else:
        main()
