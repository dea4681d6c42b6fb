"""Train for real: state born sharded, checkpoint, resume on other devices, eval, plan file.

python examples/train_resume.py [--dir /tmp/autopar_resume]

1. CreateStateParallel builds the train state directly in ZeRO-3's sharding on 8 devices.
2. Three steps, then a sharded orbax checkpoint.
3. The checkpoint is restored into the plan of a 4-device train step (resharded on load).
4. An eval step follows the 4-device train step's placement (FollowParallel): nothing moves.
5. The 4-device plan is saved as JSON and runs again from the file without planning.
"""

import argparse
import functools
import pathlib
import shutil
import tempfile

import autopar

autopar.simulate_cpu_devices(8)  # before jax runs anything; drop this on real GPUs

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from autopar.models import MLPConfig, mlp  # noqa: E402

CONFIG = MLPConfig(in_dim=64, hidden=256, out_dim=64, num_layers=4)


def evaluate(state, batch):
    pred = state.apply_fn({"params": state.params}, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=pathlib.Path, default=None, help="checkpoint directory")
    args = parser.parse_args()
    work = args.dir or pathlib.Path(tempfile.mkdtemp(prefix="autopar_resume_"))
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    batch = mlp.make_batch(CONFIG, batch_size=64)
    step_fn = mlp.make_train_step(autopar.value_and_grad)

    train8 = autopar.parallelize(step_fn, method=autopar.Zero3Parallel())
    create = autopar.parallelize(
        functools.partial(mlp.create_train_state, CONFIG),
        method=autopar.CreateStateParallel(train8, batch),
    )
    state = create()
    kernel = state.params["dense_1"]["kernel"]
    print(f"created in place: dense_1 kernel {kernel.shape} stored as {kernel.sharding.spec}")
    for i in range(3):
        state, metrics = train8(state, batch)
        print(f"8 devices, step {i}: loss {float(metrics['loss']):.5f}")
    autopar.save_checkpoint(work / "ckpt", state, step=3)

    train4 = autopar.parallelize(step_fn, method=autopar.ShardParallel(devices=jax.devices()[:4]))
    target = train4.get_executable(state, batch).input_shardings[0]
    state = autopar.restore_checkpoint(work / "ckpt", 3, target)
    for i in range(3, 6):
        state, metrics = train4(state, batch)
        print(f"4 devices, step {i}: loss {float(metrics['loss']):.5f}")

    eval_step = autopar.parallelize(evaluate, method=autopar.FollowParallel(train4))
    print(f"eval loss {float(eval_step(state, batch)):.5f}")

    plan_file = work / "plan4.json"
    plan_file.write_text(train4.get_plan(state, batch).to_json())
    replay = autopar.parallelize(step_fn, method=autopar.PlanFile(plan_file))
    state, metrics = replay(state, batch)
    print(f"from {plan_file.name}, step 6: loss {float(metrics['loss']):.5f}")


if __name__ == "__main__":
    main()
