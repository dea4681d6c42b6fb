"""Options that restrict or tune the automatic planners (names follow Alpa's)."""

from __future__ import annotations

import dataclasses
import math
import numbers

from autopar.planner.errors import InvalidArgumentError
from autopar.planner.intra import IntraOpConfig

SOLVERS = ("cbc", "highs")


@dataclasses.dataclass(frozen=True)
class AutoShardingOption:
    """How ShardParallel's ILP searches for an intra-op sharding.

    Args:
      memory_budget_per_device: bytes each device may hold at peak (None: the cluster's device
        memory). Below what data parallelism needs, the ILP stores parameters split (FSDP).
      force_data_parallel: store state replicated and split batch inputs over all devices.
      force_zero_stage_3: like force_data_parallel, with parameters and optimizer state stored
        split (FSDP / ZeRO-3).
      prefer_reduce_scatter: store optimizer state split, so gradients are reduce-scattered and
        the update is sharded (ZeRO-2 style weight-update sharding).
      solver: "cbc" (bundled with PuLP) or "highs" (needs `pip install highspy`).
      time_limit_s: wall-clock limit per ILP solve; past it the best plan found is used, with a
        warning.
      reuse_repeated_layers: give identical layers one set of variables (smaller, faster ILP).
    """

    memory_budget_per_device: float | None = None
    force_data_parallel: bool = False
    force_zero_stage_3: bool = False
    prefer_reduce_scatter: bool = False
    solver: str = "cbc"
    time_limit_s: float = 60.0
    reuse_repeated_layers: bool = True

    def __post_init__(self) -> None:
        budget = self.memory_budget_per_device
        if budget is not None and not (
            isinstance(budget, numbers.Real)
            and not isinstance(budget, bool)
            and math.isfinite(budget)
            and budget > 0
        ):
            raise InvalidArgumentError(
                f"memory_budget_per_device must be a positive number of bytes or None, got "
                f"{budget!r}"
            )
        if self.solver not in SOLVERS:
            raise InvalidArgumentError(f"solver must be one of {SOLVERS}, got {self.solver!r}")
        limit = self.time_limit_s
        if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or not limit > 0:
            raise InvalidArgumentError(f"time_limit_s must be a positive number, got {limit!r}")
        if self.force_data_parallel and self.force_zero_stage_3:
            raise InvalidArgumentError(
                "force_data_parallel and force_zero_stage_3 exclude each other; set one"
            )

    def to_config(self) -> IntraOpConfig:
        """The planner's view of these options."""
        return IntraOpConfig(**dataclasses.asdict(self))
