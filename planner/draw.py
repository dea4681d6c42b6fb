"""Plan.draw(): a picture of a plan (matplotlib, Agg canvas: no display needed).

Left, the cluster's device grid (hosts x devices per host), each device coloured by the stage
that runs on it. Right, the pipeline schedule as a timeline: one row per stage, one block per
forward (light) and backward (dark) pass of a micro-batch (under zero bubble: input gradient
dark, weight gradient darker), in the order of the plan's schedule (`planner.schedules` clock
tables), each task starting when its stage is free and its inputs are ready
(`Schedule.timed`). A stage's predicted time per micro-batch is split as `WORK_SHARE` says
(a backward pass does about twice a forward's FLOPs). The title gives the predicted
bubble fraction (`planner.summary.bubble_fraction`). A plan that is not pipelined shows one
stage running its micro-batches back to back.
"""

from __future__ import annotations

import dataclasses
import os

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from autopar.planner.plan import Plan
from autopar.planner.schedules import WORK_SHARE, TaskKind, make_schedule
from autopar.planner.summary import bubble_fraction, format_seconds, stage_latencies


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """One task of the timeline: stage, forward or backward, micro-batch, start and end (s)."""

    stage: int
    kind: TaskKind
    micro_batch: int
    start_s: float
    end_s: float


def pipeline_timeline(plan: Plan) -> tuple[Block, ...]:
    """The forward and backward tasks of one step of `plan`, timed (see the module docstring)."""
    latencies = stage_latencies(plan)
    if plan.pipeline_schedule is None:
        schedule = make_schedule("1f1b", len(latencies), plan.num_micro_batches)
    else:
        schedule = plan.pipeline_table()
    times = schedule.timed(lambda task: WORK_SHARE[task.kind] * latencies[task.stage])
    return tuple(
        Block(task.stage, task.kind, task.micro_batch, start, end)
        for task, (start, end) in times.items()
    )


def _stages_of_device(plan: Plan) -> dict[int, list[int]]:
    """The stages each device runs: one, or several with interleaved 1F1B's virtual stages."""
    found: dict[int, list[int]] = {}
    for stage in plan.stages:
        for i in stage.mesh.device_indices:
            found.setdefault(i, []).append(stage.index)
    return found


def _draw_devices(ax, plan: Plan, colours) -> None:
    hosts, per_host = plan.cluster.num_hosts, plan.cluster.devices_per_host
    stages_of = _stages_of_device(plan)
    for h in range(hosts):
        for d in range(per_host):
            index = h * per_host + d
            stages = stages_of.get(index)
            colour = "lightgrey" if stages is None else colours(stages[0])
            ax.add_patch(
                Rectangle((d, hosts - 1 - h), 0.92, 0.92, facecolor=colour, edgecolor="black")
            )
            named = "stage " if stages and len(stages) == 1 else "stages\n"
            label = f"{index}\n" + ("idle" if not stages else named + "+".join(map(str, stages)))
            ax.text(d + 0.46, hosts - 1 - h + 0.46, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.1, per_host)
    ax.set_ylim(-0.1, hosts)
    ax.set_xticks([d + 0.46 for d in range(per_host)], [str(d) for d in range(per_host)])
    ax.set_yticks([hosts - 1 - h + 0.46 for h in range(hosts)], [str(h) for h in range(hosts)])
    ax.set_xlabel("device in host")
    ax.set_ylabel("host")
    ax.set_aspect("equal")
    ax.set_title(f"{plan.num_devices} devices, {len(plan.stages)} stage(s)")


def _time_unit(seconds: float) -> tuple[float, str]:
    """(factor, unit) to show a duration of `seconds` as a number of units."""
    for factor, unit in ((1.0, "s"), (1e3, "ms"), (1e6, "us")):
        if seconds * factor >= 1:
            return factor, unit
    return 1e9, "ns"


def _draw_timeline(ax, plan: Plan, colours) -> None:
    blocks = pipeline_timeline(plan)
    makespan = max((b.end_s for b in blocks), default=0.0) or 1.0
    scale, unit = _time_unit(makespan)
    num_stages = len(plan.stages)
    for b in blocks:
        row = num_stages - 1 - b.stage
        base = to_rgba(colours(b.stage))
        forward = b.kind is TaskKind.FORWARD
        weight = b.kind is TaskKind.BACKWARD_WEIGHT
        colour = (
            (*base[:3], 0.45)
            if forward
            else (*(0.6 * c for c in base[:3]), 1.0)
            if weight
            else base
        )
        width = (b.end_s - b.start_s) * scale
        thin = width < makespan * scale / 150  # many micro-batches: no outlines, only colour
        ax.add_patch(
            Rectangle(
                (b.start_s * scale, row + 0.1),
                width,
                0.8,
                facecolor=colour,
                edgecolor="black",
                linewidth=0.0 if thin else 0.8,
            )
        )
        if width > makespan * scale / 60:
            label = f"{'F' if forward else 'W' if weight else 'B'}{b.micro_batch}"
            ax.text(
                (b.start_s + b.end_s) / 2 * scale,
                row + 0.5,
                label,
                ha="center",
                va="center",
                fontsize=7,
            )
    ax.set_xlim(0, makespan * scale * 1.02)
    ax.set_ylim(0, num_stages)
    ax.set_yticks([num_stages - 1 - s + 0.5 for s in range(num_stages)])
    ax.set_yticklabels([f"stage {s}" for s in range(num_stages)])
    ax.set_xlabel(f"time ({unit})")
    schedule = plan.pipeline_schedule or "no pipeline"
    ax.set_title(
        f"{schedule}, {plan.num_micro_batches} micro-batch(es): predicted step "
        f"{format_seconds(plan.predicted.step_time_s)}, bubble {bubble_fraction(plan):.1%}"
    )
    ax.legend(
        handles=[
            Patch(facecolor=(0.5, 0.5, 0.5, 0.45), edgecolor="black", label="forward"),
            Patch(facecolor=(0.5, 0.5, 0.5, 1.0), edgecolor="black", label="backward"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
    )


def draw_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write `plan`'s picture to `path` as a PNG (see the module docstring)."""
    hosts = plan.cluster.num_hosts
    height = max(3.0, 0.9 * max(hosts, len(plan.stages)) + 1.8)
    figure = Figure(figsize=(14, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    grid, timeline = figure.subplots(1, 2, width_ratios=[1, 2])
    cmap = colormaps["tab10"]

    def colours(stage: int):
        return cmap(stage % cmap.N)

    _draw_devices(grid, plan, colours)
    _draw_timeline(timeline, plan, colours)
    figure.suptitle(f"autopar plan: {plan.method} on {plan.cluster.name}", fontsize=11)
    figure.savefig(os.fspath(path), format="png")
