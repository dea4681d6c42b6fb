"""What the planner knows about a traced step besides its op graph: the roles of its inputs."""

from __future__ import annotations

import dataclasses

from autopar.planner.graph import OpGraph, TensorInfo


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


@dataclasses.dataclass(frozen=True, slots=True)
class Program:
    """A traced step as the planner sees it: op graph, signature and a fingerprint of the jaxpr."""

    graph: OpGraph
    signature: StepSignature
    fingerprint: str
