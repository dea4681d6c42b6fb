"""Pipeline a GPT train step over 8 simulated CPU devices with PipeshardParallel.

    python examples/pipeline_gpt.py [--stages 2|4] [--auto-stages]
        [--schedule 1f1b|gpipe|zero_bubble|interleaved_1f1b|auto] [--scan-layers]

One layer per transformer block (`pipeline_boundaries=True` marks them), grouped into stages on
disjoint sub-meshes (with interleaved_1f1b, --stages sub-meshes of two layer chunks each); each
stage is sharded by the ILP. With --scan-layers the blocks are one `nn.scan` over stacked weights
instead, which autopar unrolls and cuts into one layer per block itself. Prints the plan, the
schedule's clock table and the loss of a few steps, and checks the parameters against the serial
`jax.jit` step.
"""

import argparse

import autopar

autopar.simulate_cpu_devices(8)  # before jax runs anything; drop this on real GPUs

import jax  # noqa: E402
import numpy as np  # noqa: E402

from autopar.models import GPTConfig, gpt  # noqa: E402
from autopar.planner.schedules import AUTO_SCHEDULE, SCHEDULES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2, choices=[1, 2, 4, 8])
    parser.add_argument("--schedule", choices=[*SCHEDULES, AUTO_SCHEDULE], default="1f1b")
    parser.add_argument("--auto-stages", action="store_true", help="let Alpa's stage DP choose")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--scan-layers", action="store_true", help="blocks as one nn.scan")
    args = parser.parse_args()

    if args.scan_layers:
        config = GPTConfig(num_layers=args.layers, scan_layers=True)
        layer_option = autopar.AutoLayerOption(layer_num=args.layers)
    else:
        config = GPTConfig(num_layers=args.layers, pipeline_boundaries=True)
        layer_option = autopar.ManualLayerOption()
    stage_option = (
        autopar.AutoStageOption() if args.auto_stages else autopar.UniformStageOption(args.stages)
    )
    method = autopar.PipeshardParallel(
        num_micro_batches=args.micro_batches,
        layer_option=layer_option,
        stage_option=stage_option,
        pipeline_schedule=args.schedule,
    )
    train_step = autopar.parallelize(gpt.make_train_step(autopar.value_and_grad), method=method)
    serial_step = jax.jit(gpt.train_step)

    state = serial = gpt.create_train_state(config)
    batch = gpt.make_batch(config, args.batch)
    print(f"GPT {gpt.param_count(config):,} parameters on {len(jax.devices())} devices\n")
    print(train_step.get_plan(state, batch).summary(max_rows=4))
    for step in range(args.steps):
        state, metrics = train_step(state, batch)
        serial, _ = serial_step(serial, batch)
        print(f"step {step}: loss {float(metrics['loss']):.4f}")
    print("\n" + train_step.get_executable(state, batch).schedule.to_text())
    worst = max(
        float(np.linalg.norm(a - b) / np.linalg.norm(b))
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(serial.params), strict=True)
    )
    print(f"\nlargest relative difference from the serial step: {worst:.2e}")


if __name__ == "__main__":
    main()
