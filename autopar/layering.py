"""Cut a loss function into layers before differentiating it (Alpa's layer construction).

`layered(loss, option)` returns a function with the same signature and values. It traces the loss
to a jaxpr, assigns each eqn to a layer (`planner.layers`: the user's boundary markers or FLOP
clustering) and replays the eqns layer by layer, passing the values that cross into layer k
through an ``autopar_layer_boundary[layer=k]`` marker, and the loss's results through one with
k = the number of layers. Differentiating the result leaves matching
markers on the tangents and cotangents, which is where the step is cut into forward and backward
stages. With rematerialisation each layer runs under `jax.checkpoint`, so the backward pass
recomputes the layer's activations from its inputs instead of keeping them.

A `scan` over layers (`jax.lax.scan` over stacked weights, Flax's `nn.scan`) is one eqn, which no
cut can split; the loss is first replayed with each such scan (one whose body has a heavy op)
unrolled into its iterations, so that its layers can go to different stages. Steps that are not
pipelined keep their scans.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var, jaxprs_in_params

from autopar.options import AutoLayerOption, LayerOption, ManualLayerOption
from autopar.planner._compat import scan_operand_counts
from autopar.planner.layers import (
    HEAVY_PRIMITIVES,
    cluster_layers,
    crossing_values,
    eqn_order,
    manual_layers,
)
from autopar.planner.markers import layer_boundary_p
from autopar.runtime.interpreter import bind_eqn, read


def layer_assignment(closed: ClosedJaxpr, option: LayerOption) -> list[int]:
    """Layer index of each eqn of the loss's jaxpr under `option` (-1: a boundary marker)."""
    if isinstance(option, ManualLayerOption):
        return manual_layers(closed.jaxpr)
    return cluster_layers(closed.jaxpr, option.layer_num)


def _remat(option: LayerOption) -> bool:
    if isinstance(option, AutoLayerOption):
        return option.remat_mode == "coarse_grained"
    return option.remat_layer


def _has_heavy_op(jaxpr: Jaxpr) -> bool:
    return any(
        eqn.primitive.name in HEAVY_PRIMITIVES
        or any(_has_heavy_op(sub) for sub in jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )


def _is_layer_scan(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a scan over layers: one whose body runs a heavy op."""
    return (
        eqn.primitive.name == "scan"
        and eqn.params["length"] > 0
        and _has_heavy_op(eqn.params["jaxpr"].jaxpr)
    )


def _unrolled_scan(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """The results of scan `eqn` on `invals`, computed by running its body once per iteration."""
    n_consts, n_carry = scan_operand_counts(eqn.params)
    body, length = eqn.params["jaxpr"], eqn.params["length"]
    consts, carry, xs = (
        invals[:n_consts],
        invals[n_consts : n_consts + n_carry],
        invals[n_consts + n_carry :],
    )
    ys: list[list[Any]] = [[] for _ in range(length)]
    order = reversed(range(length)) if eqn.params["reverse"] else range(length)
    for i in order:
        outs = jax.core.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *(x[i] for x in xs))
        carry, ys[i] = outs[:n_carry], outs[n_carry:]
    return [*carry, *(jnp.stack(column) for column in zip(*ys, strict=True))]


def _bind_unrolling_scans(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    return _unrolled_scan(eqn, invals) if _is_layer_scan(eqn) else bind_eqn(eqn, invals)


def _scans_unrolled(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
    """`closed` evaluated on `args` with its scans over layers unrolled (module docstring)."""
    env = _inputs_env(closed, args)
    _run_eqns(closed.jaxpr.eqns, env, _bind_unrolling_scans)
    return [read(env, v) for v in closed.jaxpr.outvars]


def _inputs_env(closed: ClosedJaxpr, args: Sequence[Any]) -> dict[Any, Any]:
    env: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(closed.jaxpr.invars, args, strict=True))
    return env


def _run_eqns(
    eqns: Sequence[JaxprEqn],
    env: dict[Any, Any],
    bind: Callable[[JaxprEqn, Sequence[Any]], list[Any]] = bind_eqn,
) -> None:
    for eqn in eqns:
        env.update(zip(eqn.outvars, bind(eqn, [read(env, v) for v in eqn.invars]), strict=True))


def _run_layer_remat(eqns: Sequence[JaxprEqn], env: dict[Any, Any], keep: Sequence[Var]) -> None:
    """Run a layer under `jax.checkpoint`: only its inputs are saved for the backward pass."""
    defined = {v for eqn in eqns for v in eqn.outvars}
    inputs = list(
        dict.fromkeys(
            v for eqn in eqns for v in eqn.invars if isinstance(v, Var) and v not in defined
        )
    )

    @jax.checkpoint
    def layer(*values: Any) -> list[Any]:
        local = dict(zip(inputs, values, strict=True))
        _run_eqns(eqns, local)
        return [local[v] for v in keep]

    env.update(zip(keep, layer(*(env[v] for v in inputs)), strict=True))


def _replay(closed: ClosedJaxpr, layer_of: list[int], remat: bool, args: Sequence[Any]) -> list:
    jaxpr = closed.jaxpr
    env = _inputs_env(closed, args)
    crossing = crossing_values(jaxpr, layer_of)
    layers = eqn_order(jaxpr, layer_of)
    outputs = {v for v in jaxpr.outvars if isinstance(v, Var)}
    for k, eqns in enumerate(layers):
        if k > 0:
            values = layer_boundary_p.bind(*(env[v] for v in crossing[k]), layer=k, kind="forward")
            env.update(zip(crossing[k], values, strict=True))
        if remat:
            later = set(crossing[k + 1]) if k + 1 < len(layers) else set()
            defined = [v for eqn in eqns for v in eqn.outvars]
            _run_layer_remat(eqns, env, [v for v in defined if v in later or v in outputs])
        else:
            _run_eqns(eqns, env)
    # A last boundary on the loss's results ends the last layer's forward pass; its transpose
    # starts the backward pass.
    return layer_boundary_p.bind(
        *(read(env, v) for v in jaxpr.outvars), layer=len(layers), kind="forward"
    )


def layered(fun: Callable, option: LayerOption) -> Callable:
    """`fun` cut into layers with boundary markers between them (see the module docstring)."""

    def run(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        if any(_is_layer_scan(eqn) for eqn in closed.jaxpr.eqns):
            closed = jax.make_jaxpr(lambda *flat: _scans_unrolled(closed, flat))(
                *jax.tree_util.tree_leaves(args)
            )
        layer_of = layer_assignment(closed, option)
        flat = _replay(closed, layer_of, _remat(option), jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), flat)

    return run
