"""How fast XLA:CPU runs a train step's matmuls inside the step and alone: the evidence for the
dots that `make bench-costmodel` under-prices on a CPU (issue 20), on ONE real CPU device.

The roofline prices each dot by its FLOPs at the profile's matmul rate, wherever it runs. In
the zoo's GPT and MoE steps the sum of the layout copies' prices is about 2.5 times what their
kernels take, yet the whole steps read 0.83 of their measured times: something else runs slower
than priced. This reads every kernel of such a step that is one dot off a profiler trace (the
least of `STEPS` steps, and the share of its time another kernel ran beside it), then compiles
the same dot alone (its shapes, contracting and batch dimensions, in fp32, `CHAIN` dependent
copies of it in one program) and reads its kernels off a trace the same way. A dot whose
operands XLA laid out other than row-major in the step is marked: alone it gets the default
layouts. Run it with XLA's default YNNPACK dots: with them turned off
(`--xla_cpu_experimental_ynn_fusion_type=`), Eigen's dot events in a trace do not cover their
work (one read 1.9 TFLOP/s on 2 cores).

    python benchmarks/cpu_dots.py

Writes benchmarks/results/cpu_dots.{json,md}.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import statistics

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from cost_model import kernel_times, one_cpu_device, save_results, zoo  # noqa: E402

STEPS = 5
CHAIN = 6  # copies of a dot timed alone
MODELS = ("gpt", "moe")
SLOWER = 1.5  # a dot this many times its time alone or more counts as slowed in the step
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\](\{[\d,]*\})?")
_DOT = re.compile(r"= \w+\[[\d,]*\]\S* dot\(%?([\w.\-]+), %?([\w.\-]+)\)(.*)")


@dataclasses.dataclass(frozen=True)
class Dot:
    """One dot of a compiled program: operand shapes and its dimension numbers."""

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    row_major: bool  # both operands in the default layout
    op_name: str

    @property
    def result(self) -> tuple[int, ...]:
        batch = [self.lhs[d] for d in self.lhs_batch]
        lhs_free = _free(self.lhs, self.lhs_contracting + self.lhs_batch)
        return (*batch, *lhs_free, *_free(self.rhs, self.rhs_contracting + self.rhs_batch))

    @property
    def flops(self) -> int:
        return 2 * math.prod(self.result) * math.prod(self.lhs[d] for d in self.lhs_contracting)

    def text(self) -> str:
        return f"{list(self.lhs)} x {list(self.rhs)} -> {list(self.result)}"


def _free(shape: tuple[int, ...], used: tuple[int, ...]) -> list[int]:
    return [size for d, size in enumerate(shape) if d not in used]


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def _numbers(attributes: str, name: str) -> tuple[int, ...]:
    found = re.search(rf"{name}=\{{([\d,]*)\}}", attributes)
    return _dims(found.group(1)) if found else ()


def one_dot_kernels(hlo: str) -> dict[str, Dot]:
    """Each kernel of compiled `hlo` that is a dot: a dot instruction, or a fusion (XLA:CPU's
    YNNPACK fusions) whose computation holds one dot."""
    shapes: dict[str, tuple[tuple[int, ...], bool]] = {}  # name -> (dims, row-major)
    bodies: dict[str, list[str]] = {}
    body: list[str] = []
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            body = bodies.setdefault(header.group(1), [])
            continue
        body.append(line)
        found = _INSTRUCTION.match(line)
        if found:
            dims, layout = _dims(found.group(3)), found.group(4)
            default = "{" + ",".join(map(str, reversed(range(len(dims))))) + "}"
            shapes[found.group(1)] = (dims, layout in (None, default))

    def dot_of(line: str) -> Dot | None:
        found = _DOT.search(line)
        if not found or found.group(1) not in shapes or found.group(2) not in shapes:
            return None
        (lhs, lhs_rows), (rhs, rhs_rows) = shapes[found.group(1)], shapes[found.group(2)]
        attributes = found.group(3)
        op_name = re.search(r'op_name="([^"]*)"', attributes)
        return Dot(
            lhs,
            rhs,
            _numbers(attributes, "lhs_contracting_dims"),
            _numbers(attributes, "rhs_contracting_dims"),
            _numbers(attributes, "lhs_batch_dims"),
            _numbers(attributes, "rhs_batch_dims"),
            lhs_rows and rhs_rows,
            op_name.group(1) if op_name else "",
        )

    fused = set(re.findall(r" fusion\(.*calls=%?([\w.\-]+)", hlo))  # a fusion's body: no kernels
    kernels = {}
    for line in (line for name, body in bodies.items() if name not in fused for line in body):
        found = _INSTRUCTION.match(line)
        if not found:
            continue
        if " dot(" in line:
            dot = dot_of(line)
        elif " fusion(" in line and (called := re.search(r"calls=%?([\w.\-]+)", line)):
            dots = [d for d in map(dot_of, bodies.get(called.group(1), [])) if d is not None]
            dot = dots[0] if len(dots) == 1 else None
        else:
            dot = None
        if dot is not None:
            kernels[found.group(1)] = dot
    return kernels


def alone_us(dot: Dot) -> float:
    """`dot`'s kernel compiled alone on fp32 operands: the median over `CHAIN` copies of it
    in one program, each waiting on the last through one element of its lhs (kept busy, as
    the profile's matmuls are: a program's first kernel also waits for the thread pool to
    wake), of each copy's least time over `STEPS` profiled calls."""
    lhs, rhs = jnp.full(dot.lhs, 0.01, jnp.float32), jnp.full(dot.rhs, 0.01, jnp.float32)
    numbers = ((dot.lhs_contracting, dot.rhs_contracting), (dot.lhs_batch, dot.rhs_batch))
    corner = (0,) * len(dot.lhs)

    def chain(a, b):
        for _ in range(CHAIN):
            y = jax.lax.dot_general(a, b, numbers)
            a = a.at[corner].set(y[(0,) * y.ndim] * 1e-3)
        return a

    jitted = jax.jit(chain)
    kernels = one_dot_kernels(jitted.lower(lhs, rhs).compile().as_text())
    times = kernel_times(jitted, (lhs, rhs), STEPS)
    return statistics.median(times[k][0] for k in kernels if k in times)


