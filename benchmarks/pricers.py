"""The same layout priced twice: `explain`'s DP, ZeRO-2 and ZeRO-3 rows (the ILP with every
input's storage pinned) against planning DataParallel, Zero2Parallel and Zero3Parallel (their
own rule and formula), on the bundled GPT, MoE and MLP steps as users write them
(`jax.value_and_grad`, Adam), planned abstractly on the 8xV100 preset with default options.

Where the two agree the cost model is one; each gap is what issue 65's single pricer must close.
Writes `results/pricers.{json,md}`.

    python benchmarks/pricers.py
"""

from __future__ import annotations

import json
import pathlib

import jax

import autopar
from autopar.models import GPTConfig, MLPConfig, MoEConfig, gpt, mlp, moe
from autopar.planner.cluster import ClusterSpec

RESULTS = pathlib.Path(__file__).parent / "results"
FAMILIES = {
    "gpt": (gpt, GPTConfig(), 64),
    "moe": (moe, MoEConfig(), 64),
    "mlp": (mlp, MLPConfig(), 256),
}
METHODS = {"DP": autopar.DataParallel, "Z2": autopar.Zero2Parallel, "Z3": autopar.Zero3Parallel}
KiB = 2**10


def _figures(predicted) -> dict[str, float]:
    return {
        "step_us": predicted.step_time_s * 1e6,
        "compute_us": predicted.compute_s * 1e6,
        "communication_us": predicted.communication_s * 1e6,
        "memory_kib": predicted.memory_per_device_bytes / KiB,
        "traffic_kib": predicted.communication_bytes / KiB,
    }


def main() -> None:
    autopar.simulate_cpu_devices(8)
    cluster = ClusterSpec.preset("8xV100-p3")
    rows = []
    for family, (module, config, batch_size) in FAMILIES.items():
        state = module.create_train_state(config, batch_size=2)
        batch = module.make_batch(config, batch_size)
        step = module.make_train_step(jax.value_and_grad)
        explained = autopar.explain(step, state, batch, cluster_spec=cluster)
        baselines = {b.name: b for b in explained.baselines}
        for layout, method in METHODS.items():
            planned = autopar.plan(step, state, batch, method=method(), cluster_spec=cluster)
            row = {"model": family, "layout": layout}
            if baselines[layout].fits:
                row["explain"] = _figures(baselines[layout].predicted)
            row["method"] = _figures(planned.predicted)
            rows.append(row)
    header = (
        "| model | layout | step µs explain / method | compute µs | communication µs "
        "| memory KiB | traffic KiB |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        e, m = r.get("explain"), r["method"]

        def pair(key: str, e=e, m=m) -> str:
            return f"{e[key]:.0f} / {m[key]:.0f}" if e else f"- / {m[key]:.0f}"

        ratio = f" ({e['step_us'] / m['step_us']:.2f}x)" if e else ""
        lines.append(
            f"| {r['model']} | {r['layout']} | {pair('step_us')}{ratio} | {pair('compute_us')} "
            f"| {pair('communication_us')} | {pair('memory_kib')} | {pair('traffic_kib')} |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pricers.json").write_text(json.dumps(rows, indent=1) + "\n")
    intro = (
        f"`explain`'s rows against planning the method, on {cluster.name}, default options, "
        "`jax.value_and_grad` steps (Adam).\n\n"
    )
    (RESULTS / "pricers.md").write_text(intro + table + "\n")


if __name__ == "__main__":
    main()
