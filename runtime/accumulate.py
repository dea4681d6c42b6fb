"""Gradient accumulation: run the gradient part of a step once per micro-batch, apply once.

The step's jaxpr is split at the `autopar_grad_boundary` marker. The eqns the boundary depends on
run inside a `lax.scan` over micro-batches; the boundary's outputs (loss, aux, gradients) are
averaged over micro-batches (the loss is assumed to be a mean over the batch, as in Alpa); the rest
of the step (the optimizer update) runs once on the averages. Non-float outputs (counters) keep the
last micro-batch's value. Gradients the plan reduces once per step are carried through the loop as
each device's unreduced partial sums and reduced after it: one collective per step, not k.

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

from autopar.planner.errors import PlanningError
from autopar.planner.markers import grad_boundary_p
from autopar.planner.micro_batches import describe_eqn
from autopar.runtime.interpreter import (
    ShardingRules,
    Unreduced,
    constrain,
    evaluate_eqns,
    evaluate_jaxpr,
    free_vars,
    read,
    reduce_partial_sums,
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


def _zeros_like(shape: Any, sharding: NamedSharding | None) -> Any:
    """A zero accumulator shaped like `shape` (an array's or unreduced partial sums')."""
    return constrain(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shape), sharding)


def add_micro_batch(total: Any, value: Any) -> Any:
    """Accumulate one micro-batch's boundary output: floats (and partial sums) add up, other
    values (counters) keep the latest."""
    if isinstance(value, Unreduced):
        return Unreduced(total.stacked + value.stacked, value.axes)
    return total + value if jnp.issubdtype(value.dtype, jnp.inexact) else value


def mean_over_micro_batches(total: Any, k: int, sharding: NamedSharding | None, mesh) -> Any:
    """The mean of an accumulated output; partial sums are reduced here, once per step."""
    if isinstance(total, Unreduced):
        total = reduce_partial_sums(total, sharding, mesh)
    return total / k if jnp.issubdtype(total.dtype, jnp.inexact) else total


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
        step_inputs = [
            v for v in free_vars(split.per_micro_batch) if v in env and v not in batch_vars
        ]
        xs = [
            _micro_batches(args[i], k, s)
            for i, s in zip(batch_inputs, batch_shardings, strict=True)
        ]

        def micro_batch_outputs(micro_batch):
            # Tied to the micro-batch, the step's other inputs are not loop-invariant: XLA
            # cannot hoist per-micro-batch work on them (an FSDP parameter gather) out of the
            # loop and keep its result alive through it, which is what the plan prices.
            tied, micro_batch = jax.lax.optimization_barrier(
                ([env[v] for v in step_inputs], micro_batch)
            )
            # Stored as planned: unpinned, XLA would lay a micro-batch out as its first reader
            # wants and then regather it for the others (in the backward pass).
            micro_batch = [
                constrain(x, s) for x, s in zip(micro_batch, batch_shardings, strict=True)
            ]
            local = dict(env)
            local.update(zip(step_inputs, tied, strict=True))
            local.update(zip(batch_vars, micro_batch, strict=True))
            evaluate_eqns([*split.per_micro_batch, split.boundary], local, rules)
            return [read(local, v) for v in boundary_eqn.outvars]

        def body(carry, micro_batch):
            outs = micro_batch_outputs(micro_batch)
            new = [add_micro_batch(c, o) for c, o in zip(carry, outs, strict=True)]
            return [constrain(x, s) for x, s in zip(new, carry_specs, strict=True)], None

        if any(lowering.once_per_step for lowering in rules.partial_sums.values()):
            # Which outputs are unreduced partial sums (and their shapes) shows when traced.
            shapes = jax.eval_shape(micro_batch_outputs, [x[0] for x in xs])
        else:
            shapes = [v.aval for v in boundary_eqn.outvars]
        init = [_zeros_like(x, s) for x, s in zip(shapes, carry_specs, strict=True)]
        totals, _ = jax.lax.scan(body, init, xs)
        means = [
            mean_over_micro_batches(t, k, s, rules.mesh)
            for t, s in zip(totals, carry_specs, strict=True)
        ]
        env.update(zip(boundary_eqn.outvars, means, strict=True))
        evaluate_eqns(split.apply, env, rules)
        return tuple(read(env, v) for v in jaxpr.outvars)

    return step
