"""Quick start: a flax MLP train step parallelized with one decorator on 8 simulated CPU devices.

python examples/quickstart_mlp.py
"""

import autopar

autopar.simulate_cpu_devices(8)  # before jax runs anything; drop this on real GPUs

import jax.numpy as jnp  # noqa: E402

from autopar.models import MLPConfig, mlp  # noqa: E402

config = MLPConfig(in_dim=32, hidden=256, out_dim=16)


@autopar.parallelize(method=autopar.Zero3Parallel(num_micro_batches=2))
def train_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


state = mlp.create_train_state(config)
batch = mlp.make_batch(config, batch_size=64)
print(train_step.get_plan(state, batch).summary())
for step in range(5):
    state, loss = train_step(state, batch)
    print(f"step {step}: loss {float(loss):.5f}")
kernel = state.params["dense_0"]["kernel"]
print(f"dense_0 kernel {kernel.shape} is stored as {kernel.sharding.spec}")
