"""PipeshardParallel's planner: stages by Alpa's DP, each stage sharded by the intra-op ILP.

1. `pipeline.split_step` cuts the layered step into per-layer forward/backward parts and apply.
2. Every layer is planned alone by the ILP, from its LP relaxation rounded (`CANDIDATE_ROUNDING`;
   the MIP of the classes it splits, to within `CANDIDATE_GAP` of optimal or
   `CANDIDATE_TIME_SHARE` of the ILP's time limit, where the rounding breaks a memory cut), on
   every candidate logical mesh where its memory floor fits (`memory.whole_peak_bytes`;
   cost-model mode; data parallel over the first axis where the logical space forces the
   batch dim there, `stage_intra_config`): its predicted time per micro-batch, its state and
   its stashed activations, for its fastest plan and, while a stage's last plan may not fit,
   squeezed plans that fit a stage of many like layers with micro-batches in flight
   (alternatives, `StageShape`: what adds up over a stage, not one layer's peak, is what they
   squeeze). Layers with the same structure (repeated transformer blocks) are planned once
   per mesh, and free meshes that differ only in the order of equal axes once. A candidate
   stage costs the sum of its layers' times, state and stashed activations plus the largest
   of their temporaries, one alternative per squeeze level; ignoring resharding between
   layers of one stage and the transfers between stages, as Alpa's DP does.
3. `stages.solve_stages` (or the uniform/manual variants) picks layer ranges, sub-meshes and,
   per stage, the fastest alternative that fits with the micro-batches its schedule keeps in
   flight, priced by the schedule's step time; with several candidate schedules ("auto") the
   stages of each are searched and the fastest plan wins.
4. Each chosen stage is planned as a whole by the ILP on its logical mesh, within device memory,
   counting the activations its other micro-batches in flight keep (`intra.Stash`); the plan's
   predicted step time is the schedule's (`PipelineSchedule.step_time`) over those stage plans.
   A chosen stage that does not fit as a whole, or fits only with a plan far slower than its
   layers' plans add up to, is corrected in the search's costs and the search goes again (a few
   times at most); the fastest search by its stages' own plans wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from autopar.planner.cluster import ClusterSpec
from autopar.planner.cost import LogicalMesh, logical_mesh, spec_bytes_per_device
from autopar.planner.errors import MemoryBudgetError, PlanningError
from autopar.planner.forked import ForkedWorkers, process_count
from autopar.planner.gradients import gradient_chains
from autopar.planner.groups import Grouping, group_graph
from autopar.planner.intra import (
    IntraOpConfig,
    ProgramAnalysis,
    ShardingProblem,
    Stash,
    StructureStrategies,
    program_structure,
)
from autopar.planner.memory import held_values, whole_peak_bytes
from autopar.planner.menus import MeshCache
from autopar.planner.pipeline import (
    StagePlacement,
    StageProgram,
    StepParts,
    memory_floor,
    place_stages,
    stage_program,
)
from autopar.planner.plan import MeshPlan, Plan, PlanMethod, Predicted, StagePlan
from autopar.planner.program import Program, StepSignature
from autopar.planner.progress import progress
from autopar.planner.schedules import PipelineSchedule
from autopar.planner.stage_options import ManualStageOption, UniformStageOption
from autopar.planner.stages import (
    CostFn,
    StageAssignment,
    StageCost,
    StageSolution,
    forces_batch_dim,
    interleaved_stages,
    logical_mesh_shapes,
    manual_stages,
    place_submeshes,
    solve_stages,
    submesh_shapes,
    uniform_stages,
)
from autopar.planner.strategy import without_axes
from autopar.planner.summary import format_bytes

logger = logging.getLogger(__name__)

STAGE_AXES = ("x", "y")
MAX_ALTERNATIVES = 3  # a layer's fastest plan and its squeezed ones (`StageShape`)
# Searches again after chosen stages did not fit when planned as a whole (`LayerCosts.correct`),
# or ran much slower than their layers' plans add up to (`LayerCosts.reprice`).
MAX_STAGE_CORRECTIONS = 2
# A chosen stage whose plan as a whole runs this much slower than the search's estimate is
# repriced: the estimate ignores resharding between its layers, which costs some; a whole plan
# that fits only far from its layers' plans (GPT-39B in fp32 on 64 V100s: 7.8x) is another stage.
REPRICE_SLOWDOWN = 1.5
# A squeezed plan fits a stack of like layers in this share of a stage's memory: a stage mixes
# layers (the first and last hold the embeddings), and one whose stacks each fill it exactly
# would fit none of the mixes.
STACK_SHARE = 0.95
# Candidate layers are planned to within this fraction of the optimal time (the chosen stages
# are then planned exactly): a MIP proves the last fraction of a percent slowly, and the cost
# model is not that precise.
CANDIDATE_GAP = 0.01
# ...and within this share of the ILP's time limit: a candidate is an estimate for the DP, and
# a squeezed layer's memory-bound MIP can spend the whole limit closing the last percent.
CANDIDATE_TIME_SHARE = 0.25
# ...without HiGHS's presolve: on candidates that stop at that limit under memory cuts, presolve
# took much of it and left first plans up to 28x slower than without (GPT-15B layers on 16
# devices); over 63 candidate ILPs of GPT-6.7B and -15B it never found a plan 1% better. (Plans
# solved as emitted keep it: GPT-1.3B's ShardParallel ILP is optimal in 5.6 s with it, and hits
# its 10 s limit without.)
CANDIDATE_PRESOLVE = False
# ...and from the LP relaxation rounded, each memory-cut round (where the rounding breaks a
# cut, the MIP of the classes it splits; the whole MIP only where that finds no plan): a
# layer's relaxation leaves few classes split. On 18 candidate ILPs of a Flax GPT-39B layer
# (6 meshes, 3 squeeze levels, built and solved) rounding took 22.0 s against 51.9 s for the
# MIPs, with the same plans or, where the MIPs stopped at their limit, faster ones. The split
# classes' MIP took the 58 ILPs of its embedding, middle and last layers (6-7 meshes, 3
# levels) from 156 to 86 s, and where the whole MIPs had found no plan in time (the
# least-memory plans standing in) it found plans up to 72x faster per micro-batch (the
# embedding on (4, 8): 1.06 s against 77 s).
CANDIDATE_ROUNDING = True
# The chosen stages are planned whole from the LP relaxation rounded too (their layer plans
# priced them so; a profiler times them instead): a stage of 8 Flax GPT-39B layers is an ILP of
# 15k nodes whose MIP spends its whole 10 s limit and stops at a plan no better than the
# rounding finds in 1-2 s (its two stages on (4, 8): 2744.9 s and 2121.8 s per step rounded,
# against 2744.9 s and 2357.6 s from the MIP after 10 s).
STAGE_ROUNDING = True
# A plan this many times slower than its stages' step with device memory unbounded is
# memory-bound: under AutoLayerOption(remat_mode="auto") the step is planned with each layer
# recomputed too, and the faster plan wins. Recomputing adds about a third to the compute, so
# below this it cannot win. The bundled GPT-39B on 64 V100s (1024 micro-batches) fits without
# recomputation only as 2 stages of (32, 1), 18,407 s per step; recomputing, 91.6 s.
MEMORY_BOUND_SLOWDOWN = 1.5


def stage_mesh(logical: tuple[int, int], device_indices: tuple[int, ...]) -> MeshPlan:
    """A stage's planned mesh. An axis of size 1 is dropped: it only duplicates strategies."""
    kept = [(n, name) for n, name in zip(logical, STAGE_AXES, strict=True) if n > 1]
    kept = kept or [(1, STAGE_AXES[1])]
    return MeshPlan(
        tuple(n for n, _ in kept), tuple(name for _, name in kept), tuple(device_indices)
    )


