"""Inter-operator pass: slice the layers into pipeline stages on device sub-meshes (Alpa §5).

A stage is a contiguous run of layers placed on a sub-mesh of the cluster (part of one host, or
whole hosts) that the intra-op pass sees as a 2-D logical mesh. `solve_stages` searches every
such plan with Alpa's dynamic program; `uniform_stages` and `manual_stages` cost the plans a
user fixed. What a stage costs comes from the caller's `cost_fn` (in production the intra-op
ILP's prediction for that layer range on that logical mesh), so this module only searches.

A plan of stages with latencies t_1..t_S runs B micro-batches in the time its schedule says
(`PipelineSchedule.step_time`: Σ t + (B−1)·max t for GPipe and 1F1B), and a stage holds the
activations of as many micro-batches as the schedule keeps in flight where it sits
(`PipelineSchedule.in_flight`: under 1F1B a stage with s stages after it keeps s+1, under GPipe
all B).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from autopar.planner.errors import (
    InvalidArgumentError,
    MemoryBudgetError,
    PlanningError,
    check_positive_int,
)
from autopar.planner.schedules import PipelineSchedule
from autopar.planner.stage_options import (
    LOGICAL_SPACES,
    PHYSICAL_SPACES,
    AutoStageOption,
    ManualStageOption,
    UniformStageOption,
)
from autopar.planner.summary import format_bytes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class StageCost:
    """What one candidate stage costs; memory is per device."""

    latency_s: float  # one micro-batch, forward + backward
    static_memory_bytes: float  # parameters, gradients and optimizer state of the layer range
    activation_memory_bytes: float  # activations stashed per micro-batch in flight


CostFn = Callable[
    [int, int, tuple[int, int], tuple[int, int]], StageCost | Sequence[StageCost] | None
]
"""cost_fn(start, end, submesh_physical_shape, logical_mesh_shape) for layers [start, end); None
when that candidate cannot run (e.g. shapes that do not divide). It may return alternatives that
trade latency for memory (a faster sharding that stores more): a stage takes the fastest that
fits with the micro-batches in flight where it sits in the pipeline."""


def _alternatives(cost: StageCost | Sequence[StageCost] | None) -> tuple[StageCost, ...]:
    """cost_fn's answer as a tuple of usable alternatives (empty: the candidate cannot run)."""
    if cost is None:
        return ()
    found = (cost,) if isinstance(cost, StageCost) else tuple(cost)
    return tuple(c for c in found if math.isfinite(c.latency_s))


@dataclasses.dataclass(frozen=True, slots=True)
class StageAssignment:
    """Layers [start, end) on a (hosts, devices per host) sub-mesh seen as `logical_mesh`."""

    layers: tuple[int, int]
    submesh: tuple[int, int]
    logical_mesh: tuple[int, int]
    cost: StageCost


@dataclasses.dataclass(frozen=True, slots=True)
class StageSolution:
    """Stages in pipeline order and the step time their schedule predicts; with virtual stages
    (interleaved 1F1B) stage s shares the sub-mesh of stage s mod (stages / stages_per_mesh)."""

    stages: tuple[StageAssignment, ...]
    step_latency_s: float
    stages_per_mesh: int = 1

    @property
    def num_meshes(self) -> int:
        return len(self.stages) // self.stages_per_mesh


def _check_cluster(num_hosts: int, devices_per_host: int) -> None:
    check_positive_int("num_hosts", num_hosts)
    check_positive_int("devices_per_host", devices_per_host)


def submesh_shapes(
    num_hosts: int, devices_per_host: int, space: str = "power_of_two"
) -> list[tuple[int, int]]:
    """Alpa's sub-mesh shapes: slices of one host, then runs of whole hosts.

    "power_of_two" (Alpa's default): (1,1),(1,2),(1,4),..,(1,M), then (2,M),(4,M),(8,M).. up to
    N hosts; "all": every (1,k), then every (h,M). Keeping slices inside a host keeps a stage's
    collectives on the fast intra-host links; a power-of-two space also keeps the stage search
    (one layer ILP per layer and logical mesh) small on many hosts.
    """
    _check_cluster(num_hosts, devices_per_host)
    if space not in PHYSICAL_SPACES:
        raise InvalidArgumentError(f"space must be one of {PHYSICAL_SPACES}, got {space!r}")
    if space == "all":
        widths = list(range(1, devices_per_host + 1))
        hosts = list(range(2, num_hosts + 1))
    else:
        widths = [w for w in _powers_of_two(devices_per_host) if w < devices_per_host]
        widths.append(devices_per_host)
        hosts = _powers_of_two(num_hosts)[1:]
    return [(1, k) for k in widths] + [(h, devices_per_host) for h in hosts]


def _powers_of_two(n: int) -> list[int]:
    """1, 2, 4, .. up to n."""
    return [2**k for k in range(n.bit_length())]


def logical_mesh_shapes(
    submesh: tuple[int, int], space: str = "all", devices_per_host: int | None = None
) -> list[tuple[int, int]]:
    """The 2-D logical meshes the intra-op pass may view a sub-mesh of d devices as.

    "single_node_model_parallel" (Alpa's default): (d/mp, mp) for every mp that divides d and is
    at most `devices_per_host` (model parallelism within a host), with the batch dim forced onto
    the first axis where both axes split (`forces_batch_dim`), and (d, 1) left free. "all":
    every factorisation, free.
    """
    devices = submesh[0] * submesh[1]
    if space == "single_node_model_parallel":
        most = devices_per_host or submesh[1]
        shapes = [(devices // mp, mp) for mp in range(1, min(devices, most) + 1)]
        return [s for s in shapes if s[0] * s[1] == devices][::-1]
    if space == "all":
        return [(a, devices // a) for a in range(1, devices + 1) if devices % a == 0]
    if space == "same_as_physical":
        return [tuple(submesh)]
    if space == "data_parallel_only":
        return [(devices, 1)]
    if space == "model_parallel_only":
        return [(1, devices)]
    raise InvalidArgumentError(f"space must be one of {LOGICAL_SPACES}, got {space!r}")


def forces_batch_dim(space: str, logical: tuple[int, int]) -> bool:
    """Whether the intra-op pass splits the batch dim over axis 0 (and only there) for this
    logical mesh: in "single_node_model_parallel", on every mesh with two split axes."""
    return space == "single_node_model_parallel" and min(logical) > 1


def place_submeshes(
    submeshes: Sequence[tuple[int, int]], num_hosts: int, devices_per_host: int
) -> list[tuple[int, ...]]:
    """Device indices (host * devices_per_host + local) of each stage's sub-mesh, in stage order.

    Whole-host meshes (h, M) take consecutive hosts first; then slices (1, k), largest first,
    go to the first host with k free devices. Raises InvalidArgumentError when the shapes do
    not tile the cluster.
    """
    _check_cluster(num_hosts, devices_per_host)
    shapes = [tuple(int(x) for x in s) for s in submeshes]
    for shape in shapes:
        in_one_host = shape[0] == 1 and 1 <= shape[1] <= devices_per_host
        if not (in_one_host or (shape[0] >= 1 and shape[1] == devices_per_host)):
            raise InvalidArgumentError(
                f"sub-mesh {shape} is neither part of one host (1, k<={devices_per_host}) nor "
                f"whole hosts (h, {devices_per_host})"
            )
    covered, total = sum(h * k for h, k in shapes), num_hosts * devices_per_host
    if covered != total:
        raise InvalidArgumentError(
            f"sub-meshes {shapes} cover {covered} devices but the cluster has {total} "
            f"({num_hosts} hosts x {devices_per_host} devices)"
        )
    placed: list[tuple[int, ...]] = [()] * len(shapes)
    used = [0] * num_hosts  # devices taken on each host
    next_host = 0
    for i, (hosts, width) in enumerate(shapes):
        if width == devices_per_host:
            placed[i] = tuple(range(next_host * width, (next_host + hosts) * width))
            used[next_host : next_host + hosts] = [width] * hosts
            next_host += hosts
    slices = [i for i, shape in enumerate(shapes) if shape[1] < devices_per_host]
    for i in sorted(slices, key=lambda i: -shapes[i][1]):
        width = shapes[i][1]
        host = next((h for h in range(num_hosts) if used[h] + width <= devices_per_host), None)
        if host is None:
            raise InvalidArgumentError(
                f"sub-meshes {shapes} cannot be packed into {num_hosts} hosts of "
                f"{devices_per_host} devices: no host has {width} free devices for stage {i}"
            )
        start = host * devices_per_host + used[host]
        placed[i] = tuple(range(start, start + width))
        used[host] += width
    return placed


@dataclasses.dataclass(frozen=True)
class Pipelining:
    """How the stages run: B micro-batches under a schedule, which says what a stage holds and
    what a plan takes."""

    num_micro_batches: int
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    stages_per_mesh: int = 1  # v: interleaved 1F1B's virtual stages

    def memory_need(self, cost: StageCost, stages_after: int) -> float:
        """Per-device bytes: static state plus the micro-batches of activations in flight."""
        flight = self.schedule.in_flight(stages_after, self.num_micro_batches)
        return cost.static_memory_bytes + flight * cost.activation_memory_bytes

    def step(self, latencies: Sequence[float]) -> float:
        meshes = len(latencies) // self.stages_per_mesh
        return self.schedule.step_time(latencies, self.num_micro_batches, meshes)


def _describe(solution: StageSolution) -> str:
    parts = [
        f"[{a.layers[0]},{a.layers[1]}) on {a.submesh} as {a.logical_mesh}" for a in solution.stages
    ]
    noun = "stage" if len(parts) == 1 else "stages"
    return f"{len(parts)} {noun}, step {solution.step_latency_s:.4g} s: " + "; ".join(parts)


def _check_common(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_micro_batches: int,
    device_memory: float,
) -> None:
    check_positive_int("num_layers", num_layers)
    _check_cluster(num_hosts, devices_per_host)
    check_positive_int("num_micro_batches", num_micro_batches)
    if isinstance(device_memory, bool) or not isinstance(device_memory, numbers.Real):
        raise InvalidArgumentError(f"device_memory must be a number, got {device_memory!r}")
    if not device_memory > 0:
        raise InvalidArgumentError(f"device_memory must be positive, got {device_memory!r}")


def _fixed_solution(
    ranges: Sequence[tuple[int, int]],
    submeshes: Sequence[tuple[int, int]],
    logicals: Sequence[tuple[int, int]],
    pipe: Pipelining,
    cost_fn: CostFn,
    device_memory: float,
) -> StageSolution:
    """Cost a plan the user fixed; PlanningError if a stage cannot run or does not fit."""
    stages = []
    for i, (layers, submesh, logical) in enumerate(zip(ranges, submeshes, logicals, strict=True)):
        alternatives = _alternatives(cost_fn(layers[0], layers[1], submesh, logical))
        if not alternatives:
            why = getattr(cost_fn, "why_rejected", None)  # `pipeshard.LayerCosts` says why
            error = None if why is None else why(layers[0], layers[1], submesh, logical)
            raise error or PlanningError(
                f"stage {i} (layers [{layers[0]},{layers[1]}) on sub-mesh {submesh} as logical "
                f"mesh {logical}) cannot run: cost_fn rejected it"
            )
        after = len(ranges) - 1 - i
        fitting = [c for c in alternatives if pipe.memory_need(c, after) <= device_memory]
        if not fitting:
            need = min(pipe.memory_need(c, after) for c in alternatives)
            flight = pipe.schedule.in_flight(after, pipe.num_micro_batches)
            raise MemoryBudgetError(
                f"stage {i} (layers [{layers[0]},{layers[1]}) on {submesh}) needs "
                f"{format_bytes(need)} per device with {flight} micro-batches in flight under "
                f"{pipe.schedule.value}, but devices have {format_bytes(device_memory)}; use "
                'more micro-batches (smaller ones), AutoLayerOption(remat_mode="coarse_grained") '
                "or ManualLayerOption(remat_layer=True) (a stage keeps only its layers' inputs), "
                "or more devices",
                device_memory,
                need,
            )
        cost = min(fitting, key=lambda c: c.latency_s)
        stages.append(StageAssignment(tuple(layers), tuple(submesh), tuple(logical), cost))
    step = pipe.step([a.cost.latency_s for a in stages])
    solution = StageSolution(tuple(stages), step)
    logger.info("stage plan: %s", _describe(solution))
    return solution


def _even_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges as even as possible; the first stages take the extra layers."""
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (i < extra) for i in range(num_stages)]
    ends = itertools.accumulate(sizes)
    return [(end - size, end) for end, size in zip(ends, sizes, strict=True)]


def _even_submesh(num_hosts: int, devices_per_host: int, num_stages: int) -> tuple[int, int]:
    """One of num_stages equal sub-meshes: whole hosts or an equal slice of every host."""
    devices = num_hosts * devices_per_host
    per_stage, rest = divmod(devices, num_stages)
    if rest == 0 and per_stage % devices_per_host == 0:
        return (per_stage // devices_per_host, devices_per_host)
    if rest == 0 and devices_per_host % per_stage == 0:
        return (1, per_stage)
    raise InvalidArgumentError(
        f"cannot split {devices} devices ({num_hosts} hosts x {devices_per_host}) into "
        f"num_stages={num_stages} equal sub-meshes of whole hosts or equal slices of a host"
    )


def uniform_stages(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_micro_batches: int,
    cost_fn: CostFn,
    device_memory: float,
    option: UniformStageOption,
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
) -> StageSolution:
    """Equal layer counts on equal sub-meshes, for users who want a fixed, simple pipeline."""
    _check_common(num_layers, num_hosts, devices_per_host, num_micro_batches, device_memory)
    num_stages = num_layers if option.num_stages is None else option.num_stages
    if num_stages > num_layers:
        raise InvalidArgumentError(
            f"num_stages={num_stages} is more than the {num_layers} layers; each stage needs one"
        )
    submesh = _even_submesh(num_hosts, devices_per_host, num_stages)
    logical = option.submesh_logical_shape or submesh
    if logical[0] * logical[1] != submesh[0] * submesh[1]:
        raise InvalidArgumentError(
            f"submesh_logical_shape {logical} has {logical[0] * logical[1]} devices but each of "
            f"the {num_stages} stages gets a {submesh} sub-mesh of {submesh[0] * submesh[1]}"
        )
    ranges = _even_ranges(num_layers, num_stages)
    return _fixed_solution(
        ranges,
        [submesh] * num_stages,
        [logical] * num_stages,
        Pipelining(num_micro_batches, schedule),
        cost_fn,
        device_memory,
    )


def manual_stages(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_micro_batches: int,
    cost_fn: CostFn,
    device_memory: float,
    option: ManualStageOption,
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
) -> StageSolution:
    """The user's stages, checked against this cluster and model, with their predicted cost."""
    _check_common(num_layers, num_hosts, devices_per_host, num_micro_batches, device_memory)
    layer_ids = option.forward_stage_layer_ids
    given = sum(len(ids) for ids in layer_ids)
    if given != num_layers:
        raise InvalidArgumentError(
            f"forward_stage_layer_ids assign {given} layers but the model has {num_layers}"
        )
    place_submeshes(option.submesh_physical_shapes, num_hosts, devices_per_host)
    ranges = [(ids[0], ids[-1] + 1) for ids in layer_ids]
    return _fixed_solution(
        ranges,
        option.submesh_physical_shapes,
        option.submesh_logical_shapes,
        Pipelining(num_micro_batches, schedule),
        cost_fn,
        device_memory,
    )


def interleaved_stages(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_micro_batches: int,
    cost_fn: CostFn,
    device_memory: float,
    option: AutoStageOption | UniformStageOption,
    stages_per_mesh: int,
) -> StageSolution:
    """Interleaved 1F1B's stages: n equal sub-meshes, each holding v = `stages_per_mesh` chunks
    of contiguous layers (stage s on sub-mesh s mod n), as Megatron-LM lays them out.

    For each n the cluster splits into and dividing the micro-batches, and each logical mesh of
    that sub-mesh, the n·v layer ranges that minimise the slowest stage (a min-max DP over
    contiguous ranges), each stage taking its fastest alternative that fits 1/v of device
    memory with the micro-batches in flight the table keeps for it; the plan with the least
    `PipelineSchedule.step_time` wins. UniformStageOption(num_stages=n) fixes n meshes and
    gives the n·v stages equal layer counts.
    """
    _check_common(num_layers, num_hosts, devices_per_host, num_micro_batches, device_memory)
    v = check_positive_int("num_virtual_stages", stages_per_mesh)
    pipe = Pipelining(num_micro_batches, PipelineSchedule.INTERLEAVED_1F1B, v)
    uniform = isinstance(option, UniformStageOption)
    if uniform:
        meshes = option.num_stages or max(1, num_layers // v)
        submeshes = [_even_submesh(num_hosts, devices_per_host, meshes)]
        logicals = {submeshes[0]: [option.submesh_logical_shape or submeshes[0]]}
    else:
        total = num_hosts * devices_per_host
        submeshes = [
            shape
            for shape in submesh_shapes(
                num_hosts, devices_per_host, option.submesh_physical_shape_space
            )
            if total % (shape[0] * shape[1]) == 0 and shape[0] * shape[1] < total
        ]
        logicals = {
            shape: logical_mesh_shapes(shape, option.submesh_logical_shape_space, devices_per_host)
            for shape in submeshes
        }
    found: list[StageSolution] = []
    tried = []
    for submesh in submeshes:
        n = num_hosts * devices_per_host // (submesh[0] * submesh[1])
        if n * v > num_layers or num_micro_batches % n:
            tried.append(f"{n} meshes of {submesh}")
            continue
        in_flight = pipe.schedule.stage_in_flight(n * v, num_micro_batches, n)
        for logical in logicals[submesh]:
            stage_at = _fitting_stages(cost_fn, submesh, logical, device_memory / v, in_flight)
            if uniform:
                ranges = _even_ranges(num_layers, n * v)
            else:
                ranges = _min_max_ranges(num_layers, n * v, stage_at)
            stages = None if ranges is None else _assigned(ranges, stage_at, submesh, logical)
            if stages is not None:
                latencies = [a.cost.latency_s for a in stages]
                found.append(StageSolution(stages, pipe.step(latencies), v))
    if not found:
        raise PlanningError(
            f"interleaved 1F1B with num_virtual_stages={v} has no plan for {num_layers} layers "
            f"on {num_hosts}x{devices_per_host} devices with {num_micro_batches} micro-batches "
            f"and {format_bytes(device_memory)} per device (each of the v stages on a mesh gets "
            f"1/v of it){'; skipped: ' + ', '.join(tried) if tried else ''}: it needs n·v <= "
            "layers, micro-batches a multiple of the n meshes, and stages that fit; use more "
            "layers (AutoLayerOption(layer_num=...)), fewer virtual stages or pipeline_schedule="
            "'1f1b'"
        )
    solution = min(found, key=lambda f: f.step_latency_s)
    logger.info("stage plan: %s", _describe(solution))
    return solution


StageAt = Callable[[int, int, int], StageCost | None]
"""stage_at(start, end, s): the fastest alternative of layers [start, end) as stage s that fits,
or None."""


def _fitting_stages(
    cost_fn: CostFn,
    submesh: tuple[int, int],
    logical: tuple[int, int],
    memory: float,
    in_flight: Sequence[int],
) -> StageAt:
    """Stages on `submesh` as `logical`, each at its fastest alternative within `memory` with
    the micro-batches `in_flight[s]` it holds as stage s."""

    @functools.cache
    def stage_at(start: int, end: int, s: int) -> StageCost | None:
        fitting = [
            c
            for c in _alternatives(cost_fn(start, end, submesh, logical))
            if c.static_memory_bytes + in_flight[s] * c.activation_memory_bytes <= memory
        ]
        return min(fitting, key=lambda c: c.latency_s) if fitting else None

    return stage_at


def _min_max_ranges(
    num_layers: int, num_stages: int, stage_at: StageAt
) -> list[tuple[int, int]] | None:
    """`num_stages` contiguous layer ranges whose slowest stage is the fastest (None: none fit)."""
    # best[s][end]: (slowest stage, start of stage s) of layers [0, end) in s + 1 stages
    best: list[dict[int, tuple[float, int]]] = [{} for _ in range(num_stages)]
    for end in range(1, num_layers - num_stages + 2):
        cost = stage_at(0, end, 0)
        if cost is not None:
            best[0][end] = (cost.latency_s, 0)
    for s in range(1, num_stages):
        for end in range(s + 1, num_layers - num_stages + s + 2):
            options = []
            for start, (slowest, _) in best[s - 1].items():
                cost = stage_at(start, end, s) if start < end else None
                if cost is not None:
                    options.append((max(slowest, cost.latency_s), start))
            if options:
                best[s][end] = min(options)
    if num_layers not in best[-1]:
        return None
    ranges, end = [], num_layers
    for s in range(num_stages - 1, -1, -1):
        start = best[s][end][1]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def _assigned(
    ranges: Sequence[tuple[int, int]],
    stage_at: StageAt,
    submesh: tuple[int, int],
    logical: tuple[int, int],
) -> tuple[StageAssignment, ...] | None:
    """The stages of `ranges` priced by `stage_at`; None if one does not fit."""
    costs = [stage_at(a, b, s) for s, (a, b) in enumerate(ranges)]
    if any(c is None for c in costs):
        return None
    return tuple(
        StageAssignment(tuple(r), tuple(submesh), tuple(logical), c)
        for r, c in zip(ranges, costs, strict=True)
    )


# ---------------------------------------------------------------------------------------------
# The stage DP (Alpa §5): arrays and plain loops, no option objects.


@dataclasses.dataclass(frozen=True)
class _Candidates:
    """Every (layer range, sub-mesh, variant) stage, as arrays indexed
    [start, length - 1, submesh, variant]; a variant is a logical mesh with one of cost_fn's
    alternatives for it, and `costs` maps an index to that (logical mesh, cost).

    latency is inf where there is no such variant (cost_fn said None, or the range runs past the
    last layer), and so is its static memory; max_after is the most stages that may follow the
    stage within device memory (-1: it never fits); flights[after] is how many micro-batches a
    stage with `after` stages behind it keeps.
    """

    cluster: tuple[int, int]
    submeshes: tuple[tuple[int, int], ...]
    latency: np.ndarray
    static: np.ndarray
    activation: np.ndarray
    flights: tuple[int, ...]
    max_after: np.ndarray
    costs: dict[tuple[int, int, int, int], tuple[tuple[int, int], StageCost]]

    @property
    def num_devices(self) -> int:
        return self.cluster[0] * self.cluster[1]

    @property
    def sizes(self) -> np.ndarray:
        return np.array([h * k for h, k in self.submeshes])


def _collect(
    num_layers: int,
    cluster: tuple[int, int],
    submeshes: list[tuple[int, int]],
    logical_space: str,
    cost_fn: CostFn,
    device_memory: float,
    max_stages: int,
    pipe: Pipelining,
) -> _Candidates:
    """Ask cost_fn once for every candidate stage; tabulate latency and memory headroom."""
    costs = {}
    for start in range(num_layers):
        for end in range(start + 1, num_layers + 1):
            for m, submesh in enumerate(submeshes):
                variants = [
                    (logical, cost)
                    for logical in logical_mesh_shapes(submesh, logical_space, cluster[1])
                    for cost in _alternatives(cost_fn(start, end, submesh, logical))
                ]
                costs.update(((start, end - start - 1, m, g), v) for g, v in enumerate(variants))
    num_variants = 1 + max((key[3] for key in costs), default=0)
    shape = (num_layers, num_layers, len(submeshes), num_variants)
    latency = np.full(shape, np.inf)
    static = np.full(shape, np.inf)
    activation = np.zeros(shape)
    for key, (_, cost) in costs.items():
        latency[key] = cost.latency_s
        static[key] = cost.static_memory_bytes
        activation[key] = cost.activation_memory_bytes
    # Fitting is monotone in the stages after, so count how many counts fit (with the
    # expression of Pipelining.memory_need, so the DP and the fixed plans' checks agree to the
    # bit).
    flights = tuple(pipe.schedule.in_flight(a, pipe.num_micro_batches) for a in range(max_stages))
    max_after = np.full(shape, -1)
    for flight in flights:
        max_after += static + flight * activation <= device_memory
    return _Candidates(
        cluster, tuple(submeshes), latency, static, activation, flights, max_after, costs
    )


def _best_logical(cands: _Candidates, num_after: int, low: float, high: float) -> np.ndarray:
    """[after, start, length - 1, submesh]: the least latency over variants (logical meshes and
    their alternatives) that fit with `after` stages behind and lie in [low, high] — Alpa's
    trick of choosing the logical mesh once per (range, sub-mesh) instead of inside the DP."""
    inside = (cands.latency >= low) & (cands.latency <= high)
    usable = np.where(inside, cands.latency, np.inf)
    return np.stack(
        [np.where(cands.max_after >= k, usable, np.inf).min(-1) for k in range(num_after)]
    )


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A DP result: stages (start, end, submesh index), their latencies, and the latency window
    their logical meshes come from."""

    stages: tuple[tuple[int, int, int], ...]
    latencies: tuple[float, ...]
    window: tuple[float, float]

    @property
    def latency_sum(self) -> float:
        return sum(self.latencies)

    def step(self, pipe: Pipelining) -> float:
        return pipe.step(self.latencies)


_Choices = list[tuple[np.ndarray, np.ndarray, float]]


def _least_sum_dp(
    table: np.ndarray,
    sizes: np.ndarray,
    num_devices: int,
    bound: float,
    combine: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.add,
) -> _Choices:
    """Alpa's F(s, k, d) for one bound t_max on stage latency (§5.2).

    F(s, k, d) = min over the first stage [k, k+len) on sub-mesh m of
    table[s−1, k, len−1, m] + F(s−1, k+len, d − |m|), stages ≤ bound. Built from the last layer
    backwards, so the first stage of F(s, ..) has s−1 stages after it, which is what its memory
    (table[s−1]) depends on. Returns, per s, the chosen range length and sub-mesh for each
    (k, d) and F(s, 0, all devices). Each sub-mesh only scans the range lengths some stage
    within the bound has (a band) and the device counts it fits in. `combine=np.maximum`
    gives the least largest stage value instead of the least sum (`_least_memory`).
    """
    num_after, num_layers, _, num_meshes = table.shape
    longest = (table[0] <= bound).any(axis=0)  # [length - 1, submesh]: any start within bound
    widths = np.where(longest, np.arange(1, num_layers + 1)[:, None], 0).max(axis=0)
    prev = np.full((2 * num_layers + 1, num_devices + 1), np.inf)  # rows past L stay inf
    prev[num_layers, 0] = 0.0
    choices: _Choices = []
    for s in range(1, num_after + 1):
        starts = num_layers - s + 1
        cur = np.full_like(prev, np.inf)
        length_of = np.zeros((starts, num_devices + 1), dtype=np.int64)
        mesh_of = np.zeros((starts, num_devices + 1), dtype=np.int64)
        widest = min(int(widths.max()), starts)
        # rest[k, d, len - 1] = F(s−1, k + len, d), a view; prev has rows to spare past L.
        rest = sliding_window_view(prev[1 : starts + widest], widest, axis=0)
        for m in range(num_meshes):
            width, size = min(int(widths[m]), starts), int(sizes[m])
            if width == 0 or size > num_devices:
                continue
            stage = table[s - 1, :starts, :width, m]
            stage = np.where(stage <= bound, stage, np.inf)
            total = combine(stage[:, None, :], rest[:, : num_devices + 1 - size, :width])
            arg = total.argmin(axis=-1)
            value = total.min(axis=-1)
            target = cur[:starts, size:]
            better = value < target
            target[better] = value[better]
            length_of[:, size:][better] = arg[better]
            mesh_of[:, size:][better] = m
        choices.append((length_of, mesh_of, float(cur[0, num_devices])))
        if not np.isfinite(cur[:starts]).any():
            break
        prev = cur
    return choices


def _trace(
    choices: _Choices, sizes: np.ndarray, num_stages: int, num_devices: int
) -> list[tuple[int, int, int]]:
    """The stages (start, end, submesh) of the DP's plan with num_stages stages."""
    stages, start, devices = [], 0, num_devices
    for s in range(num_stages, 0, -1):
        length_of, mesh_of, _ = choices[s - 1]
        m = int(mesh_of[start, devices])
        end = start + int(length_of[start, devices]) + 1
        stages.append((start, end, m))
        start, devices = end, devices - int(sizes[m])
    return stages


def _evaluate(
    cands: _Candidates, table: np.ndarray, bound: float, window: tuple[float, float]
) -> list[_Plan]:
    """For one bound on stage latency, the least-Σ plan of every stage count that has one."""
    sizes, num_devices = cands.sizes, cands.num_devices
    choices = _least_sum_dp(table, sizes, num_devices, bound)
    plans = []
    for num_stages, (_, _, root) in enumerate(choices, start=1):
        if math.isfinite(root):
            stages = _trace(choices, sizes, num_stages, num_devices)
            latencies = tuple(
                float(table[num_stages - 1 - k, a, b - a - 1, m])
                for k, (a, b, m) in enumerate(stages)
            )
            plans.append(_Plan(tuple(stages), latencies, window))
    return plans


def _placeable(cands: _Candidates, plan: _Plan) -> bool:
    try:
        place_submeshes([cands.submeshes[m] for _, _, m in plan.stages], *cands.cluster)
    except InvalidArgumentError:
        return False
    return True


def _better(
    cands: _Candidates, plans: list[_Plan], incumbent: _Plan | None, pipe: Pipelining
) -> _Plan | None:
    """The best placeable plan by (step time, stage count); the incumbent wins ties."""
    best = incumbent
    for plan in plans:
        key = (plan.step(pipe), len(plan.stages))
        if (best is None or key < (best.step(pipe), len(best.stages))) and _placeable(cands, plan):
            best = plan
    return best


def _prune_limit(best: _Plan | None, floor_sum: float, pipe: Pipelining) -> float:
    """Bounds worth trying lie below this: a plan whose slowest stage takes t and whose Σ is at
    least floor_sum steps in c·floor_sum + (B−c)·t or more (`PipelineSchedule.step_time`),
    which must beat the best found (Alpa's early stop, with the tightest Σ bound known so far)."""
    if best is None:
        return math.inf
    c = pipe.schedule.bubble_share
    gap = best.step(pipe) - c * floor_sum
    if pipe.num_micro_batches <= c:
        return math.inf if gap > 0 else -math.inf
    return gap / (pipe.num_micro_batches - c)


def _admissible(plans: list[_Plan], tolerance: float) -> list[_Plan]:
    """Plans whose fastest stage is within the imbalance tolerance of their slowest."""
    return [p for p in plans if min(p.latencies) >= max(p.latencies) / tolerance]


def _search(
    cands: _Candidates, pipe: Pipelining, tolerance: float, max_stages: int
) -> _Plan | None:
    """Alpa's outer loop: the DP under bounds t_max on stage latency, keeping the best step.

    Bounds (the distinct candidate latencies) are tried from the top down. G(t), the least Σ
    under bound t with no tolerance, only grows as t falls; the DP under t returns it with a
    plan whose slowest stage is t' ≤ t, so G is known on [t', t] and is a lower bound on Σ
    below. With tolerance inf that plan is the best under every bound in [t', t], so the next
    bound is the largest below t': one DP per point of the (Σ, max) Pareto front, not one per
    distinct latency. With a finite tolerance τ a bound t only admits stages of latency
    ≥ t/τ, so each bound in [t', t] gets its own windowed DP. Bounds t with
    c·G + (B−c)·t ≥ the best step are skipped (`_prune_limit`), and the search stops where the
    DP without tolerance has no plan.
    """
    relaxed = _best_logical(cands, max_stages, 0.0, math.inf)
    levels = np.unique(cands.latency[cands.max_after >= 0])
    best, floor_sum, covered_low = None, -math.inf, math.inf
    index = len(levels) - 1
    while True:
        limit = _prune_limit(best, floor_sum, pipe)
        index = min(index, int(np.searchsorted(levels, limit, side="left")) - 1)
        if index < 0:
            return best
        bound = float(levels[index])
        if bound < covered_low:  # G(bound) unknown: run the DP without tolerance
            plans = _evaluate(cands, relaxed, bound, (0.0, math.inf))
            if not plans:
                return best
            best = _better(cands, _admissible(plans, tolerance), best, pipe)
            floor_sum, covered_low = min((p.latency_sum, max(p.latencies)) for p in plans)
            if tolerance == math.inf:
                index = int(np.searchsorted(levels, covered_low, side="left")) - 1
            continue
        window = (bound / tolerance, bound)
        table = _best_logical(cands, max_stages, *window)
        best = _better(cands, _evaluate(cands, table, bound, window), best, pipe)
        index -= 1


def _assignments(cands: _Candidates, plan: _Plan) -> tuple[StageAssignment, ...]:
    """Give each stage of a DP plan the logical mesh and cost the DP chose for it."""
    low, high = plan.window
    stages = []
    for k, (start, end, m) in enumerate(plan.stages):
        after = len(plan.stages) - 1 - k
        latency = cands.latency[start, end - start - 1, m]
        ok = (
            (latency >= low)
            & (latency <= high)
            & (cands.max_after[start, end - start - 1, m] >= after)
        )
        g = int(np.where(ok, latency, np.inf).argmin())
        logical, cost = cands.costs[(start, end - start - 1, m, g)]
        stages.append(StageAssignment((start, end), cands.submeshes[m], logical, cost))
    return tuple(stages)


def _least_memory(cands: _Candidates) -> tuple[float, list[tuple[int, int, int]]]:
    """The least memory per device of any plan made of the candidates (every layer, every
    device), and its stages (start, end, submesh): the min-max DP of `_least_sum_dp` over each
    stage's least need with the stages after it, whatever its latency."""
    table = np.stack([(cands.static + f * cands.activation).min(axis=-1) for f in cands.flights])
    sizes, num_devices = cands.sizes, cands.num_devices
    choices = _least_sum_dp(table, sizes, num_devices, math.inf, combine=np.maximum)
    roots = [root for _, _, root in choices]
    if not roots or not math.isfinite(min(roots)):
        return math.inf, []
    num_stages = 1 + int(np.argmin(roots))
    return min(roots), _trace(choices, sizes, num_stages, num_devices)


def _no_plan_error(
    cands: _Candidates, num_layers: int, device_memory: float, max_stages: int, pipe: Pipelining
) -> MemoryBudgetError:
    hosts, per_host = cands.cluster
    where = f"{num_layers} layers on {hosts}x{per_host} devices (max_stages={max_stages})"
    if not cands.costs:
        return MemoryBudgetError(
            f"no stage plan for {where}: no candidate stage fits in "
            f"{format_bytes(device_memory)} per device, or can run on its sub-mesh; use "
            'AutoLayerOption(remat_mode="coarse_grained"), more layers or more devices',
            device_memory,
            math.inf,
        )
    least, stages = _least_memory(cands)
    keeps = (
        f"all {pipe.num_micro_batches} micro-batches of activations"
        if pipe.schedule is PipelineSchedule.GPIPE
        else "a micro-batch of activations for each stage after it"
    )
    closest = (
        f" ({len(stages)} stage(s): "
        + ", ".join(f"[{a},{b}) on {cands.submeshes[m]}" for a, b, m in stages[:8])
        + (", ..." if len(stages) > 8 else "")
        + ")"
        if stages
        else ""
    )
    return MemoryBudgetError(
        f"no stage plan for {where} fits in {format_bytes(device_memory)} per device: under "
        f"{pipe.schedule.value} a stage keeps {keeps}, and of the stages the search priced, "
        f"the plan that needs least needs {format_bytes(least)} per device{closest}; use more "
        "micro-batches (smaller ones), "
        'AutoLayerOption(remat_mode="coarse_grained") (a stage keeps only its layers\' inputs), '
        "more devices, or that much memory",
        device_memory,
        least,
    )


def solve_stages(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_micro_batches: int,
    cost_fn: CostFn,
    device_memory: float,
    option: AutoStageOption | None = None,
    max_stages: int | None = None,
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
) -> StageSolution:
    """The stage plan with the least predicted step time (Alpa §5's DP).

    Searches contiguous layer ranges, Alpa's sub-mesh shapes and their logical meshes (as
    `option` allows), using every device and keeping every stage within device memory with the
    micro-batches `schedule` keeps in flight, priced by its step time. cost_fn is called once
    per candidate (start, end, sub-mesh, logical mesh).
    Ties go to fewer stages. Exact when the sub-mesh shapes always tile the cluster (devices
    per host a power of two, or one host); otherwise the best plan that packs among those the
    DP found.

    >>> def cost(start, end, submesh, logical):  # 1 s a layer, split; 1 s to all-reduce
    ...     devices = submesh[0] * submesh[1]
    ...     return StageCost((end - start) / devices + (devices > 1), 0.0, 0.0)
    >>> [(s.layers, s.submesh) for s in solve_stages(4, 1, 2, 8, cost, 1e9).stages]
    [((0, 2), (1, 1)), ((2, 4), (1, 1))]
    """
    _check_common(num_layers, num_hosts, devices_per_host, num_micro_batches, device_memory)
    if max_stages is not None:
        check_positive_int("max_stages", max_stages)
    if option is None:
        physical_space, logical_space, tolerance = "power_of_two", LOGICAL_SPACES[0], math.inf
    else:
        physical_space = option.submesh_physical_shape_space
        logical_space = option.submesh_logical_shape_space
        tolerance = option.stage_imbalance_tolerance
    cap = min(max_stages or num_layers, num_layers, num_hosts * devices_per_host)
    pipe = Pipelining(num_micro_batches, schedule)
    submeshes = submesh_shapes(num_hosts, devices_per_host, physical_space)
    cands = _collect(
        num_layers,
        (num_hosts, devices_per_host),
        submeshes,
        logical_space,
        cost_fn,
        device_memory,
        cap,
        pipe,
    )
    plan = _search(cands, pipe, tolerance, cap)
    if plan is None:
        raise _no_plan_error(cands, num_layers, device_memory, cap, pipe)
    stages = _assignments(cands, plan)
    solution = StageSolution(stages, pipe.step([a.cost.latency_s for a in stages]))
    logger.info("stage plan: %s", _describe(solution))
    return solution
