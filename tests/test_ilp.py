"""The intra-op ILP against brute force: random small models (classes, resharding edges with
blocking and overlappable costs, a memory model per step with resharded copies on some edges),
solved by HiGHS (the model handed over as arrays) and by CBC (through PuLP), must reach the least
objective of every assignment that fits the budget, and the least peak memory."""

import itertools
import time

import numpy as np
import pytest

from autopar.planner.ilp import OVERLAP_PENALTY, ClassCosts, EdgeClass, IntraOpIlp, MemoryModel


def _random_model(seed: int):
    rng = np.random.default_rng(seed)
    num_choices = [int(n) for n in rng.integers(2, 4, size=int(rng.integers(2, 5)))]

    def some(n, share=0.6):  # sparse non-negative costs, as the menus give
        return np.where(rng.random(n) < share, rng.random(n), 0.0)

    costs = [ClassCosts(some(n, 1.0), some(n), some(n), some(n, 0.2) * 1e-3) for n in num_choices]
    edges = []
    for producer, consumer in itertools.combinations(range(len(num_choices)), 2):
        if rng.random() < 0.6:
            rows, cols = (
                int(rng.integers(1, num_choices[producer] + 1)),
                int(rng.integers(1, num_choices[consumer] + 1)),
            )
            row_of = np.arange(num_choices[producer]) % rows
            col_of = np.arange(num_choices[consumer]) % cols
            hidden = rng.random() < 0.5  # a cell is blocking or overlappable, as the menus make
            matrix = some(rows * cols).reshape(rows, cols) * (8.0 if hidden else 1.0)
            zeros = np.zeros((rows, cols))
            blocking, overlap = (zeros, matrix) if hidden else (matrix, zeros)
            edges.append(EdgeClass(producer, consumer, row_of, col_of, blocking, overlap))
    steps = 5
    coef = [[rng.random(n) * 2**20 for n in num_choices] for _ in range(steps)]
    const = rng.random(steps) * 2**20
    # resharded copies: bytes per (producer spec, consumer need) of some edges at some steps
    copies = [
        {i: some(e.blocking.size).reshape(e.blocking.shape) * 2**21 for i, e in enumerate(edges)}
        if rng.random() < 0.5
        else {}
        for _ in range(steps)
    ]

    def evaluate(choices):
        def copied(t):
            return sum(
                m[
                    edges[i].row_of[choices[edges[i].producer]],
                    edges[i].col_of[choices[edges[i].consumer]],
                ]
                for i, m in copies[t].items()
            )

        return np.array(
            [
                const[t] + sum(coef[t][c][k] for c, k in enumerate(choices)) + copied(t)
                for t in range(steps)
            ]
        )

    memory = MemoryModel(
        evaluate,
        lambda t: (dict(enumerate(coef[t])), float(const[t])),
        edge_coefficients=lambda t: copies[t],
        copying_edges=frozenset(i for per_step in copies for i in per_step),
    )
    return num_choices, costs, edges, memory


def _objective(choices, costs, edges) -> float:
    """The ILP's objective (microseconds) of one assignment, as its module docstring defines it."""
    direct = sum(
        c.compute[k] + c.blocking[k] + OVERLAP_PENALTY * c.overlap[k] + c.tie_break[k]
        for c, k in zip(costs, choices, strict=True)
    )
    compute = sum(c.compute[k] for c, k in zip(costs, choices, strict=True))
    overlap = sum(c.overlap[k] for c, k in zip(costs, choices, strict=True))
    for e in edges:
        a, b = e.row_of[choices[e.producer]], e.col_of[choices[e.consumer]]
        direct += e.blocking[a, b] + OVERLAP_PENALTY * e.overlap[a, b]
        overlap += e.overlap[a, b]
    return 1e6 * (direct + max(0.0, overlap - compute))


