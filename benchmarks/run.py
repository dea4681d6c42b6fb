"""Benchmark suite: Alpa's weak-scaling evaluation (GPT, MoE, Wide-ResNet) in cost-model mode.

    python benchmarks/run.py [--families gpt moe wresnet] [--clusters 8xV100-p3 8xH100-80G]
                             [--max-devices 64] [--case-timeout 120] [--baselines-timeout 120]
                             [--attempt-all] [--no-compile]

Part 1 plans each case from shapes alone (`autopar.plan` on `jax.ShapeDtypeStruct`s: nothing
allocated, no device of the cluster needed) and prices the classic layouts next to the plan with
`autopar.explain`. A case is (family, size, devices, cluster preset). The sizes follow Alpa's
weak scaling, where the model grows with the device count, as in the `perf_test_suite`s of
`benchmark/alpa/suite_auto_gpt.py`, `suite_auto_moe.py` and `suite_wresnet.py` in
alpa-projects/alpa (p3.16xlarge), on the device counts of Alpa's end-to-end figures:

    devices  GPT   MoE   Wide-ResNet
          1  350M  380M  250M
          4  1.3B  1.3B  1B
          8  2.6B  2.4B  2B
         16  6.7B  10B   4B
         32  15B   27B   6.8B
         64  39B   70B   13B

(REFERENCE.md's published GPT plans, 2.6B on 8 GPUs up to 39B on 64, are these pairs.) Global
batch and micro-batches are Alpa's for each case: GPT and MoE 1024 sequences of 1024 tokens,
Wide-ResNet 1536 images of 224 px (1520 for 13B). Every case is planned for Alpa's testbed
(`8xV100-p3`: V100 16 GB, NVLink, 25 Gb/s between hosts) and for `8xH100-80G`, hosts of 8
devices (`Nx8xV100-p3` beyond 8 devices; 1 and 4 devices are a slice of one host), in float16
(Alpa trained in fp16; the presets' peaks are tensor-core fp16/bf16 peaks).

Methods: within one host (<= 8 devices) ShardParallel, the intra-op ILP with gradient
accumulation over the micro-batches, recomputing activations where nothing fits without
(`autopar.remat`). Where no ShardParallel plan fits device memory even so, the case falls back to
PipeshardParallel on that host (as Alpa's own 4- and 8-GPU GPT plans are pipelines inside one
host), marked † in the tables. Across hosts PipeshardParallel with
`AutoLayerOption(max(4, 2 x hosts))` (its default `remat_mode="auto"`: each layer recomputed
only where no plan fits without) and `AutoStageOption()` (Alpa's stage DP). The ILP solver is
HiGHS with `--time-limit` seconds per solve.

Each case is planned in its own process (plan cache off). Planning (what `autopar.plan` takes:
trace + plan) is capped at `--case-timeout` seconds of wall time: a case not planned by then is
killed and reported as not planned within that time. Pricing the baselines of a planned case is
timed apart and gets `--baselines-timeout` seconds more (a plan whose baselines were not all
priced by then is reported without the comparison). Planning time grows with the model and the
cluster, so once a case of a family and cluster is not planned within the cap its larger cases
are listed as not attempted (`--attempt-all` plans them anyway).

Part 2 (`--no-compile` skips it) checks the cost model against XLA where a case runs here: each
family at a reduced size (`COMPILE_CONFIGS`), ShardParallel on 8 simulated CPU devices planned
for each cluster preset (`autopar.init(cluster_spec=...)`, with `platform="cpu"`: the memory
model follows the backend that compiles, XLA:CPU's layout copies and scheduler) and compiled with
real arrays; the
predicted collective bytes and peak memory per device next to the compiled HLO's collectives
(`Executable.collectives()`) and XLA's memory analysis (`Executable.memory_stats()`). One
micro-batch, so that no collective sits in a gradient-accumulation loop that the HLO text shows
once. Only these processes simulate devices; the planning processes need none.
`--compile-only` reruns part 2 alone and keeps part 1's rows of the results JSON.

Writes benchmarks/results/suite.json, suite.md and the plots suite_tflops.png (predicted TFLOP/s
per device against devices, ours and the best baseline), suite_vs_baseline.png and
suite_planning_time.png (`--name` replaces "suite"; `--report-only` redraws them from the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import math
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from gpt_shapes import add_solver_arguments
from tqdm import tqdm

from autopar.plan_store import CACHE_ENV

RESULTS = pathlib.Path(__file__).parent / "results"
GiB = 2**30
PLOTS = ("tflops", "vs_baseline", "planning_time")
MiB = 2**20
CLUSTERS = ("8xV100-p3", "8xH100-80G")
DEVICES_PER_HOST = 8
COMPILE_DEVICES = 8
COMPILE_BATCH = 64  # sequences / images: 8 per simulated device
# Part 2's reduced sizes: small enough to compile on a CPU, large enough that the plan for a
# GPU preset splits the work (the family defaults are so small that replicating is cheapest).
COMPILE_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt": dict(vocab_size=4096, seq_len=256, hidden=512, num_layers=4, num_heads=8),
    "moe": dict(vocab_size=4096, seq_len=256, hidden=512, num_layers=4, num_heads=8, num_experts=8),
    "wresnet": dict(image_size=64, channels=64, stage_sizes=(1, 1, 1), num_classes=100),
}

# family -> [(devices, size, global batch, micro-batches)]: Alpa's weak-scaling cases.
SUITE: dict[str, list[tuple[int, str, int, int]]] = {
    "gpt": [
        (1, "350M", 1024, 512),
        (4, "1.3B", 1024, 128),
        (8, "2.6B", 1024, 128),
        (16, "6.7B", 1024, 64),
        (32, "15B", 1024, 128),
        (64, "39B", 1024, 1024),
    ],
    "moe": [
        (1, "380M", 1024, 512),
        (4, "1.3B", 1024, 32),
        (8, "2.4B", 1024, 32),
        (16, "10B", 1024, 16),
        (32, "27B", 1024, 128),
        (64, "70B", 1024, 64),
    ],
    "wresnet": [
        (1, "250M", 1536, 24),
        (4, "1B", 1536, 24),
        (8, "2B", 1536, 24),
        (16, "4B", 1536, 32),
        (32, "6.8B", 1536, 32),
        (64, "13B", 1520, 38),
    ],
}
FAMILY_NAMES = {"gpt": "GPT", "moe": "MoE", "wresnet": "Wide-ResNet"}

logger = logging.getLogger("suite")


@dataclasses.dataclass(frozen=True)
class Case:
    """One planning case: a family at an Alpa size on `devices` devices of a cluster preset."""

    family: str
    size: str
    devices: int
    cluster: str  # single-host preset name
    global_batch: int
    micro_batches: int

    @property
    def key(self) -> str:
        return f"{self.family}:{self.size}:{self.devices}:{self.cluster}"

    @property
    def hosts(self) -> int:
        return max(1, self.devices // DEVICES_PER_HOST)

    @property
    def method(self) -> str:
        return "shard" if self.devices <= DEVICES_PER_HOST else "pipeshard"


def all_cases(families, clusters, max_devices: int) -> list[Case]:
    return [
        Case(family, size, devices, cluster, batch, micro)
        for family in families
        for cluster in clusters
        for devices, size, batch, micro in SUITE[family]
        if devices <= max_devices
    ]


def case_by_key(key: str) -> Case:
    family, size, devices, cluster = key.split(":")
    for d, s, batch, micro in SUITE[family]:
        if s == size and d == int(devices):
            return Case(family, size, d, cluster, batch, micro)
    raise ValueError(f"unknown case {key!r}")


# ----------------------------------------------------------------------------- one case (child)


def _cluster_spec(case: Case):
    from autopar.planner.cluster import ClusterSpec

    if case.devices < DEVICES_PER_HOST:
        return ClusterSpec.preset(case.cluster).with_devices(1, case.devices)
    if case.hosts == 1:
        return ClusterSpec.preset(case.cluster)
    return ClusterSpec.preset(f"{case.hosts}x{case.cluster}")


def _family(name: str):
    from autopar.cli import FAMILIES

    family = FAMILIES[name]
    return family, importlib.import_module(family.module)


def pipeshard_layers(hosts: int) -> int:
    """AutoLayerOption's layer count: 2 per host, at least 4 (Alpa searched 6 to 16)."""
    return max(4, 2 * hosts)


