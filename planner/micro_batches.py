"""What a step computes per micro-batch, for steps that accumulate gradients over micro-batches.

Gradient accumulation and pipelining run the part of the step that the gradient boundary
(`autopar.grad`) depends on once per micro-batch, and the rest once on the averaged boundary
outputs. A step may read its batch outside the loss too: token weights computed before the
gradient call, an accuracy metric computed after it from the batch and the loss's aux logits, as
Flax's example trainers do. `hoist_batch_reads` moves those computations before the boundary, so
that they run per micro-batch like the loss and reach the rest of the step as averaged boundary
outputs, as aux values do; every method then sees a step whose batch reaches the update only
through the boundary.

`check_mean_loss` warns where averaging per micro-batch is not exact: a loss divided by a
batch-dependent count (a weighted mean over padded tokens).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var

from autopar.planner._compat import source_line
from autopar.planner.errors import PlanningError
from autopar.planner.markers import (
    GRAD_BOUNDARY,
    LAYER_BOUNDARY,
    PARAM_USE,
    PIPELINE_BOUNDARY,
    grad_boundary_p,
)

logger = logging.getLogger(__name__)


def _boundary_index(jaxpr: Jaxpr) -> int | None:
    found = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is grad_boundary_p]
    return found[0] if len(found) == 1 else None


def ancestors(roots: Sequence[object], eqns: Sequence[JaxprEqn]) -> set[int]:
    """Indices of the eqns that `roots` are computed from."""
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    found: set[int] = set()
    stack = [v for v in roots if isinstance(v, Var)]
    while stack:
        i = producer.get(stack.pop())
        if i is not None and i not in found:
            found.add(i)
            stack.extend(v for v in eqns[i].invars if isinstance(v, Var))
    return found


def _batch_dependent(jaxpr: Jaxpr, eqns: Sequence[int], batch_inputs: Sequence[int]) -> set:
    """The batch inputs and the outputs of `eqns` (in order) computed from them."""
    dependent = {jaxpr.invars[i] for i in batch_inputs}
    for i in eqns:
        eqn = jaxpr.eqns[i]
        if any(isinstance(v, Var) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return dependent


def describe_eqn(eqn: JaxprEqn) -> str:
    """`'primitive'`, with the user's source line where JAX recorded it."""
    line = source_line(eqn)
    return f"'{eqn.primitive}'" + (f" at {line}" if line else "")


def hoist_batch_reads(
    closed: ClosedJaxpr, batch_inputs: Sequence[int], input_paths: Sequence[str]
) -> ClosedJaxpr:
    """`closed` with the batch-reading computations outside the gradient moved before the
    gradient boundary (see the module docstring); unchanged if there are none or if the step
    has no single boundary (the methods that need one say so)."""
    jaxpr = closed.jaxpr
    b = _boundary_index(jaxpr)
    if b is None:
        return closed
    eqns, boundary = jaxpr.eqns, jaxpr.eqns[b]
    needed = ancestors(boundary.invars, eqns)
    per_micro_batch = _batch_dependent(jaxpr, sorted(needed), batch_inputs)
    value_of = {
        out: inp
        for inp, out, g in zip(
            boundary.invars, boundary.outvars, boundary.params["grad_of"], strict=True
        )
        if g == -1
    }
    readable = {*jaxpr.invars, *jaxpr.constvars, *value_of}
    readable.update(v for e in eqns[:b] for v in e.outvars)
    from_gradients = _from_gradients(jaxpr, b)
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    hoisted: set[int] = set()

    def hoist(i: int) -> bool:
        """Hoist eqn i with the post-boundary eqns it needs; False if it reads a gradient."""
        for v in eqns[i].invars:
            if not isinstance(v, Var) or v in readable:
                continue
            if v in from_gradients or not hoist(producer[v]):
                return False
        hoisted.add(i)
        readable.update(eqns[i].outvars)
        return True

    for i, eqn in enumerate(eqns):
        reads = [v for v in eqn.invars if isinstance(v, Var)]
        if i in needed or i in hoisted or i == b or not any(v in per_micro_batch for v in reads):
            continue
        if not hoist(i):
            paths = _batch_read(eqn, jaxpr, batch_inputs, input_paths, per_micro_batch)
            raise PlanningError(
                f"{describe_eqn(eqn)} reads the batch ({paths}) "
                "together with a value computed from the gradients or the updated state; with "
                "micro-batches the batch is only seen one micro-batch at a time, inside the "
                "gradient computation. Compute it from the batch and the loss's aux outputs only, "
                "or in a separate eval step"
            )
        per_micro_batch.update(eqn.outvars)
    _check_not_per_example(jaxpr, b, hoisted, batch_inputs)
    if not hoisted:
        return closed
    return ClosedJaxpr(_rewrite(jaxpr, b, sorted(hoisted), value_of), closed.consts)


