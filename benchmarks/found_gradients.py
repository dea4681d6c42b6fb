"""A plain `jax.grad` step against the same step written with `autopar.grad`: what DataParallel
and ZeRO-2/3 predict for each, on the 8xV100 preset cut to 4 devices (planned abstractly).

Two 6-layer Adam MLPs: a narrow one (batch 32768, width 128) and a wide one (batch 8, width
4096). Writes `results/found_gradients.{json,md}`.

    python benchmarks/found_gradients.py
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import optax

import autopar
from autopar.planner.cluster import ClusterSpec

RESULTS = pathlib.Path(__file__).parent / "results"
LAYERS = 6
SHAPES = ((32768, 128), (8, 4096))
MiB = 2**20


def _step(grad_fn, tx):
    def loss(params, batch):
        h = batch["x"]
        for i in range(LAYERS):
            h = jax.nn.relu(h @ params[f"w{i}"] + params[f"b{i}"])
        return jnp.mean((h - batch["y"]) ** 2)

    def step(state, batch):
        params, opt_state = state
        value, grads = grad_fn(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step


def _inputs(batch_size: int, width: int, tx):
    f32 = jnp.float32
    params = {}
    for i in range(LAYERS):
        params[f"w{i}"] = jax.ShapeDtypeStruct((width, width), f32)
        params[f"b{i}"] = jax.ShapeDtypeStruct((width,), f32)
    batch = {name: jax.ShapeDtypeStruct((batch_size, width), f32) for name in ("x", "y")}
    return (params, jax.eval_shape(tx.init, params)), batch


def main() -> None:
    autopar.simulate_cpu_devices(8)
    cluster = dataclasses.replace(ClusterSpec.preset("8xV100-p3"), devices_per_host=4)
    tx = optax.adam(1e-3)
    rows = []
    for batch_size, width in SHAPES:
        state, batch = _inputs(batch_size, width, tx)
        for grad_name, grad_fn in (
            ("jax.grad", jax.value_and_grad),
            ("autopar.grad", autopar.value_and_grad),
        ):
            for method in (autopar.DataParallel, autopar.Zero2Parallel, autopar.Zero3Parallel):
                step = _step(grad_fn, tx)
                p = autopar.plan(step, state, batch, method=method(), cluster_spec=cluster)
                p = p.predicted
                rows.append(
                    {
                        "mlp": f"{batch_size}x{width}",
                        "gradient": grad_name,
                        "method": method.__name__,
                        "traffic_mib": p.communication_bytes / MiB,
                        "step_ms": p.step_time_s * 1e3,
                        "memory_mib": p.memory_per_device_bytes / MiB,
                    }
                )
    header = "| MLP (batch x width) | gradient | method | traffic MiB | step ms | memory MiB |"
    lines = [header, "|---|---|---|---:|---:|---:|"]
    lines += [
        f"| {r['mlp']} | {r['gradient']} | {r['method']} | {r['traffic_mib']:.3f} "
        f"| {r['step_ms']:.2f} | {r['memory_mib']:.1f} |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "found_gradients.json").write_text(json.dumps(rows, indent=1) + "\n")
    intro = f"Predicted by default options on {cluster.name} cut to 4 devices.\n\n"
    (RESULTS / "found_gradients.md").write_text(intro + table + "\n")


if __name__ == "__main__":
    main()
