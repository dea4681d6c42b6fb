"""Bytes a training step moves per device with k = 1, 4, 16 micro-batches, per method, with
gradients reduced per micro-batch (before) and once per step (after, autopar's default).

Read off the compiled HLO on 8 simulated CPU devices (an op inside the micro-batch loop counts
once per micro-batch; a pipeline sums its stages and counts each backward variant as often as
a step runs it), next to the plan's predicted bytes. "Before" is the same plan with every
once-per-step reduction turned back into a per-micro-batch one, run through `autopar.PlanFile`.
Models: an MLP, the bundled GPT and transformers' Flax GPT-2 (random weights, small config).

    python benchmarks/grad_accumulation.py

Writes benchmarks/results/grad_accumulation.json and grad_accumulation.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ["AUTOPAR_PLAN_CACHE"] = "off"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import autopar  # noqa: E402

autopar.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

from autopar.models import GPTConfig, gpt  # noqa: E402
from autopar.planner.plan import Plan  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
BATCH = 128  # divisible by 8 devices x 16 micro-batches
MICRO_BATCHES = (1, 4, 16)


def _mlp():
    def loss(params, batch):
        h = jax.nn.relu(batch["x"] @ params["w1"])
        h = jax.nn.relu(h @ params["w2"])
        return jnp.mean((h @ params["w3"] - batch["y"]) ** 2)

    def step(params, batch):
        value, grads = autopar.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), value

    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {
        "w1": jax.random.normal(ks[0], (256, 512)) * 0.05,
        "w2": jax.random.normal(ks[1], (512, 512)) * 0.05,
        "w3": jax.random.normal(ks[2], (512, 256)) * 0.05,
    }
    batch = {
        "x": jax.random.normal(ks[3], (BATCH, 256)),
        "y": jax.random.normal(ks[4], (BATCH, 256)),
    }
    return step, (params, batch)


def _gpt():
    config = GPTConfig(num_layers=2)
    state = gpt.create_train_state(config, batch_size=2)
    return gpt.make_train_step(autopar.value_and_grad), (state, gpt.make_batch(config, BATCH))


def _hf_gpt2():
    from clients import gpt2

    client = gpt2(optax.sgd(0.1), BATCH)
    return client.step, client.args


MODELS = {"mlp": _mlp, "gpt (bundled)": _gpt, "gpt2 (transformers)": _hf_gpt2}
METHODS = {
    "DataParallel": autopar.DataParallel,
    "Zero2Parallel": autopar.Zero2Parallel,
    "Zero3Parallel": autopar.Zero3Parallel,
    "ShardParallel": autopar.ShardParallel,
    "Pipeshard 2 stages": lambda num_micro_batches: autopar.PipeshardParallel(
        num_micro_batches=num_micro_batches,
        layer_option=autopar.AutoLayerOption(layer_num=2),
        stage_option=autopar.UniformStageOption(2),
    ),
}


def per_micro_batch(plan: Plan) -> Plan:
    """`plan` with its gradients reduced per micro-batch: a reduce-scatter lowered per
    micro-batch, an all-reduce left to XLA (what autopar did before)."""
    stages = []
    for stage in plan.stages:
        sums = {
            node: dataclasses.replace(lowering, once_per_step=False)
            for node, lowering in stage.partial_sums.items()
            if not lowering.once_per_step
            or any(e and set(lowering.partial_axes) <= set(e) for e in lowering.output_spec)
        }
        stages.append(dataclasses.replace(stage, partial_sums=sums, gradient_reduction={}))
    return dataclasses.replace(plan, stages=tuple(stages))


def _bytes_per_step(executable) -> float:
    found = executable.collective_bytes_per_step()
    if isinstance(found, list):  # a pipeline: one entry per stage
        return sum(sum(stage.values()) for stage in found)
    return sum(found.values())


def _compiled(step, args, method):
    parallel = autopar.parallelize(step, method=method)
    parallel(*args)  # pipelines compile their segments on the first call
    return parallel.get_executable(*args)


def measure(model: str, method_name: str, k: int) -> dict:
    step, args = MODELS[model]()
    start = time.perf_counter()
    after = _compiled(step, args, METHODS[method_name](num_micro_batches=k))
    plan = after.plan
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "plan.json"
        path.write_text(per_micro_batch(plan).to_json())
        before = _compiled(step, args, autopar.PlanFile(path))
    reductions = [w for stage in plan.stages for w in stage.gradient_reduction.values()]
    return {
        "model": model,
        "method": method_name,
        "num_micro_batches": k,
        "bytes_before": _bytes_per_step(before),
        "bytes_after": _bytes_per_step(after),
        "predicted_after": plan.predicted.communication_bytes,
        "reduced_once": sum(w == "once per step" for w in reductions),
        "reduced_per_micro_batch": sum(w == "per micro-batch" for w in reductions),
        "seconds": time.perf_counter() - start,
    }


def _markdown(rows: list[dict]) -> str:
    lines = [
        "# Bytes moved per step: gradients reduced per micro-batch (before) and once per step",
        "",
        "Per device, from the compiled HLO on 8 simulated CPU devices (`make bench-grad`); ops "
        "inside the micro-batch loop count once per micro-batch. `after/k=1` is the step's "
        "bytes against the same method with one micro-batch; `once / per mb` counts parameters "
        "by when their gradient is reduced.",
        "",
        "| model | method | k | before (KiB) | after (KiB) | predicted (KiB) | after/k=1 "
        "| once / per mb |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    first = {
        (r["model"], r["method"]): r["bytes_after"] for r in rows if r["num_micro_batches"] == 1
    }
    for r in rows:
        base = first.get((r["model"], r["method"])) or 1.0
        lines.append(
            f"| {r['model']} | {r['method']} | {r['num_micro_batches']} "
            f"| {r['bytes_before'] / 1024:.1f} | {r['bytes_after'] / 1024:.1f} "
            f"| {r['predicted_after'] / 1024:.1f} | {r['bytes_after'] / base:.2f} "
            f"| {r['reduced_once']} / {r['reduced_per_micro_batch']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    cases = [(m, n, k) for m in MODELS for n in METHODS for k in MICRO_BATCHES]
    rows = [measure(*case) for case in tqdm(cases, desc="cases", unit="case")]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grad_accumulation.json").write_text(json.dumps(rows, indent=2))
    text = _markdown(rows)
    (RESULTS / "grad_accumulation.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
