"""Re-trace a step's jaxpr on a concrete mesh, enforcing a stage plan's shardings as it goes.

The interpreter walks the canonical jaxpr eqn by eqn (node ids as in `planner.graph`), binds each
primitive again, and adds what the plan asks for: `with_sharding_constraint` on planned outputs and
on parameter uses, and explicit partial sums (`shard_map`) for nodes that sum a gradient over the
batch: reduce-scattered per micro-batch, or kept `Unreduced` (each device's own partial sums) so
that gradient accumulation adds them up locally and reduces once per step (`reduce_partial_sums`).
An unreduced value passes through layout ops and sums on its way to the gradient boundary; any
other reader gets it reduced. Differentiated `checkpoint` eqns are re-emitted with their original
remat parameters so XLA still recomputes (e.g. re-gathers parameters) in the backward pass, their
bodies reading their operands pinned as planned (`evaluate_eqns`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.planner._compat import bind_checkpoint
from autopar.planner.graph import inlined_body, is_checkpoint
from autopar.planner.markers import grad_boundary_p, param_use_p
from autopar.planner.plan import MeshPlan, PartialSumLowering, Spec, StagePlan

logger = logging.getLogger(__name__)
# Ops linear in their one operand: applied to each device's partial sums, they commute with the
# sum over devices (what a gradient passes through between its matmul and the boundary).
_LINEAR_UNARY = frozenset(
    {"convert_element_type", "copy", "copy_p", "transpose", "reshape", "squeeze", "expand_dims"}
    | {"reduce_sum"}
)


def partition_spec(spec: Spec) -> PartitionSpec:
    """A plan spec as a jax PartitionSpec."""
    return PartitionSpec(*(None if e is None else (e[0] if len(e) == 1 else e) for e in spec))


def build_mesh(mesh_plan: MeshPlan, devices: Sequence[jax.Device]) -> Mesh:
    """The jax Mesh of a planned mesh over the run's device list."""
    if max(mesh_plan.device_indices) >= len(devices):
        raise ValueError(
            f"the plan needs {max(mesh_plan.device_indices) + 1} devices but only "
            f"{len(devices)} are available"
        )
    grid = np.array([devices[i] for i in mesh_plan.device_indices], dtype=object)
    return Mesh(grid.reshape(mesh_plan.shape), mesh_plan.axis_names)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """What the interpreter enforces: a stage's plan bound to a concrete mesh."""

    mesh: Mesh
    param_use: Mapping[int, NamedSharding]
    node_outputs: Mapping[str, tuple[NamedSharding | None, ...]]
    node_inputs: Mapping[str, tuple[NamedSharding | None, ...]]
    partial_sums: Mapping[str, PartialSumLowering]

    @classmethod
    def from_stage(cls, stage: StagePlan, mesh: Mesh) -> ShardingRules:
        def named(spec: Spec | None) -> NamedSharding | None:
            return None if spec is None else NamedSharding(mesh, partition_spec(spec))

        return cls(
            mesh=mesh,
            param_use={i: named(s) for i, s in stage.param_use_specs.items()},
            node_outputs={
                k: tuple(named(s) for s in v) for k, v in stage.node_output_specs.items()
            },
            node_inputs={k: tuple(named(s) for s in v) for k, v in stage.node_input_specs.items()},
            partial_sums=dict(stage.partial_sums),
        )


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Bind an eqn's primitive on new operands; always returns a list of outputs."""
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


@dataclasses.dataclass(frozen=True)
class Unreduced:
    """Partial sums not yet reduced over the mesh `axes`: device i of those axes holds its own in
    `stacked[i]`, so the global array has one more (leading) dim, split over `axes`."""

    stacked: jax.Array
    axes: tuple[str, ...]

    def map(self, fn: Any) -> Unreduced:
        return Unreduced(fn(self.stacked), self.axes)


jax.tree_util.register_dataclass(Unreduced, data_fields=["stacked"], meta_fields=["axes"])


def _entries(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    """A PartitionSpec as one tuple of axis names per dim (empty: not split)."""
    padded = [*spec, *([None] * (ndim - len(spec)))]
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in padded]


