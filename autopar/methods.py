"""Parallelization methods: what the user asks for. Plain configuration, checked when built."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import numpy as np
from jax.sharding import Mesh

from autopar.planner.errors import InvalidArgumentError
from autopar.planner.explicit import ZeroStage
from autopar.planner.plan import MeshPlan


def _check_micro_batches(value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidArgumentError(
            f"num_micro_batches must be a positive int or None, got {value!r}"
        )


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Split the batch over all devices; replicate parameters and optimizer state.

    Args:
      devices: None (all devices of the runtime), a list of jax devices, or a `jax.sharding.Mesh`
        (every axis of it splits the batch).
      num_micro_batches: accumulate gradients over this many micro-batches per step.
    """

    devices: Any = None
    num_micro_batches: int | None = None
    zero_stage: ClassVar[ZeroStage] = ZeroStage.DATA_PARALLEL

    def __post_init__(self) -> None:
        _check_micro_batches(self.num_micro_batches)

    @property
    def regather_params(self) -> bool:
        """Whether parameters are stored split and must be gathered again in the backward pass."""
        return self.zero_stage is ZeroStage.ZERO3


@dataclasses.dataclass(frozen=True)
class Zero2Parallel(DataParallel):
    """ZeRO-2: like DataParallel, with optimizer state and gradients split over devices."""

    zero_stage: ClassVar[ZeroStage] = ZeroStage.ZERO2


@dataclasses.dataclass(frozen=True)
class Zero3Parallel(DataParallel):
    """ZeRO-3 / FSDP: parameters, gradients and optimizer state split; parameters gathered where
    used (and gathered again in the backward pass, as SimpleFSDP does)."""

    zero_stage: ClassVar[ZeroStage] = ZeroStage.ZERO3


Method = DataParallel


def resolve_devices(
    devices: Any, default: Sequence[jax.Device]
) -> tuple[MeshPlan, tuple[jax.Device, ...]]:
    """A method's `devices` argument as a planned mesh and the device list its indices refer to."""
    if devices is None:
        devices = tuple(default)
    if isinstance(devices, Mesh):
        flat = tuple(np.asarray(devices.devices).flat)
        return (
            MeshPlan(
                tuple(devices.devices.shape), tuple(devices.axis_names), tuple(range(len(flat)))
            ),
            flat,
        )
    if (
        isinstance(devices, (list, tuple))
        and devices
        and all(isinstance(d, jax.Device) for d in devices)
    ):
        return MeshPlan((len(devices),), ("data",), tuple(range(len(devices)))), tuple(devices)
    raise InvalidArgumentError(
        f"devices must be None, a non-empty list of jax devices or a jax.sharding.Mesh; got "
        f"{devices!r}"
    )


def abstract_mesh(devices: Any, num_devices: int) -> MeshPlan:
    """The planned mesh for planning without devices: a Mesh's shape, else 1D over the cluster."""
    if isinstance(devices, Mesh):
        return resolve_devices(devices, ())[0]
    if devices is not None:
        num_devices = len(devices)
    return MeshPlan((num_devices,), ("data",), tuple(range(num_devices)))