def _check_not_per_example(
    jaxpr: Jaxpr, b: int, hoisted: set[int], batch_inputs: Sequence[int]
) -> None:
    """Values that cross the boundary are averaged over micro-batches: refuse those that hold
    one row per example (a prediction), whose average means nothing."""
    per_example = _per_example(jaxpr, batch_inputs)
    eqns, boundary = jaxpr.eqns, jaxpr.eqns[b]
    needed = ancestors(boundary.invars, eqns)
    later = [e for i, e in enumerate(eqns) if i not in needed and i not in hoisted and i != b]
    read_later = {v for e in later for v in e.invars if isinstance(v, Var)}
    read_later.update(v for v in jaxpr.outvars if isinstance(v, Var))
    crossing = [
        (inp, out)
        for inp, out, g in zip(
            boundary.invars, boundary.outvars, boundary.params["grad_of"], strict=True
        )
        if g == -1
    ]
    crossing += [(v, v) for i in sorted(hoisted) for v in eqns[i].outvars]
    producer = {v: e for e in eqns for v in e.outvars}
    for value, read in crossing:
        if isinstance(value, Var) and value in per_example and read in read_later:
            made_by = describe_eqn(producer[value]) if value in producer else "a batch input"
            raise PlanningError(
                f"{made_by} makes a value with one row per example (shape "
                f"{tuple(value.aval.shape)}) that the step uses after the gradient computation; "
                "with micro-batches such values are averaged over micro-batches, which means "
                "nothing for per-example rows. Reduce it to a metric in the step (a mean or a "
                "sum), or compute it in a separate eval step"
            )


_IDENTITIES = {LAYER_BOUNDARY, GRAD_BOUNDARY, PIPELINE_BOUNDARY, PARAM_USE}
_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}


def _per_example(jaxpr: Jaxpr, batch_inputs: Sequence[int]) -> set:
    """The values whose dim 0 is the batch inputs' dim 0 (one row per example), followed
    forward through the ops that keep it there; other ops end it (a conservative answer)."""
    found = {jaxpr.invars[i] for i in batch_inputs if jaxpr.invars[i].aval.shape}
    for eqn in jaxpr.eqns:
        has = [isinstance(v, Var) and v in found for v in eqn.invars]
        if not any(has):
            continue
        if eqn.primitive.name in _IDENTITIES:
            found.update(o for o, h in zip(eqn.outvars, has, strict=True) if h)
        elif len(eqn.outvars) == 1 and _keeps_dim0(eqn, has):
            found.add(eqn.outvars[0])
    return found


def _keeps_dim0(eqn: JaxprEqn, has: Sequence[bool]) -> bool:
    """Whether `eqn`'s output keeps dim 0 of its per-example operands (`has`) as its dim 0."""
    name, params = eqn.primitive.name, eqn.params
    if not getattr(eqn.outvars[0].aval, "shape", ()):
        return False
    if name in _REDUCTIONS:
        return 0 not in params["axes"]
    if name == "dot_general":
        (lhs_contract, _), (lhs_batch, rhs_batch) = params["dimension_numbers"]
        if has[0]:
            return tuple(lhs_batch[:1]) == (0,) or (not lhs_batch and 0 not in lhs_contract)
        return tuple(rhs_batch[:1]) == (0,)
    if name == "broadcast_in_dim":
        return tuple(params["broadcast_dimensions"][:1]) == (0,)
    if name == "transpose":
        return params["permutation"][0] == 0
    shapes = [getattr(v.aval, "shape", ()) for v, h in zip(eqn.invars, has, strict=True) if h]
    return all(shape[:1] == eqn.outvars[0].aval.shape[:1] for shape in shapes)


def _from_gradients(jaxpr: Jaxpr, b: int) -> set:
    """The gradient outputs of boundary `b` and every value computed from them."""
    boundary = jaxpr.eqns[b]
    grad_of = boundary.params["grad_of"]
    derived = {v for v, g in zip(boundary.outvars, grad_of, strict=True) if g >= 0}
    for eqn in jaxpr.eqns[b + 1 :]:
        if any(isinstance(v, Var) and v in derived for v in eqn.invars):
            derived.update(eqn.outvars)
    return derived


def _batch_read(
    eqn: JaxprEqn,
    jaxpr: Jaxpr,
    batch_inputs: Sequence[int],
    input_paths: Sequence[str],
    per_micro_batch: set,
) -> str:
    """The paths of the batch inputs that `eqn`'s per-micro-batch operands are computed from."""
    roots = [v for v in eqn.invars if isinstance(v, Var) and v in per_micro_batch]
    read = set(roots)
    for i in ancestors(roots, jaxpr.eqns):
        read.update(v for v in jaxpr.eqns[i].invars if isinstance(v, Var))
    return ", ".join(input_paths[i] for i in batch_inputs if jaxpr.invars[i] in read)


