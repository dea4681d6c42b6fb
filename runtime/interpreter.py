"""Re-trace a step's jaxpr on a concrete mesh, enforcing a stage plan's shardings as it goes.

The interpreter walks the canonical jaxpr eqn by eqn (node ids as in `planner.graph`), binds each
primitive again, and adds what the plan asks for: `with_sharding_constraint` on planned outputs and
on parameter uses, and local-compute-then-reduce-scatter (`shard_map` + `psum_scatter`) for nodes
that sum a gradient over the batch. Differentiated `checkpoint` eqns are re-emitted with their
original remat parameters so XLA still recomputes (e.g. re-gathers parameters) in the backward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar._jax_compat import bind_checkpoint
from autopar.markers import param_use_p
from autopar.planner.graph import inlined_body, is_checkpoint
from autopar.planner.plan import MeshPlan, ReduceScatterLowering, Spec, StagePlan


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
    reduce_scatter: Mapping[str, ReduceScatterLowering]

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
            reduce_scatter=dict(stage.reduce_scatter),
        )


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Bind an eqn's primitive on new operands; always returns a list of outputs."""
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _reduce_scatter(
    eqn: JaxprEqn, invals: Sequence[Any], lowering: ReduceScatterLowering, mesh: Mesh
) -> Any:
    """Compute `eqn` on local shards, then reduce-scatter the partial sums (see the lowering)."""
    axes = lowering.partial_axes
    out_dim = next(d for d, e in enumerate(lowering.output_spec) if e and set(axes) <= set(e))
    is_scatter = eqn.primitive.name in ("scatter-add", "scatter_add")

    def local(*xs):
        if is_scatter:  # the base operand must be added once, not once per device
            xs = (jnp.zeros_like(xs[0]), *xs[1:])
        (partial,) = bind_eqn(eqn, xs)
        return jax.lax.psum_scatter(partial, axes, scatter_dimension=out_dim, tiled=True)

    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(partition_spec(s) for s in lowering.operand_specs),
        out_specs=partition_spec(lowering.output_spec),
        check_vma=False,
    )(*invals)
    return out + invals[0] if is_scatter else out


def constrain(value: Any, sharding: NamedSharding | None) -> Any:
    return value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)


def evaluate_eqn(path: str, eqn: JaxprEqn, invals: Sequence[Any], rules: ShardingRules) -> list:
    """Evaluate one eqn (node id `path`) with the plan's rules applied."""
    resharded = rules.node_inputs.get(path)
    if resharded:
        invals = [constrain(x, s) for x, s in zip(invals, resharded, strict=True)]
    if eqn.primitive is param_use_p:
        outs = [constrain(invals[0], rules.param_use.get(eqn.params["index"]))]
    elif is_checkpoint(eqn):
        body = eqn.params["jaxpr"]
        outs = bind_checkpoint(
            lambda *a: evaluate_jaxpr(body, (), a, rules, f"{path}/"), invals, eqn.params
        )
    elif (body := inlined_body(eqn)) is not None:
        outs = evaluate_jaxpr(body[0], body[1], invals, rules, f"{path}/")
    elif path in rules.reduce_scatter:
        outs = [_reduce_scatter(eqn, invals, rules.reduce_scatter[path], rules.mesh)]
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
    """Evaluate (path, eqn) pairs in order, reading and writing variables in `env`."""
    for path, eqn in eqns:
        outs = evaluate_eqn(path, eqn, [read(env, v) for v in eqn.invars], rules)
        env.update(zip(eqn.outvars, outs, strict=True))


def evaluate_jaxpr(
    jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], rules: ShardingRules, prefix: str = ""
) -> list[Any]:
    """Evaluate a whole jaxpr whose eqns have node ids `prefix + index`."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    evaluate_eqns(((f"{prefix}{i}", e) for i, e in enumerate(jaxpr.eqns)), env, rules)
    return [read(env, v) for v in jaxpr.outvars]
