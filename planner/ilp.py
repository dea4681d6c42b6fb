"""The intra-op ILP (Alpa §4), solved with PuLP: one strategy per group class, least step time.

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

Memory: for each step t, arguments + outputs + temporaries live at t must fit the budget. There
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

import dataclasses
import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pulp

from autopar.planner.errors import InfeasibleError, MemoryBudgetError

logger = logging.getLogger(__name__)

_MICROSECONDS = 1e6
_MIB = float(2**20)
# The defaults of every ILP autopar solves: HiGHS finds the same optima as CBC, faster on the
# large ones (GPT-1.3B: 1.4 s against 2.5 s), and a layer or stage ILP past 10 s is rare.
SOLVERS = ("highs", "cbc")
DEFAULT_SOLVER = "highs"
DEFAULT_TIME_LIMIT_S = 10.0
_CUTS_PER_ROUND = 4  # memory cuts added per round
_MAX_CUT_ROUNDS = 40  # a budgeted solve still cutting then answers "does not fit"
_ROUNDS_PER_DOUBLING = 4  # past that, the least-memory search doubles its cuts this often
_LATE_ROUND_SHARE = 0.25  # of time_limit_s, for a cut round that starts after it ran out
OVERLAP_PENALTY = 0.1
# Per thread: whether HiGHS refused one thread there (its scheduler in that thread was started
# by other code with another thread count, which HiGHS does not change afterwards).
_HIGHS_STATE = threading.local()


class _CutsDidNotSettle(Exception):
    """A budgeted solve still adds memory cuts after `_MAX_CUT_ROUNDS` rounds."""


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
    """Memory per step as a function of the choices: see `planner.intra` for how it is built."""

    evaluate: Callable[[np.ndarray], np.ndarray]  # choice per class -> bytes per step
    coefficients: Callable[[int], tuple[dict[int, np.ndarray], float]]  # step -> per class, const


@dataclasses.dataclass(frozen=True, slots=True)
class Solution:
    choices: np.ndarray  # per class
    optimal: bool
    seconds: float
    rounds: int


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
    ) -> None:
        self.num_choices = list(num_choices)
        self.costs = costs
        self.edges = edges
        self.memory = memory
        self.solver = solver
        self.time_limit_s = time_limit_s
        self.relative_gap = relative_gap  # stop within this fraction of optimal (None: solver's)
        self.presolve = presolve  # HiGHS's presolve (`_solve_highs`)
        self._time: tuple[pulp.LpProblem, list] | None = None  # the time model and its cuts
        self._cuts: dict[int, pulp.LpConstraint] = {}
        self._budget = np.inf

    # ------------------------------------------------------------------ model

    def _base_problem(self, name: str) -> tuple[pulp.LpProblem, list[list[pulp.LpVariable]]]:
        prob = pulp.LpProblem(name, pulp.LpMinimize)
        s = [
            [pulp.LpVariable(f"s_{c}_{k}", cat=pulp.LpBinary) for k in range(n)]
            for c, n in enumerate(self.num_choices)
        ]
        for c, vs in enumerate(s):
            prob += pulp.lpSum(vs) == 1, f"one_{c}"
        return prob, s

    def _edge_terms(self, prob, s) -> tuple[list, list]:
        """Edge variables with their transport constraints; (blocking, overlap) objective terms."""
        blocking, overlap = [], []
        for i, edge in enumerate(self.edges):
            rows, cols = edge.blocking.shape
            e = [
                [pulp.LpVariable(f"e_{i}_{a}_{b}", lowBound=0) for b in range(cols)]
                for a in range(rows)
            ]
            for a in range(rows):
                ks = np.flatnonzero(edge.row_of == a)
                prob += (
                    pulp.lpSum(e[a]) - pulp.lpSum(s[edge.producer][k] for k in ks) == 0,
                    f"row_{i}_{a}",
                )
            for b in range(cols):
                ks = np.flatnonzero(edge.col_of == b)
                prob += (
                    pulp.lpSum(e[a][b] for a in range(rows))
                    - pulp.lpSum(s[edge.consumer][k] for k in ks)
                    == 0,
                    f"col_{i}_{b}",
                )
            for a in range(rows):
                for b in range(cols):
                    if edge.blocking[a, b]:
                        blocking.append((e[a][b], edge.blocking[a, b] * _MICROSECONDS))
                    if edge.overlap[a, b]:
                        overlap.append((e[a][b], edge.overlap[a, b] * _MICROSECONDS))
                        blocking.append(
                            (e[a][b], OVERLAP_PENALTY * edge.overlap[a, b] * _MICROSECONDS)
                        )
        return blocking, overlap

    def _time_problem(self) -> tuple[pulp.LpProblem, list]:
        prob, s = self._base_problem("autopar_step_time")
        blocking, overlap = self._edge_terms(prob, s)
        compute = []
        for c, cost in enumerate(self.costs):
            for k, var in enumerate(s[c]):
                direct = (
                    cost.compute[k]
                    + cost.blocking[k]
                    + OVERLAP_PENALTY * cost.overlap[k]
                    + cost.tie_break[k]
                )
                if direct:
                    blocking.append((var, direct * _MICROSECONDS))
                if cost.compute[k]:
                    compute.append((var, cost.compute[k] * _MICROSECONDS))
                if cost.overlap[k]:
                    overlap.append((var, cost.overlap[k] * _MICROSECONDS))
        exposed = pulp.LpVariable("exposed_overlappable", lowBound=0)
        prob += pulp.LpAffineExpression(blocking) + exposed
        prob += (
            exposed - pulp.LpAffineExpression(overlap) + pulp.LpAffineExpression(compute) >= 0,
            "exposed",
        )
        return prob, s

    def _add_memory_cut(self, prob, s, step: int, bound) -> pulp.LpConstraint:
        per_class, const = self.memory.coefficients(step)
        terms = [
            (s[c][k], coef[k] / _MIB)
            for c, coef in sorted(per_class.items())
            for k in range(len(coef))
            if coef[k]
        ]
        constraint = pulp.LpAffineExpression(terms) + const / _MIB <= bound
        prob += constraint, f"mem_{step}"
        return constraint

    # ------------------------------------------------------------------ solving

    def _solve_highs(self, prob: pulp.LpProblem, time_limit_s: float) -> None:
        """Solve with HiGHS on one thread, seed 0 (module docstring), with its presolve unless
        `presolve` is off. In a thread whose HiGHS scheduler other code started with more
        threads, HiGHS refuses one thread: there it solves with that scheduler, and the plan may
        differ from other machines' (warned once per thread)."""
        from highspy import HighsModelStatus

        options = dict(
            msg=False,
            timeLimit=time_limit_s,
            gapRel=self.relative_gap,
            random_seed=0,
            presolve="choose" if self.presolve else "off",
        )
        if not getattr(_HIGHS_STATE, "refuses_one_thread", False):
            prob.solve(pulp.HiGHS(threads=1, **options))
            if prob.solverModel.getModelStatus() != HighsModelStatus.kNotset:
                return
            _HIGHS_STATE.refuses_one_thread = True
            logger.warning(
                "HiGHS refuses to solve on one thread here (other code in this thread started "
                "it with another thread count); solving on its threads, so plans may differ "
                "from runs on other machines"
            )
        prob.solve(pulp.HiGHS(**options))

    def _solve(
        self, prob: pulp.LpProblem, s, time_limit_s: float
    ) -> tuple[np.ndarray, bool] | None:
        if self.solver == "highs":
            self._solve_highs(prob, time_limit_s)
        else:
            with warnings.catch_warnings():  # PuLP 3.x warns about its bundled CBC's future
                warnings.simplefilter("ignore", DeprecationWarning)
                solver = pulp.PULP_CBC_CMD(
                    msg=False, timeLimit=time_limit_s, gapRel=self.relative_gap
                )
            prob.solve(solver)
        if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return None
        choices = np.array([int(np.argmax([v.varValue or 0.0 for v in vs])) for vs in s])
        return choices, prob.sol_status == pulp.LpSolutionOptimal

    def _cut_loop(
        self,
        prob,
        s,
        fits: Callable[[np.ndarray, np.ndarray], bool],
        bound,
        cut: dict[int, pulp.LpConstraint],
        escalate: bool,
        deadline: float | None = None,
    ):
        """Solve, adding memory cuts (into `cut`, by step) at the worst steps until `fits`;
        None if infeasible.

        The rounds share the time until `deadline` (default: `time_limit_s` from now); a round
        past it still gets `_LATE_ROUND_SHARE` of the limit (the full limit again where that
        finds no plan at all), so the limit bounds a solve, not each of its rounds.

        Most plans fit after a few cuts. Where the peak keeps moving from step to step, a
        budgeted solve stops after `_MAX_CUT_ROUNDS` (`_CutsDidNotSettle`); with `escalate` the
        cuts per round double every few rounds after that instead, so within O(log steps) more
        rounds every step is cut, the solution meets every step's constraint, and the loop
        ends. (Many cuts at once slow each solve, so the first rounds add few.)"""
        optimal = True
        if deadline is None:
            deadline = time.perf_counter() + self.time_limit_s
        for rounds in itertools.count(1):
            late = self.time_limit_s * _LATE_ROUND_SHARE
            began = time.perf_counter()
            result = self._solve(prob, s, max(deadline - began, late))
            if result is None and prob.sol_status == pulp.LpSolutionNoSolutionFound:
                result = self._solve(prob, s, self.time_limit_s)  # out of time before any plan
            logger.debug(
                "memory-cut round %d (%d cuts): %s in %.2f s",
                rounds,
                len(cut),
                "no plan" if result is None else "optimal" if result[1] else "time limit hit",
                time.perf_counter() - began,
            )
            if result is None:
                return None
            choices, opt = result
            optimal = optimal and opt
            per_step = self.memory.evaluate(choices)
            worst = [int(t) for t in np.argsort(-per_step, kind="stable") if int(t) not in cut]
            if fits(choices, per_step) or not worst:  # no step left uncut: fits up to rounding
                return choices, optimal, rounds
            if rounds >= _MAX_CUT_ROUNDS and not escalate:
                raise _CutsDidNotSettle
            doublings = max(0, rounds - _MAX_CUT_ROUNDS) // _ROUNDS_PER_DOUBLING
            width = _CUTS_PER_ROUND << doublings
            for step in worst[:width]:
                cut[step] = self._add_memory_cut(prob, s, step, bound)

    def solve(
        self,
        budget_bytes: float,
        deadline: float | None = None,
        forbidden: Mapping[int, Sequence[int]] | None = None,
    ) -> Solution | None:
        """The least-time choices whose memory fits `budget_bytes` per device; None if none do.
        Its rounds share the time until `deadline` (`time.perf_counter()`; default: the time
        limit from now). `forbidden[c]`: choices of class c left out of this solve.

        Solving again with a budget no larger reuses the model and the cuts found so far."""
        start = time.perf_counter()
        if self._time is None or budget_bytes > self._budget:
            self._time, self._cuts = self._time_problem(), {}
        prob, s = self._time
        for constraint in self._cuts.values():  # the same cuts, at the new bound
            constraint.constant += (self._budget - budget_bytes) / _MIB
        self._budget = budget_bytes
        left_out = [s[c][k] for c, ks in (forbidden or {}).items() for k in ks]
        for var in left_out:
            var.upBound = 0
        try:
            result = self._cut_loop(
                prob,
                s,
                lambda _, per_step: per_step.max() <= budget_bytes,
                budget_bytes / _MIB,
                self._cuts,
                escalate=False,
                deadline=deadline,
            )
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
        finally:
            for var in left_out:
                var.upBound = 1
        if result is None:
            return None
        choices, optimal, rounds = result
        if not optimal:  # the caller warns where the plan is one a user gets
            logger.debug("the sharding ILP hit its time limit (%.3g s)", self.time_limit_s)
        return Solution(choices, optimal, time.perf_counter() - start, rounds)

    def least_memory(self) -> float:
        """The least peak memory per device over all choices (bytes), ignoring step time."""
        return float(self.memory.evaluate(self.least_memory_choices()).max())

    def least_memory_choices(self) -> np.ndarray:
        """The choices (per class) of least peak memory per device, ignoring step time."""
        prob, s = self._base_problem("autopar_least_memory")
        peak = pulp.LpVariable("peak_mib", lowBound=0)
        prob += peak
        result = self._cut_loop(
            prob,
            s,
            lambda _, per_step: per_step.max() / _MIB <= peak.varValue + 1e-6,
            peak,
            {},
            escalate=True,
        )
        if result is None:
            raise InfeasibleError("the sharding ILP has no solution even without a memory budget")
        return result[0]
