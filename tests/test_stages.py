"""Stage construction (Alpa §5): sub-mesh and logical shape spaces, the stage DP against brute
force on small random instances, memory, uniform and manual stages, and sub-mesh placement."""

import collections
import itertools
import logging
import math

import numpy as np
import pytest

from autopar.options import AutoStageOption, ManualStageOption, UniformStageOption
from autopar.planner.errors import InvalidArgumentError, MemoryBudgetError, PlanningError
from autopar.planner.schedules import PipelineSchedule, make_schedule
from autopar.planner.stages import (
    StageCost,
    forces_batch_dim,
    interleaved_stages,
    logical_mesh_shapes,
    manual_stages,
    place_submeshes,
    solve_stages,
    submesh_shapes,
    uniform_stages,
)

# What each schedule keeps in flight on a stage with `after` stages behind it, and its bubble
# share c (step = c·Σt + (B−c)·max t), written out here independently of planner.schedules.
IN_FLIGHT = {
    "1f1b": lambda after, m: min(after + 1, m),
    "gpipe": lambda after, m: m,
    "zero_bubble": lambda after, m: min(after + 1, m),
}
BUBBLE_SHARE = {"1f1b": 1.0, "gpipe": 1.0, "zero_bubble": 2 / 3}


def _fits(cost: StageCost, after: int, memory: float, m: int, schedule: str = "1f1b") -> bool:
    flight = IN_FLIGHT[schedule](after, m)
    return cost.static_memory_bytes + flight * cost.activation_memory_bytes <= memory


def _step(latencies, num_micro_batches: int, schedule: str = "1f1b") -> float:
    c = BUBBLE_SHARE[schedule]
    return c * sum(latencies) + (num_micro_batches - c) * max(latencies)


# --- shape spaces ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cluster, space, expected",
    [
        ((1, 8), "power_of_two", [(1, 1), (1, 2), (1, 4), (1, 8)]),
        ((1, 8), "all", [(1, k) for k in range(1, 9)]),
        ((2, 8), "power_of_two", [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]),
        ((2, 8), "all", [(1, k) for k in range(1, 9)] + [(2, 8)]),
        ((8, 8), "power_of_two", [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8)]),
        ((3, 4), "power_of_two", [(1, 1), (1, 2), (1, 4), (2, 4)]),
        ((8, 8), "all", [(1, k) for k in range(1, 8)] + [(h, 8) for h in range(1, 9)]),
    ],
)
def test_submesh_shapes(cluster, space, expected):
    assert submesh_shapes(*cluster, space) == expected


def test_submesh_shapes_rejects_unknown_space():
    with pytest.raises(InvalidArgumentError, match="'squares'"):
        submesh_shapes(2, 8, "squares")


@pytest.mark.parametrize(
    "space, expected",
    [
        ("all", [(1, 8), (2, 4), (4, 2), (8, 1)]),
        ("same_as_physical", [(2, 4)]),
        ("data_parallel_only", [(8, 1)]),
        ("model_parallel_only", [(1, 8)]),
    ],
)
def test_logical_mesh_shapes(space, expected):
    assert logical_mesh_shapes((2, 4), space) == expected


def test_single_node_model_parallel_keeps_model_parallelism_within_a_host():
    """Alpa's default space: (d/mp, mp) with mp at most the devices of a host; the batch dim is
    forced onto the first axis exactly where both axes split."""
    assert logical_mesh_shapes((1, 8), "single_node_model_parallel", 8) == [
        (1, 8),
        (2, 4),
        (4, 2),
        (8, 1),
    ]
    assert logical_mesh_shapes((4, 8), "single_node_model_parallel", 8) == [
        (4, 8),
        (8, 4),
        (16, 2),
        (32, 1),
    ]
    assert [
        forces_batch_dim("single_node_model_parallel", s) for s in [(1, 8), (2, 4), (8, 1)]
    ] == [False, True, False]
    assert not forces_batch_dim("all", (2, 4))


def test_logical_mesh_shapes_of_one_device_and_unknown_space():
    assert logical_mesh_shapes((1, 1), "all") == [(1, 1)]
    with pytest.raises(InvalidArgumentError, match="'rows'"):
        logical_mesh_shapes((1, 4), "rows")


# --- the DP against brute force ----------------------------------------------------------------


def _as_tuple(entry):
    return () if entry is None else (entry,) if isinstance(entry, StageCost) else entry


def _random_table(rng, num_layers, cluster, physical_space, logical_space, alternatives=False):
    """Costs for every candidate: compute shrinks with devices while communication grows, ~10%
    cannot run, memory per device shrinks with devices. With `alternatives`, a candidate may
    also offer faster variants that need more memory."""
    work = rng.uniform(0.5, 2.0, num_layers)
    comm = rng.uniform(0.05, 0.5)
    state = rng.uniform(0.5, 2.0, num_layers)
    stash = rng.uniform(0.5, 2.0, num_layers)
    table = {}
    for start, end in itertools.combinations(range(num_layers + 1), 2):
        for submesh in submesh_shapes(*cluster, physical_space):
            devices = submesh[0] * submesh[1]
            for logical in logical_mesh_shapes(submesh, logical_space):
                if rng.random() < 0.1:
                    table[start, end, submesh, logical] = None
                    continue
                compute = work[start:end].sum() / devices
                talk = comm * (end - start) * (1 - 1 / devices)
                cost = StageCost(
                    latency_s=(compute + talk) * rng.uniform(0.8, 1.25),
                    static_memory_bytes=state[start:end].sum() / devices**0.5,
                    activation_memory_bytes=stash[start:end].sum() / devices**0.7,
                )
                table[start, end, submesh, logical] = cost
                if alternatives:
                    table[start, end, submesh, logical] = (cost,) + tuple(
                        StageCost(
                            cost.latency_s * rng.uniform(0.4, 0.9),
                            cost.static_memory_bytes * rng.uniform(1.1, 2.0),
                            cost.activation_memory_bytes * rng.uniform(1.0, 1.5),
                        )
                        for _ in range(int(rng.integers(0, 3)))
                    )
    needs = [
        c.static_memory_bytes + 2 * c.activation_memory_bytes
        for entry in table.values()
        for c in _as_tuple(entry)
    ]
    return table, float(np.quantile(needs, 0.7))


def _costs_by_range(table):
    """(start, end) -> every (sub-mesh, cost) the table offers for that layer range."""
    by_range = collections.defaultdict(list)
    for (a, b, submesh, _), entry in table.items():
        by_range[a, b] += [(submesh, cost) for cost in _as_tuple(entry)]
    return by_range


def _layer_splits(num_layers):
    """Every split of the layers into contiguous ranges, as lists of (start, end)."""
    for cuts in itertools.chain.from_iterable(
        itertools.combinations(range(1, num_layers), k) for k in range(num_layers)
    ):
        yield list(itertools.pairwise((0, *cuts, num_layers)))


def _brute_force(
    num_layers, cluster, num_micro_batches, table, memory, space, tolerance, schedule="1f1b"
):
    """Least step over every layer split, sub-mesh and logical mesh choice that fits and packs."""
    num_devices = cluster[0] * cluster[1]
    by_range = _costs_by_range(table)
    best = math.inf
    for ranges in _layer_splits(num_layers):
        choices = [
            [
                (submesh, cost)
                for submesh, cost in by_range[start, end]
                if _fits(cost, len(ranges) - 1 - k, memory, num_micro_batches, schedule)
            ]
            for k, (start, end) in enumerate(ranges)
        ]
        for plan in _using_every_device(choices, num_devices):
            latencies = [cost.latency_s for _, cost in plan]
            if min(latencies) < max(latencies) / tolerance:
                continue
            try:
                place_submeshes([s for s, _ in plan], *cluster)
            except InvalidArgumentError:
                continue
            best = min(best, _step(latencies, num_micro_batches, schedule))
    return best


def _using_every_device(choices, num_devices, chosen=()):
    """Every pick of one (sub-mesh, cost) per stage whose sub-meshes hold `num_devices` devices
    together (itertools.product, skipping picks that already hold too many)."""
    if len(chosen) == len(choices):
        if num_devices == 0:
            yield chosen
        return
    for submesh, cost in choices[len(chosen)]:
        size = submesh[0] * submesh[1]
        if size <= num_devices:
            yield from _using_every_device(choices, num_devices - size, (*chosen, (submesh, cost)))


def _check_valid(solution, num_layers, cluster, num_micro_batches, table, memory, schedule="1f1b"):
    stages = solution.stages
    assert [s.layers[0] for s in stages] == [0] + [s.layers[1] for s in stages[:-1]]
    assert stages[-1].layers[1] == num_layers
    place_submeshes([s.submesh for s in stages], *cluster)  # covers every device, packs
    for k, stage in enumerate(stages):
        assert stage.cost in _as_tuple(table[(*stage.layers, stage.submesh, stage.logical_mesh)])
        assert _fits(stage.cost, len(stages) - 1 - k, memory, num_micro_batches, schedule)
    expected = _step([s.cost.latency_s for s in stages], num_micro_batches, schedule)
    assert solution.step_latency_s == pytest.approx(expected)


CLUSTERS = [(1, 2), (1, 4), (1, 8), (2, 4), (2, 2)]


def _instance(seed, spaces=("power_of_two", "all"), clusters=CLUSTERS, alternatives=False):
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(1, 7))
    cluster = clusters[int(rng.integers(len(clusters)))]
    num_micro_batches = int(rng.choice([1, 4, 16]))
    table, memory = _random_table(rng, num_layers, cluster, *spaces, alternatives=alternatives)
    return num_layers, cluster, num_micro_batches, table, memory


def _solve(num_layers, cluster, num_micro_batches, table, memory, schedule="1f1b", **option):
    option.setdefault("submesh_logical_shape_space", "all")  # the tables cover every logical mesh
    return solve_stages(
        num_layers,
        *cluster,
        num_micro_batches,
        lambda *args: table[args],
        memory,
        AutoStageOption(**option),
        schedule=PipelineSchedule.parse(schedule),
    )


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_brute_force(seed):
    num_layers, cluster, batches, table, memory = _instance(seed)
    expected = _brute_force(num_layers, cluster, batches, table, memory, "power_of_two", math.inf)
    if expected == math.inf:
        with pytest.raises(PlanningError):
            _solve(num_layers, cluster, batches, table, memory)
        return
    solution = _solve(num_layers, cluster, batches, table, memory)
    _check_valid(solution, num_layers, cluster, batches, table, memory)
    assert solution.step_latency_s == pytest.approx(expected)
    huge_tolerance = _solve(
        num_layers, cluster, batches, table, memory, stage_imbalance_tolerance=1e9
    )
    assert huge_tolerance == solution


@pytest.mark.parametrize("seed", range(500, 520))
@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble"])
def test_dp_matches_brute_force_under_other_schedules(seed, schedule):
    """GPipe keeps every micro-batch in flight on every stage; zero bubble prices the step with
    a smaller fill-and-drain share. The DP prices and fits each as the schedule says."""
    num_layers, cluster, batches, table, memory = _instance(seed)
    expected = _brute_force(
        num_layers, cluster, batches, table, memory, "power_of_two", math.inf, schedule
    )
    if expected == math.inf:
        with pytest.raises(PlanningError, match=schedule):
            _solve(num_layers, cluster, batches, table, memory, schedule)
        return
    solution = _solve(num_layers, cluster, batches, table, memory, schedule)
    _check_valid(solution, num_layers, cluster, batches, table, memory, schedule)
    assert solution.step_latency_s == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(300, 320))
def test_dp_picks_among_alternatives_like_brute_force(seed):
    """cost_fn offering faster variants that store more: each stage takes the fastest that
    fits where it sits (fewer micro-batches in flight further down the pipeline)."""
    num_layers, cluster, batches, table, memory = _instance(seed, alternatives=True)
    expected = _brute_force(num_layers, cluster, batches, table, memory, "power_of_two", math.inf)
    if expected == math.inf:
        with pytest.raises(PlanningError):
            _solve(num_layers, cluster, batches, table, memory)
        return
    solution = _solve(num_layers, cluster, batches, table, memory)
    _check_valid(solution, num_layers, cluster, batches, table, memory)
    assert solution.step_latency_s == pytest.approx(expected)


