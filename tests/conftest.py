"""Test setup: 8 simulated CPU devices (set before jax starts a backend) and shared helpers."""

import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests plan afresh: a user's plan cache must not answer for the code under test.
os.environ["AUTOPAR_PLAN_CACHE"] = "off"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar  # noqa: E402

autopar.simulate_cpu_devices(8)


@functools.cache
def serial_state(module, config, batch_size: int, steps: int):
    """The train state after `steps` serial `jax.jit` full-batch steps of `module`'s model from
    its initial state: what every parallel run is compared with."""
    state = module.create_train_state(config, batch_size=2)
    batch = module.make_batch(config, batch_size)
    step = jax.jit(module.train_step)
    for _ in range(steps):
        state, _ = step(state, batch)
    return state


def parallel_steps(module, config, method, batch_size: int, steps: int):
    """`steps` steps of `module`'s train step parallelized by `method` (gradients through
    `autopar.value_and_grad`) from the same initial state as `serial_state`.
    Returns (step, state, metrics, batch)."""
    step = autopar.parallelize(module.make_train_step(autopar.value_and_grad), method=method)
    state = module.create_train_state(config, batch_size=2)
    batch = module.make_batch(config, batch_size)
    for _ in range(steps):
        state, metrics = step(state, batch)
    return step, state, metrics, batch


def relative_error(actual, expected) -> float:
    """Largest, over leaves, of ||a - e|| / ||e|| (absolute where the expected leaf is zero)."""
    worst = 0.0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale, diff = np.linalg.norm(e), np.linalg.norm(a - e)
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst
