"""Fuzzing: many random small models × methods × meshes × micro-batch counts, each parallel run
held against the serial `jax.jit` step (tests/fuzzing.py), on 8 simulated CPU devices.

Each case either matches the serial step (relative error ≤ 1e-5), is refused with an
`autopar.AutoparError`, or is a bug: a numerical mismatch or a crash (any other exception).
A case is drawn from its seed alone: reproduce one with
`run_case(draw_case(seed))` from tests/fuzzing.py.

    python benchmarks/fuzz.py --cases 300 [--start-seed 0]

Writes benchmarks/results/fuzz.json and fuzz.md.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import pathlib
import sys
import time
import warnings

# The plan cache must not answer for the code under test; 8 devices before jax starts.
os.environ["AUTOPAR_PLAN_CACHE"] = "off"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import autopar  # noqa: E402

autopar.simulate_cpu_devices(8)

from fuzzing import CaseResult, draw_case, run_case  # noqa: E402
from tqdm import tqdm  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
STATUSES = ("match", "refused", "mismatch", "crash")


def run_cases(start_seed: int, cases: int, steps: int) -> list[CaseResult]:
    """Run seeds start_seed .. start_seed + cases - 1; a case that raises is a crash result."""
    results = []
    bar = tqdm(range(start_seed, start_seed + cases), desc="fuzz", unit="case")
    for seed in bar:
        results.append(run_case(draw_case(seed), steps=steps))
        counts = collections.Counter(r.status for r in results)
        bar.set_postfix({s: counts[s] for s in STATUSES if counts[s]})
    return results


def _row(result: CaseResult) -> dict:
    return {
        "seed": result.case.seed,
        "case": result.case.describe(),
        "status": result.status,
        "max_relative_error": result.max_relative_error,
        "error_type": result.error_type,
        "error": result.error,
        "traceback": result.traceback,
        "location": result.location,
        "seconds": round(result.seconds, 3),
        "choices": dataclasses.asdict(result.case),
    }


def summarize(results: list[CaseResult]) -> dict:
    """Counts per status, refusals grouped by message, and every mismatch and crash."""
    counts = collections.Counter(r.status for r in results)
    refusals = collections.defaultdict(list)
    for r in results:
        if r.status == "refused":
            refusals[f"{r.error_type}: {r.error}"].append(r.case.seed)
    crashes, examples = collections.defaultdict(list), {}
    for r in results:
        if r.status == "crash":  # one bug: one exception type raised at one place
            key = f"{r.error_type} @ {r.location or 'outside autopar'}"
            crashes[key].append(r.case.seed)
            examples.setdefault(key, r.error)
    return {
        "cases": len(results),
        **{status: counts[status] for status in STATUSES},
        "refusals": [
            {"message": m, "count": len(s), "seeds": s}
            for m, s in sorted(refusals.items(), key=lambda kv: -len(kv[1]))
        ],
        "crash_groups": [
            {"error": e, "example": examples[e], "count": len(s), "seeds": s}
            for e, s in sorted(crashes.items(), key=lambda kv: -len(kv[1]))
        ],
        "mismatches": [_row(r) for r in results if r.status == "mismatch"],
        "crashes": [_row(r) for r in results if r.status == "crash"],
    }


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(summary: dict, header: str) -> str:
    """The results as markdown: counts, refusal messages, mismatches and crashes."""
    lines = [header, "", "| cases | match | refused | mismatch | crash |", "|---|---|---|---|---|"]
    lines.append("| " + " | ".join(str(summary[k]) for k in ("cases", *STATUSES)) + " |")
    lines += ["", "## Refusals (autopar.AutoparError), grouped by message", ""]
    lines += ["| count | message | seeds |", "|---|---|---|"]
    for group in summary["refusals"]:
        seeds = ", ".join(map(str, group["seeds"][:10])) + (" …" if group["count"] > 10 else "")
        lines.append(f"| {group['count']} | {_cell(group['message'])} | {seeds} |")
    lines += ["", "## Mismatches (relative error > 1e-5)", ""]
    lines += ["| seed | case | error |", "|---|---|---|"]
    for row in summary["mismatches"]:
        lines.append(f"| {row['seed']} | `{row['case']}` | {_cell(row['error'])} |")
    lines += ["", "## Crashes, grouped by exception and raising frame", ""]
    lines += ["| count | exception @ autopar frame | example message | seeds |"]
    lines += ["|---|---|---|---|"]
    for group in summary["crash_groups"]:
        seeds = ", ".join(map(str, group["seeds"][:10])) + (" …" if group["count"] > 10 else "")
        error, example = _cell(group["error"]), _cell(group["example"])
        lines.append(f"| {group['count']} | {error} | {example} | {seeds} |")
    lines += ["", "| seed | case | exception |", "|---|---|---|"]
    for row in summary["crashes"]:
        lines.append(
            f"| {row['seed']} | `{row['case']}` | {_cell(row['error_type'])}: "
            f"{_cell(row['error'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--start-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    # Per-case planner warnings (replicated ops, time limits) would drown the progress bar.
    logging.getLogger("autopar").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    results = run_cases(args.start_seed, args.cases, args.steps)
    seconds = time.perf_counter() - start
    summary = summarize(results)
    last = args.start_seed + args.cases - 1
    header = (
        "# Fuzzing: random models × methods × meshes against the serial step\n\n"
        f"Seeds {args.start_seed}..{last}, {args.steps} steps each, 8 simulated CPU devices, "
        f"{seconds:.0f} s; `python benchmarks/fuzz.py --cases {args.cases} "
        f"--start-seed {args.start_seed}`. Reproduce a case with "
        "`run_case(draw_case(seed))` from tests/fuzzing.py."
    )
    table = markdown(summary, header)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "start_seed": args.start_seed,
        "cases": args.cases,
        "steps": args.steps,
        "seconds": round(seconds, 1),
        "machine": "8 simulated CPU devices",
    }
    (RESULTS / "fuzz.json").write_text(
        json.dumps(
            {"meta": meta, "summary": summary, "cases": [_row(r) for r in results]}, indent=2
        )
    )
    (RESULTS / "fuzz.md").write_text(table)


if __name__ == "__main__":
    main()