@pytest.mark.parametrize("solver", ["highs", "cbc"])
@pytest.mark.parametrize("seed", range(12))
def test_ilp_matches_brute_force(seed, solver):
    num_choices, costs, edges, memory = _random_model(seed)
    every = list(itertools.product(*(range(n) for n in num_choices)))
    peaks = {c: float(memory.evaluate(c).max()) for c in every}
    least = min(peaks.values())
    ilp = IntraOpIlp(num_choices, costs, edges, memory, solver=solver)
    assert ilp.least_memory() == pytest.approx(least)
    for budget in (max(peaks.values()), (least + max(peaks.values())) / 2, least * (1 + 1e-6)):
        fitting = [c for c in every if peaks[c] <= budget]
        best = min(_objective(c, costs, edges) for c in fitting)
        solution = ilp.solve(budget)
        assert solution is not None and solution.optimal
        chosen = tuple(int(k) for k in solution.choices)
        assert peaks[chosen] <= budget * (1 + 1e-9)
        assert _objective(chosen, costs, edges) == pytest.approx(best, rel=1e-7, abs=1e-6)
    assert ilp.solve(least * 0.99) is None  # below every assignment's peak: no plan


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_forbidden_choices_are_left_out(solver):
    num_choices, costs, edges, memory = _random_model(3)
    every = list(itertools.product(*(range(n) for n in num_choices)))
    ilp = IntraOpIlp(num_choices, costs, edges, memory, solver=solver)
    free = tuple(int(k) for k in ilp.solve(np.inf).choices)
    forbidden = {0: [free[0]]}
    allowed = [c for c in every if c[0] != free[0]]
    best = min(_objective(c, costs, edges) for c in allowed)
    chosen = tuple(int(k) for k in ilp.solve(np.inf, forbidden=forbidden).choices)
    assert chosen[0] != free[0]
    assert _objective(chosen, costs, edges) == pytest.approx(best, rel=1e-7, abs=1e-6)
    assert tuple(int(k) for k in ilp.solve(np.inf).choices) == free  # left out for one solve


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_hidden_communication_still_costs_its_penalty(solver):
    """Two plans whose communication hides behind compute: the one that moves less wins, by
    `OVERLAP_PENALTY` of the time it moves (the module docstring of `planner.ilp`)."""
    zeros = np.zeros(2)
    costs = [ClassCosts(np.array([1.0, 1.0]), zeros, zeros, zeros)] * 2
    overlap = np.array([[0.0, 0.5], [0.5, 0.0]])  # resharding unless both choose alike
    edge = EdgeClass(0, 1, np.arange(2), np.arange(2), np.zeros((2, 2)), overlap)
    memory = MemoryModel(lambda choices: np.zeros(1), lambda step: ({}, 0.0))
    ilp = IntraOpIlp([2, 2], costs, [edge], memory, solver=solver)
    choices = ilp.solve(np.inf).choices
    assert choices[0] == choices[1]
    assert _objective((0, 1), costs, [edge]) == pytest.approx(2e6 + OVERLAP_PENALTY * 0.5e6)


def test_a_budget_under_the_memory_floor_is_answered_without_a_solve(monkeypatch):
    """Where every choice holds more than the budget at some step (the memory model's floor),
    `solve` says no plan without running a solver: a cut loop could take long to find out."""
    num_choices, costs, edges, memory = _random_model(0)
    least = min(
        memory.evaluate(np.array(choices)).max()
        for choices in itertools.product(*(range(n) for n in num_choices))
    )
    floored = MemoryModel(memory.evaluate, memory.coefficients, floor=float(least))
    ilp = IntraOpIlp(num_choices, costs, edges, floored)
    assert ilp.solve(least) is not None

    def unexpected(*_):
        raise AssertionError("solved under the floor")

    monkeypatch.setattr(IntraOpIlp, "_solve", unexpected)
    assert ilp.solve(least - 1.0) is None


def _recorded_solves(monkeypatch) -> list[str]:
    """Each `IntraOpIlp._solve` from now on, in order: "relaxed", "first plan", "split" (a
    MIP with columns fixed: the relaxation's split classes only) or "mip"."""
    solves = []
    solve = IntraOpIlp._solve

    def recorded(self, model, closed, limit, start, relaxed=False, first_plan=False, **kw):
        kind = "first plan" if first_plan else "split" if len(closed) else "mip"
        solves.append("relaxed" if relaxed else kind)
        return solve(self, model, closed, limit, start, relaxed, first_plan, **kw)

    monkeypatch.setattr(IntraOpIlp, "_solve", recorded)
    return solves


@pytest.mark.parametrize("solver", ["highs", "cbc"])
@pytest.mark.parametrize("seed", range(12))
def test_rounds_out_of_time_take_the_lp_relaxation_rounded(seed, solver, monkeypatch):
    """Past its deadline, a cut round runs no MIP: it rounds the LP relaxation (the MIP's
    first plan only where the rounding breaks a memory cut), and what it answers fits."""
    num_choices, costs, edges, memory = _random_model(seed)
    every = list(itertools.product(*(range(n) for n in num_choices)))
    peaks = {c: float(memory.evaluate(np.array(c)).max()) for c in every}
    least, most = min(peaks.values()), max(peaks.values())
    solves = _recorded_solves(monkeypatch)
    ilp = IntraOpIlp(num_choices, costs, edges, memory, solver=solver)
    for budget in (most, (least + most) / 2):
        solution = ilp.solve(budget, deadline=time.perf_counter() - 1.0)
        assert solution is not None and not solution.optimal and solution.timed_out
        assert peaks[tuple(int(k) for k in solution.choices)] <= budget * (1 + 1e-9)
    assert "mip" not in solves and solves[0] == "relaxed"
    assert all(solves[i - 1] == "relaxed" for i, s in enumerate(solves) if s == "split")
    after_rounding = ("relaxed", "split")
    assert all(solves[i - 1] in after_rounding for i, s in enumerate(solves) if s == "first plan")


