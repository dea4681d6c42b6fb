"""A multi-layer perceptron on a synthetic regression task: the smallest model a planner sees.

Example::

    config = MLPConfig()
    state = create_train_state(config)
    state, metrics = jax.jit(train_step)(state, make_batch(config, batch_size=8))
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from autopar.markers import mark_pipeline_boundary
from autopar.models.common import Batch, GradFn, Metrics, TrainStep, dense_param_count


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes of an MLP with `num_layers` dense layers: ``in_dim -> hidden ... -> out_dim``."""

    in_dim: int = 32
    hidden: int = 64
    out_dim: int = 16
    num_layers: int = 2
    pipeline_boundaries: bool = False  # mark a pipeline layer boundary between dense layers

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"MLPConfig.num_layers must be >= 1, got {self.num_layers}")

    @property
    def layer_dims(self) -> tuple[int, ...]:
        """Feature sizes from input to output, one more entry than there are layers."""
        return (self.in_dim, *([self.hidden] * (self.num_layers - 1)), self.out_dim)


class MLP(nn.Module):
    """Dense+relu layers, the last one linear so the output can match any real target."""

    config: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dims = self.config.layer_dims[1:]
        for i, features in enumerate(dims):
            if self.config.pipeline_boundaries and i > 0:
                mark_pipeline_boundary()
            x = nn.Dense(features, name=f"dense_{i}")(x)
            if i < len(dims) - 1:
                x = nn.relu(x)
        return x


def make_batch(config: MLPConfig, batch_size: int, *, seed: int = 0) -> Batch:
    """Inputs ``x ~ N(0, 1)`` and targets ``y = tanh(x @ W)`` for a fixed random teacher ``W``.

    A teacher makes the task learnable, so the loss falls for a correct step.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch_size, config.in_dim), dtype=np.float32)
    teacher = rng.standard_normal((config.in_dim, config.out_dim), dtype=np.float32)
    y = np.tanh(x @ teacher / np.sqrt(config.in_dim)).astype(np.float32)
    return {"x": x, "y": y}


def create_train_state(
    config: MLPConfig, *, batch_size: int = 1, learning_rate: float = 1e-3, seed: int = 0
) -> TrainState:
    """Initialise parameters and an Adam optimizer.

    Adam (not SGD with momentum) so that all three families carry the same two-moment optimizer
    state, which is what a sharding plan has to place next to each parameter.
    """
    model = MLP(config)
    x = jnp.zeros((batch_size, config.in_dim), jnp.float32)
    params = model.init(jax.random.key(seed), x)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(learning_rate))


def make_train_step(grad_fn: GradFn = jax.value_and_grad) -> TrainStep:
    """Build the mean-squared-error train step around `grad_fn` (jax's or autopar's)."""

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        def loss_fn(params):
            pred = state.apply_fn({"params": params}, batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = grad_fn(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return train_step


train_step = make_train_step()


def param_count(config: MLPConfig) -> int:
    """Number of parameters, from the layer sizes alone (no initialisation)."""
    dims = config.layer_dims
    return sum(dense_param_count(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
