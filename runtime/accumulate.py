"""Gradient accumulation: run the gradient part of a step once per micro-batch, apply once.

The step's jaxpr is split at the `autopar_grad_boundary` marker. The eqns the boundary depends on
run inside a `lax.scan` over micro-batches; the boundary's outputs (loss, aux, gradients) are
averaged over micro-batches (the loss is assumed to be a mean over the batch, as in Alpa); the rest
of the step (the optimizer update) runs once on the averages. Non-float outputs (counters) keep the
last micro-batch's value.

Micro-batch j holds examples j, j+k, j+2k, ... of the batch. Strided micro-batches are local slices
of a batch split over devices along dim 0, so forming them moves no data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal
from jax.sharding import NamedSharding

from autopar.markers import grad_boundary_p
from autopar.planner.errors import PlanningError
from autopar.planner.micro_batches import describe_eqn
from autopar.runtime.interpreter import (
    ShardingRules,
    constrain,
    evaluate_eqns,
    evaluate_jaxpr,
    read,
)

Eqns = list[tuple[str, JaxprEqn]]


@dataclasses.dataclass(frozen=True)
class GradSplit:
    """A step's top-level eqns split into the per-micro-batch part, the boundary, and the rest."""

    per_micro_batch: Eqns
    boundary: tuple[str, JaxprEqn]
    apply: Eqns


def _backward_slice(roots: Sequence[Any], producer: dict[Any, int], eqns: Eqns) -> set[int]:
    """Indices of the eqns that the variables `roots` are computed from."""
    found: set[int] = set()
    stack = [v for v in roots if not isinstance(v, Literal)]
    while stack:
        i = producer.get(stack.pop())
        if i is not None and i not in found:
            found.add(i)
            stack.extend(v for v in eqns[i][1].invars if not isinstance(v, Literal))
    return found


def split_at_grad_boundary(closed: ClosedJaxpr, batch_inputs: Sequence[int]) -> GradSplit:
    """Split the step; values computed from the batch may reach the rest only via the boundary."""
    eqns = [(str(i), e) for i, e in enumerate(closed.jaxpr.eqns)]
    boundaries = [i for i, (_, e) in enumerate(eqns) if e.primitive is grad_boundary_p]
    if len(boundaries) != 1:
        raise PlanningError(
            "num_micro_batches > 1 needs exactly one autopar.grad / autopar.value_and_grad call at "
            f"the top level of the train step to know where gradients are computed; found "
            f"{len(boundaries)}. Use autopar.grad instead of jax.grad."
        )
    b = boundaries[0]
    producer = {v: i for i, (_, e) in enumerate(eqns) if i != b for v in e.outvars}
    per_micro_batch = _backward_slice(eqns[b][1].invars, producer, eqns)
    apply = _backward_slice(closed.jaxpr.outvars, producer, eqns)

    from_batch = {closed.jaxpr.invars[i] for i in batch_inputs}
    for i, (_, e) in enumerate(eqns):
        if i != b and any(v in from_batch for v in e.invars if not isinstance(v, Literal)):
            if i in apply:
                raise PlanningError(
                    f"with num_micro_batches > 1, {describe_eqn(e)} uses a value computed "
                    "from the batch after the gradient computation; return that value from the "
                    "loss function as aux (has_aux=True) so it is accumulated"
                )
            from_batch.update(e.outvars)
    return GradSplit(
        per_micro_batch=[eqns[i] for i in sorted(per_micro_batch)],
        boundary=eqns[b],
        apply=[eqns[i] for i in sorted(apply)],
    )


def _micro_batches(x: Any, k: int, sharding: NamedSharding | None) -> Any:
    """(B, ...) → (k, B/k, ...) where slice j holds rows j, j+k, ... (a local reshape)."""
    stacked = jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)
    if sharding is None:
        return stacked
    spec = sharding.spec
    return constrain(stacked, NamedSharding(sharding.mesh, type(spec)(None, *spec)))


def accumulating_step(
    closed: ClosedJaxpr,
    rules: ShardingRules,
    batch_inputs: Sequence[int],
    batch_shardings: Sequence[NamedSharding | None],
    num_micro_batches: int,
) -> Callable[..., tuple[Any, ...]]:
    """The step as a flat function that accumulates gradients over `num_micro_batches`."""
    if num_micro_batches == 1:
        return lambda *args: tuple(evaluate_jaxpr(closed.jaxpr, closed.consts, args, rules))
    split = split_at_grad_boundary(closed, batch_inputs)
    k = num_micro_batches
    jaxpr = closed.jaxpr
    boundary_path, boundary_eqn = split.boundary
    carry_specs = rules.node_outputs.get(boundary_path) or (None,) * len(boundary_eqn.outvars)

    def step(*args):
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        batch_vars = [jaxpr.invars[i] for i in batch_inputs]
        xs = [
            _micro_batches(args[i], k, s)
            for i, s in zip(batch_inputs, batch_shardings, strict=True)
        ]

        def body(carry, micro_batch):
            local = dict(env)
            local.update(zip(batch_vars, micro_batch, strict=True))
            evaluate_eqns([*split.per_micro_batch, split.boundary], local, rules)
            outs = [read(local, v) for v in boundary_eqn.outvars]
            new = [
                c + o if jnp.issubdtype(o.dtype, jnp.inexact) else o
                for c, o in zip(carry, outs, strict=True)
            ]
            return [constrain(x, s) for x, s in zip(new, carry_specs, strict=True)], None

        init = [
            constrain(jnp.zeros(v.aval.shape, v.aval.dtype), s)
            for v, s in zip(boundary_eqn.outvars, carry_specs, strict=True)
        ]
        totals, _ = jax.lax.scan(body, init, xs)
        means = [t / k if jnp.issubdtype(t.dtype, jnp.inexact) else t for t in totals]
        env.update(zip(boundary_eqn.outvars, means, strict=True))
        evaluate_eqns(split.apply, env, rules)
        return tuple(read(env, v) for v in jaxpr.outvars)

    return step
