"""The main demo: a GPT train step (flax linen, AdamW) planned and run on 8 simulated CPU devices.

    python examples/gpt.py [--method auto|dp|zero2|zero3] [--micro-batches K] [--layers L]

Prints the plan autopar chose (by default the automatic one: ShardParallel's ILP), how it
compares with the hand layouts (DP, ZeRO-2, ZeRO-3, Megatron) under the same cost model, XLA's
per-device memory, and the loss of a few steps.
"""

import argparse

import autopar

autopar.simulate_cpu_devices(8)  # before jax runs anything; drop this on real GPUs

import jax  # noqa: E402

from autopar.models import GPTConfig, gpt  # noqa: E402

METHODS = {
    "auto": autopar.ShardParallel,
    "dp": autopar.DataParallel,
    "zero2": autopar.Zero2Parallel,
    "zero3": autopar.Zero3Parallel,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=sorted(METHODS), default="auto")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    config = GPTConfig(hidden=args.hidden, num_layers=args.layers, vocab_size=args.vocab)
    method = METHODS[args.method](num_micro_batches=args.micro_batches)
    train_step = autopar.parallelize(gpt.make_train_step(autopar.value_and_grad), method=method)

    state = gpt.create_train_state(config)
    batch = gpt.make_batch(config, args.batch)
    print(f"GPT {gpt.param_count(config):,} parameters on {len(jax.devices())} devices\n")
    executable = train_step.get_executable(state, batch)
    print(executable.plan.summary(max_rows=12))
    print()
    print(train_step.explain(state, batch))
    mem = executable.memory_stats()
    print(
        f"\nXLA memory per device: arguments {mem.argument_bytes / 2**20:.2f} MiB, "
        f"temporaries {mem.temp_bytes / 2**20:.2f} MiB, peak {mem.peak_bytes / 2**20:.2f} MiB"
    )
    counts = {kind: len(sizes) for kind, sizes in executable.collectives().items() if sizes}
    print(f"collectives in the compiled step: {counts}\n")
    for step in range(args.steps):
        state, metrics = train_step(state, batch)
        print(f"step {step}: loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
