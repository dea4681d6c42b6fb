"""Compile a Plan: single-stage plans into an Executable with `jax.jit` shardings."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding

from autopar.planner.plan import Plan
from autopar.runtime.accumulate import accumulating_step
from autopar.runtime.executable import Executable
from autopar.runtime.interpreter import ShardingRules, build_mesh, partition_spec
from autopar.runtime.local import PipelineExecutable
from autopar.tracing import TracedStep

logger = logging.getLogger(__name__)


def compile_plan(
    traced: TracedStep, plan: Plan, devices: Sequence[jax.Device]
) -> Executable | PipelineExecutable:
    """Lower and compile `traced` under `plan` on `devices` (indices in the plan refer to them).

    Pipelined plans get a `PipelineExecutable`, whose segments compile on their first call."""
    if plan.pipeline_schedule is not None:
        return PipelineExecutable(traced, plan, devices)
    if len(plan.stages) != 1:
        raise ValueError(f"compile_plan runs single-stage plans; this one has {len(plan.stages)}")
    if plan.fingerprint and plan.fingerprint != traced.program.fingerprint:
        raise ValueError(
            f"the plan was made for program {plan.fingerprint}, not for this one "
            f"({traced.program.fingerprint})"
        )
    stage = plan.stages[0]
    mesh = build_mesh(stage.mesh, devices)
    in_shardings = [NamedSharding(mesh, partition_spec(s)) for s in stage.input_specs]
    out_shardings = [NamedSharding(mesh, partition_spec(s)) for s in stage.output_specs]
    batch_inputs = traced.program.signature.batch_inputs
    step = accumulating_step(
        traced.closed_jaxpr,
        ShardingRules.from_stage(stage, mesh),
        batch_inputs,
        [in_shardings[i] for i in batch_inputs],
        plan.num_micro_batches,
    )
    avals = traced.full_batch_avals()
    args = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=a.weak_type)
        for a, s in zip(avals, in_shardings, strict=True)
    ]
    logger.info("compiling %s (%s) on %d devices", traced.fun_name, plan.method, mesh.size)
    compiled = (
        jax.jit(
            step,
            in_shardings=tuple(in_shardings),
            out_shardings=tuple(out_shardings),
            donate_argnums=plan.donated_inputs,
        )
        .lower(*args)
        .compile()
    )
    return Executable(
        plan,
        compiled,
        in_shardings,
        out_shardings,
        traced.in_tree,
        traced.out_tree,
        traced.static_argnums,
    )
