"""What the model families share: the gradient-function contract, the step signature, the family
interface and abstract (shape-only) inputs for planning any family.

Every family's `make_train_step(grad_fn)` takes a `GradFn`, so the same step runs with
`jax.value_and_grad` (reference) or `autopar.value_and_grad` (planned), and the two can be
compared number for number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np
from flax.training.train_state import TrainState

from autopar.markers import value_and_grad

Batch = dict[str, np.ndarray]
"""A synthetic batch: named NumPy arrays, batch dimension first."""

Metrics = dict[str, jax.Array]
"""Scalars a train step reports, e.g. ``{"loss": ...}``."""

TrainStep = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
"""``train_step(state, batch) -> (new_state, metrics)``; pure, not jitted."""


class GradFn(Protocol):
    """`jax.value_and_grad`'s signature: ``grad_fn(fun, has_aux=...)(params) -> (value, grads)``."""

    def __call__(
        self, fun: Callable[..., Any], argnums: int = 0, has_aux: bool = False
    ) -> Callable[..., tuple[Any, Any]]: ...


def dense_param_count(fan_in: int, fan_out: int, *, bias: bool = True) -> int:
    """Parameters of a dense layer ``fan_in -> fan_out``: kernel plus optional bias."""
    return fan_in * fan_out + (fan_out if bias else 0)


class Family(Protocol):
    """A model family module (`autopar.models.gpt`, ...): the functions every family has."""

    def make_batch(self, config: Any, batch_size: int, *, seed: int = 0) -> Batch: ...

    def create_train_state(
        self, config: Any, *, batch_size: int = 1, learning_rate: float = 1e-3, seed: int = 0
    ) -> TrainState: ...

    def make_train_step(self, grad_fn: GradFn = ...) -> TrainStep: ...

    def param_count(self, config: Any) -> int: ...


def abstract_train_inputs(
    family: Family, config: Any, batch_size: int, *, grad_fn: GradFn = value_and_grad
) -> tuple[TrainStep, Any, dict[str, jax.ShapeDtypeStruct]]:
    """`family`'s train step around `grad_fn` (autopar's by default), its train state as
    `jax.ShapeDtypeStruct` leaves (initialisers traced, never run) and an abstract batch of
    `batch_size` examples: what `autopar.plan` needs to plan the step for any cluster without
    allocating the model.

    Example::

        step, state, batch = abstract_train_inputs(gpt, GPTConfig.alpa("1.3B"), 1024)
        plan = autopar.plan(step, state, batch, cluster_spec=ClusterSpec.preset("8xV100-p3"))
    """
    state = jax.eval_shape(lambda: family.create_train_state(config))
    # A one-example batch gives names, trailing shapes and dtypes; only that example is built.
    example = family.make_batch(config, 1)
    batch = {
        name: jax.ShapeDtypeStruct((batch_size, *x.shape[1:]), x.dtype)
        for name, x in example.items()
    }
    return family.make_train_step(grad_fn), state, batch
