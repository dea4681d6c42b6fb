"""Benchmark: ShardParallel's ILP plan versus hand-written baselines, all under one cost model.

For Alpa's GPT models (seq 1024, vocab 51200; global batch 1024 in 128 micro-batches by default)
on 8-GPU cluster presets, the unrestricted ILP plan is compared with four classic layouts, as
`autopar.planner.baselines` defines and prices them (the library code `autopar.explain` uses).
Each baseline is the same ILP with the storage spec of EVERY step input pinned
(`IntraOpConfig.pinned_inputs`), so all are priced by the same cost model; the ILP still picks the
strategies of the ops in between (it cannot do worse than the layout's natural strategies). A
baseline that does not fit device memory is reported as OOM with the least memory it needs.

* DP: batch split on dim 0; parameters, optimizer state and scalars replicated.
* Z2 (ZeRO-2): batch split; parameters replicated; optimizer state split on its largest dim
  divisible by the device count (`split_spec`).
* Z3 (ZeRO-3 / FSDP): batch split; parameters and optimizer state split the same way.
* Megatron (8-way tensor parallelism): batch replicated; on GPT the library's rule gives: q/k/v
  kernels (hidden, heads, head_dim) and fc_in split on their output dim (heads, or head_dim
  where heads is not divisible by the device count: GPT-125M has 12 heads), q/v biases and the
  fc_in bias with them; attention out (heads, head_dim, hidden) and fc_out split on their input
  dim; token embedding split on vocab (Megatron's VocabParallelEmbedding) and the LM head on
  vocab (its column-parallel output layer); position embedding, layernorms, out/fc_out biases
  and scalars replicated; Adam moments mirror their parameter.

    python benchmarks/plan_quality.py [--models 125M] [--clusters 8xV100-p3] [--time-limit 60]

The ILP solver is HiGHS when `highspy` is installed (much faster here than CBC), else CBC; each
solve is capped at 30 s by default; the 45 plans take about 3 minutes on 2 CPU cores.

Writes benchmarks/results/plan_quality.json and plan_quality.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
from gpt_shapes import (
    RESULTS,
    add_shape_arguments,
    add_solver_arguments,
    gpt_inputs,
    trace_gpt_step,
)
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import autopar
from autopar.models import GPTConfig
from autopar.planner.baselines import (
    TOLERANCE,
    Baseline,
    InputRole,
    LayoutResult,
    baseline_pins,
    input_roles,
    price_layout,
)
from autopar.planner.cluster import preset_names
from autopar.planner.intra import IntraOpConfig
from autopar.planner.plan import MeshPlan, Plan, Spec
from autopar.planner.program import Program
from autopar.planner.summary import format_bytes

logger = logging.getLogger("plan_quality")

CLUSTERS = ("8xV100-p3", "8xA100-80G", "8xH100-80G")
BASELINES = tuple(b.value for b in Baseline)  # DP, Z2, Z3, Megatron
METHODS = ("ILP",) + BASELINES
GiB = 2**30
ROLES = {"batch": InputRole.BATCH, "param": InputRole.PARAM, "opt": InputRole.PARAM_STATE}
Pins = tuple[tuple[str, Spec], ...]


# ----------------------------------------------------------------------------- evaluation


def _split_fraction(program: Program, plan: Plan, role: InputRole) -> float | None:
    """Fraction of the bytes of inputs of `role` that the plan stores split."""
    sig = program.signature
    total = split = 0
    for aval, spec, kind in zip(
        sig.input_avals, plan.stages[0].input_specs, input_roles(program), strict=True
    ):
        if kind is not role:
            continue
        size = math.prod(aval.shape) * aval.dtype.itemsize
        total += size
        split += size if any(spec) else 0
    return split / total if total else None


def evaluate(result: LayoutResult, program: Program, pins: Pins, seconds: float) -> dict[str, Any]:
    """A priced layout as a result row entry."""
    if not result.fits:
        logger.info("planning failed: %s", result.message)
        needs = result.least_memory_bytes
        return {
            "status": result.status.value,
            "needs": None if needs is None else format_bytes(needs),
            "message": result.message,
            "plan_s": seconds,
        }
    plan, p = result.plan, result.predicted
    pinned = dict(pins)
    broken = [
        path
        for path, spec in zip(plan.input_paths, plan.stages[0].input_specs, strict=True)
        if path in pinned and tuple(spec) != tuple(pinned[path])
    ]
    if broken:
        logger.warning(
            "%d pinned inputs were not stored as pinned, e.g. %s", len(broken), broken[0]
        )
    return {
        "status": "ok",
        "step_ms": p.step_time_s * 1e3,
        "compute_ms": p.compute_s * 1e3,
        "communication_ms": p.communication_s * 1e3,
        "memory_gib": p.memory_per_device_bytes / GiB,
        "communication_gib": p.communication_bytes / GiB,
        "optimal": not any("time limit" in note for note in plan.notes),
        "pins_broken": len(broken),
        "split": {name: _split_fraction(program, plan, role) for name, role in ROLES.items()},
        "plan_s": seconds,
    }


def run_method(
    program: Program,
    method: str,
    mesh: MeshPlan,
    cluster: autopar.ClusterSpec,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Plan one method: the ILP unrestricted, a baseline with its storage layout pinned."""
    pins = () if method == "ILP" else baseline_pins(program, Baseline(method), mesh)
    config = IntraOpConfig(solver=args.solver, time_limit_s=args.time_limit, pinned_inputs=pins)
    start = time.perf_counter()
    result = price_layout(program, mesh, cluster, config, args.micro_batches, method)
    return evaluate(result, program, pins, time.perf_counter() - start)


