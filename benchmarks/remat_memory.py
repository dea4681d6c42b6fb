"""Recomputation held against XLA's memory analysis on ONE device (run it on a GPU).

ShardParallel recomputes activations where nothing fits as traced, on GPU clusters only (XLA's CPU
scheduler runs the recomputation early and keeps what it was meant to free). This checks what
that plan promises on the backend it is made for: the bundled GPT on one device, planned with a
memory budget of `BUDGET_FRACTION` of what its plan needs as traced; the plan must recompute, and
the compiled step's peak in XLA's memory analysis (arguments + outputs − donated aliases +
temporaries) must be within the budget. The optimizer is plain SGD, so that what the parameters
moved in `STEPS` steps is a sum of gradients: it is compared with what the serial `jax.jit`
step moves them (Adam would turn rounding noise into steps of the learning rate), in fp32 at
the highest matmul precision (TF32 rounding would hide a wrong result).

    JAX_PLATFORMS=cuda python benchmarks/remat_memory.py

Writes benchmarks/results/remat_memory_<platform>.{json,md}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

os.environ["AUTOPAR_PLAN_CACHE"] = "off"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402
from autopar.models import GPTConfig, gpt  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
CONFIG = GPTConfig(vocab_size=1024, seq_len=128, hidden=256, num_layers=8)
BATCH = 64
BUDGET_FRACTION = 0.6
STEPS = 2
LEARNING_RATE = 0.1
MIB = 2**20


def _method(budget: float) -> autopar.ShardParallel:
    option = autopar.AutoShardingOption(memory_budget_per_device=budget)
    return autopar.ShardParallel(auto_sharding_option=option)


def _moved(step, state, batch) -> list[np.ndarray]:
    """What `STEPS` steps of `step` move each parameter (float64)."""
    moved = state
    for _ in range(STEPS):
        moved, _ = step(moved, batch)
    return [
        np.asarray(after, np.float64) - np.asarray(before, np.float64)
        for after, before in zip(
            jax.tree.leaves(moved.params), jax.tree.leaves(state.params), strict=True
        )
    ]


def _errors(got: list[np.ndarray], want: list[np.ndarray]) -> tuple[float, float]:
    """`got` against `want`: relative to the whole update's norm, and the worst leaf's own."""
    pairs = list(zip(got, want, strict=True))
    total = np.sqrt(sum(np.sum((g - w) ** 2) for g, w in pairs))
    scale = np.sqrt(sum(np.sum(w**2) for w in want))
    worst = max(np.linalg.norm(g - w) / np.linalg.norm(w) for g, w in pairs if w.any())
    return float(total / scale), float(worst)


def main() -> None:
    if len(jax.devices()) != 1:
        raise SystemExit("run with ONE device (unset XLA_FLAGS device counts)")
    jax.config.update("jax_default_matmul_precision", "highest")
    device = jax.devices()[0]
    spec = dataclasses.replace(autopar.ClusterSpec.local(1), platform="gpu")
    autopar.init("local", cluster_spec=spec)
    train_step = gpt.make_train_step(autopar.value_and_grad)
    sgd = optax.sgd(LEARNING_RATE)
    state = gpt.create_train_state(CONFIG, batch_size=2)
    state = state.replace(tx=sgd, opt_state=sgd.init(state.params))
    batch = gpt.make_batch(CONFIG, BATCH)
    roomy = autopar.parallelize(train_step, method=_method(spec.device_memory))
    as_traced = roomy.get_plan(state, batch)
    budget = BUDGET_FRACTION * as_traced.predicted.memory_per_device_bytes
    step = autopar.parallelize(train_step, method=_method(budget))
    plan = step.get_plan(state, batch)
    stats = step.get_executable(state, batch).memory_stats()
    reference = _moved(jax.jit(gpt.train_step), state, batch)
    error, worst_leaf = _errors(_moved(step, state, batch), reference)
    control, control_worst = _errors(_moved(roomy, state, batch), reference)
    autopar.shutdown()
    result = {
        "device": f"one {device.device_kind} ({device.platform})",
        "model": f"GPT (vocab {CONFIG.vocab_size}, seq {CONFIG.seq_len}, hidden {CONFIG.hidden}, "
        f"{CONFIG.num_layers} layers, fp32), batch {BATCH}, SGD",
        "as_traced_predicted_bytes": as_traced.predicted.memory_per_device_bytes,
        "budget_bytes": budget,
        "recomputed": any("recomputed" in note for note in plan.notes),
        "notes": list(plan.notes),
        "predicted_bytes": plan.predicted.memory_per_device_bytes,
        "xla_peak_bytes": stats.peak_bytes,
        "xla_temp_bytes": stats.temp_bytes,
        "within_budget": stats.peak_bytes <= budget,
        "update_relative_error": error,
        "update_worst_leaf_relative_error": worst_leaf,
        "not_recomputed_update_relative_error": control,
        "not_recomputed_update_worst_leaf_relative_error": control_worst,
    }
    print(json.dumps(result, indent=1))
    _write(result, device.platform)


def _write(result: dict, platform: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"remat_memory_{platform}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        ("device", result["device"]),
        ("model", result["model"]),
        ("plan as traced, predicted", f"{result['as_traced_predicted_bytes'] / MIB:.1f} MiB"),
        ("budget", f"{result['budget_bytes'] / MIB:.1f} MiB ({BUDGET_FRACTION:.0%} of that)"),
        ("plan recomputes", "yes" if result["recomputed"] else "no"),
        ("plan, predicted", f"{result['predicted_bytes'] / MIB:.1f} MiB"),
        ("XLA's memory analysis: peak", f"{result['xla_peak_bytes'] / MIB:.1f} MiB"),
        ("within the budget", "yes" if result["within_budget"] else "**no**"),
        (
            f"what {STEPS} SGD steps moved the parameters, against serial: relative error "
            "(worst leaf)",
            f"{result['update_relative_error']:.1e} "
            f"({result['update_worst_leaf_relative_error']:.1e})",
        ),
        (
            "the same for the plan as traced (no recomputation)",
            f"{result['not_recomputed_update_relative_error']:.1e} "
            f"({result['not_recomputed_update_worst_leaf_relative_error']:.1e})",
        ),
    ]
    lines = [
        "# Recomputation against XLA's memory analysis",
        "",
        "`python benchmarks/remat_memory.py` (see its docstring).",
        "",
        "| | |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
        "",
        "Plan notes: " + "; ".join(result["notes"]),
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.md", file=sys.stderr)


if __name__ == "__main__":
    main()
