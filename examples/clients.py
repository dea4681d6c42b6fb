"""Train steps as equinox and Flax NNX users write them, parallelized on 8 simulated CPU devices.

pip install equinox   (or: pip install -e ".[clients]")
python examples/clients.py
"""

import autopar

autopar.simulate_cpu_devices(8)  # before jax runs anything; drop this on real GPUs

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

rng = np.random.default_rng(0)
batch = {
    "x": rng.standard_normal((64, 16)).astype(np.float32),
    "y": rng.standard_normal((64, 4)).astype(np.float32),
}
tx = optax.adamw(1e-3)


# equinox: the Module goes in and comes out as it is (its activation function is a static leaf).
def mse(model, batch):
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


@autopar.parallelize(batch_argnums=(2,))
def eqx_step(model, opt_state, batch):
    loss, grads = autopar.value_and_grad(mse)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss


model = eqx.nn.MLP(16, 4, width_size=64, depth=2, activation=jax.nn.gelu, key=jax.random.key(0))
opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
for step in range(3):
    model, opt_state, loss = eqx_step(model, opt_state, batch)
    print(f"equinox step {step}: loss {float(loss):.5f}")
print(f"the step returned a {type(model).__name__}; activation {model.activation.__name__}")


# Flax NNX, functional style: split outside the step, merge inside it.
class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 64, rngs=rngs)
        self.out = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.gelu(self.hidden(x)))


graphdef, params = nnx.split(Net(nnx.Rngs(0)), nnx.Param)


@autopar.parallelize(batch_argnums=(2,))
def nnx_step(params, opt_state, batch):
    def loss_fn(params):
        return jnp.mean((nnx.merge(graphdef, params)(batch["x"]) - batch["y"]) ** 2)

    loss, grads = autopar.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


opt_state = tx.init(params)
for step in range(3):
    params, opt_state, loss = nnx_step(params, opt_state, batch)
    print(f"nnx step {step}: loss {float(loss):.5f}")
print(nnx_step.get_plan(params, opt_state, batch).summary())