def _pspec(entries: Iterable[tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


def _stacked_spec(entries: Sequence[tuple[str, ...]], axes: tuple[str, ...]) -> PartitionSpec:
    """The spec of the stacked partial sums of a value laid out as `entries` once reduced."""
    return _pspec([axes, *(tuple(a for a in e if a not in axes) for e in entries)])


def stacked_sharding(sharding: NamedSharding, value: Unreduced) -> NamedSharding:
    """Where `value`'s stacked partial sums go so that reducing them yields `sharding`."""
    entries = _entries(sharding.spec, value.stacked.ndim - 1)
    return NamedSharding(sharding.mesh, _stacked_spec(entries, value.axes))


def _partial_sum(
    eqn: JaxprEqn, invals: Sequence[Any], lowering: PartialSumLowering, mesh: Mesh
) -> Any:
    """Compute `eqn` on local shards and sum the partial results as the lowering says: a
    reduce-scatter now, or (`once_per_step`) left `Unreduced` for the accumulation to reduce."""
    axes, once = lowering.partial_axes, lowering.once_per_step
    is_scatter = eqn.primitive.name in ("scatter-add", "scatter_add")
    out_entries = _entries(partition_spec(lowering.output_spec), len(lowering.output_spec))

    def local(*xs):
        if is_scatter:  # the base operand must be added once, not once per device
            first = once & (jax.lax.axis_index(axes) == 0)
            xs = (jnp.where(first, xs[0], jnp.zeros_like(xs[0])), *xs[1:])
        (partial,) = bind_eqn(eqn, xs)
        if once:
            return partial[None]
        out_dim = next(d for d, e in enumerate(out_entries) if e and set(axes) <= set(e))
        return jax.lax.psum_scatter(partial, axes, scatter_dimension=out_dim, tiled=True)

    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(partition_spec(s) for s in lowering.operand_specs),
        out_specs=_stacked_spec(out_entries, axes) if once else _pspec(out_entries),
        check_vma=False,
    )(*invals)
    if once:
        return Unreduced(out, axes)
    return out + invals[0] if is_scatter else out


def reduce_partial_sums(value: Unreduced, sharding: NamedSharding | None, mesh: Mesh) -> jax.Array:
    """Sum `value` over its axes into `sharding`: reduce-scattered onto each dim that `sharding`
    splits over some of those axes (as its minor axes), all-reduced over the others."""
    axes, ndim = value.axes, value.stacked.ndim - 1
    entries = _entries(sharding.spec, ndim) if sharding is not None else [()] * ndim
    scatter: dict[int, tuple[str, ...]] = {}
    for d, e in enumerate(entries):
        summed = tuple(a for a in e if a in axes)
        if summed and e[len(e) - len(summed) :] == summed:
            scatter[d] = summed
    kept = [
        e if d in scatter else tuple(a for a in e if a not in axes) for d, e in enumerate(entries)
    ]
    rest = tuple(a for a in axes if all(a not in s for s in scatter.values()))

    def local(x):
        x = x[0]
        for d, summed in scatter.items():
            x = jax.lax.psum_scatter(x, summed, scatter_dimension=d, tiled=True)
        return jax.lax.psum(x, rest) if rest else x

    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=_stacked_spec(entries, axes),
        out_specs=_pspec(kept),
        check_vma=False,
    )(value.stacked)
    return constrain(out, sharding)


def _on_partial_sums(eqn: JaxprEqn, invals: Sequence[Any], mesh: Mesh) -> list[Any]:
    """An eqn that reads unreduced partial sums: passed on unreduced where that is exact (the
    gradient boundary, linear layout ops, sums of partial sums over the same axes), else
    reduced first."""
    partial = [x for x in invals if isinstance(x, Unreduced)]
    if eqn.primitive is grad_boundary_p:
        return list(invals)
    if eqn.primitive.name in _LINEAR_UNARY and len(invals) == 1:
        return [invals[0].map(jax.vmap(lambda x: bind_eqn(eqn, [x])[0]))]
    if (
        eqn.primitive.name == "add_any"
        and len(partial) == len(invals)
        and len({x.axes for x in partial}) == 1
    ):
        return [Unreduced(partial[0].stacked + partial[1].stacked, partial[0].axes)]
    logger.warning(
        "%s reads partial sums that the plan meant to reduce once per step; they are reduced "
        "per micro-batch instead",
        eqn.primitive.name,
    )
    invals = [reduce_partial_sums(x, None, mesh) if isinstance(x, Unreduced) else x for x in invals]
    return bind_eqn(eqn, invals)