def _method(kind: str, case: Case, args: argparse.Namespace):
    import autopar

    option = autopar.AutoShardingOption(solver=args.solver, time_limit_s=args.time_limit)
    if kind == "shard":
        return autopar.ShardParallel(
            num_micro_batches=case.micro_batches, auto_sharding_option=option
        )
    return autopar.PipeshardParallel(
        num_micro_batches=case.micro_batches,
        layer_option=autopar.AutoLayerOption(layer_num=pipeshard_layers(case.hosts)),
        stage_option=autopar.AutoStageOption(),
        auto_sharding_option=option,
    )


def _stage_rows(plan, devices_per_host: int) -> list[dict[str, Any]]:
    rows = []
    for stage in plan.stages:
        hosts = len({i // devices_per_host for i in stage.mesh.device_indices})
        rows.append(
            {
                "layers": None if stage.layers is None else list(stage.layers),
                "submesh": [hosts, stage.mesh.num_devices // hosts],
                "logical_mesh": dict(zip(stage.mesh.axis_names, stage.mesh.shape, strict=True)),
            }
        )
    return rows


def _predicted(p) -> dict[str, float]:
    return {
        "step_s": p.step_time_s,
        "compute_s": p.compute_s,
        "communication_s": p.communication_s,
        "communication_bytes": p.communication_bytes,
        "memory_per_device_bytes": p.memory_per_device_bytes,
        "flops": p.flops,
    }


def _layout(result) -> dict[str, Any]:
    row: dict[str, Any] = {"name": result.name, "status": result.status.value}
    if result.predicted is not None:
        row.update(_predicted(result.predicted))
    if result.least_memory_bytes is not None:
        row["least_memory_bytes"] = result.least_memory_bytes
    if result.message and not result.fits:
        row["message"] = " ".join(result.message.split())
    return row


def _write(out: pathlib.Path, row: dict[str, Any]) -> None:
    """Replace `out` with `row` at once: a child killed mid-write leaves the previous row."""
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(row))
    os.replace(tmp, out)


def plan_one(case: Case, args: argparse.Namespace, out: pathlib.Path) -> None:
    """Plan `case`, then price its baselines; `out` gets the row after each of the two, so a
    process killed while pricing baselines still leaves the plan."""
    import jax.numpy as jnp

    from autopar.api import plan_in_context
    from autopar.models import abstract_train_inputs
    from autopar.planner.errors import PlanningError
    from autopar.planner.explain import explain_plan
    from autopar.planner.summary import bubble_fraction, throughput

    family, module = _family(case.family)
    config = family.make_config(case.size, dtype=jnp.dtype(args.dtype))
    cluster = _cluster_spec(case)
    row: dict[str, Any] = {
        **dataclasses.asdict(case),
        "params": module.param_count(config),
        "cluster_spec": cluster.name,
        "hosts": case.hosts,
        "method": case.method,
    }
    step, state, batch = abstract_train_inputs(module, config, case.global_batch)
    start = time.perf_counter()
    try:
        method = _method(case.method, case, args)
        plan, context = plan_in_context(step, (state, batch), method, cluster, (1,), ())
    except PlanningError as e:
        row.update(status="no plan", plan_s=time.perf_counter() - start, error=str(e))
        _write(out, row)
        if case.method != "shard":
            return
        # No ShardParallel plan fits, even recomputing activations: plan a pipeline on the host
        # as Alpa did (its 4- and 8-GPU GPT plans are pipelines inside one host).
        row.update(fallback=True, method="pipeshard", shard_s=row.pop("plan_s"))
        row["shard_error"] = row.pop("error")
        row["status"] = "fallback"
        _write(out, row)
        start = time.perf_counter()
        try:
            method = _method("pipeshard", case, args)
            plan, context = plan_in_context(step, (state, batch), method, cluster, (1,), ())
        except PlanningError as e:
            row.update(status="no plan", plan_s=time.perf_counter() - start, error=str(e))
            _write(out, row)
            return
    row["plan_s"] = time.perf_counter() - start
    rate = throughput(plan)
    row.update(
        status="planned",
        stages=_stage_rows(plan, cluster.devices_per_host),
        predicted=_predicted(plan.predicted),
        tflops_per_device=None if rate is None else rate[0] / 1e12,
        mfu=None if rate is None else rate[1],
        bubble=bubble_fraction(plan) if plan.pipeline_schedule else None,
        notes=list(plan.notes),
    )
    _write(out, row)
    start = time.perf_counter()
    explanation = explain_plan(plan, context)
    best = explanation.best_baseline
    row.update(
        status="ok",
        explain_s=time.perf_counter() - start,
        baselines=[_layout(b) for b in explanation.baselines],
        best_baseline=None if best is None else best.name,
        best_baseline_step_s=None if best is None else best.step_time_s,
        ratio=explanation.chosen_over_best,
        explain_notes=list(explanation.notes),
    )
    _write(out, row)


# ----------------------------------------------------------------------------- compile (child)


def compile_one(family_name: str, cluster_name: str, out: pathlib.Path) -> None:
    """`family_name` at its reduced size on 8 simulated CPU devices, planned for `cluster_name`
    with XLA:CPU's memory rules (`ClusterSpec.platform`: its layout copies and scheduler; the
    GPU's cannot be checked here) and compiled: predicted collective bytes and peak memory
    next to the HLO's and XLA's."""
    import autopar

    autopar.simulate_cpu_devices(COMPILE_DEVICES)  # before jax creates its backend
    import jax.numpy as jnp

    from autopar.planner.cluster import ClusterSpec, xla_cpu_dfs_scheduler

    family, module = _family(family_name)
    config = family.make_config("tiny", **COMPILE_CONFIGS[family_name])
    # The preset's speeds, XLA:CPU's layout and scheduling rules: XLA:CPU compiles the plan
    preset = ClusterSpec.preset(cluster_name)
    spec = dataclasses.replace(preset, platform="cpu", dfs_schedule=xla_cpu_dfs_scheduler())
    autopar.init(cluster="local", cluster_spec=spec)
    try:
        state = module.create_train_state(config, batch_size=COMPILE_BATCH)
        batch = module.make_batch(config, COMPILE_BATCH)
        step = autopar.parallelize(
            module.make_train_step(autopar.value_and_grad), method=autopar.ShardParallel()
        )
        start = time.perf_counter()
        executable = step.get_executable(state, batch)
        compile_s = time.perf_counter() - start
        predicted = executable.plan.predicted
        collectives = {k: sum(v) for k, v in executable.collectives().items() if v}
        measured_comm = sum(collectives.values())
        measured_mem = executable.memory_stats().peak_bytes
    finally:
        autopar.shutdown()
    row = {
        "family": family_name,
        "cluster": cluster_name,
        "config": {
            k: (jnp.dtype(v).name if k == "dtype" else v)
            for k, v in dataclasses.asdict(config).items()
        },
        "params": module.param_count(config),
        "batch": COMPILE_BATCH,
        "devices": COMPILE_DEVICES,
        "plan_and_compile_s": compile_s,
        "stages": _stage_rows(executable.plan, COMPILE_DEVICES),
        "predicted_comm_bytes": predicted.communication_bytes,
        "hlo_comm_bytes": measured_comm,
        "hlo_collectives": collectives,
        "comm_ratio": predicted.communication_bytes / measured_comm if measured_comm else None,
        "predicted_memory_bytes": predicted.memory_per_device_bytes,
        "xla_peak_bytes": measured_mem,
        "memory_ratio": predicted.memory_per_device_bytes / measured_mem if measured_mem else None,
        "status": "ok",
    }
    _write(out, row)


# ----------------------------------------------------------------------------- driver


def _child_args(args: argparse.Namespace) -> list[str]:
    return [
        "--solver",
        args.solver,
        "--time-limit",
        str(args.time_limit),
        "--dtype",
        args.dtype,
    ]


@dataclasses.dataclass(frozen=True)
class ChildResult:
    """What a child process left: the row it wrote last (None: none), its stderr, its wall
    time, whether it was killed at the cap, and its exit code."""

    row: dict[str, Any] | None
    stderr: str
    wall_s: float
    timed_out: bool
    returncode: int


PLANNED = ("planned", "ok", "no plan")  # a child's row statuses once planning has ended


def _read_row(out: pathlib.Path) -> dict[str, Any] | None:
    return json.loads(out.read_text()) if out.exists() and out.stat().st_size else None


def run_child(extra: list[str], timeout: float, then: float = 0.0) -> ChildResult:
    """Run this script with `extra` in a new process group, killed if its row has not reached
    a `PLANNED` status after `timeout` s, or after `timeout + then` s in all."""
    with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
        out = pathlib.Path(tmp) / "row.json"
        err = pathlib.Path(tmp) / "stderr.txt"
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *extra, "--out", str(out)]
        start = time.perf_counter()
        with open(err, "w") as stderr:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
                env={**os.environ, CACHE_ENV: "off"},  # plan afresh: time the planner
            )
            timed_out = False
            while proc.poll() is None:
                elapsed = time.perf_counter() - start
                row = _read_row(out) if then and elapsed > timeout else None
                if elapsed > timeout + then or (
                    elapsed > timeout and (row or {}).get("status") not in PLANNED
                ):
                    timed_out = True
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # the child and what it started
                    proc.wait()
                    break
                time.sleep(0.2)
        wall = time.perf_counter() - start
        return ChildResult(
            _read_row(out), err.read_text(errors="replace"), wall, timed_out, proc.returncode
        )


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """Plan `case` in a child process under the cap; its row, with how it ended."""
    extra = ["--one-case", case.key, *_child_args(args)]
    child = run_child(extra, args.case_timeout, args.baselines_timeout)
    row = {**dataclasses.asdict(case), "hosts": case.hosts, "method": case.method}
    row.update(child.row or {})
    row["wall_s"] = child.wall_s
    row["ilp_time_limit_hits"] = child.stderr.count("hit its time limit")
    if child.timed_out:
        row["timeout_s"] = args.case_timeout
        # planned, but the baselines were not all priced in time: keep the plan
        if row.get("status") == "planned":
            row["status"] = "baselines timeout"
            row["baselines_timeout_s"] = args.baselines_timeout
        else:
            row["status"] = "timeout"
    elif child.returncode != 0 or row.get("status") not in ("ok", "no plan"):
        row["status"] = "error"
        row["error"] = _last_error(child.stderr)
    return row


