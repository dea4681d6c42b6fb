"""What the image classifiers (`convnet`, `wresnet`) share: the train state that carries BatchNorm
statistics, synthetic image batches and the cross-entropy train step.

BatchNorm's running statistics live in the ``"batch_stats"`` collection and are updated by the
train step, so a planner must handle state that changes every step but has no gradient. Under
`ShardParallel` the batch statistics are means over the whole (sharded) batch, as in the serial
step; micro-batching (gradient accumulation, pipelining) takes them per micro-batch instead, so
such a step is not expected to match the full-batch serial step number for number.

A family module binds these to its model, e.g. ``create_train_state(ConvNet(config), config)``.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from autopar.models.common import Batch, GradFn, Metrics, TrainStep


class ImageConfig(Protocol):
    """What the shared pieces read from a family's config: square NHWC images and classes."""

    @property
    def image_size(self) -> int: ...

    @property
    def in_channels(self) -> int: ...

    @property
    def num_classes(self) -> int: ...


class BatchNormTrainState(TrainState):
    """`TrainState` plus BatchNorm running statistics, which are updated but not differentiated."""

    batch_stats: Any = None


def image_shape(config: ImageConfig, batch_size: int) -> tuple[int, int, int, int]:
    """NHWC shape of a batch of `batch_size` images."""
    return (batch_size, config.image_size, config.image_size, config.in_channels)


def make_batch(config: ImageConfig, batch_size: int, *, seed: int = 0) -> Batch:
    """Images ``~ N(0, 1)`` in NHWC layout and uniformly random integer labels."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal(image_shape(config, batch_size), dtype=np.float32)
    labels = rng.integers(0, config.num_classes, (batch_size,), dtype=np.int32)
    return {"images": images, "labels": labels}


def create_train_state(
    model: nn.Module,
    config: ImageConfig,
    *,
    batch_size: int = 1,
    learning_rate: float = 1e-3,
    seed: int = 0,
) -> BatchNormTrainState:
    """Initialise `model`'s parameters, BatchNorm statistics (mean 0, variance 1) and AdamW.

    `model` is called as ``model(images, train=...)``.
    """
    images = jnp.zeros(image_shape(config, batch_size), jnp.float32)
    variables = model.init(jax.random.key(seed), images, train=False)
    return BatchNormTrainState.create(
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

    def train_step(state: BatchNormTrainState, batch: Batch) -> tuple[BatchNormTrainState, Metrics]:
        def loss_fn(params):
            variables = {"params": params, "batch_stats": state.batch_stats}
            logits, updates = state.apply_fn(
                variables, batch["images"], train=True, mutable=["batch_stats"]
            )
            logits = logits.astype(jnp.float32)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
            return losses.mean(), updates["batch_stats"]

        (loss, batch_stats), grads = grad_fn(loss_fn, has_aux=True)(state.params)
        new_state = state.apply_gradients(grads=grads).replace(batch_stats=batch_stats)
        return new_state, {"loss": loss}

    return train_step
