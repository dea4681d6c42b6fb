"""Run a pipelined GPT train step on Ray mesh workers (a local Ray instance, no GPUs needed).

    python examples/ray_pipeline.py [--stages 2|4] [--hosts 1|2] [--steps 3]

`autopar.init("ray")` starts Ray here; with `--hosts 2` the 8 simulated devices are two simulated
hosts of 4, so each stage mesh is one or more workers. The driver plans, the workers run: the
state is created on the workers (`CreateStateParallel`, each leaf on the stage that reads it),
the batch is placed there ahead of the steps (`preshard_dynamic_args`), the state stays there as
`RemoteArray`s, and only the loss is fetched. At the end the parameters are fetched once and
compared with the serial `jax.jit` step.
On a GPU cluster: `autopar.init("ray", address="auto", cluster_spec=ClusterSpec.preset(...))`.
"""

import argparse
import dataclasses
import functools

import jax
import numpy as np

import autopar
from autopar.models import GPTConfig, gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2, choices=[1, 2, 4])
    parser.add_argument("--hosts", type=int, default=1, choices=[1, 2])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    cluster = dataclasses.replace(
        autopar.ClusterSpec.local(8 // args.hosts), num_hosts=args.hosts, name="simulated"
    )
    autopar.init("ray", cluster_spec=cluster)
    try:
        config = GPTConfig(num_layers=4)
        method = autopar.PipeshardParallel(
            num_micro_batches=4,
            layer_option=autopar.AutoLayerOption(layer_num=4),
            stage_option=autopar.UniformStageOption(args.stages),
        )
        train_step = autopar.parallelize(gpt.make_train_step(autopar.value_and_grad), method=method)
        batch = gpt.make_batch(config, 32)
        create = autopar.parallelize(
            functools.partial(gpt.create_train_state, config),
            method=autopar.CreateStateParallel(train_step, batch),
        )
        state = create()  # RemoteArrays, born on the workers
        state, placed = train_step.preshard_dynamic_args(state, batch)
        serial = gpt.create_train_state(config)
        serial_step = jax.jit(gpt.train_step)
        for step in range(args.steps):
            state, metrics = train_step(state, placed)
            serial, _ = serial_step(serial, batch)
            print(f"step {step}: loss {float(np.asarray(metrics['loss'])):.4f}")
        executable = train_step.get_executable(state, batch)
        for stage, hosts in enumerate(executable.hosts):
            print(f"stage {stage}: {len(hosts)} worker(s) on host(s) {hosts}")
        print(executable.schedule.to_text())
        params = jax.tree.map(np.asarray, state.params)  # the only full fetch
        worst = max(
            float(np.linalg.norm(a - b) / np.linalg.norm(b))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(serial.params), strict=True)
        )
        print(f"largest relative difference from the serial step: {worst:.2e}")
    finally:
        autopar.shutdown()


if __name__ == "__main__":
    main()