def skipped_row(case: Case, after: dict[str, Any]) -> dict[str, Any]:
    """A case not attempted because a smaller case of its family and cluster hit the cap."""
    return {
        **dataclasses.asdict(case),
        "hosts": case.hosts,
        "method": case.method,
        "status": "skipped",
        "wall_s": 0.0,
        "error": (
            f"not attempted: {after['size']} on {after['devices']} devices already took more "
            f"than the {after['timeout_s']:.0f} s cap (--attempt-all runs it)"
        ),
    }


def run_compile(family: str, cluster: str, args: argparse.Namespace) -> dict[str, Any]:
    """The XLA check of `family` for `cluster` in a child process under the cap."""
    child = run_child(["--compile-case", f"{family}:{cluster}"], args.case_timeout)
    row = child.row
    if row is None:
        why = (
            f"not compiled within {args.case_timeout:.0f} s"
            if child.timed_out
            else _last_error(child.stderr)
        )
        status = "timeout" if child.timed_out else "error"
        row = {"family": family, "cluster": cluster, "status": status, "error": why}
    row["wall_s"] = child.wall_s
    return row


# ----------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str = ".3g", none: str = "–") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _mesh_text(mesh: dict[str, int], two_d: bool) -> str:
    """A logical mesh: (8) for ShardParallel's 1D mesh, (x, y) for a pipeline stage's (the
    planner drops an axis of size 1)."""
    sizes = [mesh.get("x", 1), mesh.get("y", 1)] if two_d else list(mesh.values())
    return "(" + ",".join(str(n) for n in sizes) + ")"