def _least_need(num_layers, cluster, num_micro_batches, table):
    """Brute force: the least memory per device, over every plan that uses every device and
    packs, of its stage that needs most (state plus the micro-batches in flight)."""
    by_range = _costs_by_range(table)
    least = math.inf
    for ranges in _layer_splits(num_layers):
        for plan in _using_every_device([by_range[r] for r in ranges], cluster[0] * cluster[1]):
            try:
                place_submeshes([s for s, _ in plan], *cluster)
            except InvalidArgumentError:
                continue
            need = max(
                cost.static_memory_bytes
                + IN_FLIGHT["1f1b"](len(plan) - 1 - k, num_micro_batches)
                * cost.activation_memory_bytes
                for k, (_, cost) in enumerate(plan)
            )
            least = min(least, need)
    return least


@pytest.mark.parametrize("seed", range(700, 720))
def test_no_plan_names_the_least_memory_a_plan_needs_like_brute_force(seed):
    """Where nothing fits, the error names the least memory per device of any plan of the
    candidates (a min-max DP over the same table), and that much memory gets a plan."""
    num_layers, cluster, batches, table, _ = _instance(seed, alternatives=True)
    least = _least_need(num_layers, cluster, batches, table)
    if least == math.inf:
        return
    with pytest.raises(MemoryBudgetError, match="the plan that needs least needs") as info:
        _solve(num_layers, cluster, batches, table, least * 0.999)
    assert info.value.least == pytest.approx(least)
    assert info.value.budget == pytest.approx(least * 0.999)
    solution = _solve(num_layers, cluster, batches, table, least * 1.001)
    _check_valid(solution, num_layers, cluster, batches, table, least * 1.001)


@pytest.mark.parametrize("seed", range(100, 120))
def test_dp_matches_brute_force_with_all_shapes(seed):
    """Every (1,k) slice and every factorisation, on clusters where such slices always pack."""
    spaces = ("all", "all")
    num_layers, cluster, batches, table, memory = _instance(seed, spaces, [(1, 4), (2, 2), (1, 3)])
    expected = _brute_force(num_layers, cluster, batches, table, memory, "all", math.inf)
    option = {"submesh_physical_shape_space": "all"}
    if expected == math.inf:
        with pytest.raises(PlanningError):
            _solve(num_layers, cluster, batches, table, memory, **option)
        return
    solution = _solve(num_layers, cluster, batches, table, memory, **option)
    _check_valid(solution, num_layers, cluster, batches, table, memory)
    assert solution.step_latency_s == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(200, 220))
@pytest.mark.parametrize("tolerance", [1.0, 1.5, 3.0])
def test_imbalance_tolerance_matches_brute_force(seed, tolerance):
    num_layers, cluster, batches, table, memory = _instance(seed)
    expected = _brute_force(num_layers, cluster, batches, table, memory, "power_of_two", tolerance)
    option = {"stage_imbalance_tolerance": tolerance}
    if expected == math.inf:
        with pytest.raises(PlanningError):
            _solve(num_layers, cluster, batches, table, memory, **option)
        return
    solution = _solve(num_layers, cluster, batches, table, memory, **option)
    _check_valid(solution, num_layers, cluster, batches, table, memory)
    latencies = [s.cost.latency_s for s in solution.stages]
    assert min(latencies) >= max(latencies) / tolerance
    assert solution.step_latency_s == pytest.approx(expected)


def test_cost_fn_called_once_per_candidate():
    num_layers, cluster, batches, table, memory = _instance(3)
    calls = collections.Counter()

    def cost_fn(*args):
        calls[args] += 1
        return table[args]

    solve_stages(num_layers, *cluster, batches, cost_fn, memory * 100)
    assert set(calls) == set(table)
    assert set(calls.values()) == {1}


