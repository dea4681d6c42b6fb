"""Types shared by the model families: the gradient-function contract and the step signature.

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