def _stages_text(row: dict[str, Any]) -> str:
    stages = row.get("stages") or []
    if not stages:
        return "–"
    if len(stages) == 1 and stages[0]["layers"] is None:
        return f"1 mesh {_mesh_text(stages[0]['logical_mesh'], False)}"
    parts = []
    for s in stages:
        h, d = s["submesh"]
        mesh = _mesh_text(s["logical_mesh"], True)
        parts.append(f"[{s['layers'][0]},{s['layers'][1]}) {h}x{d} as {mesh}")
    return f"{len(stages)} stage{'s' if len(stages) > 1 else ''}: " + "; ".join(parts)


def _no_plan_text(error: str) -> str:
    """ "no plan fits in B (needs about N)" from the planner's over-budget error."""
    found = re.search(r"budget of ([\d.]+ \w+) .*? about ([\d.]+ \w+)", error)
    if found:
        return f"no plan fits in {found.group(1)} (needs about {found.group(2)})"
    return "no plan: " + " ".join(error.split())[:160]


def _status_text(row: dict[str, Any]) -> str:
    status, cap = row.get("status"), row.get("timeout_s", 0)
    text = {
        "ok": "ok",
        "timeout": f"not planned within {cap:.0f} s",
        "baselines timeout": "planned; baselines not priced within "
        f"{row.get('baselines_timeout_s', 0):.0f} s more",
        "skipped": row.get("error", ""),
        "no plan": _no_plan_text(str(row.get("error", ""))),
    }.get(status, f"{status}: {' '.join(str(row.get('error', '')).split())[:160]}")
    if row.get("fallback"):
        text = f"ShardParallel: {_no_plan_text(row['shard_error'])}; pipeshard: {text}"
    return text


