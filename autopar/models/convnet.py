"""A small convolutional classifier with BatchNorm: the family that carries non-parameter state.

BatchNorm's running statistics live in the ``"batch_stats"`` collection and are updated by the
train step (see `autopar.models.vision`, whose batches, train state and step this family uses).

Example::

    config = ConvNetConfig()
    state = create_train_state(config)
    state, metrics = jax.jit(train_step)(state, make_batch(config, batch_size=8))
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from autopar.models import vision
from autopar.models.common import dense_param_count
from autopar.models.vision import BatchNormTrainState


@dataclasses.dataclass(frozen=True)
class ConvNetConfig:
    """Square RGB-like images of side `image_size`; both conv layers have `channels` filters."""

    image_size: int = 16
    channels: int = 8
    num_classes: int = 10
    in_channels: int = 3


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


def create_train_state(
    config: ConvNetConfig, *, batch_size: int = 1, learning_rate: float = 1e-3, seed: int = 0
) -> BatchNormTrainState:
    """Initialise parameters, BatchNorm statistics (mean 0, variance 1) and AdamW."""
    return vision.create_train_state(
        ConvNet(config), config, batch_size=batch_size, learning_rate=learning_rate, seed=seed
    )


# Batches and the step are the image classifiers' shared ones.
make_batch = vision.make_batch
make_train_step = vision.make_train_step
train_step = make_train_step()


def param_count(config: ConvNetConfig) -> int:
    """Number of trainable parameters (BatchNorm scale and bias included, running stats not)."""
    c = config.channels
    convs = 9 * config.in_channels * c + 9 * c * c
    batch_norms = 2 * (2 * c)
    return convs + batch_norms + dense_param_count(c, config.num_classes)