def stage_intra_config(
    config: PipelineConfig, logical: tuple[int, int], signature: StepSignature
) -> IntraOpConfig | None:
    """The intra-op options of a stage on `logical`: with the batch dim forced onto its first
    axis where the stage option's logical space says so (`stages.forces_batch_dim`); None when
    the micro-batch does not split evenly over that axis (the candidate cannot run, as in
    Alpa)."""
    space = getattr(config.stage_option, "submesh_logical_shape_space", None)
    if space is None or not forces_batch_dim(space, logical):
        return config.intra
    shapes = [signature.input_avals[i].shape for i in signature.batch_inputs]
    if any(shape and shape[0] % logical[0] for shape in shapes):
        return None
    return dataclasses.replace(config.intra, force_batch_dim_to_mesh_dim=0)


def _spec_bytes(aval, spec: tuple | None, mesh: LogicalMesh) -> float:
    spec = spec or (None,) * len(aval.shape)
    return spec_bytes_per_device(aval.shape, aval.dtype.itemsize, spec, mesh)


def stash_bytes(stage: StageProgram, plan: StagePlan, grouping: Grouping | None = None) -> float:
    """Per-device bytes the forward part keeps for the backward part, per micro-batch: the
    values the ILP counts once per micro-batch in flight (`intra.Stash`). `grouping`: the
    stage program's, where its ILP has it (grouping a GPT-15B layer again took 45 ms)."""
    graph = stage.program.graph
    mesh = logical_mesh_of(plan.mesh)
    total = 0.0
    grouping = group_graph(graph) if grouping is None else grouping
    for node, k in held_values(grouping, stage.num_forward):
        specs = plan.node_output_specs.get(node, ())
        spec = specs[k] if k < len(specs) else None
        total += _spec_bytes(graph.node(node).out_avals[k], spec, mesh)
    return total


def state_bytes(stage: StageProgram, plan: StagePlan) -> float:
    """Per-device bytes that live through the whole step: the state the stage reads (parameters,
    optimizer state) as stored, plus its gradient accumulators (whole where a gradient stored
    split waits for the last micro-batch to be reduce-scattered)."""
    mesh = logical_mesh_of(plan.mesh)
    invars = stage.closed.jaxpr.invars
    total = 0.0
    for v, spec in zip(invars, plan.input_specs, strict=True):
        if v not in stage.per_micro_batch_inputs:
            total += _spec_bytes(v.aval, spec, mesh)
    accumulated = plan.node_output_specs.get(str(stage.boundary_index), ())
    for v, spec in zip(stage.means, accumulated, strict=False):
        total += _spec_bytes(v.aval, spec, mesh)
    graph = stage.program.graph
    for chain in gradient_chains(graph):
        lowering = plan.partial_sums.get(chain.sums[0]) if chain.sums else None
        if lowering is None or not lowering.once_per_step:
            continue
        aval = graph.node(chain.boundary).in_avals[chain.position]
        specs = plan.node_output_specs.get(chain.boundary, ())
        spec = specs[chain.position] if chain.position < len(specs) else None
        spec = spec or (None,) * len(aval.shape)
        whole = without_axes(spec, lowering.partial_axes)
        total += _spec_bytes(aval, whole, mesh) - _spec_bytes(aval, spec, mesh)
    return total


def range_program(parts: StepParts, signature: StepSignature, start: int, end: int) -> StageProgram:
    """Layers [start, end) as a stage of their own (the layers around them on other stages)."""
    n = parts.num_layers
    ranges = [r for r in ((0, start), (start, end), (end, n)) if r[0] < r[1]]
    placement = place_stages(parts, ranges)
    return stage_program(parts, placement, ranges.index((start, end)), signature)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer planned alone: time per micro-batch and per-device memory by how it adds up
    over the layers of a stage (state and stashed activations add; temporaries do not)."""

    latency_s: float
    state_bytes: float
    stash_bytes: float
    temporary_bytes: float


def logical_mesh_of(mesh: MeshPlan) -> LogicalMesh:
    """A LogicalMesh view of a planned mesh, for byte counts (its link figures are unused)."""
    n = len(mesh.shape)
    return LogicalMesh(mesh.shape, mesh.axis_names, (1.0,) * n, (0.0,) * n)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """PipeshardParallel's choices as plain planner arguments."""

    num_micro_batches: int
    schedules: tuple[PipelineSchedule, ...]  # the schedule to run, or those "auto" picks among
    stage_option: object  # AutoStageOption | UniformStageOption | ManualStageOption
    intra: IntraOpConfig
    num_virtual_stages: int = 2  # stages per mesh under interleaved 1F1B

    def most_in_flight(self, stages_after: int) -> int:
        """The most micro-batches a stage with `stages_after` stages after it may hold."""
        k = self.num_micro_batches
        return max(schedule.in_flight(stages_after, k) for schedule in self.schedules)

    @property
    def least_memory_share(self) -> float:
        """The least share of a device's memory a stage may get: 1/v where a schedule puts v
        stages on each mesh, else all of it."""
        interleaves = any(schedule.interleaves for schedule in self.schedules)
        return 1 / self.num_virtual_stages if interleaves else 1.0


@dataclasses.dataclass(frozen=True)
class StageShape:
    """A stage a squeezed layer plan is made for: `depth` like layers, each with `flight`
    micro-batches of activations stashed. Its ILP fits all of their state and stashes, and one
    layer's temporaries, in device memory (`ShardingProblem.stacked`): squeezing a layer's
    peak alone would keep state that adds up over a deep stage's layers, and leave deep stages
    without a plan that fits where one exists."""

    depth: int
    flight: int

    def __post_init__(self) -> None:
        if self.depth < 1 or self.flight < 1:
            raise ValueError(f"StageShape needs depth and flight >= 1, got {self}")