def _method_text(row: dict[str, Any]) -> str:
    return row["method"] + ("†" if row.get("fallback") else "")


def _model_text(row: dict[str, Any]) -> str:
    return f"{FAMILY_NAMES[row['family']]} {row['size']}"


def _baseline_cell(layout: dict[str, Any]) -> str:
    if layout["status"] == "ok":
        return f"{layout['step_s']:.3g}"
    if layout["status"] == "oom":
        need = layout.get("least_memory_bytes")
        return "OOM" + (f" ({need / GiB:.1f} GiB)" if need else "")
    return layout["status"]


def _header(result: dict[str, Any]) -> list[str]:
    s = result["setup"]
    return [
        "# Benchmark suite: Alpa's weak-scaling cases in cost-model mode",
        "",
        f"`{s.get('command', 'python benchmarks/run.py')}`. Planned from shapes only (no device of "
        f"the cluster, nothing compiled), {s['dtype']} compute. ShardParallel (intra-op ILP, "
        "gradient accumulation, activations recomputed where nothing fits without) within one "
        "host; † = no ShardParallel plan fits device memory even so, so PipeshardParallel on "
        "that host instead, as Alpa's "
        f"own 4- and 8-GPU GPT plans; PipeshardParallel (AutoLayerOption({s['pipeshard_layers']} "
        "layers, layers recomputed where nothing fits without), Alpa's stage DP) across hosts. "
        "ILP solver "
        f"{s['solver']}, {s['time_limit_s']:.0f} s limit per plan's ILP work. Each case runs in "
        f"its own process, capped at {s['case_timeout_s']:.0f} s of wall time for planning "
        f"(trace + plan) and {s.get('baselines_timeout_s', 0):.0f} s more for pricing the "
        "baselines; once a case of a family and cluster is not planned within the cap, its "
        f"larger cases are not attempted (`--attempt-all` plans them). {s['machine']}; the "
        "suite took "
        f"{result['total_s'] / 60:.1f} min.",
        "",
        "Sizes and micro-batches are Alpa's weak-scaling cases (`perf_test_suite` of "
        "`benchmark/alpa/suite_auto_gpt.py`, `suite_auto_moe.py`, `suite_wresnet.py`), on the "
        "device counts of Alpa's end-to-end figures; global batch 1024 sequences of 1024 tokens "
        "(GPT, MoE) and 1536 images of 224 px (Wide-ResNet; 1520 for 13B).",
        "",
        "Step times are the cost model's (roofline: each op at the device's peak FLOP/s or memory "
        "bandwidth, whichever binds; α-β collectives), "
        "so TFLOP/s per device and MFU are predictions, not measurements; they count the step's "
        "FLOPs with recomputation, so a rematerialised pipeline's are hardware FLOPs. *best "
        "baseline* is the fastest layout that fits device memory among DP, ZeRO-2 (Z2), ZeRO-3 "
        "(Z3), Megatron (each the ILP with every input's storage pinned, on all the plan's "
        "devices) and, for pipelines and across hosts, plain pipelines (S uniform stages, data "
        "parallel inside); *ours / best* below 1: the plan is predicted faster.",
    ]


def _findings(rows: list[dict[str, Any]]) -> list[str]:
    def name(r: dict[str, Any]) -> str:
        return f"{_model_text(r)} on {r['devices']} x {r['cluster']}"

    better = [r for r in rows if r.get("ratio") is not None and r["ratio"] < 0.9]
    worse = [r for r in rows if r.get("ratio") is not None and r["ratio"] > 1 + 1e-4]
    capped = [r for r in rows if r["status"] in ("timeout", "baselines timeout")]
    lines = ["", "## Findings", ""]
    lines.append(
        "- Plan beats the best baseline by more than 10%: "
        + (", ".join(f"{name(r)} ({r['ratio']:.3f})" for r in better) or "none")
        + "."
    )
    lines.append(
        "- Plan slower than the best baseline (ratio > 1): "
        + (
            ", ".join(f"{name(r)} ({r['ratio']:.3f}, {r['best_baseline']})" for r in worse)
            or "none"
        )
        + "."
    )
    lines.append(
        "- Hit the cap: "
        + (", ".join(f"{name(r)} ({_status_text(r)})" for r in capped) or "none")
        + "."
    )
    for status, what in (("no plan", "No plan fits"), ("skipped", "Not attempted")):
        found = [r for r in rows if r["status"] == status]
        if found:
            lines.append(f"- {what}: " + ", ".join(name(r) for r in found) + ".")
    return lines


