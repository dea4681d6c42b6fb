"""`autopar.explain`: the chosen plan next to classic layouts, all priced by one cost model.

A plan is data; what explaining it needs besides (the traced step, the cluster and the options it
was planned with) is a `PlanningContext` that `autopar.explain` and `train_step.explain` keep
beside the plan they made. `explain_plan` prices, under the same memory budget:

* the single-mesh baselines of `planner.baselines` (DP, ZeRO-2, ZeRO-3, Megatron) on all of the
  plan's devices, each the ILP with every input's storage pinned, on the step as ShardParallel
  traces it;
* plain pipelines: S uniform stages (equal layers on equal sub-meshes) with data parallelism
  inside each stage, for S = the plan's sub-mesh count (pipelined plans) and S = the host count
  (more than one host), with the plan's micro-batches and schedule (interleaved: its chunks per
  sub-mesh).

The ILP can store every input as any single-mesh baseline does, so a ShardParallel plan is never
predicted slower than the best of them that fits (up to the solver's gap and time limit, and
what the emission adds to the ILP's memory, whole accumulators of gradients reduced once per
step: where that pushes its fastest plan over the budget, a slower one is taken; the
explanation says if it is). That guarantee does not cover
pipelined plans (the stage DP prices stages from per-layer plans), plans made by a fixed rule
(DataParallel, ZeRO), or pipelines compared with a single-mesh plan: the explanation says
which applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from autopar.planner.baselines import (
    TOLERANCE,
    Baseline,
    LayoutResult,
    LayoutStatus,
    price_baseline,
)
from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import InvalidArgumentError, PlanningError
from autopar.planner.intra import IntraOpConfig
from autopar.planner.pipeline import StepParts
from autopar.planner.pipeshard import PipelineConfig, plan_pipeshard
from autopar.planner.plan import MeshPlan, OpGroupCost, Plan, PlanMethod
from autopar.planner.program import Program
from autopar.planner.schedules import PipelineSchedule
from autopar.planner.stage_options import UniformStageOption
from autopar.planner.summary import format_bytes, format_seconds

TOP_OP_GROUPS = 5
_ILP_METHODS = (PlanMethod.SHARD_PARALLEL,)


@dataclasses.dataclass(frozen=True)
class PlanningContext:
    """What `explain_plan` needs besides the plan's data: the step as traced for planning and
    what it was planned for.

    `mesh` holds all the plan's devices as ShardParallel plans them (the baselines' mesh);
    `cluster_shape` is those devices as (hosts, devices per host), for pipelines.
    `single_mesh_program()` is the step as ShardParallel traces it (None: `program` is).
    `layered(n)` is the step cut into layers (at least n where it can) as a pipeline splits it,
    with its program; None where the step cannot be layered."""

    program: Program
    cluster: ClusterSpec
    mesh: MeshPlan
    cluster_shape: tuple[int, int]
    intra: IntraOpConfig
    num_micro_batches: int
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    single_mesh_program: Callable[[], Program] | None = None
    layered: Callable[[int], tuple[StepParts, Program]] | None = None


@dataclasses.dataclass(frozen=True)
class StageOpCost:
    """One of the costliest op groups of a plan, and the stage it runs on."""

    stage: int
    cost: OpGroupCost


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The chosen plan and the baselines, priced by one cost model; `str()` is a table.

    `guaranteed` says whether the ILP guarantees that the chosen plan is never slower than a
    single-mesh baseline that fits; `op_costs` are the chosen plan's costliest op groups."""

    method: str
    cluster: str
    num_devices: int
    num_micro_batches: int
    chosen: LayoutResult
    baselines: tuple[LayoutResult, ...]
    op_costs: tuple[StageOpCost, ...]
    guaranteed: bool
    notes: tuple[str, ...] = ()

    @property
    def best_baseline(self) -> LayoutResult | None:
        """The fastest baseline that fits, or None."""
        fitting = [b for b in self.baselines if b.fits]
        return min(fitting, key=lambda b: b.step_time_s) if fitting else None

    @property
    def chosen_over_best(self) -> float | None:
        """Chosen step time / best fitting baseline's (below 1: the chosen plan is faster)."""
        best = self.best_baseline
        if best is None or not best.step_time_s:
            return None
        return self.chosen.step_time_s / best.step_time_s

    def __str__(self) -> str:
        return _format(self)


def _unavailable(name: str, why: str) -> LayoutResult:
    return LayoutResult(name, LayoutStatus.UNAVAILABLE, message=why)


def _baseline_config(intra: IntraOpConfig) -> IntraOpConfig:
    """The plan's ILP options (solver, time limit, memory budget) without restrictions."""
    return dataclasses.replace(
        intra,
        pinned_inputs=(),
        force_data_parallel=False,
        force_zero_stage_3=False,
        prefer_reduce_scatter=False,
    )


