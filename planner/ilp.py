"""The intra-op ILP (Alpa §4): one strategy per group class, least step time.

The model is built as arrays (`_Model`) and handed to HiGHS whole; CBC gets it through PuLP.
Built through PuLP's expressions, a GPT-15B candidate layer ILP took 0.41 s of Python (0.08 s as
arrays), and PuLP rebuilt HiGHS's model at every memory-cut round, all under the GIL, where the
stage search's workers queued on it.

Variables: a one-hot binary vector per class (groups of one class share it), and per edge class a
continuous matrix e[a, b] over (producer spec a, consumer need b) whose row sums are the
producer's one-hot (folded by spec) and column sums the consumer's: with one-hot ends it is their
outer product, so Σ e·cost is exactly the resharding paid, and the LP relaxation is Alpa's.

Objective (microseconds): compute + blocking communication + max(0, overlappable communication −
compute), the last through one continuous variable: communication that can be prefetched or
deferred hides behind compute until there is more of it than compute. Hidden communication still
costs `OVERLAP_PENALTY` of its time (it competes with compute for memory bandwidth), so of two
plans that hide everything the one that moves less wins; and each class may carry a tie-break
cost (e.g. bytes stored), small enough never to outweigh a real cost.

Memory: for each step t, arguments + outputs + temporaries live at t must fit the budget (a
resharded copy's bytes on its edge's e[a, b]: exact with one-hot ends). There
are as many steps as nodes, so constraints are added lazily: solve, find the steps over budget
under the solution, add those, solve again (a cutting-plane loop; it stops when the solution fits).
The model and its cuts are kept, so solving again under a tighter budget starts from them.

Determinism: the model is built in a fixed order and HiGHS runs on one thread with seed 0 (its
MIP search runs a concurrent worker per thread, so another thread count can return another of
several equally good plans); CBC runs serially with its fixed default seeds. The same ILP then
gives the same plan run after run, whatever the core count, unless a solve stops at its
wall-clock `time_limit_s`: the best plan found by then depends on the machine's speed and load
(the plan's note says "time limit hit").
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pulp

from autopar.planner._compat import pulp_sum, pulp_variable, solve_cbc
from autopar.planner.errors import InfeasibleError, InvalidArgumentError, MemoryBudgetError

logger = logging.getLogger(__name__)

_MICROSECONDS = 1e6
_MIB = float(2**20)
# The defaults of every ILP autopar solves: HiGHS finds the same optima as CBC, faster on the
# large ones (GPT-1.3B: 1.4 s against 2.5 s), and a layer or stage ILP past 10 s is rare.
SOLVERS = ("highs", "cbc")
DEFAULT_SOLVER = "highs"
DEFAULT_TIME_LIMIT_S = 10.0
_CUTS_PER_ROUND = 4  # memory cuts added per round
_SPLIT_SHARE = 1e-6  # a choice the LP relaxation takes more of than this is in its split
_ROUNDING_SLACK_MIB = 1e-6  # a rounded plan within the cuts' bound up to this (`_rounded`)
_MAX_CUT_ROUNDS = 40  # a budgeted solve still cutting then answers "does not fit"
_ROUNDS_PER_DOUBLING = 4  # past that, the least-memory search doubles its cuts this often
OVERLAP_PENALTY = 0.1
# Per thread: whether HiGHS refused one thread there (its scheduler in that thread was started
# by other code with another thread count, which HiGHS does not change afterwards).
_HIGHS_STATE = threading.local()


class _CutsDidNotSettle(Exception):
    """A budgeted solve still adds memory cuts after `_MAX_CUT_ROUNDS` rounds."""


class _Status(enum.Enum):
    """How one solve ended; the value is what the debug log says."""

    OPTIMAL = "optimal"
    FEASIBLE = "time limit hit"  # stopped at a limit with a plan
    ROUNDED = "LP relaxation rounded"  # a plan from the relaxation (`IntraOpIlp._rounded`)
    SPLIT_SOLVED = "MIP of the relaxation's split classes solved"  # `IntraOpIlp._split_solved`
    NO_SOLUTION = "no plan yet"  # stopped at the limit before any plan
    INFEASIBLE = "no plan"


class _Model:
    """An ILP as arrays: bounded columns, a cost per column, rows `lower <= a·x <= upper`.

    The solvers get the columns in name order and the rows in the order they were added, as
    PuLP handed them over before: the same model, so the same plans."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._lower: list[float] = []
        self._upper: list[float] = []
        self._integer: list[bool] = []
        self.cost = np.zeros(0)
        self.row_cols: list[np.ndarray] = []
        self.row_coefs: list[np.ndarray] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.edge_cols: dict[int, np.ndarray] = {}  # edge class -> its e[a, b] columns

    def add_cols(
        self, names: Sequence[str], lower: float, upper: float, integer: bool
    ) -> np.ndarray:
        """Columns named `names`, all with the same bounds; their indices."""
        first = len(self.names)
        self.names += names
        self._lower += [lower] * len(names)
        self._upper += [upper] * len(names)
        self._integer += [integer] * len(names)
        return np.arange(first, len(self.names))

    def add_row(self, cols, coefs, lower: float, upper: float) -> int:
        """A row over distinct columns `cols` (zero coefficients left out); its index."""
        cols, coefs = np.asarray(cols, dtype=np.int64), np.asarray(coefs, dtype=float)
        keep = coefs != 0
        self.row_cols.append(cols[keep])
        self.row_coefs.append(coefs[keep])
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        return len(self.row_lower) - 1

    def add_rows(
        self, rows: np.ndarray, cols: np.ndarray, coefs: np.ndarray, lower: float, upper: float
    ) -> None:
        """Rows 0..max(rows) over the columns `cols` with the nonzero `coefs`, entry i in row
        `rows[i]` (each row over distinct columns), all within the same bounds: many rows built
        at once, a layer ILP's edges add ~10^5."""
        order = np.argsort(rows, kind="stable")
        bounds = np.cumsum(np.bincount(rows, minlength=rows.max() + 1))[:-1]
        self.row_cols += np.split(np.asarray(cols, dtype=np.int64)[order], bounds)
        self.row_coefs += np.split(np.asarray(coefs, dtype=float)[order], bounds)
        self.row_lower += [lower] * (len(bounds) + 1)
        self.row_upper += [upper] * (len(bounds) + 1)

    def set_costs(self, cols, coefs) -> None:
        """The objective: `coefs` summed per column."""
        self.cost = np.zeros(len(self.names))
        np.add.at(self.cost, np.asarray(cols, dtype=np.int64), np.asarray(coefs, dtype=float))

    @functools.cached_property
    def order(self) -> np.ndarray:
        """Column indices in name order (columns are all added before the first solve)."""
        return np.array(sorted(range(len(self.names)), key=self.names.__getitem__), dtype=np.int64)

    def bounds(self, closed: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper) per column, with the columns `closed` fixed at 0."""
        upper = np.array(self._upper)
        upper[list(closed)] = 0.0
        return np.array(self._lower), upper

    def highs_lp(self, closed: Sequence[int]) -> Any:
        """The model as HiGHS's `HighsLp`, columns in name order, and each column's position
        there (to read the solution back)."""
        import highspy

        order = self.order
        position = np.empty_like(order)
        position[order] = np.arange(len(order))
        lower, upper = self.bounds(closed)
        rows = np.repeat(np.arange(len(self.row_cols)), [len(c) for c in self.row_cols])
        cols = position[np.concatenate(self.row_cols)] if self.row_cols else np.zeros(0, int)
        values = np.concatenate(self.row_coefs) if self.row_coefs else np.zeros(0)
        by_col = np.lexsort((rows, cols))
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(order), len(self.row_lower)
        lp.col_cost_ = self.cost[order]
        lp.col_lower_, lp.col_upper_ = lower[order], upper[order]
        lp.row_lower_, lp.row_upper_ = np.array(self.row_lower), np.array(self.row_upper)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.searchsorted(cols[by_col], np.arange(len(order) + 1)).astype(
            np.int32
        )
        lp.a_matrix_.index_ = rows[by_col].astype(np.int32)
        lp.a_matrix_.value_ = values[by_col]
        kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
        lp.integrality_ = [kinds[self._integer[c]] for c in order]
        return lp, position

    def pulp_problem(self, closed: Sequence[int]) -> tuple[pulp.LpProblem, list]:
        """The model as a PuLP problem (for CBC) and its variables by column."""
        lower, upper = self.bounds(closed)
        prob = pulp.LpProblem("autopar", pulp.LpMinimize)
        variables = [
            pulp_variable(
                prob, name, None if lo == -np.inf else lo, None if hi == np.inf else hi, integer
            )
            for name, lo, hi, integer in zip(self.names, lower, upper, self._integer, strict=True)
        ]
        nonzero = np.flatnonzero(self.cost)
        prob += pulp_sum((variables[c], self.cost[c]) for c in nonzero)
        for i, (cols, coefs, lo, hi) in enumerate(
            zip(self.row_cols, self.row_coefs, self.row_lower, self.row_upper, strict=True)
        ):
            expr = pulp_sum((variables[c], v) for c, v in zip(cols, coefs, strict=True))
            if lo == hi:
                prob += expr == lo, f"r{i}"
            else:
                if lo != -np.inf:
                    prob += expr >= lo, f"r{i}_lo"
                if hi != np.inf:
                    prob += expr <= hi, f"r{i}_hi"
        return prob, variables


@dataclasses.dataclass(slots=True)
class ClassCosts:
    """Per-choice costs (seconds) of one class, summed over its groups."""

    compute: np.ndarray
    blocking: np.ndarray
    overlap: np.ndarray
    tie_break: np.ndarray


@dataclasses.dataclass(slots=True)
class EdgeClass:
    """Resharding between two classes: choice → row/column maps and summed cost matrices."""

    producer: int
    consumer: int
    row_of: np.ndarray
    col_of: np.ndarray
    blocking: np.ndarray
    overlap: np.ndarray


@dataclasses.dataclass(slots=True)
class MemoryModel:
    """Memory per step as a function of the choices: see `planner.intra` for how it is built.
    A resharded copy's buffer depends on both ends of an edge: `edge_coefficients(step)` gives
    its bytes per (producer spec, consumer need) of each edge class whose copies live then."""

    evaluate: Callable[[np.ndarray], np.ndarray]  # choice per class -> bytes per step
    coefficients: Callable[[int], tuple[dict[int, np.ndarray], float]]  # step -> per class, const
    floor: float = 0.0  # bytes every choice holds at some step: a budget below it fits nothing
    edge_coefficients: Callable[[int], dict[int, np.ndarray]] = lambda step: {}
    copying_edges: frozenset[int] = frozenset()  # edge classes with copies at some step


@dataclasses.dataclass(frozen=True, slots=True)
class Solution:
    choices: np.ndarray  # per class
    optimal: bool
    seconds: float
    rounds: int
    # a solve stopped at its time limit (else a plan not proved optimal was rounded from the LP
    # relaxation by choice, `round_relaxation`)
    timed_out: bool = False


class IntraOpIlp:
    """Build and solve the ILP for classes with `num_choices[c]` choices each."""

    def __init__(
        self,
        num_choices: Sequence[int],
        costs: Sequence[ClassCosts],
        edges: Sequence[EdgeClass],
        memory: MemoryModel,
        *,
        solver: str = DEFAULT_SOLVER,
        time_limit_s: float = DEFAULT_TIME_LIMIT_S,
        relative_gap: float | None = None,
        presolve: bool = True,
        round_relaxation: bool = False,
    ) -> None:
        self.num_choices = list(num_choices)
        self.costs = costs
        self.edges = edges
        self.memory = memory
        self.solver = solver
        self.time_limit_s = time_limit_s
        self.relative_gap = relative_gap  # stop within this fraction of optimal (None: solver's)
        self.presolve = presolve  # HiGHS's presolve (`_solve_highs`)
        # each memory-cut round takes its LP relaxation rounded, or where that breaks a cut the
        # MIP of the classes it splits (`_cut_loop`): for candidates, whose plans are estimates
        self.round_relaxation = round_relaxation
        self._time: tuple[_Model, list[np.ndarray]] | None = None  # the time model, its cuts
        self._cuts: dict[int, _Cut] = {}
        self._budget = np.inf
        self._least: np.ndarray | None = None  # `least_memory_choices`' answer
        # whether the last solve found no plan for want of time (not proved to have none)
        self.out_of_time = False

    # ------------------------------------------------------------------ model

    def _base_problem(self, edges: Sequence[int]) -> tuple[_Model, list[np.ndarray]]:
        """The choice columns (one binary per class and choice) and their one-hot rows, and
        the columns of the edge classes `edges` with their transport rows."""
        model = _Model()
        s = [
            model.add_cols([f"s_{c}_{k}" for k in range(n)], 0.0, 1.0, integer=True)
            for c, n in enumerate(self.num_choices)
        ]
        if s:  # one choice per class
            sizes = [len(cols) for cols in s]
            model.add_rows(
                np.repeat(np.arange(len(s)), sizes),
                np.concatenate(s),
                np.ones(sum(sizes)),
                1.0,
                1.0,
            )
        for i in edges:
            edge = self.edges[i]
            rows, cols = edge.blocking.shape
            e = model.add_cols(
                [f"e_{i}_{a}_{b}" for a in range(rows) for b in range(cols)],
                0.0,
                np.inf,
                integer=False,
            ).reshape(rows, cols)
            # row a: the e[a, :] sum to the producer's choices that hold the value as row a
            # (column b alike for the consumer's), so one e[a, b] is 1 in a plan
            for ks, of, transport in (
                (s[edge.producer], edge.row_of, e),
                (s[edge.consumer], edge.col_of, e.T),
            ):
                model.add_rows(
                    np.concatenate([np.repeat(np.arange(len(transport)), transport.shape[1]), of]),
                    np.concatenate([transport.ravel(), ks]),
                    np.concatenate([np.ones(transport.size), -np.ones(len(ks))]),
                    0.0,
                    0.0,
                )
            model.edge_cols[i] = e
        return model, s

    def _edge_terms(self, model: _Model) -> tuple[list, list]:
        """(blocking, overlap) objective terms of the edge columns, each a (columns,
        microseconds) pair of arrays."""
        blocking, overlap = [], []
        for i, edge in enumerate(self.edges):
            e = model.edge_cols[i].ravel()
            blocking.append((e, edge.blocking.ravel() * _MICROSECONDS))
            overlap.append((e, edge.overlap.ravel() * _MICROSECONDS))
            blocking.append((e, OVERLAP_PENALTY * edge.overlap.ravel() * _MICROSECONDS))
        return blocking, overlap

    def _time_problem(self) -> tuple[_Model, list[np.ndarray]]:
        model, s = self._base_problem(range(len(self.edges)))
        blocking, overlap = self._edge_terms(model)
        compute = []
        for c, cost in enumerate(self.costs):
            direct = cost.compute + cost.blocking + OVERLAP_PENALTY * cost.overlap + cost.tie_break
            blocking.append((s[c], np.asarray(direct, dtype=float) * _MICROSECONDS))
            compute.append((s[c], np.asarray(cost.compute, dtype=float) * _MICROSECONDS))
            overlap.append((s[c], np.asarray(cost.overlap, dtype=float) * _MICROSECONDS))
        (exposed,) = model.add_cols(["exposed_overlappable"], 0.0, np.inf, integer=False)
        blocking.append((np.array([exposed]), np.ones(1)))
        model.set_costs(*_joined(blocking))
        # exposed >= overlap - compute: a column may carry both, so their coefficients are summed
        cols, coefs = _joined([*overlap, *((c, -v) for c, v in compute)])
        summed = np.zeros(len(model.names))
        np.add.at(summed, cols, coefs)
        touched = np.unique(cols)
        model.add_row(np.r_[exposed, touched], np.r_[1.0, -summed[touched]], 0.0, np.inf)
        return model, s

    def _add_memory_cut(self, model: _Model, s, step: int, bound: float, peak=None) -> _Cut:
        """Memory at `step` within `bound` MiB, or within the column `peak` where given."""
        per_class, const = self.memory.coefficients(step)
        per_edge = self.memory.edge_coefficients(step)
        cols, coefs = _joined(
            [(s[c], np.asarray(coef, dtype=float) / _MIB) for c, coef in sorted(per_class.items())]
            + [(model.edge_cols[i].ravel(), coef.ravel() / _MIB) for i, coef in per_edge.items()]
        )
        if peak is not None:
            cols, coefs = np.r_[cols, peak], np.r_[coefs, -1.0]
        row = model.add_row(cols, coefs, -np.inf, bound - const / _MIB)
        return _Cut(row, const / _MIB)

    # ------------------------------------------------------------------ solving

    def _solve_highs(
        self,
        model: _Model,
        closed: Sequence[int],
        time_limit_s: float,
        start: Mapping[int, float],
        relaxed: bool,
        first_plan: bool,
        presolve: bool,
    ) -> tuple[_Status, np.ndarray | None]:
        """Solve with HiGHS on one thread, seed 0 (module docstring), with its presolve where
        `presolve`, from the (partial) solution `start` (column -> value) where given;
        its LP relaxation with `relaxed`; stopped at the first plan with `first_plan`.
        In a thread whose HiGHS scheduler other code started with more threads, HiGHS refuses
        one thread: there it solves with that scheduler, and the plan may differ from other
        machines' (warned once per thread)."""
        import highspy

        lp, position = model.highs_lp(closed)
        if relaxed:
            lp.integrality_ = []  # none: every column continuous
        options = {
            "output_flag": False,
            "time_limit": float(time_limit_s),
            "random_seed": 0,
            "presolve": "choose" if presolve else "off",
        }
        if self.relative_gap is not None:
            options["mip_rel_gap"] = self.relative_gap
        if first_plan:
            options["mip_max_improving_sols"] = 1
        one_thread = not getattr(_HIGHS_STATE, "refuses_one_thread", False)
        hint = (position[list(start)], list(start.values())) if start else None
        highs = _run_highs(lp, {**options, "threads": 1} if one_thread else options, hint)
        if one_thread and highs.getModelStatus() == highspy.HighsModelStatus.kNotset:
            _HIGHS_STATE.refuses_one_thread = True
            logger.warning(
                "HiGHS refuses to solve on one thread here (other code in this thread started "
                "it with another thread count); solving on its threads, so plans may differ "
                "from runs on other machines"
            )
            highs = _run_highs(lp, options, hint)
        status = _highs_statuses().get(highs.getModelStatus(), _Status.NO_SOLUTION)
        if status is _Status.FEASIBLE and not np.isfinite(highs.getInfo().objective_function_value):
            status = _Status.NO_SOLUTION
        if status not in (_Status.OPTIMAL, _Status.FEASIBLE):
            return status, None
        return status, np.asarray(highs.getSolution().col_value)[position]

    def _solve_cbc(
        self,
        model: _Model,
        closed: Sequence[int],
        time_limit_s: float,
        start: Mapping[int, float],
        relaxed: bool,
        first_plan: bool,
    ) -> tuple[_Status, np.ndarray | None]:
        """Solve with CBC (PuLP's): without `start`, which its command line cannot take; its
        LP relaxation with `relaxed`; stopped at the first plan with `first_plan`."""
        prob, variables = model.pulp_problem(closed)
        outcome = solve_cbc(
            prob,
            msg=False,
            timeLimit=time_limit_s,
            gapRel=self.relative_gap,
            mip=not relaxed,
            options=["maxSolutions 1"] if first_plan else [],
        )
        if outcome is None:
            raise InvalidArgumentError(
                f"solver='cbc' needs PuLP's CBC, and PuLP {pulp.__version__} finds none: "
                "install it with `pip install 'pulp[cbc]'` or plan with solver='highs'"
            )
        status = {
            "optimal": _Status.OPTIMAL,
            "feasible": _Status.FEASIBLE,
            "no_solution": _Status.NO_SOLUTION,
        }.get(outcome, _Status.INFEASIBLE)
        if status not in (_Status.OPTIMAL, _Status.FEASIBLE):
            return status, None
        return status, np.array([v.varValue or 0.0 for v in variables])

    def _solve(
        self,
        model: _Model,
        closed: Sequence[int],
        time_limit_s: float,
        start: Mapping[int, float],
        relaxed: bool = False,
        first_plan: bool = False,
        presolve: bool | None = None,
    ) -> tuple[_Status, np.ndarray | None]:
        """(status, column values) of one solve with the columns `closed` fixed at 0, from the
        column values `start` where the solver takes one; with `relaxed`, of the LP relaxation
        (every column continuous); with `first_plan`, stopped at the first plan found;
        `presolve`: whether HiGHS presolves (None: as the ILP's option says)."""
        if self.solver != "highs":
            return self._solve_cbc(model, closed, time_limit_s, start, relaxed, first_plan)
        presolve = self.presolve if presolve is None else presolve
        return self._solve_highs(model, closed, time_limit_s, start, relaxed, first_plan, presolve)

    def _cut_loop(
        self,
        model: _Model,
        s,
        fits: Callable[[np.ndarray, np.ndarray, np.ndarray], bool],
        bound: float,
        cut: dict[int, _Cut],
        escalate: bool,
        deadline: float | None = None,
        closed: Sequence[int] = (),
        peak: int | None = None,
        start: Mapping[int, float] | None = None,
    ):
        """Solve, adding memory cuts (into `cut`, by step) at the worst steps until `fits`
        (choices, memory per step, column values); None if infeasible.

        The rounds share the time until `deadline` (default: `time_limit_s` from now), so the
        limit bounds a solve, not each of its rounds. A round that starts past it, or whose MIP
        finds no plan before it, takes its LP relaxation rounded (`_rounded`) instead: on
        memory-tight layers of GPT-39B, HiGHS spends 5 s and more on cuts at its root before its
        first plan, past a 2.5 s limit and then again, where the rounded LP gives one as good in
        a second. Where the rounding breaks a memory cut, the MIP of the classes the relaxation
        splits gives the plan (`_split_solved`); only where that finds none does the whole MIP
        run again, within the limit, stopped at its first plan. With `round_relaxation`, a
        round takes the rounded LP (or its split classes' MIP) first, the whole MIP only where
        neither gives a plan.

        Most plans fit after a few cuts. Where the peak keeps moving from step to step, a
        budgeted solve stops after `_MAX_CUT_ROUNDS` (`_CutsDidNotSettle`); with `escalate` the
        cuts per round double every few rounds after that instead, so within O(log steps) more
        rounds every step is cut, the solution meets every step's constraint, and the loop
        ends. (Many cuts at once slow each solve, so the first rounds add few.)"""
        optimal, timed_out = True, False
        if deadline is None:
            deadline = time.perf_counter() + self.time_limit_s
        for rounds in itertools.count(1):
            began = time.perf_counter()
            status, values = _Status.NO_SOLUTION, None
            if self.round_relaxation:
                status, values = self._rounded(model, closed, s, cut, bound, peak)
            if status is _Status.NO_SOLUTION and (now := time.perf_counter()) < deadline:
                status, values = self._solve(model, closed, deadline - now, start or {})
                timed_out |= status in (_Status.FEASIBLE, _Status.NO_SOLUTION)
            if status is _Status.NO_SOLUTION and not self.round_relaxation:  # out of time
                timed_out = True
                status, values = self._rounded(model, closed, s, cut, bound, peak)
            if status is _Status.NO_SOLUTION:  # nor a rounded one: the MIP's first plan
                timed_out = True
                status, values = self._solve(
                    model, closed, self.time_limit_s, start or {}, first_plan=True
                )
            logger.debug(
                "memory-cut round %d (%d cuts): %s in %.2f s",
                rounds,
                len(cut),
                status.value,
                time.perf_counter() - began,
            )
            self.out_of_time = status is _Status.NO_SOLUTION
            if values is None:
                return None
            choices = _largest_shares(s, values)
            optimal = optimal and status is _Status.OPTIMAL
            per_step = self.memory.evaluate(choices)
            worst = [int(t) for t in np.argsort(-per_step, kind="stable") if int(t) not in cut]
            if fits(choices, per_step, values) or not worst:  # no step left uncut: fits
                return choices, optimal, rounds, timed_out
            if rounds >= _MAX_CUT_ROUNDS and not escalate:
                raise _CutsDidNotSettle
            doublings = max(0, rounds - _MAX_CUT_ROUNDS) // _ROUNDS_PER_DOUBLING
            width = _CUTS_PER_ROUND << doublings
            for step in worst[:width]:
                cut[step] = self._add_memory_cut(model, s, step, bound, peak)

    def _rounded(
        self,
        model: _Model,
        closed: Sequence[int],
        s,
        cut: Mapping[int, _Cut],
        bound: float,
        peak: int | None,
    ) -> tuple[_Status, np.ndarray | None]:
        """The LP relaxation with each class's largest share rounded to 1 (and the `peak`
        column, where given, at the peak of the cut steps): a plan for a cut round whose MIP
        ran out of time, where it keeps within the memory cuts so far (`bound` MiB; else the
        leanest rounding of the split classes, else their MIP, `_split_solved`). A layer's
        relaxation leaves few classes split, so its rounding is about as fast as the MIP's
        plans (GPT-39B's: 8 of 133 split, 213.5 s against the MIP's 213.5 s after 20 s, the
        bound 199.9 s)."""
        status, values = self._solve(model, closed, self.time_limit_s, {}, relaxed=True)
        if status is _Status.INFEASIBLE:
            return status, None  # an infeasible relaxation proves the MIP infeasible
        if status is not _Status.OPTIMAL:
            return _Status.NO_SOLUTION, None
        choices = _largest_shares(s, values)
        held = self._cut_memory(choices, cut)
        if peak is None and (held > bound + _ROUNDING_SLACK_MIB).any():
            over = [t for t, mib in zip(cut, held, strict=True) if mib > bound]
            choices = self._leaner(choices, [values[cols] for cols in s], over)
            held = self._cut_memory(choices, cut)
            if (held > bound + _ROUNDING_SLACK_MIB).any():
                return self._split_solved(model, closed, s, values)
        rounded = values.copy()
        one_hot = _one_hot(s, dict(enumerate(choices.tolist())))
        rounded[list(one_hot)] = list(one_hot.values())
        if peak is not None:
            rounded[peak] = held.max()
        return _Status.ROUNDED, rounded

    def _split_solved(
        self, model: _Model, closed: Sequence[int], s, values: np.ndarray
    ) -> tuple[_Status, np.ndarray | None]:
        """The MIP over the classes that the LP relaxation `values` splits, every other class
        fixed at the choice the relaxation takes whole: a plan for a round whose rounding breaks
        a memory cut, from a MIP of a few classes instead of all. On GPT-39B's embedding layer,
        the whole MIP found no plan in twice its 2.5 s limit, and the least-memory plan that
        followed took 77 s per micro-batch where a plan of 4.1 s fits. No plan here where the
        relaxation's whole choices leave none (which does not prove the whole MIP has none).
        HiGHS presolves it whatever the option says: presolve drops the fixed columns, and the
        27 split MIPs of the Flax GPT-39B's layer ILPs on 64 V100s took 24.9 s with it against
        36.6 s without, for the same plans."""
        fixed = [
            int(col)
            for cols in s
            if values[cols].max() >= 1 - _SPLIT_SHARE
            for col in cols
            if values[col] <= _SPLIT_SHARE
        ]
        _, solved = self._solve(model, [*closed, *fixed], self.time_limit_s, {}, presolve=True)
        return (_Status.NO_SOLUTION, None) if solved is None else (_Status.SPLIT_SOLVED, solved)

    def _cut_memory(self, choices: np.ndarray, cut: Mapping[int, _Cut]) -> np.ndarray:
        """MiB held at each cut step under `choices` (one 0 where nothing is cut)."""
        return self.memory.evaluate(choices)[list(cut)] / _MIB if cut else np.zeros(1)

    def _leaner(
        self, choices: np.ndarray, shares: Sequence[np.ndarray], steps: Sequence[int]
    ) -> np.ndarray:
        """`choices` with each class that the relaxation splits (`shares`) rounded instead to
        the choice of its split that holds least at `steps`, where the largest share broke
        their memory cuts."""
        held: dict[int, np.ndarray] = {}
        for step in steps:
            for c, coef in self.memory.coefficients(step)[0].items():
                held[c] = held.get(c, 0.0) + np.asarray(coef, dtype=float)
        leaner = choices.copy()
        for c, share in enumerate(shares):
            split = np.flatnonzero(share > _SPLIT_SHARE)
            if len(split) > 1 and c in held:
                leaner[c] = int(split[np.argmin(held[c][split])])
        return leaner

    def solve(
        self,
        budget_bytes: float,
        deadline: float | None = None,
        forbidden: Mapping[int, Sequence[int]] | None = None,
        start: Mapping[int, int] | None = None,
    ) -> Solution | None:
        """The least-time choices whose memory fits `budget_bytes` per device; None if none do.
        Its rounds share the time until `deadline` (`time.perf_counter()`; default: the time
        limit from now). `forbidden[c]`: choices of class c left out of this solve. `start[c]`:
        a choice of class c for the solver to start from (HiGHS), the other classes' first
        solved with those fixed: a solve that stops at its time limit is then no worse than a
        start that fits.

        Solving again with a budget no larger reuses the model and the cuts found so far."""
        began = time.perf_counter()
        self.out_of_time = False
        if budget_bytes < self.memory.floor:
            return None  # no solve needed (and a cut loop might take long to find it out)
        if self._time is None or budget_bytes > self._budget:
            self._time, self._cuts = self._time_problem(), {}
        model, s = self._time
        for memory_cut in self._cuts.values():  # the same cuts, at the new bound
            model.row_upper[memory_cut.row] = budget_bytes / _MIB - memory_cut.const
        self._budget = budget_bytes
        deadline = began + self.time_limit_s if deadline is None else deadline
        closed = [int(s[c][k]) for c, ks in (forbidden or {}).items() for k in ks]
        hint: dict[int, float] = {}
        if start and self.solver == "highs":
            hint = _one_hot(s, start)
            if len(start) < len(s):  # the other classes' choices, with the started ones fixed
                fixed = [col for col, value in hint.items() if not value]
                with contextlib.suppress(_CutsDidNotSettle):
                    completed = self._budgeted(model, s, budget_bytes, deadline, closed + fixed, {})
                    hint = {} if completed is None else _one_hot(s, dict(enumerate(completed[0])))
        try:
            result = self._budgeted(model, s, budget_bytes, deadline, closed, hint)
        except _CutsDidNotSettle:
            least = self.least_memory()
            raise MemoryBudgetError(
                f"no plan within {budget_bytes / 2**30:.3g} GiB per device was found in "
                f"{_MAX_CUT_ROUNDS} rounds of memory cuts; the least memory per device any plan "
                f"needs is about {least / 2**30:.3g} GiB (raise "
                "AutoShardingOption(memory_budget_per_device=...) towards it, or use more "
                "devices or micro-batches)",
                budget_bytes,
                least,
            ) from None
        if result is None:
            return None
        choices, optimal, rounds, timed_out = result
        if not optimal:  # the caller warns where the plan is one a user gets
            logger.debug(
                "the sharding ILP's plan is not proved optimal: %s",
                f"a solve hit the time limit ({self.time_limit_s:.3g} s)"
                if timed_out
                else "rounded from its LP relaxation",
            )
        return Solution(choices, optimal, time.perf_counter() - began, rounds, timed_out)

    def _budgeted(
        self,
        model: _Model,
        s,
        budget_bytes: float,
        deadline: float,
        closed: Sequence[int],
        start: Mapping[int, float],
    ):
        """The cut loop of `solve` within `budget_bytes`, its cuts kept for later solves."""
        return self._cut_loop(
            model,
            s,
            lambda _, per_step, __: per_step.max() <= budget_bytes,
            budget_bytes / _MIB,
            self._cuts,
            escalate=False,
            deadline=deadline,
            closed=closed,
            start=start,
        )

    def least_memory(self) -> float:
        """The least peak memory per device over all choices (bytes), ignoring step time."""
        return float(self.memory.evaluate(self.least_memory_choices()).max())

    def least_memory_choices(self) -> np.ndarray:
        """The choices (per class) of least peak memory per device, ignoring step time:
        searched once, the model does not change."""
        if self._least is None:
            model, s = self._base_problem(sorted(self.memory.copying_edges))
            (peak,) = model.add_cols(["peak_mib"], 0.0, np.inf, integer=False)
            model.set_costs([peak], [1.0])
            result = self._cut_loop(
                model,
                s,
                lambda _, per_step, values: per_step.max() / _MIB <= values[peak] + 1e-6,
                0.0,
                {},
                escalate=True,
                peak=peak,
            )
            if result is None:
                raise InfeasibleError(
                    "the sharding ILP has no solution even without a memory budget"
                )
            self._least = result[0]
        return self._least


