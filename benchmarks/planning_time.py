"""Benchmark: how long ShardParallel takes to plan Alpa's GPT models, from shapes alone.

For each model (seq 1024, vocab 51200; Alpa's global batch 1024 in 128 micro-batches by default,
so the step is traced on micro-batches of 8 sequences) this times what `autopar.plan` does with a
`ShardParallel` method: tracing the step to a jaxpr (`autopar.tracing.trace_step`) and planning it
(`plan_shard_parallel`: grouping, strategy menus and costs, ILP). The state comes from
`jax.eval_shape` and the batch from `jax.ShapeDtypeStruct`s: nothing is allocated or compiled.

    python benchmarks/planning_time.py [--models 125M 350M] [--cluster 8xV100-p3] [--profile F]

Writes benchmarks/results/planning_time.json and planning_time.md (and, with --profile FILE,
cProfile's top 15 functions by cumulative time for each model to FILE).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pathlib
import pstats
import re
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
from autopar.models import GPTConfig, gpt
from autopar.planner.cluster import preset_names
from autopar.planner.intra import plan_shard_parallel

logger = logging.getLogger("planning_time")

TARGET_S = 15.0  # the goal for GPT-1.3B: trace + plan on a laptop-class CPU
_NOTE = re.compile(r"ILP over (\d+) groups \((\d+) classes\), (optimal|time limit hit)")


class _IlpLog(logging.Handler):
    """Keeps the numbers of `plan_shard_parallel`'s "sharding ILP: ..." log record."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("sharding ILP") and len(record.args or ()) == 6:
            keys = ("nodes", "groups", "classes", "edges", "solve_s", "rounds")
            self.last = dict(zip(keys, record.args, strict=True))