def _single_mesh(ctx: PlanningContext, program: Program) -> list[LayoutResult]:
    config = _baseline_config(ctx.intra)
    results = []
    for baseline in Baseline:
        try:
            results.append(
                price_baseline(
                    program, baseline, ctx.mesh, ctx.cluster, config, ctx.num_micro_batches
                )
            )
        except (ValueError, PlanningError) as e:  # e.g. a batch that does not split
            results.append(_unavailable(baseline.value, str(e)))
    return results


def price_pipeline(
    parts: StepParts,
    program: Program,
    ctx: PlanningContext,
    num_stages: int,
    stages_per_mesh: int = 1,
) -> LayoutResult:
    """`num_stages` uniform stages (sub-meshes, of `stages_per_mesh` chunks each when the
    schedule interleaves), data parallel inside each, priced by the pipeline planner; when they
    do not fit, the memory per device they need (planned without a budget)."""
    name = f"Pipeline {num_stages}xDP"
    intra = dataclasses.replace(_baseline_config(ctx.intra), force_data_parallel=True)
    config = PipelineConfig(
        num_micro_batches=ctx.num_micro_batches,
        schedules=(ctx.schedule,),
        stage_option=UniformStageOption(num_stages=num_stages),
        intra=intra,
        num_virtual_stages=stages_per_mesh,
    )
    try:
        plan = plan_pipeshard(parts, program, ctx.cluster, ctx.cluster_shape, config)
    except InvalidArgumentError as e:  # the devices or layers do not split evenly
        return _unavailable(name, str(e))
    except PlanningError as e:
        unbounded = dataclasses.replace(
            config, intra=dataclasses.replace(intra, memory_budget_per_device=float("inf"))
        )
        try:
            plan = plan_pipeshard(parts, program, ctx.cluster, ctx.cluster_shape, unbounded)
        except PlanningError:
            return LayoutResult(name, LayoutStatus.INFEASIBLE, message=str(e))
        need = plan.predicted.memory_per_device_bytes
        return LayoutResult(name, LayoutStatus.OOM, least_memory_bytes=need, message=str(e))
    return LayoutResult(name, LayoutStatus.OK, plan.predicted, plan=plan)


def _pipelines(ctx: PlanningContext, plan: Plan) -> tuple[list[LayoutResult], list[str]]:
    counts = set()
    per_mesh = len(plan.stages) // plan.num_meshes
    if plan.pipeline_schedule is not None:
        counts.add(plan.num_meshes)
    if ctx.cluster_shape[0] > 1:
        counts.add(ctx.cluster_shape[0])
    counts.discard(1)
    if not counts:
        return [], ["no pipeline baselines: the plan is not pipelined and uses one host"]
    if ctx.layered is None:
        return [], ["no pipeline baselines: the step cannot be cut into layers"]
    results = []
    for count in sorted(counts):
        try:
            parts, program = ctx.layered(count * per_mesh)
        except (PlanningError, InvalidArgumentError) as e:
            results.append(_unavailable(f"Pipeline {count}xDP", str(e)))
            continue
        results.append(price_pipeline(parts, program, ctx, count, per_mesh))
    return results, []


def _top_op_costs(plan: Plan) -> tuple[StageOpCost, ...]:
    found = [StageOpCost(s.index, c) for s in plan.stages for c in s.op_costs]
    found.sort(key=lambda x: -x.cost.total_s)
    return tuple(found[:TOP_OP_GROUPS])


def _guarantee_notes(plan: Plan, baselines: list[LayoutResult]) -> tuple[bool, list[str]]:
    if plan.method in _ILP_METHODS:
        notes = [
            "the ILP can store inputs as every single-mesh baseline (DP, Z2, Z3, Megatron) "
            "does, so the chosen plan is never predicted slower than the best of them that fits"
        ]
        chosen_s = plan.predicted.step_time_s
        faster = [
            b.name
            for b in baselines
            if b.name.startswith("Pipeline") and b.fits and b.step_time_s < chosen_s
        ]
        if faster:
            notes.append(
                f"{', '.join(faster)} is predicted faster: pipelines are outside a single-mesh "
                "plan's search space, so PipeshardParallel may pay off here"
            )
        return True, notes
    if plan.pipeline_schedule is not None:
        return False, [
            "not guaranteed to beat every baseline: the stage DP prices candidate stages from "
            "per-layer ILP plans, and the pipeline adds its bubble"
        ]
    return False, [
        f"not guaranteed to beat every baseline: a {plan.method} plan follows a fixed rule "
        "priced by its own formula; ShardParallel searches all these layouts"
    ]


def _hit_time_limit(plan: Plan) -> bool:
    return any("time limit" in note for note in plan.notes)