def constrain(value: Any, sharding: NamedSharding | None) -> Any:
    """`value` pinned to `sharding` (unreduced partial sums: to where they reduce into it)."""
    if sharding is None:
        return value
    if isinstance(value, Unreduced):
        target = stacked_sharding(sharding, value)
        return value.map(lambda x: jax.lax.with_sharding_constraint(x, target))
    return jax.lax.with_sharding_constraint(value, sharding)


def evaluate_eqn(
    path: str,
    eqn: JaxprEqn,
    invals: Sequence[Any],
    rules: ShardingRules,
    operand_shardings: Sequence[NamedSharding | None] | None = None,
) -> list:
    """Evaluate one eqn (node id `path`) with the plan's rules applied; a checkpoint's body
    reads its operands pinned to `operand_shardings` (None: as they come)."""
    resharded = rules.node_inputs.get(path)
    if resharded:
        invals = [constrain(x, s) for x, s in zip(invals, resharded, strict=True)]
    if eqn.primitive is param_use_p:
        outs = [constrain(invals[0], rules.param_use.get(eqn.params["index"]))]
    elif is_checkpoint(eqn):
        body = eqn.params["jaxpr"]
        pins = operand_shardings or [None] * len(invals)

        def run_body(*args: Any) -> list[Any]:
            pinned = [constrain(x, s) for x, s in zip(args, pins, strict=True)]
            return evaluate_jaxpr(body, (), pinned, rules, f"{path}/")

        outs = bind_checkpoint(run_body, invals, eqn.params)
    elif (body := inlined_body(eqn)) is not None:
        outs = evaluate_jaxpr(body[0], body[1], invals, rules, f"{path}/")
    elif any(isinstance(x, Unreduced) for x in invals):
        outs = _on_partial_sums(eqn, invals, rules.mesh)
    elif path in rules.partial_sums:
        outs = [_partial_sum(eqn, invals, rules.partial_sums[path], rules.mesh)]
    else:
        outs = bind_eqn(eqn, invals)
    specs = rules.node_outputs.get(path)
    if specs:
        outs = [constrain(o, s) for o, s in zip(outs, specs, strict=True)]
    return outs


def read(env: Mapping[Any, Any], var: Any) -> Any:
    return var.val if isinstance(var, Literal) else env[var]


def free_vars(eqns: Iterable[tuple[str, JaxprEqn]]) -> list[Var]:
    """Variables the (path, eqn) pairs read that they do not define, in first-read order."""
    eqns = list(eqns)
    inner = {v for _, e in eqns for v in e.outvars}
    return list(
        dict.fromkeys(v for _, e in eqns for v in e.invars if isinstance(v, Var) and v not in inner)
    )


def evaluate_eqns(
    eqns: Iterable[tuple[str, JaxprEqn]], env: dict[Any, Any], rules: ShardingRules
) -> None:
    """Evaluate (path, eqn) pairs in order, reading and writing variables in `env`.

    A checkpoint's body reads the operands made here pinned as the plan pins them: a reshard
    inside the body otherwise propagates onto the operand, and XLA hands the resharded copy to
    the operand's other readers there and partitions them to match (a weight gradient computed
    on a batch-split image and all-reduced, where the plan computes it whole)."""
    pinned: dict[Var, NamedSharding] = {}
    for path, eqn in eqns:
        operand_shardings = None
        if is_checkpoint(eqn):
            operand_shardings = [pinned.get(v) if isinstance(v, Var) else None for v in eqn.invars]
        invals = [read(env, v) for v in eqn.invars]
        outs = evaluate_eqn(path, eqn, invals, rules, operand_shardings)
        env.update(zip(eqn.outvars, outs, strict=True))
        specs = rules.node_outputs.get(path, ())
        if len(specs) == len(eqn.outvars):
            pinned.update((v, s) for v, s in zip(eqn.outvars, specs, strict=True) if s)


def evaluate_jaxpr(
    jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], rules: ShardingRules, prefix: str = ""
) -> list[Any]:
    """Evaluate a whole jaxpr whose eqns have node ids `prefix + index`."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    evaluate_eqns(((f"{prefix}{i}", e) for i, e in enumerate(jaxpr.eqns)), env, rules)
    return [read(env, v) for v in jaxpr.outvars]
