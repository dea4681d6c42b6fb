"""Exception types; each message names the argument, shape, device count or memory involved."""

from __future__ import annotations

import math
import numbers


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class InvalidArgumentError(AutoparError, ValueError):
    """An argument of the user's call (shape, type, option) cannot be used as given."""


class TracingError(AutoparError):
    """The train step could not be traced to a jaxpr."""


class PlanningError(AutoparError):
    """No valid plan exists for this program on this cluster with these options."""


class MemoryBudgetError(PlanningError):
    """No plan fits the memory budget; carries the budget and the least memory per device that
    any plan tried needs (bytes), so callers can try more (recomputation) or say what to do."""

    def __init__(self, message: str, budget: float, least: float) -> None:
        super().__init__(message)
        self.budget = budget
        self.least = least

    def __reduce__(self):  # pickled whole, as a worker process (`forked`) sends it back
        return type(self), (str(self), self.budget, self.least)


class InfeasibleError(PlanningError):
    """The sharding ILP has no solution at all, whatever the memory budget (e.g. inputs pinned
    to specs that no strategy of their readers accepts)."""


def check_positive_int(name: str, value: object) -> int:
    """`value` as an int; InvalidArgumentError naming `name` unless it is an integer ≥ 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidArgumentError(f"{name}={value!r} must be a positive integer")
    return int(value)


def check_memory_budget(value: object) -> float | None:
    """`value` as bytes per device, or None; InvalidArgumentError unless it is a finite
    positive number or None."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(value) and value > 0)
    ):
        raise InvalidArgumentError(
            f"memory_budget_per_device must be a positive number of bytes or None, got {value!r}"
        )
    return float(value)