def _time_limit_notes(layouts: list[LayoutResult]) -> list[str]:
    """A note naming the layouts whose ILP stopped at its wall-clock limit: their rows depend on
    the machine's speed and load."""
    hit = [b.name for b in layouts if b.plan is not None and _hit_time_limit(b.plan)]
    if not hit:
        return []
    return [
        f"{', '.join(hit)}: the ILP hit its time limit, so the plan priced is the best found by "
        "then and may differ between runs (raise AutoShardingOption.time_limit_s)"
    ]


def explain_plan(plan: Plan, ctx: PlanningContext) -> Explanation:
    """`plan` next to the baselines (see the module docstring), from the context it was planned
    in."""
    program = ctx.program if ctx.single_mesh_program is None else ctx.single_mesh_program()
    baselines = _single_mesh(ctx, program)
    pipelines, notes = _pipelines(ctx, plan)
    baselines += pipelines
    chosen = LayoutResult(f"chosen ({plan.method})", LayoutStatus.OK, plan.predicted, plan=plan)
    guaranteed, more = _guarantee_notes(plan, baselines)
    notes = more + notes
    single = [b for b in baselines if b.fits and not b.name.startswith("Pipeline")]
    if guaranteed and single:
        best = min(single, key=lambda b: b.step_time_s)
        if chosen.step_time_s > best.step_time_s * (1 + TOLERANCE):
            why = (
                "the ILP hit its time limit"
                if _hit_time_limit(plan)
                else "the solver stopped in its gap, or the ILP's fastest choices did not fit "
                "the memory budget as emitted (gradients reduced once per step hold whole "
                "accumulators its memory does not count), and a slower plan was taken"
            )
            notes.append(
                f"WARNING: the chosen plan is predicted slower than {best.name} "
                f"({chosen.step_time_s / best.step_time_s:.4f}x): {why}"
            )
    notes += _time_limit_notes([chosen, *baselines])
    if plan.pipeline_schedule is None and ctx.single_mesh_program is not None:
        notes.append("baselines are priced on the step as ShardParallel traces it")
    return Explanation(
        method=plan.method,
        cluster=plan.cluster.name,
        num_devices=plan.num_devices,
        num_micro_batches=plan.num_micro_batches,
        chosen=chosen,
        baselines=tuple(baselines),
        op_costs=_top_op_costs(plan),
        guaranteed=guaranteed,
        notes=tuple(notes),
    )


# ----------------------------------------------------------------------------- text


_ms = format_seconds


def _row(result: LayoutResult, chosen_s: float) -> list[str]:
    if result.status is LayoutStatus.OK:
        p = result.predicted
        return [
            result.name,
            _ms(p.step_time_s),
            f"{p.step_time_s / chosen_s:.2f}x" if chosen_s > 0 else "-",
            _ms(p.compute_s),
            _ms(p.communication_s),
            format_bytes(p.memory_per_device_bytes),
            "yes",
        ]
    if result.status is LayoutStatus.OOM:
        need = result.least_memory_bytes
        return [result.name, "-", "-", "-", "-", f"needs {format_bytes(need)}", "no (OOM)"]
    return [result.name, "-", "-", "-", "-", "-", result.status.value]


def _format(e: Explanation) -> str:
    chosen_s = e.chosen.step_time_s
    header = ["layout", "step time", "vs chosen", "compute", "communication", "memory/device"]
    rows = [header + ["fits"]] + [_row(r, chosen_s) for r in (e.chosen, *e.baselines)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header) + 1)]
    lines = [
        f"autopar explain: {e.method} plan on {e.cluster} ({e.num_devices} devices), "
        f"{e.num_micro_batches} micro-batch(es); every layout priced by the same cost model",
    ]
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  " + "  ".join(cells).rstrip())
    for result in e.baselines:
        if result.status in (LayoutStatus.UNAVAILABLE, LayoutStatus.INFEASIBLE):
            lines.append(f"  {result.name}: {result.message}")
    best, ratio = e.best_baseline, e.chosen_over_best
    if best is not None:
        lines.append(
            f"best baseline that fits: {best.name} ({_ms(best.step_time_s)}); the chosen plan "
            f"takes {ratio:.4g}x its time"
        )
    else:
        lines.append("no baseline fits in device memory")
    if e.op_costs:
        total = e.chosen.predicted.compute_s + e.chosen.predicted.communication_s
        lines.append("costliest op groups of the chosen plan (per step, per device):")
        for item in e.op_costs:
            c = item.cost
            share = f" ({c.total_s / total:.0%})" if total > 0 else ""
            times = f" x{c.count}" if c.count > 1 else ""
            lines.append(
                f"  stage {item.stage}: {c.description}{times}: compute {_ms(c.compute_s)}, "
                f"communication {_ms(c.communication_s)}{share}"
            )
    else:
        lines.append("op-level costs are recorded for ILP plans only")
    lines.extend(f"note: {note}" for note in e.notes)
    return "\n".join(lines)