def time_model(
    name: str, args: argparse.Namespace, cluster: autopar.ClusterSpec, ilp_log: _IlpLog
) -> dict[str, Any]:
    config = GPTConfig.alpa(name, dtype=jnp.dtype(args.dtype))
    state, batch = gpt_inputs(config, args.global_batch)
    option = autopar.AutoShardingOption(solver=args.solver, time_limit_s=args.time_limit)
    method = autopar.ShardParallel(
        num_micro_batches=args.micro_batches, auto_sharding_option=option
    )
    ilp_log.last = {}
    start = time.perf_counter()
    traced = trace_gpt_step(method, state, batch)
    traced_at = time.perf_counter()
    mesh, _ = method.mesh(cluster)
    plan = plan_shard_parallel(
        traced.program, mesh, cluster, option.to_config(), args.micro_batches
    )
    end = time.perf_counter()
    found = next((m for n in plan.notes if (m := _NOTE.search(n))), None)
    solve_s = ilp_log.last.get("solve_s")
    plan_s = end - traced_at
    p = plan.predicted
    return {
        "model": name,
        "params": gpt.param_count(config),
        "hidden": config.hidden,
        "layers": config.num_layers,
        "heads": config.num_heads,
        "nodes": len(traced.program.graph),
        "inputs": len(traced.program.signature.input_paths),
        "groups": int(found.group(1)) if found else ilp_log.last.get("groups"),
        "classes": int(found.group(2)) if found else ilp_log.last.get("classes"),
        "edges": ilp_log.last.get("edges"),
        "ilp_rounds": ilp_log.last.get("rounds"),
        "optimal": found.group(3) == "optimal" if found else None,
        "trace_s": traced_at - start,
        "build_s": plan_s - solve_s if solve_s is not None else None,
        "solve_s": solve_s,
        "plan_s": plan_s,
        "total_s": end - start,
        "predicted_step_ms": p.step_time_s * 1e3,
        "predicted_memory_gib": p.memory_per_device_bytes / 2**30,
        "notes": list(plan.notes),
    }


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    s = result["setup"]
    lines = [
        f"# ShardParallel planning time, GPT on {s['cluster']} ({s['devices']} devices)",
        "",
        f"Shapes only (no compile). Global batch {s['global_batch']} in {s['micro_batches']} "
        f"micro-batches (traced on {s['micro_batch']} sequences), seq {s['seq_len']}, "
        f"{s['dtype']} compute, solver {s['solver']} (time limit {s['time_limit_s']:.0f} s), "
        f"{s['machine']}.",
        "",
        "| model | params | nodes | groups | classes | edges | trace s | build s | ILP s | "
        "plan s | total s | ILP status | pred. step ms | pred. GiB/dev |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} |" + " |" * 12)
            continue
        status = {True: "optimal", False: "time limit hit", None: "?"}[r["optimal"]]
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['nodes']} | {r['groups']} | "
            f"{r['classes']} | {r['edges']} | {r['trace_s']:.2f} | {_fmt(r['build_s'])} | "
            f"{_fmt(r['solve_s'])} | {r['plan_s']:.2f} | {r['total_s']:.2f} | {status} | "
            f"{r['predicted_step_ms']:.1f} | {r['predicted_memory_gib']:.2f} |"
        )
    lines += [
        "",
        "trace: `trace_step` (jaxpr, inlining, op graph); build: grouping, strategy menus, costs, "
        "memory model; ILP: HiGHS solve incl. memory cuts; plan = build + ILP; total = trace + "
        "plan (what `autopar.plan` spends).",
    ]
    target = result.get("target")
    if target:
        lines.append(
            f"Target: {target['model']} in ≤ {target['target_s']:.0f} s — measured "
            f"{target['total_s']:.1f} s ({'met' if target['met'] else 'missed'})."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--cluster", default="8xV100-p3", choices=preset_names())
    add_solver_arguments(parser)
    parser.add_argument(
        "--profile", metavar="FILE", help="cProfile each model; write the top functions to FILE"
    )
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    ilp_log = _IlpLog()
    intra_logger = logging.getLogger("autopar.planner.intra")
    intra_logger.addHandler(ilp_log)
    if intra_logger.getEffectiveLevel() > logging.INFO:
        intra_logger.setLevel(logging.INFO)
        intra_logger.propagate = logging.getLogger().level <= logging.INFO
    cluster = autopar.ClusterSpec.preset(args.cluster)

    rows, profiles = [], []
    with logging_redirect_tqdm():
        for name in tqdm(args.models, desc="planning"):
            profiler = cProfile.Profile() if args.profile else None
            try:
                if profiler:
                    profiler.enable()
                row = time_model(name, args, cluster, ilp_log)
            except Exception as e:  # noqa: BLE001 - a crash is a result to report
                logger.exception("planning GPT-%s failed", name)
                row = {"model": name, "error": f"{type(e).__name__}: {e}"}
            finally:
                if profiler:
                    profiler.disable()
            rows.append(row)
            if "error" not in row:
                logger.info(
                    "GPT-%s: %d nodes, %s groups, %s classes; trace %.2f s, plan %.2f s "
                    "(ILP %s s), total %.2f s",
                    name,
                    row["nodes"],
                    row["groups"],
                    row["classes"],
                    row["trace_s"],
                    row["plan_s"],
                    _fmt(row["solve_s"]),
                    row["total_s"],
                )
            if profiler:
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(15)
                profiles.append(f"===== GPT-{name} =====\n{out.getvalue()}")

    timed = [r for r in rows if "error" not in r]
    target = None
    if timed:
        biggest = next((r for r in timed if r["model"] == "1.3B"), timed[-1])
        target = {
            "model": biggest["model"],
            "target_s": TARGET_S,
            "total_s": biggest["total_s"],
            "met": biggest["total_s"] <= TARGET_S,
        }
    result = {
        "setup": {
            "cluster": args.cluster,
            "devices": cluster.num_devices,
            "global_batch": args.global_batch,
            "micro_batches": args.micro_batches,
            "micro_batch": args.global_batch // args.micro_batches,
            "seq_len": 1024,
            "dtype": args.dtype,
            "solver": args.solver,
            "time_limit_s": args.time_limit,
            "machine": f"jax {jax.__version__}, {os.cpu_count()} CPU cores",
        },
        "rows": rows,
        "target": target,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planning_time.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (RESULTS / "planning_time.md").write_text(table + "\n")
    if args.profile:
        pathlib.Path(args.profile).write_text("\n".join(profiles))
    print(table)


if __name__ == "__main__":
    main()
