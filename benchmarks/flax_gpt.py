"""Planning time with the defaults on a GPT a user writes with Flax's stock layers.

The model is not autopar's bundled GPT: `nn.MultiHeadDotProductAttention` with a causal mask,
`nn.Embed` tied to the output through `Embed.attend`, `nn.LayerNorm`, `nn.Dense`, and flax's
`TrainState` with `optax.adam`. It is planned from shapes (`jax.eval_shape`: no weights are
made) with `PipeshardParallel(num_micro_batches, layer_option=AutoLayerOption(layer_num),
stage_option=AutoStageOption())` and nothing else set, as a new user would.

    python benchmarks/flax_gpt.py [--size 39B] [--cluster 8x8xV100-p3] [--remat-mode MODE]

Writes `benchmarks/results/flax_gpt.{json,md}` (`flax_gpt_MODE.*` with `--remat-mode`); "no
plan fits" is recorded as an outcome, with the time it took to say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

os.environ.setdefault("AUTOPAR_PLAN_CACHE", "off")  # measure planning, not the cache

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import autopar  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    batch: int
    micro_batches: int
    layer_num: int


# Alpa's GPT-3 cases (Table 4 of the paper): seq 1024, vocab 51200.
SIZES = {
    "2.6B": Size(32, 2560, 32, 1024, 128, 8),
    "6.7B": Size(32, 4096, 32, 1024, 64, 8),
    "39B": Size(48, 8192, 64, 1024, 64, 16),
}
SEQ, VOCAB = 1024, 51200


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(h)))


class GPT(nn.Module):
    size: Size

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, self.size.hidden)
        x = embed(tokens) + nn.Embed(SEQ, self.size.hidden)(jnp.arange(tokens.shape[1]))
        for _ in range(self.size.layers):
            x = Block(self.size.heads)(x)
        return embed.attend(nn.LayerNorm()(x))


def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def abstract_inputs(size: Size):
    """The train state and batch as `jax.ShapeDtypeStruct`s (no weights are made)."""
    model = GPT(size)
    tokens = jax.ShapeDtypeStruct((size.batch, SEQ), jnp.int32)

    def create():
        params = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-4))

    return jax.eval_shape(create), {"tokens": tokens, "labels": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="39B", choices=sorted(SIZES))
    parser.add_argument("--cluster", default="8x8xV100-p3")
    parser.add_argument(
        "--remat-mode",
        default=None,
        choices=["none", "coarse_grained"],
        help="AutoLayerOption(remat_mode=...); default: not set (the option's default)",
    )
    args = parser.parse_args()
    size = SIZES[args.size]
    cluster = autopar.ClusterSpec.preset(args.cluster)
    layer_args = {"layer_num": size.layer_num}
    if args.remat_mode is not None:
        layer_args["remat_mode"] = args.remat_mode
    option_text = ", ".join(f"{k}={v!r}" for k, v in layer_args.items())
    method = autopar.PipeshardParallel(
        num_micro_batches=size.micro_batches,
        layer_option=autopar.AutoLayerOption(**layer_args),
        stage_option=autopar.AutoStageOption(),
    )
    state, batch = abstract_inputs(size)
    start = time.perf_counter()
    try:
        plan = autopar.plan(train_step, state, batch, method=method, cluster_spec=cluster)
    except autopar.PlanningError as e:  # "no plan fits" is an answer, and its time counts
        plan, outcome = None, f"no plan: {e}"
    seconds = time.perf_counter() - start
    stages = (
        []
        if plan is None
        else [f"[{s.layers[0]},{s.layers[1]}) {s.mesh.shape}" for s in plan.stages]
    )
    if plan is not None:
        outcome = (
            f"{len(stages)} stages: {', '.join(stages)}; step {plan.predicted.step_time_s:.2f} s"
        )
    row = {
        "size": args.size,
        "cluster": args.cluster,
        "micro_batches": size.micro_batches,
        "layer_option": f"AutoLayerOption({option_text})",
        "planning_s": round(seconds, 1),
        "stages": stages,
        "predicted_step_s": None if plan is None else plan.predicted.step_time_s,
        "notes": [] if plan is None else list(plan.notes),
        "outcome": outcome,
        "options": "defaults (AutoShardingOption())",
        "cpus": os.cpu_count(),
    }
    print(json.dumps(row, indent=2))
    name = "flax_gpt" if args.remat_mode is None else f"flax_gpt_{args.remat_mode}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(row, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(
        "# Planning a GPT written with Flax's stock layers, default options\n\n"
        f"`python benchmarks/flax_gpt.py --size {args.size} --cluster {args.cluster}"
        f"{'' if args.remat_mode is None else ' --remat-mode ' + args.remat_mode}` on "
        f"{os.cpu_count()} CPUs: PipeshardParallel(num_micro_batches={size.micro_batches}, "
        f"layer_option=AutoLayerOption({option_text}), "
        "stage_option=AutoStageOption()), nothing else set.\n\n"
        "| model | cluster | planning s (trace + plan) | outcome |\n"
        "|---|---|---|---|\n"
        f"| GPT-{args.size} (Flax stock layers) | {args.cluster} | {seconds:.1f} | {outcome} |\n"
    )


if __name__ == "__main__":
    main()