def compare(row: dict[str, Any]) -> None:
    """Add the winner and the ILP's ratio to the best baseline that fits."""
    ok = {m: r["step_ms"] for m, r in row["methods"].items() if r["status"] == "ok"}
    row["winner"] = min(ok, key=ok.get) if ok else None
    baselines = {m: t for m, t in ok.items() if m != "ILP"}
    if "ILP" in ok and baselines:
        best = min(baselines, key=baselines.get)
        ratio = ok["ILP"] / baselines[best]
        row["best_baseline"] = best
        row["ilp_over_best_baseline"] = ratio
        row["ilp_worse"] = ratio > 1 + TOLERANCE
    else:
        row["best_baseline"] = None
        row["ilp_over_best_baseline"] = None
        row["ilp_worse"] = "ILP" in row["methods"] and "ILP" not in ok and bool(baselines)


# ----------------------------------------------------------------------------- report


def _cell(r: dict[str, Any], key: str = "step_ms", fmt: str = ".1f") -> str:
    if r["status"] == "oom":
        return f"OOM (needs {r['needs']})" if r.get("needs") else "OOM"
    if r["status"] != "ok":
        return r["status"]
    return f"{r[key]:{fmt}}" + ("" if r["optimal"] else " †")


def markdown(result: dict[str, Any]) -> str:
    s = result["setup"]
    methods = s["methods"]
    lines = [
        "# Plan quality: ShardParallel's ILP vs baselines (predicted by the same cost model)",
        "",
        f"GPT (seq 1024, vocab 51200), global batch {s['global_batch']} in {s['micro_batches']} "
        f"micro-batches of {s['micro_batch']}, {s['dtype']} compute, 8 devices (1D mesh). "
        f"ILP solver {s['solver']} (time limit {s['time_limit_s']:.0f} s). Predicted step time "
        "in ms. Baselines are the ILP with every input's storage pinned. † = ILP time limit hit "
        "(best found); infeasible = no plan at all with these pins; "
        "OOM (needs X) = over device memory, X the least the layout needs.",
        "",
        "| model | cluster | " + " | ".join(methods) + " | winner | ILP / best baseline |",
        "|---" * (len(methods) + 4) + "|",
    ]
    for row in result["rows"]:
        ratio = row.get("ilp_over_best_baseline")
        verdict = "–" if ratio is None else f"{ratio:.4f} ({row['best_baseline']})"
        if row.get("ilp_worse"):
            verdict += " **ILP WORSE**"
        cells = [_cell(row["methods"][m]) for m in methods]
        lines.append(
            f"| {row['model']} | {row['cluster']} | " + " | ".join(cells) + f" | "
            f"{row.get('winner') or '–'} | {verdict} |"
        )
    for title, key, fmt in (
        ("Predicted peak memory per device (GiB)", "memory_gib", ".2f"),
        ("Predicted communication per step (GiB moved per device)", "communication_gib", ".2f"),
    ):
        lines += ["", f"## {title}", "", "| model | cluster | " + " | ".join(methods) + " |"]
        lines.append("|---" * (len(methods) + 2) + "|")
        for row in result["rows"]:
            cells = [_cell(row["methods"][m], key, fmt) for m in methods]
            lines.append(f"| {row['model']} | {row['cluster']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## What the ILP stores split (fraction of bytes)",
        "",
        "| model | cluster | batch | params | Adam moments |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        ilp = row["methods"].get("ILP", {})
        if ilp.get("status") == "ok":
            f = ilp["split"]
            lines.append(
                f"| {row['model']} | {row['cluster']} | {f['batch']:.0%} | {f['param']:.0%} | "
                f"{f['opt']:.0%} |"
            )
    worse = [r for r in result["rows"] if r.get("ilp_worse")]
    lines += [
        "",
        "ILP never worse than the best baseline (tolerance "
        f"{TOLERANCE:g}): **{'yes' if not worse else 'NO'}**.",
    ]
    for r in worse:
        lines.append(
            f"- {r['model']} on {r['cluster']}: ILP {_cell(r['methods']['ILP'])} ms vs "
            f"{r['best_baseline']} {_cell(r['methods'][r['best_baseline']])} ms"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS), choices=preset_names())
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    add_solver_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    k = args.micro_batches

    rows = []
    jobs = [(m, c, method) for m in args.models for c in args.clusters for method in args.methods]
    with logging_redirect_tqdm(), tqdm(total=len(jobs), desc="plans") as bar:
        for name in args.models:
            config = GPTConfig.alpa(name, dtype=jnp.dtype(args.dtype))
            traced = trace_gpt_step(
                autopar.ShardParallel(num_micro_batches=k), *gpt_inputs(config, args.global_batch)
            )
            program = traced.program
            for cluster_name in args.clusters:
                cluster = autopar.ClusterSpec.preset(cluster_name)
                mesh, _ = autopar.ShardParallel().mesh(cluster)
                row: dict[str, Any] = {"model": name, "cluster": cluster_name, "methods": {}}
                for method in args.methods:
                    bar.set_postfix_str(f"{name} {cluster_name} {method}")
                    try:
                        row["methods"][method] = run_method(program, method, mesh, cluster, args)
                    except Exception as e:  # noqa: BLE001 - a crash is a result to report
                        logger.exception("%s on %s, %s crashed", name, cluster_name, method)
                        row["methods"][method] = {
                            "status": "error",
                            "message": f"{type(e).__name__}: {e}",
                        }
                    bar.update()
                compare(row)
                rows.append(row)

    result = {
        "setup": {
            "global_batch": args.global_batch,
            "micro_batches": k,
            "micro_batch": args.global_batch // k,
            "dtype": args.dtype,
            "solver": args.solver,
            "time_limit_s": args.time_limit,
            "tolerance": TOLERANCE,
            "methods": args.methods,
            "machine": f"jax {jax.__version__}, {os.cpu_count()} CPU cores",
        },
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_quality.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (RESULTS / "plan_quality.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