def model_rows(name: str, build) -> list[dict]:
    """Each one-dot kernel of the model's step: in the step and alone."""
    step, args = build()
    jitted = jax.jit(step)
    dots = one_dot_kernels(jitted.lower(*args).compile().as_text())
    in_step = kernel_times(jitted, args, STEPS)
    rows = []
    for kernel, dot in dots.items():
        if kernel not in in_step:
            continue
        least, _, beside = in_step[kernel]
        alone = alone_us(dot)
        rows.append(
            {
                "model": name,
                "kernel": kernel,
                "op": dot.op_name.rsplit("/", 2)[-2] if "/" in dot.op_name else dot.op_name,
                "shapes": dot.text(),
                "mflop": dot.flops / 1e6,
                "row_major": dot.row_major,
                "step_us": least,
                "share_beside_other_kernels": beside,
                "alone_us": alone,
                "step_over_alone": least / alone,
                "step_gflop_per_s": dot.flops / least / 1e3,
                "alone_gflop_per_s": dot.flops / alone / 1e3,
            }
        )
    return sorted(rows, key=lambda r: -r["step_us"])


def summary(rows: list[dict]) -> dict:
    """Totals, and the dots slowed in the step: all of them, and those that ran with no other
    kernel beside them for at least 90% of their time (side by side, two kernels share the
    cores, which a slowdown of each does not show as lost time)."""
    slowed = [r for r in rows if r["step_over_alone"] >= SLOWER]
    by_themselves = [r for r in slowed if r["share_beside_other_kernels"] < 0.1]
    return {
        "dots": len(rows),
        "step_ms": sum(r["step_us"] for r in rows) / 1e3,
        "alone_ms": sum(r["alone_us"] for r in rows) / 1e3,
        "slowed": len(slowed),
        "slowed_excess_ms": sum(r["step_us"] - r["alone_us"] for r in slowed) / 1e3,
        "slowed_by_themselves": len(by_themselves),
        "slowed_by_themselves_excess_ms": sum(r["step_us"] - r["alone_us"] for r in by_themselves)
        / 1e3,
    }


def _summary_text(s: dict) -> str:
    return (
        f"{s['dots']} dots: {s['step_ms']:.2f} ms in the step, {s['alone_ms']:.2f} ms alone. "
        f"**{s['slowed']} run {SLOWER}x their time alone or more**, "
        f"{s['slowed_excess_ms']:.2f} ms over it; {s['slowed_by_themselves']} of them with no "
        f"other kernel beside them, {s['slowed_by_themselves_excess_ms']:.2f} ms over."
    )


def main() -> None:
    if len(jax.devices()) != 1:
        raise SystemExit("run with ONE device (unset XLA_FLAGS device counts)")
    builds = dict(zoo())
    models = {}
    for name in MODELS:
        rows = model_rows(name, builds[name])
        models[name] = {"rows": rows, "summary": summary(rows)}
        s = models[name]["summary"]
        print(f"{name}: {_summary_text(s)}", flush=True)
    data = {"device": one_cpu_device(), "steps": STEPS, "models": models}
    lines = [
        "# A train step's matmuls on XLA:CPU, in the step and alone",
        "",
        f"`python benchmarks/cpu_dots.py`, {data['device']}. Each kernel of the zoo's step that "
        f"is one dot: its least time over {STEPS} profiled steps (and the share of it another "
        "kernel ran beside it), against the same dot compiled alone on fp32 operands (the median "
        f"over {CHAIN} dependent copies of it in one program of each's least time over {STEPS} "
        "profiled calls). `*`: operands laid out other than row-major in the step.",
    ]
    for name, model in models.items():
        s = model["summary"]
        lines += [
            "",
            f"## {name}",
            "",
            _summary_text(s),
            "",
            "| kernel | op | shapes | MFLOP | in the step | beside others | alone | step / alone |",
            "|---|---|---|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['kernel']} | {r['op']} | {r['shapes']}{'' if r['row_major'] else ' *'} | "
            f"{r['mflop']:.1f} | {r['step_us']:.0f} µs | {r['share_beside_other_kernels']:.0%} "
            f"| {r['alone_us']:.0f} µs | {r['step_over_alone']:.2f} |"
            for r in model["rows"]
        ]
    save_results("cpu_dots", data, lines)


if __name__ == "__main__":
    main()
