"""Plan.summary(): a text table a person can read in a terminal.

Inputs are listed grouped by layer pattern: paths that differ only in the number of a numbered
dict key (``'block_3'``, ``'layers_12'``, ``'7'``) and are stored alike (same spec and shape)
share one row, e.g. ``state.params['block_{0..23}']['attn']['query']['kernel']``, so a
48-layer model takes as many rows as one layer.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence

from autopar.planner.plan import Plan, Predicted, Spec, StagePlan, format_spec

# A numbered dict key in a pytree path: ['block_3'] or ['3'] (not a sequence index like [0]).
_NUMBERED_KEY = re.compile(r"\['((?:[^'\]]*?_)?)(\d+)'\]")


def format_bytes(n: float) -> str:
    """A byte count in B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_flops(n: float) -> str:
    """A FLOP count (or rate, with "/s" appended by the caller) in the unit that fits:
    MFLOP, GFLOP, TFLOP or PFLOP, 4 significant digits."""
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP")):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n / 1e6:.4g} MFLOP"


def format_ranges(numbers: Iterable[int]) -> str:
    """Sorted distinct numbers with runs collapsed: ``0..3,5,7..9``."""
    values = sorted(set(numbers))
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


@dataclasses.dataclass(frozen=True, slots=True)
class PathGroup:
    """Paths that differ only in their numbered dict keys, stored with the same spec.

    `pattern` is the path with each number replaced by ``{}``; `numbers[j]` are the numbers seen
    at placeholder j; `count` how many paths the group holds."""

    pattern: str
    numbers: tuple[tuple[int, ...], ...]
    count: int
    spec: Spec | None
    shape: tuple[int, ...] | None

    @property
    def label(self) -> str:
        """The pattern with its numbers: ``state.params['block_{0..23}']['w']``."""
        parts = []
        for found in self.numbers:
            text = format_ranges(found)
            parts.append(text if len(found) == 1 else "{" + text + "}")
        return self.pattern.format(*parts)


def group_paths(
    paths: Sequence[str],
    specs: Sequence[Spec | None],
    shapes: Sequence[tuple[int, ...] | None] | None = None,
) -> list[PathGroup]:
    """Group `paths` by layer pattern and (spec, shape), in order of first appearance."""
    shapes = shapes if shapes is not None else [None] * len(paths)
    order: dict[tuple, list[tuple[int, ...]]] = {}
    for path, spec, shape in zip(paths, specs, shapes, strict=True):
        escaped = path.replace("{", "{{").replace("}", "}}")
        numbers = tuple(int(m.group(2)) for m in _NUMBERED_KEY.finditer(path))
        pattern = _NUMBERED_KEY.sub(lambda m: f"['{m.group(1)}{{}}']", escaped)
        order.setdefault((pattern, spec, shape), []).append(numbers)
    groups = []
    for (pattern, spec, shape), seen in order.items():
        columns = tuple(tuple(sorted({n[j] for n in seen})) for j in range(len(seen[0])))
        groups.append(PathGroup(pattern, columns, len(seen), spec, shape))
    return groups