def _rewrite(jaxpr: Jaxpr, b: int, hoisted: Sequence[int], value_of: dict) -> Jaxpr:
    """Move the `hoisted` eqns before the boundary `b` (each right after the last producer of
    its operands, so a pipeline runs it where its inputs are) and pass the values that the rest
    of the step reads through the boundary."""
    eqns, boundary = jaxpr.eqns, jaxpr.eqns[b]
    hoisted_set = set(hoisted)
    rest = [e for i, e in enumerate(eqns) if i > b and i not in hoisted_set]
    read_later = {v for e in rest for v in e.invars if isinstance(v, Var)}
    read_later.update(v for v in jaxpr.outvars if isinstance(v, Var))
    exported = [v for i in hoisted for v in eqns[i].outvars if v in read_later]
    # Each eqn before the boundary gets a sort key: (i,) for the one at i, and key + (-n,) for
    # the n-th placed right after the eqn of that key, so the latest placed comes first, as
    # inserting into the list would place it (without a list's O(n) search per hoisted eqn).
    before = [(i,) for i in range(b) if i not in hoisted_set]
    eqn_at = {key: eqns[key[0]] for key in before}
    key_of = {v: key for key in before for v in eqn_at[key].outvars}
    placed_after: collections.Counter = collections.Counter()
    for i in hoisted:
        eqn = eqns[i].replace(
            invars=[value_of.get(v, v) if isinstance(v, Var) else v for v in eqns[i].invars]
        )
        after = max(
            (key_of[v] for v in eqn.invars if isinstance(v, Var) and v in key_of), default=(-1,)
        )
        placed_after[after] += 1
        key = (*after, -placed_after[after])
        eqn_at[key] = eqn
        key_of.update((v, key) for v in eqn.outvars)
    before = [eqn_at[key] for key in sorted(eqn_at)]
    fresh = {v: Var(v.aval) for v in exported}
    new_boundary = boundary.replace(
        invars=[*boundary.invars, *exported],
        outvars=[*boundary.outvars, *(fresh[v] for v in exported)],
        params={
            **boundary.params,
            "grad_of": (*boundary.params["grad_of"], *(-1,) * len(exported)),
        },
    )

    def renamed(vs):
        return [fresh.get(v, v) if isinstance(v, Var) else v for v in vs]

    rest = [e.replace(invars=renamed(e.invars)) for e in rest]
    return jaxpr.replace(eqns=[*before, new_boundary, *rest], outvars=renamed(jaxpr.outvars))


def recompute_for_update(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` where the part after the gradients computes again the values it shares with the
    gradient computation (the dropout key split from the state's key: the loss reads one half,
    the new state keeps the other). Those values do not depend on the batch (else
    `hoist_batch_reads` has moved their readers before the boundary), so recomputing them once
    gives what every micro-batch saw, and a pipeline stage need not keep a micro-batch's value
    for the update."""
    jaxpr = closed.jaxpr
    b = _boundary_index(jaxpr)
    if b is None:
        return closed
    eqns = jaxpr.eqns
    needed = ancestors(eqns[b].invars, eqns)
    in_gradients = {v for i in needed for v in eqns[i].outvars}
    rest = [e for i, e in enumerate(eqns) if i not in needed and i != b]
    shared = [
        v
        for v in (*(v for e in rest for v in e.invars), *jaxpr.outvars)
        if isinstance(v, Var) and v in in_gradients
    ]
    if not shared:
        return closed
    copies = sorted(i for i in ancestors(shared, eqns) if i in needed)
    fresh = {v: Var(v.aval) for i in copies for v in eqns[i].outvars}

    def renamed(vs):
        return [fresh.get(v, v) if isinstance(v, Var) else v for v in vs]

    cloned = [
        eqns[i].replace(invars=renamed(eqns[i].invars), outvars=renamed(eqns[i].outvars))
        for i in copies
    ]
    new_eqns = [
        *(e for i, e in enumerate(eqns[:b]) if i in needed),
        eqns[b],
        *cloned,
        *(e.replace(invars=renamed(e.invars)) for e in rest),
    ]
    return ClosedJaxpr(jaxpr.replace(eqns=new_eqns, outvars=renamed(jaxpr.outvars)), closed.consts)


def check_mean_loss(closed: ClosedJaxpr, batch_inputs: Sequence[int], k: int) -> None:
    """Warn if the loss divides by a count computed from the batch: averaging such a loss per
    micro-batch differs from the full-batch loss (README: losses that are not plain means)."""
    jaxpr = closed.jaxpr
    b = _boundary_index(jaxpr)
    if b is None or k == 1:
        return
    boundary = jaxpr.eqns[b]
    losses = [
        v for v, g in zip(boundary.invars, boundary.params["grad_of"], strict=True) if g == -1
    ][:1]
    loss_eqns = sorted(ancestors(losses, jaxpr.eqns))
    dependent = _batch_dependent(jaxpr, loss_eqns, batch_inputs)
    for i in loss_eqns:
        eqn = jaxpr.eqns[i]
        if eqn.primitive.name != "div" or not isinstance(eqn.invars[1], Var):
            continue
        count = eqn.invars[1]
        if count in dependent and count.aval.shape == ():
            logger.warning(
                "the loss divides by a count computed from the batch (%s): with "
                "num_micro_batches=%d it is averaged over micro-batches, which differs from the "
                "full-batch loss when micro-batches hold different counts. Return the sum and the "
                "count (has_aux=True) and divide the loss and gradients after autopar.grad",
                describe_eqn(eqn),
                k,
            )
            return