def stage_shapes(
    num_layers: int, num_devices: int, mesh_devices: int, config: PipelineConfig
) -> tuple[StageShape, ...]:
    """The stages a layer's squeezed plans on a mesh of `mesh_devices` are made for, lightest
    first: a balanced pipeline over all devices with meshes of that size has S of them, each
    of about num_layers / S layers, the first holding the most micro-batches in flight; and
    one halfway there (geometric means), for stages that need less than that."""
    stages = max(1, min(num_layers, num_devices // mesh_devices))
    depth = math.ceil(num_layers / stages)
    deepest = StageShape(depth, config.most_in_flight(stages - 1))
    if stages == 1:  # the only stage on such a mesh holds every layer
        return (deepest,)
    halfway = StageShape(math.ceil(math.sqrt(depth)), math.ceil(math.sqrt(deepest.flight)))
    shapes = dict.fromkeys(s for s in (halfway, deepest) if s != StageShape(1, 1))
    return tuple(shapes)


@dataclasses.dataclass
class _LayerPlans:
    """One layer's plans on one mesh kind so far: the fastest first, then one per squeezed
    `shapes`, and each one's strategies (a start for a stage's ILP). The ILP is built on first
    use, by whichever thread or worker process (`forked`) plans it."""

    key: tuple  # (structure, mesh kind, forced batch axis): `LayerCosts._plans`'s key
    stage: StageProgram
    mesh: MeshPlan
    build: Callable[[], ShardingProblem]
    shapes: tuple[StageShape, ...]
    found: list[LayerCost]
    strategies: list[StructureStrategies] = dataclasses.field(default_factory=list)
    exhausted: bool = False
    _problem: ShardingProblem | None = None

    @property
    def problem(self) -> ShardingProblem:
        if self._problem is None:
            self._problem = self.build()
        return self._problem


class LayerCosts:
    """The DP's cost_fn: each layer planned alone by the ILP, once per structure and mesh kind.

    A stage gets its next squeezed alternative only while its last one does not fit with as
    many micro-batches in flight as it could ever hold (one per layer after it, plus its own):
    past one that fits, the DP would never pick them, since it takes the fastest alternative
    that fits. Nor where B micro-batches at the last one's latency already take `step_bound_s`
    (the step time of a plan found without it): a pipeline runs no faster than B times its
    slowest stage, and squeezed plans are slower still.
    """

    def __init__(
        self,
        parts: StepParts,
        program: Program,
        cluster: ClusterSpec,
        config: PipelineConfig,
        num_devices: int,
    ) -> None:
        self.parts, self.program, self.cluster, self.config = parts, program, cluster, config
        self.num_devices = num_devices
        self.device_memory = config.intra.budget(cluster)
        self._programs: dict[int, StageProgram] = {}
        self._placement: StagePlacement | None = None  # every layer a stage (`layer_program`)
        # (fingerprint, batch inputs, output_to_input) -> program_structure of such a program
        self._structures: dict[tuple, int] = {}
        # program_structure -> its first layer's program, analysis and whole_peak_bytes, which
        # serve every layer of that structure
        self._analyses: dict[int, tuple[StageProgram, ProgramAnalysis, float]] = {}
        self._plans: dict[tuple, _LayerPlans] = {}
        # (mesh shape, axis names, intra config) -> what the layer ILPs there share
        self._mesh_caches: dict[tuple, MeshCache] = {}
        # (layer, logical mesh) -> `_layer_plans`' answer: the DP asks for it ~10^5 times
        self._plans_of: dict[tuple[int, tuple], _LayerPlans | None] = {}
        self.ilp_solves = 0
        self.step_bound_s = math.inf
        self._extra: dict[tuple, float] = {}  # stage -> memory it needs beyond its estimate
        self._latency: dict[tuple, float] = {}  # stage -> its whole plan's latency (`reprice`)
        self._count_lock = threading.Lock()
        self._workers: ForkedWorkers | None = None  # while `planning_processes` runs

    def layer_program(self, layer: int) -> StageProgram:
        """Layer `layer` as a stage of its own: a stage of the placement of every layer on a
        stage of its own, placed once (each placement walks the whole step)."""
        if layer not in self._programs:
            if self._placement is None:
                layers = [(k, k + 1) for k in range(self.parts.num_layers)]
                self._placement = place_stages(self.parts, layers)
            self._programs[layer] = stage_program(
                self.parts, self._placement, layer, self.program.signature
            )
        return self._programs[layer]

    def layer_costs(
        self, layer: int, logical: tuple, levels: int = MAX_ALTERNATIVES
    ) -> tuple[LayerCost, ...]:
        """Layer `layer` alone on a logical mesh: its fastest plan within device memory, then
        (up to `levels` in all) plans squeezed to fit ever deeper stages of like layers
        (`stage_shapes`), until the ILP finds none (empty: the layer never fits or cannot run
        there). Each is the ILP's plan within the budget by its own memory model, priced at
        its memory as emitted (`ShardingProblem.solve`'s `as_emitted=False`): a layer's plan is
        a candidate, and the chosen stages are planned again within the budget as emitted.
        They depend on the mesh's axes, not on which devices."""
        plans = self._layer_plans(layer, logical)
        if plans is None:
            return ()
        self._squeeze_to(plans, levels)
        return tuple(plans.found[:levels])

    @contextlib.contextmanager
    def planning_processes(self, logicals: Iterable[tuple[int, int]]) -> Iterator[None]:
        """While the block runs, the layer plans on `logicals` that `prefetch` and
        `prefetch_squeezed` ask for are planned in worker processes forked from this one
        (`forked`: the ILPs' Python runs in parallel too), where the platform forks and more
        than one process is set; elsewhere on threads."""
        count = process_count()
        if not count or self._workers is not None:
            yield
            return
        for logical in dict.fromkeys(logicals):  # every layer plan the workers may plan
            for layer in range(self.parts.num_layers):
                self._layer_plans(layer, logical)
        with ForkedWorkers(count, self._plan_level, self._plans, _mesh_of) as workers:
            self._workers = workers
            try:
                yield
            finally:
                self._workers = None

    def prefetch(self, logicals: Iterable[tuple[int, int]], workers: int | None = None) -> None:
        """Plan every layer's fastest plan on each of `logicals`, `workers` (default: the CPU
        count) ILPs at a time: the DP asks for all of them anyway."""
        pending = {
            id(plans): plans
            for logical in dict.fromkeys(logicals)
            for layer in range(self.parts.num_layers)
            if (plans := self._layer_plans(layer, logical)) is not None and not plans.found
        }
        self._plan_next(list(pending.values()), "layer plans (ILP)", workers)

    def prefetch_squeezed(
        self,
        candidates: Iterable[tuple[int, int, tuple, tuple]],
        workers: int | None = None,
        best_step: Callable[[CostFn], float] | None = None,
    ) -> None:
        """Plan the squeezed alternatives the DP will ask for among `candidates` (start, end,
        submesh, logical), a level at a time: a stage gets its next level only where its last
        one may still not fit (`_needs_tighter`). Within a level, each layer and mesh is one
        task, all of them `workers` at a time. Before each level after the first, `best_step`
        (the step of the best plan under a cost_fn) of the levels planned so far (`planned`)
        lowers `step_bound_s`: a stage that cannot beat a plan already found is not squeezed
        deeper (the first level's bound is the caller's)."""
        candidates = list(candidates)
        for level in range(1, MAX_ALTERNATIVES):
            if best_step is not None and level > 1:
                self.step_bound_s = min(self.step_bound_s, best_step(self.planned))
            pending = {
                id(plans): plans
                for start, end, submesh, logical in candidates
                if self.fastest(start, end, submesh, logical)
                for plans in self._to_squeeze(start, end, logical, level)
            }
            if not pending:
                return
            self._plan_next(list(pending.values()), f"squeezed layer plans, level {level}", workers)

    def _plan_next(self, pending: list[_LayerPlans], desc: str, workers: int | None) -> None:
        """Plan each of `pending` at its next level: in the worker processes while they run
        (`planning_processes`), else `workers` (default: the CPU count) threads at a time (the
        solver runs outside Python's GIL)."""
        pending = [plans for plans in pending if not self._exhausted(plans)]
        if not pending:
            return
        if self._workers is not None and all(p.key in self._workers.keys for p in pending):
            planned = self._workers.map((plans.key, len(plans.found)) for plans in pending)
            planned = progress(planned, desc=desc, total=len(pending), unit="ILP")
            for plans, result in zip(pending, planned, strict=True):
                self._record(plans, result)
            return
        with ThreadPoolExecutor(min(len(pending), workers or os.cpu_count() or 1)) as pool:
            solves = pool.map(self._squeeze, pending)
            list(progress(solves, desc=desc, total=len(pending), unit="ILP"))

    def _to_squeeze(self, start: int, end: int, logical: tuple, level: int) -> list[_LayerPlans]:
        """The layers of stage [start, end) on `logical` (each with its fastest plan) still to
        plan at squeeze `level`, as `__call__` would ask for them: none where the stage at a
        level before fits or cannot win (`_needs_tighter`)."""
        layers = [self._layer_plans(layer, logical) for layer in range(start, end)]
        found = [plans.found for plans in layers]
        if not all(self._needs_tighter(_stage_cost(found, lv), end) for lv in range(level)):
            return []
        return [plans for plans in layers if len(plans.found) == level and not plans.exhausted]

    def _squeeze_to(self, plans: _LayerPlans, levels: int) -> None:
        """Squeeze until the layer has `levels` plans or no more fit."""
        while len(plans.found) < min(levels, MAX_ALTERNATIVES) and not plans.exhausted:
            self._squeeze(plans)

    def _layer_plans(self, layer: int, logical: tuple) -> _LayerPlans | None:
        """The plans of `layer` on `logical` so far, shared by every layer of the same structure
        (up to the order of its ops and inputs) on the same mesh kind; None where the layer
        cannot run on it, or never fits there (its floor, `whole_peak_bytes`, says so without
        building the ILP)."""
        if (layer, logical) not in self._plans_of:
            self._plans_of[layer, logical] = self._new_layer_plans(layer, logical)
        return self._plans_of[layer, logical]

    def _new_layer_plans(self, layer: int, logical: tuple) -> _LayerPlans | None:
        stage = self.layer_program(layer)
        intra = stage_intra_config(self.config, logical, self.program.signature)
        if intra is None:
            return None
        mesh = stage_mesh(logical, tuple(range(math.prod(logical))))
        axes = logical_mesh(self.cluster, mesh.shape, mesh.axis_names)
        cached = [c or 0.0 for c in axes.cached_bandwidths or (None,) * len(axes.shape)]
        kind = tuple(zip(axes.shape, axes.bandwidths, axes.latencies, cached, strict=True))
        if intra.force_batch_dim_to_mesh_dim is None:
            kind = tuple(sorted(kind))  # free axes of equal size and links can be swapped
        structure = self._structure(stage.program)
        if structure not in self._analyses:  # the first layer of this structure plans for all
            analysis = ProgramAnalysis.of(stage.program, self.cluster, self.config.intra)
            peak = whole_peak_bytes(analysis.grouping, analysis.live)
            self._analyses[structure] = stage, analysis, peak
        stage, analysis, peak = self._analyses[structure]
        floor = peak / math.prod(logical)
        if floor > self.device_memory:
            return None
        key = (structure, kind, intra.force_batch_dim_to_mesh_dim)
        if key not in self._plans:
            k = self.config.num_micro_batches
            intra = dataclasses.replace(
                intra,
                relative_gap=CANDIDATE_GAP,
                time_limit_s=CANDIDATE_TIME_SHARE * intra.time_limit_s,
                presolve=CANDIDATE_PRESOLVE,
                round_relaxation=CANDIDATE_ROUNDING,
            )
            cache = self._mesh_caches.setdefault((mesh.shape, mesh.axis_names, intra), MeshCache())
            build = functools.partial(
                ShardingProblem,
                stage.program,
                mesh,
                self.cluster,
                intra,
                k,
                analysis=analysis,
                cache=cache,
            )
            shapes = stage_shapes(
                self.parts.num_layers, self.num_devices, math.prod(logical), self.config
            )
            self._plans[key] = _LayerPlans(key, stage, mesh, build, shapes, [])
        return self._plans[key]

    def _structure(self, program: Program) -> int:
        """`program_structure` of a layer's program, found once for the layers whose jaxprs
        print alike (up to which parameters and layers they touch) and whose inputs play the
        same roles: the rest never build their graphs."""
        signature = program.signature
        key = (program.fingerprint, signature.batch_inputs, signature.output_to_input)
        if key not in self._structures:
            self._structures[key] = program_structure(program)
        return self._structures[key]

    def _squeeze(self, plans: _LayerPlans) -> None:
        """Plan the layer at its next level (`_plan_level`) and record the plan."""
        if not self._exhausted(plans):
            self._record(plans, self._plan_level(plans.key, len(plans.found)))

    @staticmethod
    def _exhausted(plans: _LayerPlans) -> bool:
        """Whether the layer has no next level to plan (marked so where it has no deeper stage
        shape)."""
        if len(plans.found) > len(plans.shapes):
            plans.exhausted = True
        return plans.exhausted

    def _record(
        self, plans: _LayerPlans, planned: tuple[LayerCost, StructureStrategies] | None
    ) -> None:
        with self._count_lock:
            self.ilp_solves += 1
        if planned is None:
            plans.exhausted = True
        else:
            plans.found.append(planned[0])
            plans.strategies.append(planned[1])

    def _plan_level(self, key: tuple, level: int) -> tuple[LayerCost, StructureStrategies] | None:
        """The layer's plan at squeeze `level` (None: none fits, or no level that deep): its
        fastest plan within device memory at level 0, then one for its stage shape (whose
        layers an interleaved schedule splits into chunks on the same mesh, sharing its memory
        as one stage's would). It runs in a worker process (`forked`) or a thread."""
        start = time.perf_counter()
        plans = self._plans[key]
        if level == 0:
            shape, problem, budget = StageShape(1, 1), plans.problem, self.device_memory
        else:
            shape = plans.shapes[level - 1]
            stash = Stash(plans.stage.num_forward, shape.depth * shape.flight - 1)
            problem = plans.problem.stacked(shape.depth, stash)
            budget = STACK_SHARE * self.device_memory
        # a squeezed plan that the emission takes over the budget is corrected
        found = problem.candidate(budget, correct=level > 0)
        logger.debug(
            "layers %s on mesh %s as 1 of %d with %d micro-batch(es) in flight, within %.3g "
            "GiB: %s in %.2f s",
            plans.stage.layers,
            plans.mesh.shape,
            shape.depth,
            shape.flight,
            budget / 2**30,
            "no plan" if found is None else "a plan",
            time.perf_counter() - start,
        )
        if found is None:
            return None
        plan = found.plan
        stash = stash_bytes(plans.stage, plan.stages[0], problem.problem.grouping)
        state = state_bytes(plans.stage, plan.stages[0])
        # the stack's peak less its layers' state and stashes: one layer's temporaries
        temporary = plan.predicted.memory_per_device_bytes - shape.depth * state
        temporary -= shape.depth * shape.flight * stash
        k = self.config.num_micro_batches
        latency = plan.predicted.step_time_s / k
        return LayerCost(latency, state, stash, max(0.0, temporary)), found.strategies

    def __call__(
        self, start: int, end: int, submesh: tuple, logical: tuple
    ) -> tuple[StageCost, ...]:
        """The stage DP's cost_fn: layers [start, end) on `logical` (see the module docstring):
        its fastest alternative, then one per squeeze level as long as the last may not fit (a
        layer with fewer levels stays at its tightest). A stage `correct`ed after it did not
        fit as a whole counts the memory it needs there."""
        key = (start, end, submesh, logical)
        extra = self._extra.get(key, 0.0)
        if extra == math.inf:
            return ()
        latency = self._latency.get(key, 0.0)
        found = [_raised(c, extra, latency) for c in self.fastest(start, end, submesh, logical)]
        while found and len(found) < MAX_ALTERNATIVES and self._needs_tighter(found[-1], end):
            level = len(found)
            layers = [self.layer_costs(layer, logical, level + 1) for layer in range(start, end)]
            if all(len(costs) <= level for costs in layers):
                break  # every layer is at its tightest
            found.append(_raised(_stage_cost(layers, level), extra, latency))
        return tuple(found)

    def reprice(self, stage: StageAssignment, latency: float) -> None:
        """`stage`, planned as a whole, takes `latency` seconds per micro-batch, far more than
        its layers' plans add up to (where only plans far from theirs fit it as a whole): the
        search goes again with each of its alternatives that slow."""
        key = _stage_key(stage)
        self._latency[key] = max(self._latency.get(key, 0.0), latency)

    def correct(self, stage: StageAssignment, flight: int, least: float) -> None:
        """Raise the memory of `stage`'s alternatives so that none fits with `flight`
        micro-batches in flight: planned as a whole there, it needs `least` bytes per device
        (inf: it has no plan), more than its layers' plans add up to (resharding between them,
        activations alive across them). The search then places it where fewer micro-batches
        are in flight, or leaves it out."""
        key = _stage_key(stage)
        alternatives = self(*key)
        if not math.isfinite(least) or not alternatives:
            self._extra[key] = math.inf
            return
        estimate = min(
            c.static_memory_bytes + flight * c.activation_memory_bytes for c in alternatives
        )
        self._extra[key] = self._extra.get(key, 0.0) + max(0.0, least - estimate)

    def _needs_tighter(self, cost: StageCost, end: int) -> bool:
        """Whether the DP may need a tighter alternative than `cost` for a stage ending at layer
        `end`: it does not fit with as many micro-batches in flight as the stage could ever
        hold, and it is not hopeless (the class docstring; tighter plans are slower still)."""
        most_in_flight = self.config.most_in_flight(self.parts.num_layers - end)
        need = cost.static_memory_bytes + most_in_flight * cost.activation_memory_bytes
        # even at this speed, a plan with this stage would be no better than the bound (every
        # schedule's step is at least B times its slowest stage):
        hopeless = self.config.num_micro_batches * cost.latency_s >= self.step_bound_s
        return need > self.device_memory * self.config.least_memory_share and not hopeless

    def chosen_strategies(self, stage: StageAssignment) -> list[StructureStrategies]:
        """The strategies of the layer plans that priced the alternative the stage search
        chose for `stage`: its ILP starts from them, so that a stage plan stopped at the time
        limit is no worse than the search's estimate. Only plans made on the stage's very
        mesh (not one with its axes swapped) apply."""
        (start, end), logical = stage.layers, stage.logical_mesh
        alternatives = self(start, end, stage.submesh, logical)
        if stage.cost not in alternatives:
            return []
        level = alternatives.index(stage.cost)
        mesh = stage_mesh(logical, tuple(range(math.prod(logical))))
        layers = [self._layer_plans(layer, logical) for layer in range(start, end)]
        return [
            plans.strategies[min(level, len(plans.strategies) - 1)]
            for plans in layers
            if plans is not None
            and plans.strategies
            and (plans.mesh.shape, plans.mesh.axis_names) == (mesh.shape, mesh.axis_names)
        ]

    def planned(
        self, start: int, end: int, submesh: tuple, logical: tuple
    ) -> tuple[StageCost, ...]:
        """A cost_fn of stages at the levels their layers have been planned at so far
        (planning nothing): each is a stage the DP may take later, so the best plan under it
        bounds the step the search will find."""
        layers = [self._layer_plans(layer, logical) for layer in range(start, end)]
        if not all(plans and plans.found for plans in layers):
            return ()
        found = [tuple(plans.found) for plans in layers]
        return tuple(_stage_cost(found, lv) for lv in range(max(map(len, found))))

    def why_rejected(
        self, start: int, end: int, submesh: tuple, logical: tuple
    ) -> PlanningError | None:
        """Why the cost_fn has no plan of layers [start, end) on `logical`: the first layer
        that cannot run there (its micro-batch does not split over the forced batch axis) or
        never fits the device memory (with the least memory it needs); None if none is."""
        signature = self.program.signature
        for layer in range(start, end):
            if self.layer_costs(layer, logical, 1):
                continue
            if stage_intra_config(self.config, logical, signature) is None:
                return PlanningError(
                    f"layer {layer} cannot run on logical mesh {logical}: its micro-batch does "
                    f"not split over the mesh's first axis ({logical[0]} devices); choose a "
                    "submesh_logical_shape whose first axis divides the micro-batch"
                )
            plans = self._layer_plans(layer, logical)
            if plans is None:  # its floor alone is over the device memory
                _, _, peak = self._analyses[self._structure(self.layer_program(layer).program)]
                least = peak / math.prod(logical)
            else:
                least = plans.problem.least_memory()
            return MemoryBudgetError(
                f"layer {layer} alone needs at least {format_bytes(least)} per device on "
                f"logical mesh {logical} ({math.prod(logical)} devices, sub-mesh {submesh}), "
                f"over the memory budget of {format_bytes(self.device_memory)}: use fewer "
                'stages (more devices each), AutoLayerOption(remat_mode="coarse_grained") or '
                "ManualLayerOption(remat_layer=True), more micro-batches (smaller ones), or "
                "more devices",
                self.device_memory,
                least,
            )
        return None

    def fastest(
        self, start: int, end: int, submesh: tuple, logical: tuple
    ) -> tuple[StageCost, ...]:
        """A cost_fn of stages at their layers' fastest plans only (never squeezed)."""
        fastest = [self.layer_costs(layer, logical, 1) for layer in range(start, end)]
        return (_stage_cost(fastest, 0),) if all(fastest) else ()


def _stage_key(stage: StageAssignment) -> tuple:
    """The cost_fn's arguments for `stage`: (start, end, submesh, logical mesh)."""
    return (*stage.layers, stage.submesh, stage.logical_mesh)


def _raised(cost: StageCost, extra: float, latency: float = 0.0) -> StageCost:
    """`cost` with `extra` bytes per device more all step long, taking at least `latency`
    seconds per micro-batch."""
    if not extra and latency <= cost.latency_s:
        return cost
    return dataclasses.replace(
        cost,
        static_memory_bytes=cost.static_memory_bytes + extra,
        latency_s=max(cost.latency_s, latency),
    )


def _mesh_of(key: tuple) -> tuple:
    """The mesh part of a layer plan's key (structure, mesh kind, forced batch axis): the
    layer ILPs of one mesh share a `MeshCache`, so a worker plans them together."""
    return key[1:]


def _stage_cost(layers: list[tuple[LayerCost, ...]], level: int) -> StageCost:
    """A stage of these layers at one squeeze level (a layer with fewer levels stays at its
    tightest): latencies, state and stashes add up; the largest temporary counts once."""
    costs = [found[min(level, len(found) - 1)] for found in layers]
    return StageCost(
        latency_s=sum(c.latency_s for c in costs),
        static_memory_bytes=sum(c.state_bytes for c in costs)
        + max(c.temporary_bytes for c in costs),
        activation_memory_bytes=sum(c.stash_bytes for c in costs),
    )


def _solve(
    num_layers: int,
    cluster_shape: tuple[int, int],
    cost_fn: Callable,
    device_memory: float,
    config: PipelineConfig,
    schedule: PipelineSchedule,
) -> StageSolution:
    """The stages of the option's kind (DP, uniform or manual) under `schedule`."""
    args = (num_layers, *cluster_shape, config.num_micro_batches, cost_fn, device_memory)
    option = config.stage_option
    if schedule.interleaves:
        if isinstance(option, ManualStageOption):
            raise PlanningError(
                "pipeline_schedule='interleaved_1f1b' lays its stages out itself (equal "
                "sub-meshes, num_virtual_stages chunks each): use AutoStageOption or "
                "UniformStageOption, not ManualStageOption"
            )
        return interleaved_stages(*args, option, config.num_virtual_stages)
    if isinstance(option, ManualStageOption):
        return manual_stages(*args, option, schedule)
    if isinstance(option, UniformStageOption):
        return uniform_stages(*args, option, schedule)
    if isinstance(cost_fn, LayerCosts):
        # The DP asks for every layer on every candidate mesh. Plans found without squeezed
        # alternatives bound which stages are worth squeezing into memory: first the best
        # with every stage at its fastest (all planned by now), then the best with stages
        # within a host (fast links, cheap ILPs), squeezed as that bound allows.
        meshes = [
            (submesh, logical)
            for submesh in submesh_shapes(*cluster_shape, option.submesh_physical_shape_space)
            for logical in logical_mesh_shapes(
                submesh, option.submesh_logical_shape_space, cluster_shape[1]
            )
        ]
        with cost_fn.planning_processes(logical for _, logical in meshes):
            cost_fn.prefetch(logical for _, logical in meshes)
            cost_fn.step_bound_s = _best_step(args, option, schedule, cost_fn.fastest)
            stages = [
                (start, end, submesh, logical)
                for start in range(num_layers)
                for end in range(start + 1, num_layers + 1)
                for submesh, logical in meshes
            ]
            if cluster_shape[0] > 1:
                cost_fn.prefetch_squeezed(stage for stage in stages if stage[2][0] == 1)
                within_host = functools.partial(_within_host, cost_fn)
                bound = _best_step(args, option, schedule, within_host)
                cost_fn.step_bound_s = min(cost_fn.step_bound_s, bound)
            cost_fn.prefetch_squeezed(
                stages, best_step=functools.partial(_best_step, args, option, schedule)
            )
    return solve_stages(*args, option, schedule=schedule)


def unbounded_step(
    costs: LayerCosts, cluster_shape: tuple[int, int], schedule: PipelineSchedule
) -> float:
    """The step of the best stages under `schedule` with every layer at its fastest plan (as
    `costs` planned them) and device memory unbounded: what a plan would take if memory did not
    bind. Infinite where the stages are not searched (manual, uniform or interleaved)."""
    option = costs.config.stage_option
    if isinstance(option, ManualStageOption | UniformStageOption) or schedule.interleaves:
        return math.inf
    k = costs.config.num_micro_batches
    args = (costs.parts.num_layers, *cluster_shape, k, costs.fastest, math.inf)
    return _best_step(args, option, schedule, costs.fastest)


def _within_host(cost_fn: CostFn, start: int, end: int, submesh: tuple, logical: tuple):
    """`cost_fn` of stages on one host's devices; None for the others."""
    return cost_fn(start, end, submesh, logical) if submesh[0] == 1 else None


def _best_step(args: tuple, option, schedule: PipelineSchedule, cost_fn: CostFn) -> float:
    """The step time of the best plan under `cost_fn` instead of args' (inf: none fits)."""
    num_layers, num_hosts, devices_per_host, num_micro_batches, _, memory = args
    try:
        solution = solve_stages(
            num_layers,
            num_hosts,
            devices_per_host,
            num_micro_batches,
            cost_fn,
            memory,
            option,
            schedule=schedule,
        )
    except PlanningError:
        return math.inf
    return solution.step_latency_s


def _fastest_schedule(
    num_layers: int,
    cluster_shape: tuple[int, int],
    cost_fn: CostFn,
    device_memory: float,
    config: PipelineConfig,
    launch_s: float,
) -> tuple[PipelineSchedule, StageSolution]:
    """The stages searched under each of the config's schedules, and the schedule whose
    stages step fastest, the host's launches of their tasks included (the first on ties); the
    first schedule's error where none has a plan."""
    found, errors = [], []
    for schedule in config.schedules:
        try:
            solution = _solve(num_layers, cluster_shape, cost_fn, device_memory, config, schedule)
        except PlanningError as error:
            errors.append(error)
            continue
        k = config.num_micro_batches
        host = schedule.host_time(len(solution.stages), k, launch_s)
        step = max(solution.step_latency_s, host)
        found.append((step, len(found), schedule, solution))
        logger.info("%s: predicted step %.4g s", schedule.value, step)
    if not found:
        raise errors[0]
    _, _, schedule, solution = min(found, key=lambda f: f[:2])
    return schedule, solution


@dataclasses.dataclass(frozen=True)
class _StageJob:
    """A chosen stage to plan as a whole: its program on its mesh with `flight` micro-batches
    in flight, and the strategies of the layer plans that priced it (the ILP's start)."""

    stage: StageProgram
    mesh: MeshPlan
    intra: IntraOpConfig
    flight: int
    layer_strategies: list[StructureStrategies]


def _stage_jobs(
    parts: StepParts,
    program: Program,
    config: PipelineConfig,
    costs: CostFn,
    schedule: PipelineSchedule,
    solution: StageSolution,
    cluster_shape: tuple[int, int],
) -> tuple[list[tuple[StageProgram, MeshPlan, tuple]], dict[tuple, _StageJob]]:
    """Per chosen stage (its program, mesh, job key), and the jobs that plan them: identical
    stages on equal meshes with as many micro-batches in flight are planned once."""
    ranges = [a.layers for a in solution.stages]
    placement = place_stages(parts, ranges)
    meshes = solution.num_meshes
    devices = place_submeshes([a.submesh for a in solution.stages[:meshes]], *cluster_shape)
    in_flight = schedule.stage_in_flight(len(ranges), config.num_micro_batches, meshes)
    chosen, jobs = [], {}
    for s, assignment in enumerate(solution.stages):
        stage = stage_program(parts, placement, s, program.signature)
        mesh = stage_mesh(assignment.logical_mesh, tuple(devices[s % meshes]))
        flight = in_flight[s]
        key = (stage.program.fingerprint, mesh.shape, mesh.axis_names, flight)
        chosen.append((stage, mesh, key))
        if key not in jobs:
            intra = stage_intra_config(config, assignment.logical_mesh, program.signature)
            # the layer plans that priced it, where the cost model did (not a profiler)
            priced = []
            if isinstance(costs, LayerCosts):
                priced = costs.chosen_strategies(assignment)
                intra = dataclasses.replace(intra, round_relaxation=STAGE_ROUNDING)
            jobs[key] = _StageJob(stage, mesh, intra, flight, priced)
    return chosen, jobs


def _plan_stage(
    job: _StageJob, cluster: ClusterSpec, num_micro_batches: int, memory: float
) -> Plan | MemoryBudgetError:
    """A chosen stage planned as a whole within device memory, its other micro-batches in
    flight holding their activations (the ILP trades them against the rest, `intra.Stash`),
    from the strategies its layers' plans chose; the error, with the least memory the stage
    needs, where none fits."""
    stage, mesh, flight = job.stage, job.mesh, job.flight
    stash = Stash(stage.num_forward, flight - 1)
    problem = ShardingProblem(stage.program, mesh, cluster, job.intra, num_micro_batches, stash)
    plan = problem.solve(memory, start=problem.start_from(job.layer_strategies))
    if plan is None:
        error = problem.over_budget(memory)
        return MemoryBudgetError(
            f"stage of layers {stage.layers} on mesh {mesh.shape} with {flight} micro-batches "
            f"in flight: {error}; or use more micro-batches (less activation memory each) or "
            "more pipeline stages",
            error.budget,
            error.least,
        )
    return plan


def _plan_stages(
    jobs: dict[tuple, _StageJob], plan_job: Callable[[_StageJob], Plan | MemoryBudgetError]
) -> list[Plan | MemoryBudgetError]:
    """Each job planned as a whole (`plan_job`), in worker processes forked for them where
    there are several (`forked`), else on threads: half of an ILP's time is Python."""
    count = min(process_count(), len(jobs))
    if count > 1:
        with ForkedWorkers(count, lambda key, _: plan_job(jobs[key]), jobs) as workers:
            done = workers.map((key, None) for key in jobs)
            return list(progress(done, desc="stage plans (ILP)", total=len(jobs), unit="stage"))
    with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1) or 1) as pool:
        done = pool.map(plan_job, jobs.values())
        return list(progress(done, desc="stage plans (ILP)", total=len(jobs), unit="stage"))