@dataclasses.dataclass(frozen=True, slots=True)
class _Cut:
    """A memory cut: its row, and its constant term (MiB) that the budget's bound is less."""

    row: int
    const: float


def _largest_shares(s: Sequence[np.ndarray], values: np.ndarray) -> np.ndarray:
    """Per class, the choice its columns in `values` give the most of (the one at 1 in a plan;
    the first of equal shares)."""
    if not s:
        return np.zeros(0, np.int64)
    sizes = np.array([len(cols) for cols in s])
    starts = np.cumsum(sizes) - sizes
    classes = np.repeat(np.arange(len(s)), sizes)
    by_share = np.lexsort((-values[np.concatenate(s)], classes))  # stable: first on ties
    return by_share[starts] - starts


def _one_hot(s: Sequence[np.ndarray], choices: Mapping[int, int]) -> dict[int, float]:
    """Column -> value of choosing `choices[c]` for each class c in it (1 there, 0 elsewhere)."""
    return {int(col): float(j == k) for c, k in choices.items() for j, col in enumerate(s[c])}


def _joined(terms: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(columns, coefficients) of (columns, coefficients) pairs, concatenated."""
    if not terms:
        return np.zeros(0, np.int64), np.zeros(0)
    return (
        np.concatenate([np.asarray(c, dtype=np.int64) for c, _ in terms]),
        np.concatenate([np.asarray(v, dtype=float) for _, v in terms]),
    )


def _run_highs(
    lp: Any, options: Mapping[str, Any], start: tuple[np.ndarray, Sequence[float]] | None
) -> Any:
    """HiGHS run on `lp`, from the partial solution `start` (positions, values) where given."""
    import highspy

    highs = highspy.Highs()
    for name, value in options.items():
        highs.setOptionValue(name, value)
    highs.passModel(lp)
    if start is not None:
        positions, values = start
        highs.setSolution(len(positions), np.asarray(positions, np.int32), np.asarray(values))
    highs.run()
    return highs


@functools.cache
def _highs_statuses() -> dict[Any, _Status]:
    from highspy import HighsModelStatus as M

    limits = (
        *(M.kTimeLimit, M.kIterationLimit, M.kSolutionLimit, M.kInterrupt),
        *(M.kObjectiveBound, M.kObjectiveTarget),
    )
    return {
        M.kOptimal: _Status.OPTIMAL,
        **dict.fromkeys(limits, _Status.FEASIBLE),
        M.kInfeasible: _Status.INFEASIBLE,
        M.kUnboundedOrInfeasible: _Status.INFEASIBLE,
    }
