"""Plan.summary(): a text table a person can read in a terminal."""

from __future__ import annotations

from autopar.planner.plan import Plan, format_spec


def format_bytes(n: float) -> str:
    """A byte count in B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def plan_summary(plan: Plan, max_inputs: int = 40) -> str:
    """Method, meshes, how each input is stored, and the predicted step cost."""
    p = plan.predicted
    lines = [
        f"autopar plan: {plan.method}, {plan.num_micro_batches} micro-batch(es), "
        f"cluster {plan.cluster.get('name', '?')}"
        + (f", {plan.pipeline_schedule} pipeline" if plan.pipeline_schedule else ""),
    ]
    for stage in plan.stages:
        mesh = " x ".join(
            f"{n}={s}" for n, s in zip(stage.mesh.axis_names, stage.mesh.shape, strict=True)
        )
        layers = "" if stage.layers is None else f"layers [{stage.layers[0]},{stage.layers[1]}) "
        lines.append(
            f"stage {stage.index}: {layers}mesh ({mesh}) on devices "
            f"{list(stage.mesh.device_indices)}"
        )
        if stage.predicted is not None:
            q = stage.predicted
            lines.append(
                f"  predicted: {q.step_time_s / plan.num_micro_batches * 1e3:.3f} ms per "
                f"micro-batch, memory per device {format_bytes(q.memory_per_device_bytes)}"
            )
        paths = stage.input_paths or plan.input_paths
        width = max((len(path) for path in paths[:max_inputs]), default=0)
        for path, spec in list(zip(paths, stage.input_specs, strict=True))[:max_inputs]:
            lines.append(f"  {path:<{width}}  {format_spec(spec)}")
        if len(paths) > max_inputs:
            lines.append(f"  ... and {len(paths) - max_inputs} more inputs")
        if stage.reduce_scatter:
            lines.append(f"  gradients reduce-scattered at {len(stage.reduce_scatter)} node(s)")
    lines.append(
        f"predicted per step: {p.step_time_s * 1e3:.3f} ms (compute {p.compute_s * 1e3:.3f} ms, "
        f"communication {p.communication_s * 1e3:.3f} ms, "
        f"{format_bytes(p.communication_bytes)} moved); "
        f"memory per device {format_bytes(p.memory_per_device_bytes)}"
    )
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)
