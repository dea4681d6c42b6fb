"""Every difference between the dependency versions autopar supports, behind named helpers.

Supported: jax/jaxlib 0.10–0.12 and PuLP 3–4. Nothing else in autopar checks a version or
reaches into `jax._src`. Needed for:

* a scan's operand layout: ``num_consts``/``num_carry`` until jax 0.11, a flat tree
  ``ft_in = (consts, carry, xs)`` from 0.12;
* re-emitting a differentiated `checkpoint` (remat) eqn with its original parameters: the public
  `jax.checkpoint` always records ``differentiated=False``, and only differentiated remats get
  the optimization barrier that stops XLA from merging the backward recomputation with the
  forward pass;
* naming the user's source line of an eqn in errors, and a single-device sharding;
* PuLP's model API (PuLP 4 has a new core: variables come from the problem, expressions from
  factory methods) and its CBC, bundled until PuLP 3 and the ``pulp[cbc]`` extra's from 4.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import pulp
from jax._src.ad_checkpoint import remat_p
from jax._src.interpreters.partial_eval import convert_constvars_jaxpr

logger = logging.getLogger(__name__)

# What a rule reading an eqn's parameters raises when a jax release renamed or reshaped them.
PARAM_LAYOUT_ERRORS = (KeyError, TypeError, ValueError, IndexError)
_warned_layouts: set[tuple[str, str]] = set()


class UnknownParamLayout(KeyError):
    """An eqn's parameters are laid out in a way no supported jax release uses."""


def warn_unknown_params(primitive: str, what: str, error: Exception) -> None:
    """Log, once per primitive and use, that `primitive`'s parameters could not be read for
    `what` and a safe fallback is used instead."""
    if (primitive, what) not in _warned_layouts:
        _warned_layouts.add((primitive, what))
        logger.warning(
            "cannot read the parameters of primitive %r on jax %s (%s: %s); its %s falls back "
            "to a safe default. Report this with your jax version.",
            primitive,
            jax.__version__,
            type(error).__name__,
            error,
            what,
        )


def scan_operand_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """How many of a `scan` eqn's operands are consts and how many carries (the rest are xs)."""
    if "num_consts" in params and "num_carry" in params:  # jax <= 0.11
        return params["num_consts"], params["num_carry"]
    flat_tree = params.get("ft_in")
    if flat_tree is not None and hasattr(flat_tree, "unpack"):  # jax 0.12: (consts, carry, xs)
        consts, carry, _ = flat_tree.unpack()
        return len(consts), len(carry)
    raise UnknownParamLayout(f"scan params {sorted(params)} name neither num_consts nor ft_in")


def single_device_sharding(device: jax.Device) -> jax.sharding.Sharding:
    """A sharding that places an array whole on `device` (jax 0.12 deprecates building
    `SingleDeviceSharding` directly for `make_single_device_sharding`)."""
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    return make(device) if make is not None else jax.sharding.SingleDeviceSharding(device)


def bind_checkpoint(
    body: Callable[..., Sequence[Any]], args: Sequence[Any], params: dict[str, Any]
) -> list[Any]:
    """Trace `body` over `args` and bind it as a `checkpoint` eqn with the given remat params.

    Arguments and results may be pytrees of arrays (unreduced partial sums are)."""
    flat, in_tree = jax.tree.flatten(list(args))
    closed, out_shape = jax.make_jaxpr(
        lambda *a: list(body(*jax.tree.unflatten(in_tree, a))), return_shape=True
    )(*flat)
    jaxpr = convert_constvars_jaxpr(closed.jaxpr)
    new_params = {k: v for k, v in params.items() if k != "jaxpr"}
    outs = remat_p.bind(*closed.consts, *flat, jaxpr=jaxpr, **new_params)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def source_line(eqn: Any) -> str | None:
    """The user's source line that created `eqn` ("file.py:12 (fn)"), where JAX recorded it."""
    from jax._src import source_info_util

    summary = source_info_util.summarize(eqn.source_info)
    return None if not summary or summary.startswith("unknown") else summary


def pulp_variable(
    prob: pulp.LpProblem, name: str, low: float | None, high: float | None, integer: bool
) -> Any:
    """A new variable of `prob` (None bounds: unbounded)."""
    return prob.add_variable(
        name, lowBound=low, upBound=high, cat=pulp.LpInteger if integer else pulp.LpContinuous
    )


def pulp_sum(terms: Iterable[tuple[Any, float]]) -> Any:
    """The affine expression Σ coefficient · variable over `terms` of (variable, coefficient)."""
    terms = list(terms)
    if hasattr(pulp.LpAffineExpression, "from_list"):  # PuLP 4
        return pulp.LpAffineExpression.from_list(terms)
    return pulp.LpAffineExpression(terms)


def solve_cbc(prob: pulp.LpProblem, **options: Any) -> str | None:
    """Solve `prob` with PuLP's CBC given `options` (PULP_CBC_CMD's keywords): "optimal"
    (within the gap asked), "feasible" (stopped early with a solution), "no_solution" (stopped
    early without one) or "infeasible"; None where no CBC is installed."""
    with warnings.catch_warnings():  # PuLP 3.x warns about its bundled CBC's future
        warnings.simplefilter("ignore", DeprecationWarning)
        bundled = getattr(pulp, "PULP_CBC_CMD", None)  # PuLP <= 3
        solver = (bundled or pulp.COIN_CMD)(**options)
    if not solver.available():
        return None
    stats = prob.solve(solver)
    if bundled is not None:
        return {
            pulp.LpSolutionOptimal: "optimal",
            pulp.LpSolutionIntegerFeasible: "feasible",
            pulp.LpSolutionNoSolutionFound: "no_solution",
        }.get(prob.sol_status, "infeasible")
    done = (pulp.LpSolveStatus.Optimal, pulp.LpSolveStatus.GapLimit)  # PuLP 4: why it stopped
    if stats.has_solution:
        return "optimal" if stats.status in done else "feasible"
    infeasible = (pulp.LpSolveStatus.Infeasible, pulp.LpSolveStatus.Unbounded)
    return "infeasible" if stats.status in infeasible else "no_solution"