def _check_memory_floor(
    parts: StepParts, program: Program, cluster_shape: tuple[int, int], memory: float
) -> None:
    """A MemoryBudgetError, before any ILP, where even the state and one micro-batch of
    activations spread evenly over all devices exceed `memory` per device
    (`pipeline.memory_floor`): no stage plan can fit, and the search would take long to say so."""
    state, activations = memory_floor(parts, program.signature.batch_inputs)
    devices = math.prod(cluster_shape)
    floor = (state + activations) / devices
    if floor <= memory:
        return
    raise MemoryBudgetError(
        f"no pipeline plan of {parts.num_layers} layers on {devices} devices fits in "
        f"{format_bytes(memory)} per device: the state ({format_bytes(state)}) and one "
        f"micro-batch of activations ({format_bytes(activations)}) alone need at least "
        f"{format_bytes(floor)} per device, spread over all devices; use more micro-batches "
        '(smaller ones), AutoLayerOption(remat_mode="coarse_grained") (a stage keeps only its '
        "layers' inputs), or more devices",
        memory,
        floor,
    )


@dataclasses.dataclass(frozen=True)
class _Search:
    """One stage search whose chosen stages, planned whole (`planned`, by job key), all fit:
    its step as their own plans run it."""

    schedule: PipelineSchedule
    solution: StageSolution
    chosen: list[tuple[StageProgram, MeshPlan, tuple]]
    planned: dict[tuple, Plan]
    num_micro_batches: int
    launch_s: float

    @property
    def latencies(self) -> list[float]:
        """Each chosen stage's seconds per micro-batch, as planned whole."""
        k = self.num_micro_batches
        return [self.planned[key].predicted.step_time_s / k for _, _, key in self.chosen]

    @property
    def host(self) -> float:
        """Seconds one host takes to launch every task of a step."""
        stages = len(self.solution.stages)
        return self.schedule.host_time(stages, self.num_micro_batches, self.launch_s)

    @property
    def step(self) -> float:
        """The host launches every task while the devices run the ones before: the step is as
        long as the slower of the devices' schedule and the host's launches."""
        k, meshes = self.num_micro_batches, self.solution.num_meshes
        return max(self.schedule.step_time(self.latencies, k, meshes), self.host)