def _stage_devices(stage: StagePlan, devices_per_host: int) -> tuple[int, int]:
    """The (hosts, devices per host) of a stage's sub-mesh."""
    hosts = {i // devices_per_host for i in stage.mesh.device_indices}
    return len(hosts), stage.mesh.num_devices // max(1, len(hosts))


def stage_latencies(plan: Plan) -> list[float]:
    """Predicted seconds per micro-batch of each stage (one stage: the step's share)."""
    k = plan.num_micro_batches
    return [(stage.predicted or plan.predicted).step_time_s / k for stage in plan.stages]


def bubble_fraction(plan: Plan) -> float:
    """The share of device time the pipeline idles: 1 − k·Σ t_i / (n · T) for stages of t_i
    seconds per micro-batch on n meshes, k micro-batches and the predicted step T (its
    schedule's, `PipelineSchedule.step_time`)."""
    latencies = stage_latencies(plan)
    step = plan.predicted.step_time_s
    if step <= 0:
        return 0.0
    busy = plan.num_micro_batches * sum(latencies)
    return max(0.0, 1.0 - busy / (plan.num_meshes * step))


def throughput(plan: Plan) -> tuple[float, float] | None:
    """(FLOP/s per device, model FLOPs utilisation) of the predicted step; None without FLOPs."""
    p = plan.predicted
    if p.flops <= 0 or p.step_time_s <= 0 or plan.num_devices == 0:
        return None
    per_device = p.flops / p.step_time_s / plan.num_devices
    peak = plan.cluster.device_flops
    return per_device, per_device / peak if peak > 0 else math.nan


def format_seconds(seconds: float) -> str:
    """A duration in ns, us, ms or s, with 4 significant digits."""
    if seconds == 0:
        return "0 s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds * 1e9:.4g} ns"


_ms = format_seconds


def _costs(p: Predicted) -> str:
    host = f", host launches {_ms(p.host_s)}" if p.host_s else ""
    return (
        f"compute {_ms(p.compute_s)}, communication {_ms(p.communication_s)} "
        f"({format_bytes(p.communication_bytes)} moved){host}, memory per device "
        f"{format_bytes(p.memory_per_device_bytes)}"
    )


def _cluster_line(plan: Plan) -> str:
    c = plan.cluster
    memory = (
        f"{c.memory_bandwidth / 1e9:.4g} GB/s memory bandwidth"
        if c.memory_bandwidth
        else "memory bandwidth not given: memory-bound work priced free"
    )
    return (
        f"cluster {c.name} ({c.num_hosts} host(s) x {c.devices_per_host} "
        f"devices, {format_flops(c.device_flops)}/s 16-bit peak, {memory}, "
        f"{format_bytes(c.device_memory)} per device)"
    )


def _stage_lines(plan: Plan, stage: StagePlan, max_rows: int) -> list[str]:
    dph = plan.cluster.devices_per_host
    hosts, per_host = _stage_devices(stage, dph)
    mesh = " x ".join(
        f"{n}={s}" for n, s in zip(stage.mesh.axis_names, stage.mesh.shape, strict=True)
    )
    layers = "" if stage.layers is None else f"layers [{stage.layers[0]},{stage.layers[1]}) on "
    lines = [
        f"stage {stage.index}: {layers}sub-mesh {hosts}x{per_host} (hosts x devices) = devices "
        f"[{format_ranges(stage.mesh.device_indices)}], logical mesh ({mesh}), "
        f"{plan.num_micro_batches} micro-batch(es)"
    ]
    p = stage.predicted or plan.predicted
    lines.append(
        f"  predicted: {_ms(p.step_time_s / plan.num_micro_batches)} per micro-batch; per "
        f"step {_costs(p)}"
    )
    paths = stage.input_paths or plan.input_paths
    groups = group_paths(paths, stage.input_specs)
    lines.append(f"  storage of {len(paths)} inputs in {len(groups)} rows:")
    width = min(90, max((len(g.label) for g in groups[:max_rows]), default=0))
    for group in groups[:max_rows]:
        times = f"  x{group.count}" if group.count > 1 else ""
        lines.append(f"    {group.label:<{width}}  {format_spec(group.spec)}{times}")
    if len(groups) > max_rows:
        lines.append(f"    ... and {len(groups) - max_rows} more rows")
    lines.extend(_gradient_lines(plan, stage, max_rows))
    return lines


def _gradient_lines(plan: Plan, stage: StagePlan, max_rows: int) -> list[str]:
    """When each parameter's gradient is summed over devices, grouped by layer pattern."""
    if not stage.gradient_reduction:
        return []
    by_when: dict[str, list[str]] = {}
    for path, when in stage.gradient_reduction.items():
        by_when.setdefault(when, []).append(path)
    counts = ", ".join(f"{len(paths)} {when}" for when, paths in sorted(by_when.items()))
    lines = [
        f"  gradients summed over devices, over {plan.num_micro_batches} micro-batches: {counts}"
    ]
    width = min(90, max(len(w) for w in by_when))
    for when, paths in sorted(by_when.items()):
        groups = group_paths(paths, [None] * len(paths))
        for group in groups[:max_rows]:
            lines.append(f"    {when:<{width}}  {group.label}")
        if len(groups) > max_rows:
            lines.append(f"    {when:<{width}}  ... and {len(groups) - max_rows} more rows")
    return lines


def plan_summary(plan: Plan, max_rows: int = 60) -> str:
    """Method, stages (sub-meshes, logical meshes, layers, micro-batches) with their predicted
    costs, how each input is stored (grouped by layer pattern), and the predicted step: time,
    FLOP/s per device and MFU."""
    p = plan.predicted
    lines = [
        f"autopar plan: {plan.method}, {plan.num_micro_batches} micro-batch(es), "
        f"{len(plan.stages)} stage(s) on {plan.num_devices} device(s), {_cluster_line(plan)}"
        + (f", {plan.pipeline_schedule} pipeline" if plan.pipeline_schedule else "")
        + (
            f" ({len(plan.stages) // plan.num_meshes} stages on each of {plan.num_meshes} meshes)"
            if plan.num_meshes < len(plan.stages)
            else ""
        ),
    ]
    for stage in plan.stages:
        lines.extend(_stage_lines(plan, stage, max_rows))
    lines.append(f"predicted per step: {_ms(p.step_time_s)}; {_costs(p)}")
    rate = throughput(plan)
    if rate is not None:
        lines.append(
            f"predicted throughput: {format_flops(p.flops)} per step, "
            f"{format_flops(rate[0])}/s per device, MFU {rate[1]:.1%} of the 16-bit peak"
        )
    if plan.pipeline_schedule:
        lines.append(f"predicted pipeline bubble: {bubble_fraction(plan):.1%} of device time")
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)
