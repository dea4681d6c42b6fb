"""A small convolutional classifier with BatchNorm: the family that carries non-parameter state.

BatchNorm's running statistics live in the ``"batch_stats"`` collection and are updated by the
train step, so a planner must handle state that changes every step but has no gradient.

Example::

    config = ConvNetConfig()
    state = create_train_state(config)
    state, metrics = jax.jit(train_step)(state, make_batch(config, batch_size=8))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from autopar.models.common import Batch, GradFn, Metrics, TrainStep, dense_param_count


@dataclasses.dataclass(frozen=True)
class ConvNetConfig:
    """Square RGB-like images of side `image_size`; both conv layers have `channels` filters."""

    image_size: int = 16
    channels: int = 8
    num_classes: int = 10
    in_channels: int = 3


class ConvNetTrainState(TrainState):
    """`TrainState` plus BatchNorm running statistics, which are updated but not differentiated."""

    batch_stats: Any = None


class ConvNet(nn.Module):
    """Conv(3x3) -> BatchNorm -> relu, twice, then global mean pool and a dense classifier."""

    config: ConvNetConfig

    @nn.compact
    def __call__(self, images: jax.Array, *, train: bool) -> jax.Array:
        x = images
        for i in range(2):
            # No conv bias: the BatchNorm right after it subtracts the mean anyway.
            x = nn.Conv(self.config.channels, (3, 3), use_bias=False, name=f"conv_{i}")(x)
            x = nn.BatchNorm(use_running_average=not train, name=f"bn_{i}")(x)
            x = nn.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.config.num_classes, name="head")(x)


def make_batch(config: ConvNetConfig, batch_size: int, *, seed: int = 0) -> Batch:
    """Images ``~ N(0, 1)`` in NHWC layout and uniformly random integer labels."""
    rng = np.random.default_rng(seed)
    shape = (batch_size, config.image_size, config.image_size, config.in_channels)
    images = rng.standard_normal(shape, dtype=np.float32)
    labels = rng.integers(0, config.num_classes, (batch_size,), dtype=np.int32)
    return {"images": images, "labels": labels}


def create_train_state(
    config: ConvNetConfig, *, batch_size: int = 1, learning_rate: float = 1e-3, seed: int = 0
) -> ConvNetTrainState:
    """Initialise parameters, BatchNorm statistics (mean 0, variance 1) and AdamW."""
    model = ConvNet(config)
    shape = (batch_size, config.image_size, config.image_size, config.in_channels)
    variables = model.init(jax.random.key(seed), jnp.zeros(shape, jnp.float32), train=False)
    return ConvNetTrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.adamw(learning_rate),
    )


def make_train_step(grad_fn: GradFn = jax.value_and_grad) -> TrainStep:
    """Build the cross-entropy train step around `grad_fn` (jax's or autopar's).

    The loss returns the new BatchNorm statistics as aux (``has_aux=True``), so they leave the
    gradient computation alongside the loss and are stored in the new state.
    """

    def train_step(state: ConvNetTrainState, batch: Batch) -> tuple[ConvNetTrainState, Metrics]:
        def loss_fn(params):
            variables = {"params": params, "batch_stats": state.batch_stats}
            logits, updates = state.apply_fn(
                variables, batch["images"], train=True, mutable=["batch_stats"]
            )
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
            return losses.mean(), updates["batch_stats"]

        (loss, batch_stats), grads = grad_fn(loss_fn, has_aux=True)(state.params)
        new_state = state.apply_gradients(grads=grads).replace(batch_stats=batch_stats)
        return new_state, {"loss": loss}

    return train_step


train_step = make_train_step()


def param_count(config: ConvNetConfig) -> int:
    """Number of trainable parameters (BatchNorm scale and bias included, running stats not)."""
    c = config.channels
    convs = 9 * config.in_channels * c + 9 * c * c
    batch_norms = 2 * (2 * c)
    return convs + batch_norms + dense_param_count(c, config.num_classes)