def plan_pipeshard(
    parts: StepParts,
    program: Program,
    cluster: ClusterSpec,
    cluster_shape: tuple[int, int],
    config: PipelineConfig,
    costs: CostFn | None = None,
) -> Plan:
    """The pipeshard plan of a layered step on a (hosts, devices per host) cluster.

    `costs` is the stage DP's cost_fn: by default a new `LayerCosts` (cost-model mode); pass one
    to reuse (and keep) its cached layer plans, or a `runtime.profile.StageProfiler` to measure
    candidates on devices. Either counts its ILP solves in `ilp_solves`."""
    start_time = time.perf_counter()
    memory = config.intra.budget(cluster)
    _check_memory_floor(parts, program, cluster_shape, memory)
    costs = costs or LayerCosts(parts, program, cluster, config, math.prod(cluster_shape))
    k = config.num_micro_batches
    solved: dict[tuple, Plan | MemoryBudgetError] = {}  # by job key, over the searches
    best: _Search | None = None  # the fastest search whose stages all fit as planned
    for searches in itertools.count(1):
        schedule, solution = _fastest_schedule(
            parts.num_layers, cluster_shape, costs, memory, config, cluster.launch_overhead_s
        )
        per_mesh = solution.stages_per_mesh
        chosen, jobs = _stage_jobs(parts, program, config, costs, schedule, solution, cluster_shape)
        todo = {key: job for key, job in jobs.items() if (*key, per_mesh) not in solved}
        plan_job = functools.partial(  # the stages on a mesh share its memory
            _plan_stage, cluster=cluster, num_micro_batches=k, memory=memory / per_mesh
        )
        done = _plan_stages(todo, plan_job)
        solved.update(((*key, per_mesh), plan) for key, plan in zip(todo, done, strict=True))
        planned = {key: solved[(*key, per_mesh)] for key in jobs}
        failed = {key: p for key, p in planned.items() if isinstance(p, MemoryBudgetError)}
        slow = {}
        if not failed:
            search = _Search(schedule, solution, chosen, planned, k, cluster.launch_overhead_s)
            best = search if best is None or search.step < best.step else best
            slow = {
                key: latency
                for (_, _, key), assignment, latency in zip(
                    chosen, solution.stages, search.latencies, strict=True
                )
                if latency > REPRICE_SLOWDOWN * assignment.cost.latency_s
            }
            if not slow:
                break
        if not isinstance(costs, LayerCosts) or searches > MAX_STAGE_CORRECTIONS:
            if best is None:
                raise next(iter(failed.values()))
            break
        # A chosen stage needs more memory as a whole than its layers' plans add up to, or
        # only a plan far slower than theirs fits it: the search goes again, knowing.
        for (_, _, key), assignment in zip(chosen, solution.stages, strict=True):
            if key in failed:
                costs.correct(assignment, jobs[key].flight, failed[key].least)
            elif key in slow:
                costs.reprice(assignment, slow[key])
        logger.info(
            "%d chosen stage(s) did not fit as a whole (%s) and %d ran over %g times slower "
            "than estimated; searching the stages again",
            len(failed),
            next(iter(failed.values()), "none"),
            len(slow),
            REPRICE_SLOWDOWN,
        )
    schedule, solution, chosen, planned = best.schedule, best.solution, best.chosen, best.planned
    meshes = solution.num_meshes
    ranges = [a.layers for a in solution.stages]
    stage_plans, peaks = [], []
    compute = comm = comm_bytes = flops = 0.0
    for s, ((stage, mesh, key), assignment) in enumerate(zip(chosen, solution.stages, strict=True)):
        p = planned[key].predicted
        stage_plans.append(
            dataclasses.replace(
                planned[key].stages[0],
                index=s,
                mesh=mesh,
                layers=tuple(assignment.layers),
                input_paths=stage.program.signature.input_paths,
                predicted=p,
            )
        )
        peaks.append(p.memory_per_device_bytes)
        compute, comm, comm_bytes, flops = (
            compute + p.compute_s,
            comm + p.communication_s,
            comm_bytes + p.communication_bytes,
            flops + p.flops,
        )
    mesh_peaks = [sum(peaks[i::meshes]) for i in range(meshes)]
    elapsed = time.perf_counter() - start_time
    shapes = ", ".join(
        f"layers [{a.layers[0]},{a.layers[1]}) on {a.submesh} as {a.logical_mesh}"
        for a in solution.stages
    )
    # Timings stay out of the plan (logged only): the same program and options give the same plan.
    note = (
        f"{len(ranges)} stage(s): {shapes}; {schedule.value}; stage search over "
        f"{parts.num_layers} layers with {costs.ilp_solves} candidate ILP solves"
    )
    if searches > 1:
        note += (
            f" ({searches} searches: chosen stages that did not fit as a whole, or ran over "
            f"{REPRICE_SLOWDOWN:g} times slower than estimated, were repriced)"
        )
    logger.info("pipeshard plan: %s; planned in %.2f s", note, elapsed)
    sig = program.signature
    return Plan(
        method=PlanMethod.PIPESHARD_PARALLEL,
        num_micro_batches=k,
        stages=tuple(stage_plans),
        predicted=Predicted(
            step_time_s=best.step,
            compute_s=compute,
            communication_s=comm,
            memory_per_device_bytes=max(mesh_peaks),
            communication_bytes=comm_bytes,
            flops=flops,
            host_s=best.host,
        ),
        cluster=cluster,
        input_paths=sig.input_paths,
        output_paths=sig.output_paths,
        donated_inputs=sig.donated_inputs,
        fingerprint=program.fingerprint,
        notes=(note,),
        pipeline_schedule=schedule,
    )
