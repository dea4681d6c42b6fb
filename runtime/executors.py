"""Where planned steps run, chosen once by `autopar.init`: this process's devices
(`LocalExecutor`) or Ray mesh workers (`runtime.ray.RayCluster`). The API builds every
executable through the runtime's executor and never asks which one it has."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import jax

from autopar.planner.plan import Plan, TracingRecord
from autopar.tracing import TracedStep


@dataclasses.dataclass(frozen=True)
class StepToBuild:
    """A planned step as an executor needs it: the traced program and its plan, the function
    and the arguments it was traced with (a remote worker traces it again), and the devices its
    plan's indices refer to in this process (none on Ray)."""

    traced: TracedStep
    plan: Plan
    fun: Callable
    args: Sequence[Any]
    argnums: tuple[tuple[int, ...], ...]
    devices: tuple[jax.Device, ...]


@dataclasses.dataclass(frozen=True)
class StepToTime:
    """A step whose candidate pipeline stages profiling mode times: how a remote worker traces
    it again (the function, its abstract arguments, argnums and tracing, as `StepSource`), the
    program it must trace to (`fingerprint`), and the devices to time them on in this process
    (none on Ray)."""

    fun: Callable
    args: Sequence[Any]
    argnums: tuple[tuple[int, ...], ...]
    tracing: TracingRecord
    num_micro_batches: int
    fingerprint: str
    devices: tuple[jax.Device, ...]


class Executor(Protocol):
    """Runs planned steps. `holds_devices`: whether the arrays live in this process (False on
    Ray, where a step's inputs and outputs stay on the workers)."""

    holds_devices: bool

    def build(self, step: StepToBuild) -> Any:
        """An executable of the step: called with the flat dynamic arguments (`call_flat`)."""

    def stage_timer(self, step: StepToTime) -> AbstractContextManager[Any]:
        """Where profiling mode times `step`'s candidate stages: a context that gives a
        `runtime.profile.StageMeasure` and releases what timing needs when it ends."""

    def shutdown(self) -> None:
        """Release what the executor holds (workers, placement groups)."""


class LocalExecutor:
    """This process's jax devices: plans compile with `jax.jit` shardings, pipelines run on the
    local pipeline executor."""

    holds_devices = True

    def build(self, step: StepToBuild) -> Any:
        from autopar.runtime.compile import compile_plan

        return compile_plan(step.traced, step.plan, step.devices)

    @contextlib.contextmanager
    def stage_timer(self, step: StepToTime) -> Iterator[Any]:
        """Stages timed on the step's devices in this process."""
        from autopar.runtime.profile import measure_stage

        yield functools.partial(measure_stage, devices=step.devices)

    def shutdown(self) -> None:
        """Nothing to release: the devices are the process's."""