def _main_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "| model | devices | cluster | method | µ-batches | stages (layers, hosts x devices as "
        "logical mesh) | step s | TFLOP/s / device | MFU | GiB / device | best baseline "
        "(step s) | ours / best | plan s | baselines s | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.get("predicted") or {}
        best = r.get("best_baseline")
        best_text = (
            f"{best} ({r['best_baseline_step_s']:.3g})"
            if best
            else ("none fits" if r.get("status") == "ok" else "–")
        )
        memory = p["memory_per_device_bytes"] / GiB if p else None
        lines.append(
            f"| {_model_text(r)} | {r['devices']} | {r['cluster']} | {_method_text(r)} | "
            f"{r['micro_batches']} | {_stages_text(r) or '–'} | {_fmt(p.get('step_s'))} | "
            f"{_fmt(r.get('tflops_per_device'), '.1f')} | {_fmt(r.get('mfu'), '.0%')} | "
            f"{_fmt(memory, '.1f')} | {best_text} | {_fmt(r.get('ratio'), '.3f')} | "
            f"{_fmt(r.get('plan_s'), '.1f')} | {_fmt(r.get('explain_s'), '.1f')} | "
            f"{_status_text(r)} |"
        )
    return lines


def _layouts_table(rows: list[dict[str, Any]]) -> list[str]:
    names = sorted({b["name"] for r in rows for b in r.get("baselines", [])}, key=_layout_order)
    if not names:
        return []
    lines = [
        "",
        "## Every layout's predicted step time (s)",
        "",
        "OOM (X GiB): over device memory, X the least the layout needs; n/a: the layout does "
        "not apply (e.g. the batch does not split over the devices).",
        "",
        "| model | devices | cluster | ours | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        if not r.get("baselines"):
            continue
        cells = {b["name"]: _baseline_cell(b) for b in r["baselines"]}
        lines.append(
            f"| {_model_text(r)} | {r['devices']} | {r['cluster']} | "
            f"{_fmt(r['predicted']['step_s'])} | "
            + " | ".join(cells.get(n, "–") for n in names)
            + " |"
        )
    return lines


def _config_text(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items() if k not in ("pipeline_boundaries",))


def _compile_table(compiled: list[dict[str, Any]]) -> list[str]:
    if not compiled:
        return []
    lines = [
        "",
        f"## Cost model against XLA ({COMPILE_DEVICES} simulated CPU devices)",
        "",
        f"Each family at a reduced size, batch {COMPILE_BATCH}, 1 micro-batch, ShardParallel "
        "planned for the cluster preset with the memory rules of XLA:CPU, the backend that "
        "compiles it (`ClusterSpec.platform` cpu), and compiled by XLA: the predicted "
        "collective bytes per device against the summed result sizes of the HLO's collectives "
        "(`Executable.collectives()`), the predicted peak memory per device against XLA's "
        "memory analysis (arguments + outputs − aliases + temporaries, "
        "`Executable.memory_stats().peak_bytes`).",
        "",
        "| model | planned for | mesh | comm predicted | comm HLO | pred. / HLO | "
        "memory predicted | XLA peak | pred. / XLA | HLO collectives | plan + compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in compiled:
        label = FAMILY_NAMES[c["family"]]
        if c.get("status") != "ok":
            lines.append(
                f"| {label} | {c['cluster']} | {c['status']}: {c.get('error', '')} |" + " |" * 8
            )
            continue
        kinds = ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in c["hlo_collectives"].items())
        lines.append(
            f"| {label} ({c['params'] / 1e6:.1f}M params) | {c['cluster']} | {_stages_text(c)} | "
            f"{c['predicted_comm_bytes'] / MiB:.1f} MiB | {c['hlo_comm_bytes'] / MiB:.1f} MiB | "
            f"{_fmt(c['comm_ratio'], '.3f')} | {c['predicted_memory_bytes'] / MiB:.0f} MiB | "
            f"{c['xla_peak_bytes'] / MiB:.0f} MiB | {_fmt(c['memory_ratio'], '.3f')} | "
            f"{kinds or 'none'} | {c['plan_and_compile_s']:.1f} |"
        )
    configs = {c["family"]: c["config"] for c in compiled if c.get("config")}
    lines.append("")
    lines.extend(f"- {FAMILY_NAMES[f]}: {_config_text(cfg)}" for f, cfg in configs.items())
    return lines


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = _header(result) + _main_table(rows) + _findings(rows) + _layouts_table(rows)
    lines += _compile_table(result.get("compile_rows") or [])
    name = result["setup"].get("name", "suite")
    plots = ", ".join(f"`{name}_{kind}.png`" for kind in PLOTS)
    lines += ["", f"Plots: {plots}."]
    return "\n".join(lines) + "\n"


def _layout_order(name: str) -> tuple[int, str]:
    fixed = ["DP", "Z2", "Z3", "Megatron"]
    return (fixed.index(name), name) if name in fixed else (len(fixed), name)


# ----------------------------------------------------------------------------- plots


def _xy(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    return [x for x, _ in points], [y for _, y in points]


def baseline_tflops(row: dict[str, Any]) -> float | None:
    """The best baseline's predicted TFLOP/s per device, from its own FLOPs (a baseline does
    not recompute, a rematerialised pipeline does)."""
    best = [b for b in row.get("baselines", []) if b["name"] == row.get("best_baseline")]
    if not best or not best[0].get("step_s"):
        return None
    return best[0]["flops"] / best[0]["step_s"] / row["devices"] / 1e12


def _tflops_panel(ax, rows: list[dict[str, Any]]) -> None:
    """Predicted TFLOP/s per device against devices: ours, the best baseline and the device
    peak; x where there is no plan."""
    ours = [(r["devices"], r["tflops_per_device"]) for r in rows if r.get("tflops_per_device")]
    base = [(r["devices"], baseline_tflops(r)) for r in rows if baseline_tflops(r)]
    missing = [r["devices"] for r in rows if not r.get("tflops_per_device")]
    peaks = [r["tflops_per_device"] / r["mfu"] for r in rows if r.get("mfu")]
    if ours:
        ax.plot(*_xy(ours), "o-", color="C0", label="autopar")
    if base:
        ax.plot(*_xy(base), "s--", color="C1", alpha=0.7, label="best baseline that fits")
    if peaks:
        ax.axhline(peaks[0], color="grey", ls=":", lw=1, label="device peak")
    if missing:
        ax.plot(missing, [0] * len(missing), "x", color="C3", ms=9, label="no plan")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("predicted TFLOP/s per device")
    ax.set_ylim(bottom=-0.03 * (peaks[0] if peaks else 1), top=1.1 * peaks[0] if peaks else None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")


def plot(result: dict[str, Any], out_dir: pathlib.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    name = result["setup"].get("name", "suite")
    families = list(dict.fromkeys(r["family"] for r in rows))
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    colors = {c: f"C{i}" for i, c in enumerate(clusters)}
    written = []

    fig, axes = plt.subplots(
        len(clusters),
        len(families),
        figsize=(4.5 * len(families), 3.4 * len(clusters)),
        squeeze=False,
    )
    for i, cluster in enumerate(clusters):
        for ax, family in zip(axes[i], families, strict=True):
            _tflops_panel(
                ax, [r for r in rows if r["family"] == family and r["cluster"] == cluster]
            )
            ax.set_title(f"{FAMILY_NAMES[family]}, {cluster}", fontsize=10)
            ax.set_xticks([d for d, *_ in SUITE[family]], [str(d) for d, *_ in SUITE[family]])
    fig.suptitle(
        "Weak scaling (the model grows with the devices), cost-model prediction; "
        "x: no plan (see suite.md)",
        fontsize=10,
    )
    fig.tight_layout()
    path = out_dir / f"{name}_tflops.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)

    fig, ax = plt.subplots(figsize=(max(7, 0.3 * len(rows)), 4.5))
    ratios = [r.get("ratio") for r in rows]
    shown = [x for x in ratios if x is not None]
    low = min([0.95, *shown]) - 0.01
    ax.bar(
        range(len(rows)),
        [1.0 - low if x is None else x - low for x in ratios],
        bottom=low,
        color=[
            "none" if x is None else colors[r["cluster"]] for r, x in zip(rows, ratios, strict=True)
        ],
        edgecolor=[colors[r["cluster"]] for r in rows],
    )
    for i, (r, x) in enumerate(zip(rows, ratios, strict=True)):
        text = f"{x:.3f}" if x is not None else _short_status(r)
        ax.text(i, low + 0.002, text, rotation=90, ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="k", lw=1)
    labels = [f"{r['family']} {r['size']}@{r['devices']} {r['cluster'][2:6]}" for r in rows]
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylim(low, max([1.02, *shown]))
    ax.set_ylabel("predicted step time: ours / best baseline")
    ax.set_title(
        "Below 1: the plan beats every classic layout that fits (hollow: no ratio)", fontsize=10
    )
    fig.tight_layout()
    path = out_dir / f"{name}_vs_baseline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    cap = result["setup"]["case_timeout_s"]
    for j, family in enumerate(families):
        for cluster in clusters:
            mine = [r for r in rows if r["family"] == family and r["cluster"] == cluster]
            timed = [(r["devices"], r["plan_s"]) for r in mine if r.get("plan_s") and "stages" in r]
            capped = [r["devices"] for r in mine if r["status"] == "timeout"]
            label = f"{FAMILY_NAMES[family]}, {cluster}"
            marker = "os^D"[j % 4]
            if timed:
                ax.plot(*_xy(timed), marker=marker, color=colors[cluster], label=label)
            if capped:
                ax.plot(
                    capped, [cap] * len(capped), marker, color=colors[cluster], mfc="none", ms=9
                )
    ax.axhline(cap, color="r", ls=":", label="cap (hollow: not planned within it)")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["devices"] for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_yscale("log")
    ax.set_xlabel("devices (the model grows with them)")
    ax.set_ylabel("planning time, s (trace + plan)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / f"{name}_planning_time.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)
    return written


def _short_status(row: dict[str, Any]) -> str:
    return {
        "ok": "no baseline fits",
        "timeout": "cap",
        "baselines timeout": "baselines: cap",
        "skipped": "not attempted",
        "no plan": "no plan fits",
    }.get(row["status"], row["status"])


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(SUITE), choices=list(SUITE))
    parser.add_argument(
        "--clusters",
        nargs="+",
        default=list(CLUSTERS),
        metavar="PRESET",
        help="single-host presets (planner/cluster.py)",
    )
    parser.add_argument("--max-devices", type=int, default=64)
    parser.add_argument(
        "--case-timeout",
        type=float,
        default=120.0,
        help="wall-clock cap on planning a case (trace + plan), s",
    )
    parser.add_argument(
        "--baselines-timeout",
        type=float,
        default=120.0,
        help="further wall-clock cap on pricing a planned case's baselines, s",
    )
    add_solver_arguments(parser)
    parser.add_argument("--dtype", default="float16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--attempt-all",
        action="store_true",
        help="also plan the larger cases of a family and cluster after one hit the cap",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip part 2 (XLA check)")
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="rerun part 2 alone, keeping part 1's rows of the results JSON (--name)",
    )
    parser.add_argument(
        "--name",
        default="suite",
        help="output name: benchmarks/results/NAME.json, NAME.md, NAME_*.png",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite NAME.md and the plots from benchmarks/results/NAME.json; plan nothing",
    )
    parser.add_argument("--log-level", default="WARNING")
    # internal: what one child process does
    parser.add_argument("--one-case", help=argparse.SUPPRESS)
    parser.add_argument("--compile-case", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=pathlib.Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if args.one_case:
        return plan_one(case_by_key(args.one_case), args, args.out)
    if args.compile_case:
        return compile_one(*args.compile_case.split(":"), args.out)

    if args.report_only:
        result = json.loads((RESULTS / f"{args.name}.json").read_text())
        write_report(result)
        return None

    if args.compile_only:
        result = json.loads((RESULTS / f"{args.name}.json").read_text())
        result["compile_rows"] = compile_all(args)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        write_report(result)
        return None

    from autopar.planner.cluster import preset_names

    unknown = [c for c in args.clusters if c not in preset_names()]
    if unknown:
        sys.exit(f"unknown presets {unknown}; known: {preset_names()}")
    cases = all_cases(args.families, args.clusters, args.max_devices)
    start = time.perf_counter()
    rows = []
    capped: dict[tuple[str, str], dict[str, Any]] = {}  # (family, cluster) -> first capped row
    for case in tqdm(cases, desc="plan", unit="case"):
        after = capped.get((case.family, case.cluster))
        if after is not None and not args.attempt_all:
            row = skipped_row(case, after)
        else:
            row = run_case(case, args)
            if row["status"] == "timeout":
                capped.setdefault((case.family, case.cluster), row)
        rows.append(row)
        step = (row.get("predicted") or {}).get("step_s")
        tqdm.write(
            f"{case.key}: {_status_text(row)}; step {_fmt(step)} s, ours/best "
            f"{_fmt(row.get('ratio'), '.3f')}, plan {_fmt(row.get('plan_s'), '.1f')} s, wall "
            f"{row['wall_s']:.0f} s"
        )
    compile_rows = [] if args.no_compile else compile_all(args)
    result = {
        "setup": {
            "name": args.name,
            "command": " ".join(["python benchmarks/run.py", *sys.argv[1:]]),
            "families": args.families,
            "clusters": args.clusters,
            "max_devices": args.max_devices,
            "case_timeout_s": args.case_timeout,
            "baselines_timeout_s": args.baselines_timeout,
            "solver": args.solver,
            "time_limit_s": args.time_limit,
            "dtype": args.dtype,
            "pipeshard_layers": "max(4, 2 x hosts)",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        },
        "rows": rows,
        "compile_rows": compile_rows,
        "total_s": time.perf_counter() - start,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    write_report(result)
    return None


def compile_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Part 2's rows: each family at its reduced size compiled for each cluster."""
    rows = []
    pairs = [(f, c) for f in args.families for c in args.clusters]
    for family, cluster in tqdm(pairs, desc="compile", unit="case"):
        row = run_compile(family, cluster, args)
        rows.append(row)
        tqdm.write(
            f"{family} (reduced) for {cluster}: comm pred/HLO "
            f"{_fmt(row.get('comm_ratio'), '.3f')}, memory pred/XLA "
            f"{_fmt(row.get('memory_ratio'), '.3f')}"
        )
    return rows


def write_report(result: dict[str, Any]) -> None:
    """suite.md and the plots from the suite's result; the tables go to stdout too."""
    text = markdown(result)
    name = result["setup"].get("name", "suite")
    (RESULTS / f"{name}.md").write_text(text)
    plot(result, RESULTS)
    print(text)


if __name__ == "__main__":
    main()