# --- hand-made cases ---------------------------------------------------------------------------


def _layer_cost(work, all_reduce_s=0.0, stash=0.0):
    """Latency: the range's work split over the devices, plus an all-reduce when split.
    Memory: `stash` bytes of activations per layer per micro-batch, split over the devices."""

    def cost_fn(start, end, submesh, logical):
        devices = submesh[0] * submesh[1]
        latency = sum(work[start:end]) / devices + (all_reduce_s if devices > 1 else 0.0)
        return StageCost(latency, 0.0, stash * (end - start) / devices)

    return cost_fn


def test_memory_rules_out_the_fastest_plan():
    cost_fn = _layer_cost([1.0] * 4, all_reduce_s=1.0, stash=1.0)
    free = solve_stages(4, 1, 2, 8, cost_fn, 1e9)
    assert [(s.layers, s.submesh) for s in free.stages] == [((0, 2), (1, 1)), ((2, 4), (1, 1))]
    assert free.step_latency_s == pytest.approx(2 + 2 + 7 * 2)
    # With 3.5 bytes, stage 0 of that plan (2 layers, 2 micro-batches in flight) needs 4.
    tight = solve_stages(4, 1, 2, 8, cost_fn, 3.5)
    assert [(s.layers, s.submesh) for s in tight.stages] == [((0, 4), (1, 2))]
    assert tight.step_latency_s == pytest.approx(8 * 3)
    for k, stage in enumerate(tight.stages):
        assert _fits(stage.cost, len(tight.stages) - 1 - k, 3.5, 8)


def test_heavy_first_layer_gets_a_stage_of_its_own():
    cost_fn = _layer_cost([3.0, 1.0, 1.0, 1.0], all_reduce_s=10.0)
    solution = solve_stages(4, 1, 2, 4, cost_fn, 1e9)
    assert [s.layers for s in solution.stages] == [(0, 1), (1, 4)]
    assert solution.step_latency_s == pytest.approx(3 + 3 + 3 * 3)


def test_ties_go_to_fewer_stages():
    # One stage on both devices or one layer per device: both step in 2 s with one micro-batch.
    solution = solve_stages(2, 1, 2, 1, _layer_cost([1.0, 1.0], all_reduce_s=1.0), 1e9)
    assert [(s.layers, s.submesh) for s in solution.stages] == [((0, 2), (1, 2))]


def test_max_stages_caps_the_pipeline():
    solution = solve_stages(4, 1, 4, 64, _layer_cost([1.0] * 4), 1e9, max_stages=1)
    assert [(s.layers, s.submesh) for s in solution.stages] == [((0, 4), (1, 4))]


def test_logical_space_restricts_the_logical_meshes():
    seen = set()

    def cost_fn(start, end, submesh, logical):
        seen.add(logical)
        return StageCost(1.0, 0.0, 0.0)

    solution = solve_stages(
        2, 1, 4, 4, cost_fn, 1e9, AutoStageOption(submesh_logical_shape_space="data_parallel_only")
    )
    assert seen == {(1, 1), (2, 1), (4, 1)}
    assert all(s.logical_mesh[1] == 1 for s in solution.stages)


