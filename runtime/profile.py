"""Profiling mode of the stage DP: candidate stages compiled and timed on the devices (Alpa's
default; `AutoStageOption(profile=True)`).

Cost-model mode predicts what a stage costs; profiling measures it. A candidate stage (a layer
range on a logical mesh) is planned as a whole by the intra-op ILP, its forward and backward
parts for one micro-batch are compiled with that plan on the first devices of the mesh's size
(devices of one host are interchangeable), and run on zero inputs; the latency is the median
of a few runs after a warm-up. Memory comes from the same plan: its state and stashed
activations are the byte sizes of the planned shardings, its temporaries what XLA's compiled
memory analysis reports. Candidates with the same structure on equal meshes are measured once.

Where the timing runs is the executor's (`StageMeasure`): `measure_stage` on this process's
devices, or on a Ray mesh worker that traces the step itself (`runtime.ray`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from autopar.planner.cluster import ClusterSpec
from autopar.planner.intra import ShardingProblem
from autopar.planner.pipeline import StageProgram, StepParts
from autopar.planner.pipeshard import (
    PipelineConfig,
    range_program,
    stage_intra_config,
    stage_mesh,
    stash_bytes,
    state_bytes,
)
from autopar.planner.plan import StagePlan
from autopar.planner.program import Program
from autopar.planner.progress import progress_bar
from autopar.planner.stages import StageCost
from autopar.runtime.interpreter import (
    ShardingRules,
    build_mesh,
    evaluate_eqns,
    free_vars,
    partition_spec,
    read,
)

logger = logging.getLogger(__name__)


REPEATS = 5  # timed runs of a candidate stage (the median counts), after one warm-up

StageMeasure = Callable[[StageProgram, StagePlan], tuple[float, float]]
"""A candidate stage and its plan -> (seconds of its forward and backward for one micro-batch,
temporary bytes XLA's memory analysis gives them), measured where the step will run."""


class StageProfiler:
    """The stage DP's cost_fn in profiling mode: each candidate planned, then timed by
    `measure` (`StageMeasure`)."""

    def __init__(
        self,
        parts: StepParts,
        program: Program,
        cluster: ClusterSpec,
        config: PipelineConfig,
        measure: StageMeasure,
    ) -> None:
        self.parts, self.program, self.cluster, self.config = parts, program, cluster, config
        self.measure = measure
        self.device_memory = config.intra.budget(cluster)
        self.ilp_solves = 0
        self._programs: dict[tuple[int, int], StageProgram] = {}
        self._measured: dict[tuple, StageCost | None] = {}
        self._progress = progress_bar(desc="profiling stages", unit="stage")
        self._started = time.perf_counter()

    def __call__(self, start: int, end: int, submesh: tuple, logical: tuple) -> StageCost | None:
        """Layers [start, end) on `logical`, measured (None: no plan fits device memory)."""
        if (start, end) not in self._programs:  # asked again for every mesh
            self._programs[start, end] = range_program(
                self.parts, self.program.signature, start, end
            )
        stage = self._programs[start, end]
        intra = stage_intra_config(self.config, logical, self.program.signature)
        if intra is None:
            return None
        mesh = stage_mesh(logical, tuple(range(math.prod(logical))))
        key = (stage.program.fingerprint, mesh.shape, intra.force_batch_dim_to_mesh_dim)
        if key not in self._measured:
            k = self.config.num_micro_batches
            problem = ShardingProblem(stage.program, mesh, self.cluster, intra, k)
            self.ilp_solves += 1
            plan = problem.solve(self.device_memory)
            self._measured[key] = None if plan is None else self._measure(stage, plan.stages[0])
            self._progress.update()
        return self._measured[key]

    def close(self) -> None:
        """End the progress bar and log what was measured."""
        self._progress.close()
        logger.info(
            "profiled %d candidate stages (%d fit in memory) in %.1f s",
            len(self._measured),
            sum(c is not None for c in self._measured.values()),
            time.perf_counter() - self._started,
        )

    def _measure(self, stage: StageProgram, plan: StagePlan) -> StageCost:
        latency, temporaries = self.measure(stage, plan)
        stash = stash_bytes(stage, plan)
        logger.debug(
            "stage layers %s on %s: %.3g s, %.3g temporary bytes",
            stage.layers,
            plan.mesh,
            latency,
            temporaries,
        )
        # One micro-batch's stash is among the temporaries; the DP adds it per micro-batch.
        return StageCost(
            latency_s=latency,
            static_memory_bytes=state_bytes(stage, plan) + max(0.0, temporaries - stash),
            activation_memory_bytes=stash,
        )


def measure_stage(
    stage: StageProgram, plan: StagePlan, devices: Sequence[jax.Device], repeats: int = REPEATS
) -> tuple[float, float]:
    """`StageMeasure` on `devices` (the plan's mesh on the first of them): the stage's forward
    and backward compiled with its plan, run on zeros; the median of `repeats` timed runs."""
    mesh = build_mesh(plan.mesh, devices)
    rules = ShardingRules.from_stage(plan, mesh)
    closed = stage.closed
    eqns = stage.part("forward") + stage.part("backward")
    reads = free_vars(eqns)
    defined = {v for _, e in eqns for v in e.outvars}
    results = list(stage.grads) + [v for v in closed.jaxpr.outvars if v in defined]
    consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    spec_of = dict(zip(closed.jaxpr.invars, plan.input_specs, strict=True))

    def forward_backward(*args):
        env = dict(consts)
        env.update(zip(reads, args, strict=True))
        evaluate_eqns(eqns, env, rules)
        return [read(env, v) for v in results]

    args = [
        jnp.zeros(
            v.aval.shape, v.aval.dtype, device=NamedSharding(mesh, partition_spec(spec_of[v]))
        )
        for v in reads
    ]
    compiled = jax.jit(forward_backward).lower(*args).compile()
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - begin)
    return statistics.median(times), float(compiled.memory_analysis().temp_size_in_bytes)
