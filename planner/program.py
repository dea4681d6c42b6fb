"""What the planner knows about a traced step besides its op graph: the roles of its inputs."""

from __future__ import annotations

import dataclasses
import functools

from jax.extend.core import ClosedJaxpr

from autopar.planner.graph import OpGraph, TensorInfo, build_graph


@dataclasses.dataclass(frozen=True, slots=True)
class StepSignature:
    """Names and roles of the step's flat inputs and outputs.

    ``output_to_input[j]`` is the input that output j is the new value of (same path below the
    argument and same shape/dtype, e.g. ``state.params`` in and out), or None. Plans place such an
    output like its input, so the next step needs no resharding.
    """

    input_paths: tuple[str, ...]
    output_paths: tuple[str, ...]
    input_avals: tuple[TensorInfo, ...]
    output_avals: tuple[TensorInfo, ...]
    batch_inputs: tuple[int, ...]
    donated_inputs: tuple[int, ...]
    output_to_input: tuple[int | None, ...]

    @property
    def num_buffers(self) -> int:
        """Input and output buffers of one launch of the step (what its dispatch handles)."""
        return len(self.input_avals) + len(self.output_avals)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A traced step as the planner sees it: its jaxpr, signature and a fingerprint of the jaxpr,
    and the jaxpr's op graph, built on first use: a pipeline's layers of one structure are found
    alike by fingerprint and signature, and only one of them needs its graph (0.3 s to build for
    a GPT-15B layer); a pipeline's whole step needs none."""

    closed: ClosedJaxpr
    signature: StepSignature
    fingerprint: str

    @functools.cached_property
    def graph(self) -> OpGraph:
        return build_graph(self.closed)