def test_no_feasible_plan_names_the_memory():
    cost_fn = _layer_cost([1.0] * 3, stash=10.0)
    # Least: one stage of the 3 layers on all 4 devices keeps one micro-batch of 30 B / 4.
    with pytest.raises(PlanningError, match=r"fits in 1 B .* needs least needs 7 B") as info:
        solve_stages(3, 1, 4, 4, cost_fn, 1.0)
    assert "1 stage(s): [0,3) on (1, 4)" in str(info.value)
    for change in ("more micro-batches", 'remat_mode="coarse_grained"', "more devices"):
        assert change in str(info.value)
    assert isinstance(info.value, MemoryBudgetError) and info.value.least > info.value.budget
    with pytest.raises(MemoryBudgetError, match="no candidate stage fits in 1 B"):
        solve_stages(3, 1, 4, 4, lambda *args: None, 1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_micro_batches": 0}, "num_micro_batches"),
        ({"device_memory": -1.0}, "device_memory"),
        ({"max_stages": 0}, "max_stages"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_solve_stages_rejects_bad_arguments(kwargs, match):
    args = {
        "num_layers": 2,
        "num_hosts": 1,
        "devices_per_host": 2,
        "num_micro_batches": 4,
        "cost_fn": _layer_cost([1.0, 1.0]),
        "device_memory": 1e9,
    }
    with pytest.raises(InvalidArgumentError, match=match):
        solve_stages(**(args | kwargs))


def test_solve_stages_logs_the_plan(caplog):
    with caplog.at_level(logging.INFO, logger="autopar.planner.stages"):
        solve_stages(4, 1, 2, 4, _layer_cost([1.0] * 4), 1e9)
    assert "stage plan: 1 stage, step 8 s: [0,4) on (1, 2) as (1, 2)" in caplog.text


def test_48_layers_on_64_devices():
    """Production size: 48 layers, 8 hosts x 8, a few logical meshes per sub-mesh."""
    rng = np.random.default_rng(0)
    work = np.concatenate([[0.0], np.cumsum(rng.uniform(0.5, 1.5, 48))])

    def cost_fn(start, end, submesh, logical):
        devices = submesh[0] * submesh[1]
        comm = 0.05 * (logical[1] - 1) * (end - start) * (4 if submesh[0] > 1 else 1)
        return StageCost((work[end] - work[start]) / devices + comm, 1e8 * (end - start), 2e7)

    solution = solve_stages(48, 8, 8, 32, cost_fn, 1e9)
    assert sum(s.submesh[0] * s.submesh[1] for s in solution.stages) == 64
    assert solution.stages[-1].layers[1] == 48


# --- uniform and manual stages -----------------------------------------------------------------


def test_uniform_stages_split_layers_and_devices_evenly():
    cost_fn = _layer_cost([1.0] * 5)
    solution = uniform_stages(5, 1, 4, 4, cost_fn, 1e9, UniformStageOption(num_stages=2))
    assert [(s.layers, s.submesh, s.logical_mesh) for s in solution.stages] == [
        ((0, 3), (1, 2), (1, 2)),
        ((3, 5), (1, 2), (1, 2)),
    ]
    assert solution.step_latency_s == pytest.approx(1.5 + 1.0 + 3 * 1.5)
    hosts = uniform_stages(4, 4, 2, 4, cost_fn, 1e9, UniformStageOption(2, (4, 1)))
    assert [(s.submesh, s.logical_mesh) for s in hosts.stages] == [((2, 2), (4, 1))] * 2
    per_layer = uniform_stages(4, 1, 4, 4, cost_fn, 1e9, UniformStageOption())
    assert [s.layers for s in per_layer.stages] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize(
    "num_layers, cluster, option, match",
    [
        (4, (1, 4), UniformStageOption(num_stages=3), r"cannot split 4 devices .* num_stages=3"),
        (2, (1, 4), UniformStageOption(num_stages=4), r"num_stages=4 is more than the 2 layers"),
        (4, (2, 4), UniformStageOption(num_stages=2, submesh_logical_shape=(2, 4)), "has 8"),
    ],
)
def test_uniform_stages_rejects_bad_splits(num_layers, cluster, option, match):
    with pytest.raises(InvalidArgumentError, match=match):
        uniform_stages(num_layers, *cluster, 4, _layer_cost([1.0] * num_layers), 1e9, option)


def test_uniform_stages_checks_memory():
    with pytest.raises(MemoryBudgetError, match=r"stage 0 .* needs 4 B .* 2 micro-batches"):
        uniform_stages(4, 1, 2, 4, _layer_cost([1.0] * 4, stash=1.0), 3.0, UniformStageOption(2))


def test_manual_stages():
    option = ManualStageOption(((0,), (1, 2, 3)), ((1, 1), (1, 3)), ((1, 1), (3, 1)))
    solution = manual_stages(4, 1, 4, 2, _layer_cost([3.0, 1.0, 1.0, 1.0]), 1e9, option)
    assert [(s.layers, s.submesh, s.logical_mesh) for s in solution.stages] == [
        ((0, 1), (1, 1), (1, 1)),
        ((1, 4), (1, 3), (3, 1)),
    ]
    assert solution.step_latency_s == pytest.approx(3 + 1 + 1 * 3)


@pytest.mark.parametrize(
    "num_layers, cluster, option, match",
    [
        (
            5,
            (1, 4),
            ManualStageOption(((0, 1), (2, 3)), ((1, 2), (1, 2)), ((1, 2), (1, 2))),
            "assign 4 layers but the model has 5",
        ),
        (
            4,
            (1, 4),
            ManualStageOption(((0, 1), (2, 3)), ((1, 2), (1, 1)), ((1, 2), (1, 1))),
            "cover 3 devices but the cluster has 4",
        ),
        (
            3,
            (2, 4),
            ManualStageOption(
                ((0,), (1,), (2,)), ((1, 3), (1, 3), (1, 2)), ((1, 3),) * 2 + ((1, 2),)
            ),
            "cannot be packed into 2 hosts of 4 devices",
        ),
    ],
)
def test_manual_stages_rejects_plans_that_do_not_fit_the_cluster(
    num_layers, cluster, option, match
):
    with pytest.raises(InvalidArgumentError, match=match):
        manual_stages(num_layers, *cluster, 4, _layer_cost([1.0] * num_layers), 1e9, option)


def test_manual_stages_reports_stages_cost_fn_rejects():
    option = ManualStageOption(((0,), (1,)), ((1, 1), (1, 1)), ((1, 1), (1, 1)))
    with pytest.raises(PlanningError, match=r"stage 0 .* cost_fn rejected it"):
        manual_stages(2, 1, 2, 4, lambda *args: None, 1e9, option)


# --- placement ---------------------------------------------------------------------------------


def test_place_submeshes_packs_whole_hosts_then_slices():
    placed = place_submeshes([(1, 2), (2, 4), (1, 4), (1, 1), (1, 1)], 4, 4)
    assert placed == [(12, 13), tuple(range(8)), (8, 9, 10, 11), (14,), (15,)]
    slices = place_submeshes([(1, 1), (1, 2), (1, 1), (1, 4)], 2, 4)
    assert slices == [(6,), (4, 5), (7,), (0, 1, 2, 3)]
    assert sorted(itertools.chain(*slices)) == list(range(8))


@pytest.mark.parametrize(
    "shapes, match",
    [
        ([(1, 4), (1, 2)], "cover 6 devices but the cluster has 8"),
        ([(1, 3), (1, 3), (1, 2)], "no host has 2 free devices for stage 2"),
        ([(2, 2), (1, 4)], r"sub-mesh \(2, 2\) is neither part of one host"),
        ([(1, 8)], r"sub-mesh \(1, 8\) is neither"),
    ],
)
def test_place_submeshes_errors(shapes, match):
    with pytest.raises(InvalidArgumentError, match=match):
        place_submeshes(shapes, 2, 4)


# --- interleaved 1F1B's stages ----------------------------------------------------------------


def _interleaved_step(latencies, num_micro_batches: int, num_meshes: int) -> float:
    """(1/v)·Σ t + (m − 1/v)·max over meshes of the sum of its stages' t, written out here."""
    c = num_meshes / len(latencies)
    loads = [sum(latencies[d::num_meshes]) for d in range(num_meshes)]
    return c * sum(latencies) + (num_micro_batches - c) * max(loads)


def _interleaved_brute_force(num_layers, n, v, m, submesh, logical, table, memory):
    """Least slowest stage over every split of the layers into n·v ranges on (submesh,
    logical), each stage at its fastest alternative within memory/v (inf: none fits)."""
    flight = [make_schedule("interleaved_1f1b", n * v, m, n).max_in_flight(s) for s in range(n * v)]
    best = math.inf
    for cuts in itertools.combinations(range(1, num_layers), n * v - 1):
        slowest = 0.0
        for s, (a, b) in enumerate(itertools.pairwise((0, *cuts, num_layers))):
            fits = [
                c.latency_s
                for c in _as_tuple(table[a, b, submesh, logical])
                if c.static_memory_bytes + flight[s] * c.activation_memory_bytes <= memory / v
            ]
            slowest = max(slowest, min(fits, default=math.inf))
        best = min(best, slowest)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_interleaved_stages_balance_the_slowest_stage_like_brute_force(seed):
    """Valid (equal sub-meshes, stage s on mesh s mod n, fits 1/v of memory with the table's
    micro-batches in flight, priced by the schedule's step); its slowest stage is the least any
    split on its mesh allows; it has a plan exactly when brute force finds one."""
    rng = np.random.default_rng(1000 + seed)
    num_layers = int(rng.integers(2, 8))
    cluster = [(1, 2), (1, 4), (2, 2)][int(rng.integers(3))]
    m = int(rng.choice([4, 8]))
    v = int(rng.choice([1, 2]))
    table, memory = _random_table(rng, num_layers, cluster, "power_of_two", "all", True)
    option = AutoStageOption(submesh_logical_shape_space="all")
    candidates = [
        (s, logical, cluster[0] * cluster[1] // (s[0] * s[1]))
        for s in submesh_shapes(*cluster)
        for logical in logical_mesh_shapes(s, "all")
        if s[0] * s[1] < cluster[0] * cluster[1]
    ]
    brute = {
        (s, logical): _interleaved_brute_force(num_layers, n, v, m, s, logical, table, memory)
        for s, logical, n in candidates
        if n * v <= num_layers and m % n == 0
    }
    args = (num_layers, *cluster, m, lambda *a: table[a], memory, option, v)
    if all(best == math.inf for best in brute.values()):
        with pytest.raises(PlanningError, match=f"num_virtual_stages={v} has no plan"):
            interleaved_stages(*args)
        return
    solution = interleaved_stages(*args)
    stages = solution.stages
    n = solution.num_meshes
    assert solution.stages_per_mesh == v and len(stages) == n * v and m % n == 0
    assert [s.layers[0] for s in stages] == [0] + [s.layers[1] for s in stages[:-1]]
    assert stages[-1].layers[1] == num_layers
    assert len({(s.submesh, s.logical_mesh) for s in stages}) == 1
    flight = make_schedule("interleaved_1f1b", n * v, m, n)
    for k, stage in enumerate(stages):
        assert stage.cost in _as_tuple(table[(*stage.layers, stage.submesh, stage.logical_mesh)])
        need = stage.cost.static_memory_bytes
        need += flight.max_in_flight(k) * stage.cost.activation_memory_bytes
        assert need <= memory / v
    latencies = [s.cost.latency_s for s in stages]
    assert solution.step_latency_s == pytest.approx(_interleaved_step(latencies, m, n))
    assert max(latencies) == pytest.approx(brute[stages[0].submesh, stages[0].logical_mesh])


def test_interleaved_stages_uniform_option_and_errors():
    cost_fn = _layer_cost([1.0] * 8)
    uniform = interleaved_stages(8, 1, 4, 4, cost_fn, 1e9, UniformStageOption(2), 2)
    assert [s.layers for s in uniform.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert {s.submesh for s in uniform.stages} == {(1, 2)}
    # 4 stages of 2 layers on 2 devices (1 s each) on 2 meshes, 4 micro-batches: (m·v + n − 1)·t
    assert uniform.step_latency_s == pytest.approx(9.0)
    with pytest.raises(PlanningError, match="micro-batches a multiple of the n meshes"):
        interleaved_stages(8, 1, 4, 3, cost_fn, 1e9, UniformStageOption(2), 2)
    with pytest.raises(PlanningError, match=r"skipped: 2 meshes of \(1, 2\)"):
        interleaved_stages(3, 1, 4, 4, cost_fn, 1e9, UniformStageOption(2), 2)
    with pytest.raises(InvalidArgumentError, match="num_virtual_stages=0"):
        interleaved_stages(8, 1, 4, 4, cost_fn, 1e9, UniformStageOption(2), 0)