@pytest.mark.parametrize("solver", ["highs", "cbc"])
@pytest.mark.parametrize("seed", range(12))
def test_round_relaxation_rounds_first_and_runs_the_mip_only_where_that_breaks_a_cut(
    seed, solver, monkeypatch
):
    """With `round_relaxation` (the stage search's candidates), each cut round solves the LP
    relaxation first, then the MIP of its split classes where the rounding broke a memory cut,
    and the whole MIP only where that finds no plan; the plan fits, is no faster than the
    optimum, and a budget below the least memory has none."""
    num_choices, costs, edges, memory = _random_model(seed)
    every = list(itertools.product(*(range(n) for n in num_choices)))
    peaks = {c: float(memory.evaluate(np.array(c)).max()) for c in every}
    least, most = min(peaks.values()), max(peaks.values())
    solves = _recorded_solves(monkeypatch)
    ilp = IntraOpIlp(num_choices, costs, edges, memory, solver=solver, round_relaxation=True)
    for budget in (most, (least + most) / 2, least * (1 + 1e-6)):
        solution = ilp.solve(budget)
        assert solution is not None and not solution.timed_out  # rounded by choice, in time
        chosen = tuple(int(k) for k in solution.choices)
        assert peaks[chosen] <= budget * (1 + 1e-9)
        best = min(_objective(c, costs, edges) for c in every if peaks[c] <= budget)
        assert _objective(chosen, costs, edges) >= best * (1 - 1e-7) - 1e-6
    assert solves[0] == "relaxed"
    assert all(solves[i - 1] == "relaxed" for i, s in enumerate(solves) if s == "split")
    after_rounding = ("relaxed", "split")
    assert all(solves[i - 1] in after_rounding for i, s in enumerate(solves) if s != "relaxed")
    assert ilp.solve(least * 0.99) is None


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_a_rounding_that_breaks_a_cut_solves_the_mip_of_the_split_classes(solver):
    """The MIP of the classes that the LP relaxation splits, the others fixed at the choices it
    takes whole, gives the fastest of those completions within the memory cuts (brute force),
    and no plan where none of them fits."""
    split = 0
    for seed in range(30):
        num_choices, costs, edges, memory = _random_model(seed)
        every = list(itertools.product(*(range(n) for n in num_choices)))
        peaks = {c: float(memory.evaluate(np.array(c)).max()) for c in every}
        budget = (min(peaks.values()) + max(peaks.values())) / 2
        ilp = IntraOpIlp(num_choices, costs, edges, memory, solver=solver)
        model, s = ilp._time_problem()
        for step in range(len(memory.evaluate(np.array(every[0])))):
            ilp._add_memory_cut(model, s, step, budget / 2**20)
        _, values = ilp._solve(model, [], 10.0, {}, relaxed=True)
        whole = {
            c: int(np.argmax(values[cols]))
            for c, cols in enumerate(s)
            if values[cols].max() > 1 - 1e-6
        }
        if len(whole) == len(s):
            continue
        split += 1
        completions = [
            c
            for c in every
            if all(c[k] == whole[k] for k in whole) and peaks[c] <= budget * (1 + 1e-9)
        ]
        status, solved = ilp._split_solved(model, [], s, values)
        if not completions:
            assert solved is None
            continue
        chosen = tuple(int(np.argmax(solved[cols])) for cols in s)
        assert chosen in completions
        best = min(_objective(c, costs, edges) for c in completions)
        assert _objective(chosen, costs, edges) <= best * (1 + 1e-7) + 1e-6
    assert split >= 3  # the relaxation splits some classes of these models


def test_a_rounding_that_breaks_a_cut_takes_the_leanest_choice_of_each_split_class():
    """Where the relaxation's largest shares hold too much at a cut step, each class it splits
    is rounded to the choice of its split that holds least there; classes it does not split,
    or that hold nothing there, keep their largest share."""
    held = {0: np.array([10.0, 1.0, 0.5]), 1: np.array([5.0, 1.0])}  # class -> bytes per choice
    memory = MemoryModel(lambda choices: np.zeros(1), lambda step: (held, 0.0))
    zeros = [np.zeros(n) for n in (3, 2, 2)]
    costs = [ClassCosts(z, z, z, z) for z in zeros]
    ilp = IntraOpIlp([3, 2, 2], costs, [], memory)
    shares = [np.array([0.6, 0.4, 0.0]), np.array([1.0, 0.0]), np.array([0.7, 0.3])]
    argmax = np.array([0, 0, 0])
    assert ilp._leaner(argmax, shares, [0]).tolist() == [1, 0, 0]
