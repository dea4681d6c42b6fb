"""What the planner knows about a cluster: device count, speed, memory and links, as plain numbers.

The planner never touches devices, so a `ClusterSpec` stands for them: plans for 64 H100s can be
made on a laptop. The physical mesh is (num_hosts, devices_per_host); axis 0 crosses hosts,
axis 1 stays inside one. Units: FLOP/s, bytes, bytes/s, seconds.

Compute is priced per op as a roofline (`autopar.planner.cost.op_time`): the op's FLOPs at the
peak for its dtype (`peak_flops`: 16-bit, TF32 or fp32) times `compute_efficiency`, against the
bytes it moves at `memory_bandwidth` times `memory_efficiency`, plus `kernel_overhead_s` per
kernel. Some op classes run at rates of their own where a spec gives them (achieved rates, which
the efficiencies do not scale): element-wise transcendentals (`exp`, `tanh`, ...) at
`transcendental_rate` elements/s, convolutions at `conv_flops`, transposes that move the minor
(contiguous) dimension at `transpose_bandwidth`, matmuls whose lhs contracts a dimension other
than its minor one (a weight gradient x^T·dy, which XLA:CPU runs outside its fast matmul kernels)
at `transposed_matmul_rate` of its result's columns (XLA:CPU packs its transposed lhs first, a
cost that a narrow result amortizes over fewer FLOPs: a 64-column one runs at about half the
rate of a 256-column one; `transposed_matmul_flops` and `narrow_transposed_matmul_flops` are the
two), and pools and their gradients (below). A small matmul does not
reach the peak (it leaves cores or tensor-core units idle and pays set-up that a large one
amortizes): `matmul_efficiency` holds
measured (FLOPs, fraction of the peak) points, and a contraction of F FLOPs per device runs at
its peak times `matmul_fraction(F)` (`autopar.profile_cluster()` measures the points; the
presets have none). The fields after `platform` have defaults that
reproduce the FLOP-only model older plan files were priced with (memory bandwidth unknown, so
memory-bound work is free; transcendentals one FLOP per element, convolutions at the matmul peak,
transposes folded into their readers): the presets and `autopar.profile_cluster()` give real
figures.

A step starts on the host: the runtime launches its program and collects its results, a cost the
devices do not see. `launch_overhead_s` is that cost for one program and `buffer_overhead_s` what
each input and output buffer adds to it (`autopar.planner.roofline.launch_s`): a step that waits
for its results pays them on top of its device time (the host is idle meanwhile), and a pipeline
pays them per task. Small models on GPUs spend much of their step there. `kernel_update_s` is what
each kernel adds to a launch whose buffers moved since the last one: XLA:GPU runs a program as
one CUDA graph and updates its kernels' arguments before launching it again, and a train step's
outputs are fresh buffers every step. A CPU has no graph: 0 there.

A step also writes its temporaries, and on a CPU that costs more than bandwidth where the
allocator hands them out afresh every step: glibc maps an allocation of `fresh_memory_threshold`
bytes or more (its largest dynamic mmap threshold, 32 MiB) from the kernel and unmaps it when
freed, so every step's first write to each of its pages faults and zeroes it. XLA:CPU allocates
a step's temporaries as one block, so a step whose temporaries reach the threshold pays their
bytes at `fresh_memory_rate` (`autopar.planner.roofline.fresh_memory_s`). GPU runtimes keep a
pool of device memory: None there, and no cost.

A GPU reduces the rows of a column reduction (one that keeps the minor dimension: a bias or
layer norm gradient, batch norm statistics) in a loop per thread block, so one over many rows
and few columns takes far longer than its bytes: an H200 takes 4.9 µs to sum a 4096x64 float32
array over its rows (1 MiB, 0.25 µs of its bandwidth) and 2.0 µs at 1024 rows. Where a spec
gives `column_reduction_rate` (rows/s), a column reduction takes at least its rows over that
rate beyond its kernel floor (`autopar.planner.roofline`; XLA:GPU splits one over more than
`roofline.COLUMN_REDUCTION_SPLIT` rows into two kernels of about √rows each). XLA:CPU's column
reductions stream at the memory bandwidth (a 4096x8 one takes what a streaming kernel over it
takes): None there, as in specs that predate it. XLA:GPU fuses element-wise work over the
reduced array's shape into the reduction's kernel, and such a kernel walks its rows far more
slowly, per array of that shape it reads or writes: a GPT's layer norm gradient over 1024x256
that also writes two such arrays took 18 µs on an H200, a plain one 3.5 µs.
`column_reduction_array_rate` (rows/s per array) prices it; None: not priced.

XLA:CPU runs a reduce-window (a max or average pool) as a scalar loop over each output's window,
element by element: a 3x3 max pool of stride 2 over 4 MiB took 0.6 ms on a 2-core host, 0.25 ns
per window element and 8x its bytes' time. Max pooling's gradient (`select_and_scatter_add`) it
expands into an int32 iota of the operand's shape per dimension, a reduce-window over the
operand and those iotas that picks each window's maximum and its index, and a scatter of the
gradient there: 60 ns a window on that host over 4 MiB, a hundred times its bytes' time, and
22-30 ns where the operand fits in 1 MiB. `window_reduction_rate` (window elements/s) and
`select_and_scatter_rate` (windows/s, beyond the caches) price them where a spec gives them,
and `cached_select_and_scatter_rate` a gradient over an operand the caches hold
(`select_and_scatter_rate_at` reads between the two sizes); None (the presets: no GPU was
measured on them): priced by their bytes.

XLA:CPU fuses the element-wise loop that writes a dot's operand into the copy that lays the
operand out for its matmul (`autopar.planner.dot_layout`), and that loop reads its arrays down
their columns. Where the row stride is a multiple of `aliasing_stride` (the L1 cache's size
over its ways: 4 KiB on this x86 host), every line one output row walks falls in the same few
cache sets, and XLA packs its temporaries back to back, so the arrays' lines share them too: an
MoE expert layer's GELU gradient, copied from [4 experts, 512 tokens, 1024] and reading 3 arrays,
took 18 ms, 2.9 ns per element and array, against 0.3 ns at a 1000-wide layer.
`aliased_loop_rate` and `many_lines_aliased_loop_rate` price such a loop by its lines in flight
(`aliased_loop_s_at`); None (GPUs, which transpose in tiles, and the presets): priced as any
copy.

Peak memory follows the order XLA runs a step in (`autopar.planner.memory`). XLA:CPU's DFS memory
scheduler, which `autopar.simulate_cpu_devices` selects, runs every weight gradient but the
first layer's after the whole backward pass; `dfs_schedule` says a spec's XLA:CPU uses it
(`ClusterSpec.local` and `autopar.profile_cluster()` read it off XLA_FLAGS; Ray's simulated
hosts always do). Otherwise steps are taken in program order, close to XLA:CPU's default
breadth-first scheduler.

All-to-alls follow Alpa's formula, fitted to V100s and NVLink; where they run slower than it
on the link the other collectives measure (XLA:CPU's all-to-all), `all_to_all_factor` scales
its bytes term (`autopar.profile_cluster()` fits it; 1 in the presets).

XLA:CPU's collectives between simulated devices copy through the host's caches, and slow down
once their buffers outgrow them: on a 2-core host with a 32 MiB last-level cache, 8 devices
all-gathered at 4.4 GB/s (bus bandwidth) up to 4 MiB and at 3.0 GB/s from 8 MiB. Where a spec
gives `cached_intra_host_bandwidth`, the share of a collective's bytes whose buffers fit in
`collective_cache_bytes` per device (the last-level cache over the host's devices) moves at it
and the rest at `intra_host_bandwidth` (`autopar.planner.cost`); None (GPUs, the presets): one
bandwidth at every size.

Bandwidths are *bus bandwidths* as NCCL reports them, so that the α-β formulas in
`autopar.planner.cost` apply directly. `inter_host_bandwidth` is the share **one device** gets
when every device of a host talks across hosts at once (host NIC bandwidth / devices_per_host),
which is what a collective along axis 0 of a (hosts, devices_per_host) logical mesh sees.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import json
import math
import numbers
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from autopar.planner.errors import InvalidArgumentError

_INT_FIELDS = ("num_hosts", "devices_per_host")
PLATFORMS = ("gpu", "cpu")
_POSITIVE_FIELDS = (
    *("device_flops", "device_memory", "intra_host_bandwidth", "inter_host_bandwidth"),
    *("fresh_memory_threshold", "all_to_all_factor"),
)
_NON_NEGATIVE_FIELDS = (
    *("intra_host_latency", "inter_host_latency", "kernel_overhead_s"),
    *("launch_overhead_s", "buffer_overhead_s", "kernel_update_s"),
)
_OPTIONAL_POSITIVE_FIELDS = (
    "memory_bandwidth",
    "fp32_flops",
    "tf32_flops",
    "transcendental_rate",
    "conv_flops",
    "transpose_bandwidth",
    "transposed_matmul_flops",
    "narrow_transposed_matmul_flops",
    "fresh_memory_rate",
    "column_reduction_rate",
    "column_reduction_array_rate",
    "window_reduction_rate",
    "select_and_scatter_rate",
    "cached_select_and_scatter_rate",
    "aliasing_stride",
    "aliased_loop_rate",
    "many_lines_aliased_loop_rate",
    "collective_cache_bytes",
    "cached_intra_host_bandwidth",
)
_FRACTION_FIELDS = ("compute_efficiency", "memory_efficiency")
GLIBC_MMAP_THRESHOLD = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts
# The result widths (columns per device) at which `autopar.profile_cluster()` times a weight
# gradient: `narrow_transposed_matmul_flops` at the first, `transposed_matmul_flops` at the second.
TRANSPOSED_MATMUL_COLUMNS = (64, 256)
# The operand bytes per device at which it times max pooling's gradient:
# `cached_select_and_scatter_rate` at the first (one core's L2 cache holds it),
# `select_and_scatter_rate` at the second (beyond the caches, as training-size activations are).
SELECT_AND_SCATTER_BYTES = (512 * 2**10, 4 * 2**20)
# The lines in flight (rows walked x arrays read) at which it times an element-wise loop that
# XLA:CPU fuses into a transposing copy at an aliasing row stride: `aliased_loop_rate` at the
# first (256 rows, 2 arrays), `many_lines_aliased_loop_rate` at the second (512 rows, 3 arrays).
ALIASED_LOOP_LINES = (512, 1536)
# False selects XLA:CPU's DFS memory scheduler over its breadth-first default
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def xla_cpu_dfs_scheduler() -> bool:
    """Whether this process's XLA:CPU schedules with its DFS memory scheduler: its
    concurrency-optimised default turned off in XLA_FLAGS, as `autopar.simulate_cpu_devices`
    does (read when a CPU spec is made, as XLA reads it when it compiles)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return any(f in flags for f in (f"{CPU_SCHEDULER_FLAG}=false", f"{CPU_SCHEDULER_FLAG}=0"))


_SIXTEEN_BIT = frozenset({"bfloat16", "float16"})


@functools.cache
def _dtype_name(dtype: Any) -> str:
    """A dtype's name; cached, as numpy computes it anew on every access and the cost model
    asks for it once per op and strategy."""
    return getattr(dtype, "name", str(dtype))


def log_interpolated(x: float, low: tuple[float, float], high: tuple[float, float]) -> float:
    """y at `x` on the line through points `low` and `high` (x increasing) in log x; `low`'s y
    at or below it, `high`'s at or above: how a measured rate is read between two sizes."""
    (x0, y0), (x1, y1) = low, high
    if x <= x0:
        return y0
    if x >= x1:
        return y1
    return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)


def _checked_curve(curve: Any) -> tuple[tuple[float, float], ...]:
    """`ClusterSpec.matmul_efficiency` as a tuple of (FLOPs, fraction) float pairs (JSON gives
    lists), or ValueError naming what is wrong."""
    hint = "pairs (FLOPs > 0, fraction in (0, 1]) with FLOPs increasing"
    try:
        points = tuple((float(f), float(e)) for f, e in curve)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"ClusterSpec.matmul_efficiency must be {hint}, got {curve!r}"
        ) from e
    ok = all(math.isfinite(f) and f > 0 and 0 < e <= 1 for f, e in points)
    if not ok or any(f0 >= f1 for (f0, _), (f1, _) in itertools.pairwise(points)):
        raise InvalidArgumentError(f"ClusterSpec.matmul_efficiency must be {hint}, got {curve!r}")
    return points


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A homogeneous cluster of `num_hosts` hosts with `devices_per_host` accelerators each."""

    num_hosts: int
    devices_per_host: int
    device_flops: float
    device_memory: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    intra_host_latency: float
    inter_host_latency: float
    name: str = "custom"
    platform: str = "gpu"  # the XLA backend that compiles for it: its memory layout rules differ
    memory_bandwidth: float | None = None  # bytes/s of device memory; None: not priced
    fp32_flops: float | None = None  # fp32 peak (no tensor cores); None: device_flops
    tf32_flops: float | None = None  # fp32 matmuls at default precision; None: fp32_flops
    compute_efficiency: float = 1.0  # share of the peak a large matmul reaches
    memory_efficiency: float = 1.0  # share of memory_bandwidth a streaming kernel reaches
    kernel_overhead_s: float = 0.0  # launch floor of every kernel
    transcendental_rate: float | None = None  # elements/s of exp & co.; None: 1 FLOP each
    conv_flops: float | None = None  # FLOP/s of a convolution; None: the matmul peak
    transpose_bandwidth: float | None = None  # bytes/s moving the minor dim; None: folded, free
    transposed_matmul_flops: float | None = None  # lhs contracting its major dim; None: peak
    # FLOP/s of such a matmul whose result is 64 columns wide; None: transposed_matmul_flops
    narrow_transposed_matmul_flops: float | None = None
    fresh_memory_rate: float | None = None  # bytes/s of first writes to fresh pages; None: free
    column_reduction_rate: float | None = None  # rows/s a column reduction walks; None: free
    # rows/s per array of its operand's size a column reduction with fused element-wise outputs
    # reads or writes; None: such outputs are priced by their bytes
    column_reduction_array_rate: float | None = None
    window_reduction_rate: float | None = None  # window elements/s of a pool; None: by bytes
    # windows/s of max pooling's gradient (`select_and_scatter_add`); None: priced by its bytes
    select_and_scatter_rate: float | None = None
    # the same over an operand the caches hold; None: select_and_scatter_rate at every size
    cached_select_and_scatter_rate: float | None = None
    # bytes: a CPU's L1 cache over its ways, the span of its sets; None: no aliasing priced
    aliasing_stride: float | None = None
    # elements x arrays read per second of an element-wise loop fused into a transposing copy
    # whose row stride is a multiple of aliasing_stride, at ALIASED_LOOP_LINES[0] and [1]
    # lines in flight; None: such a copy priced as any other
    aliased_loop_rate: float | None = None
    many_lines_aliased_loop_rate: float | None = None
    fresh_memory_threshold: float = GLIBC_MMAP_THRESHOLD  # bytes: allocations mapped afresh
    launch_overhead_s: float = 0.0  # host time to launch one program and collect its results
    buffer_overhead_s: float = 0.0  # host time each input or output buffer adds to a launch
    kernel_update_s: float = 0.0  # host time each kernel adds to a launch whose buffers moved
    all_to_all_factor: float = 1.0  # all-to-all time over its α-β formula's bytes term
    # bytes per device of the host's last-level cache (its size over the host's devices); a
    # collective's buffers within it move at cached_intra_host_bandwidth (bytes/s); None: the
    # link's bandwidth at every size
    collective_cache_bytes: float | None = None
    cached_intra_host_bandwidth: float | None = None
    # (FLOPs, fraction of the peak) of matmuls by size, FLOPs increasing; () : every size at peak
    matmul_efficiency: tuple[tuple[float, float], ...] = ()
    # XLA:CPU schedules with its DFS memory scheduler (`xla_cpu_dfs_scheduler`); False: in
    # about program order (its default breadth-first scheduler, and every GPU spec)
    dfs_schedule: bool = False

    def __post_init__(self) -> None:
        for field in _INT_FIELDS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise InvalidArgumentError(
                    f"ClusterSpec.{field} must be a positive int, got {value!r}"
                )
            object.__setattr__(self, field, int(value))
        for field in _POSITIVE_FIELDS + _NON_NEGATIVE_FIELDS:
            value = getattr(self, field)
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            ok = ok and math.isfinite(value) and value >= 0
            if not ok or (field in _POSITIVE_FIELDS and value == 0):
                kind = "positive" if field in _POSITIVE_FIELDS else "non-negative"
                raise InvalidArgumentError(
                    f"ClusterSpec.{field} must be a {kind} finite number, got {value!r}"
                )
            object.__setattr__(self, field, float(value))  # one type in reprs and JSON
        for field in _OPTIONAL_POSITIVE_FIELDS + _FRACTION_FIELDS:
            value = getattr(self, field)
            if value is None and field in _OPTIONAL_POSITIVE_FIELDS:
                continue
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            ok = ok and math.isfinite(value) and value > 0
            ok = ok and (field not in _FRACTION_FIELDS or value <= 1)
            if not ok:
                kind = "number in (0, 1]" if field in _FRACTION_FIELDS else "positive finite number"
                raise InvalidArgumentError(f"ClusterSpec.{field} must be a {kind}, got {value!r}")
            object.__setattr__(self, field, float(value))
        object.__setattr__(self, "matmul_efficiency", _checked_curve(self.matmul_efficiency))
        if (self.collective_cache_bytes is None) != (self.cached_intra_host_bandwidth is None):
            raise InvalidArgumentError(
                "ClusterSpec.collective_cache_bytes and cached_intra_host_bandwidth go together "
                f"(both or neither), got {self.collective_cache_bytes!r} and "
                f"{self.cached_intra_host_bandwidth!r}"
            )
        if not isinstance(self.dfs_schedule, bool):
            raise InvalidArgumentError(
                f"ClusterSpec.dfs_schedule must be a bool, got {self.dfs_schedule!r}"
            )
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(
                f"ClusterSpec.name must be a non-empty str, got {self.name!r}"
            )
        if self.platform not in PLATFORMS:
            raise InvalidArgumentError(
                f"ClusterSpec.platform must be one of {PLATFORMS}, got {self.platform!r}"
            )

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    @property
    def physical_mesh_shape(self) -> tuple[int, int]:
        return (self.num_hosts, self.devices_per_host)

    @property
    def overlaps_communication(self) -> bool:
        """Whether collectives can run beside compute: a GPU runs them on their own streams
        (NCCL kernels next to the compute kernels); a CPU's collectives are copies made by the
        cores that compute, so the time they take is never hidden."""
        return self.platform == "gpu"

    def peak_flops(
        self, dtype: Any, matmul: bool = False, highest_precision: bool = False
    ) -> float:
        """FLOP/s peak for arithmetic in `dtype`: 16-bit floats at `device_flops`; fp32 matmuls
        at `tf32_flops` unless `highest_precision` (JAX's default lets XLA use TF32 on GPUs);
        everything else at `fp32_flops`."""
        name = _dtype_name(dtype)
        if name in _SIXTEEN_BIT:
            return self.device_flops
        fp32 = self.fp32_flops or self.device_flops
        if matmul and name == "float32" and not highest_precision:
            return self.tf32_flops or fp32
        return fp32

    def matmul_fraction(self, flops: float) -> float:
        """The share of its peak a matmul of `flops` FLOPs (per device) reaches: linear in
        log FLOPs between the `matmul_efficiency` points, the nearest point's outside them."""
        curve = self.matmul_efficiency
        if not curve:
            return 1.0
        for low, high in itertools.pairwise(curve):
            if flops <= high[0]:
                return log_interpolated(flops, low, high)
        return curve[-1][1]

    def transposed_matmul_rate(self, columns: float) -> float | None:
        """FLOP/s of a matmul whose lhs contracts its major dim (a weight gradient x^T·dy) with
        a result `columns` wide per device; None: not priced. XLA:CPU's Eigen kernel first packs
        the transposed lhs (rows x contraction), a cost its result's columns do not share, so a
        narrow result runs slower: time = lhs elements / packing rate + FLOPs / R, and the rate
        is R·N / (N + N½) for N columns. The two measured widths (`TRANSPOSED_MATMUL_COLUMNS`)
        fix R and N½: on a 2-core host, 160 GFLOP/s at 64 columns and 285 at 256 give R = 385
        and N½ = 90, which reads 226 at 128 columns (245 measured), 101 at 32 (77), 327 at 512
        (318-334). Where the narrow rate is not measured, or the two do not fit that law (the
        narrow one faster, or under a quarter of the wide one), every width runs at the wide
        rate."""
        narrow, wide = self.narrow_transposed_matmul_flops, self.transposed_matmul_flops
        if wide is None or narrow is None:
            return wide
        low, high = TRANSPOSED_MATMUL_COLUMNS
        # seconds per FLOP = 1 / R + (N½ / R) / N, through the two measured points
        per_column = (1 / narrow - 1 / wide) / (1 / low - 1 / high)
        per_flop = 1 / wide - per_column / high
        if per_column <= 0 or per_flop <= 0:
            return wide
        return 1 / (per_flop + per_column / columns)

    def select_and_scatter_rate_at(self, operand_bytes: float) -> float | None:
        """Windows/s of max pooling's gradient over `operand_bytes` per device: faster where the
        caches hold the operand it scatters into (a 2-core host: 22-30 ns a window up to 1 MiB,
        35-70 ns from 4 MiB). Linear in log bytes between the two measured sizes
        (`SELECT_AND_SCATTER_BYTES`), the nearest one's outside them; None: not priced."""
        cached, large = self.cached_select_and_scatter_rate, self.select_and_scatter_rate
        if large is None or cached is None:
            return large
        low, high = SELECT_AND_SCATTER_BYTES
        return log_interpolated(operand_bytes, (low, cached), (high, large))

    def aliased_loop_s_at(self, lines: float) -> float | None:
        """Seconds per element and array read of an element-wise loop that XLA:CPU fuses into a
        transposing copy at a row stride that is a multiple of `aliasing_stride`, with `lines`
        lines in flight (the rows one output row walks times the arrays it reads): every such
        line falls in the same few cache sets, so the more there are, the further each read
        goes. On a 2-core host: 1.1 ns at 256 to 512 lines, 1.9-2.3 at 1024, 2.7-3.1 at 1536,
        against 0.15-0.32 at a 4000-byte stride. The two measured points
        (`ALIASED_LOOP_LINES`), the first's time at fewer lines, linear through both beyond it;
        None: not priced."""
        few, many = self.aliased_loop_rate, self.many_lines_aliased_loop_rate
        if self.aliasing_stride is None or few is None or many is None:
            return None
        low, high = ALIASED_LOOP_LINES
        few_s, many_s = 1 / few, 1 / many
        return few_s + max(0.0, many_s - few_s) * max(0.0, lines - low) / (high - low)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; `ClusterSpec.from_dict` reads it back unchanged."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["matmul_efficiency"] = [list(point) for point in self.matmul_efficiency]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterSpec:
        """Build from `to_dict()`'s output; every field but `name` is required, no extra keys."""
        if not isinstance(d, Mapping):
            raise InvalidArgumentError(
                f"ClusterSpec.from_dict needs a mapping, got {type(d).__name__}"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
        missing = sorted(required - d.keys())
        unknown = sorted(set(d.keys()) - fields.keys())
        if missing or unknown:
            raise InvalidArgumentError(
                f"ClusterSpec.from_dict: missing keys {missing}, unknown keys {unknown}; "
                f"expected {sorted(fields)}"
            )
        return cls(**d)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        """Read a spec written as `json.dump(spec.to_dict(), f)`. Every error names the file."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise InvalidArgumentError(
                f"cannot read cluster spec file {os.fspath(path)!r}: {e}"
            ) from e
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(
                f"cluster spec file {os.fspath(path)!r} is not valid JSON: {e}"
            ) from e
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"cluster spec file {os.fspath(path)!r}: {e}") from e

    @classmethod
    def preset(cls, name: str) -> ClusterSpec:
        """A known node type, e.g. "8xV100-p3"; prefix "Nx" for N such hosts: "2x8xV100-p3"."""
        if name in PRESETS:
            return PRESETS[name]
        hosts, sep, node = name.partition("x")
        if sep and hosts.isdigit() and node in PRESETS:
            if int(hosts) < 1:
                raise InvalidArgumentError(
                    f"cluster preset {name!r} needs at least 1 host, got {hosts}"
                )
            base = PRESETS[node]
            if int(hosts) == 1:
                return base
            return dataclasses.replace(base, num_hosts=int(hosts), name=name)
        names = [*PRESETS, *(f"{hosts}x{p}" for p in PRESETS if sep and hosts.isdigit())]
        close = difflib.get_close_matches(name, names, 1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise InvalidArgumentError(
            f"unknown cluster preset {name!r}; {hint}known presets: {', '.join(preset_names())} "
            f"(prefix 'Nx' for N hosts, e.g. '2x{preset_names()[0]}')"
        )

    def with_devices(self, num_hosts: int, devices_per_host: int) -> ClusterSpec:
        """The same hardware cut down to a (num_hosts, devices_per_host) sub-cluster."""
        if (
            not 1 <= num_hosts <= self.num_hosts
            or not 1 <= devices_per_host <= self.devices_per_host
        ):
            raise InvalidArgumentError(
                f"sub-cluster ({num_hosts}, {devices_per_host}) does not fit in cluster "
                f"{self.name!r} of shape {self.physical_mesh_shape}"
            )
        name = f"{self.name}[{num_hosts}x{devices_per_host}]"
        return dataclasses.replace(
            self, num_hosts=num_hosts, devices_per_host=devices_per_host, name=name
        )

    @classmethod
    def local(cls, num_devices: int) -> ClusterSpec:
        """Simulated CPU devices on one host (--xla_force_host_platform_device_count).

        The figures are modest guesses for a few CPU cores per device, not measurements: they keep
        plans well-defined on a laptop; use `ClusterSpec.preset` or a profile for real numbers.
        """
        return cls(
            num_hosts=1,
            devices_per_host=num_devices,
            device_flops=100e9,  # ~100 GFLOP/s: a few AVX2 cores in fp32
            device_memory=8e9,  # 8 GB: a share of a laptop's RAM
            intra_host_bandwidth=10e9,  # ~10 GB/s: memcpy between host buffers
            inter_host_bandwidth=10e9,  # unused on one host; same as intra
            intra_host_latency=10e-6,  # ~10 µs: thread hand-off per collective
            inter_host_latency=10e-6,
            name=f"local-{num_devices}",
            platform="cpu",
            memory_bandwidth=10e9,  # ~10 GB/s: a share of a laptop's DRAM bandwidth
            compute_efficiency=0.8,
            memory_efficiency=0.8,
            kernel_overhead_s=2e-6,  # ~2 µs: dispatching one fused loop
            launch_overhead_s=5e-6,  # a jitted call on a 2-core machine (`profile_cluster`)
            buffer_overhead_s=0.6e-6,
            dfs_schedule=xla_cpu_dfs_scheduler(),
        )


# Per-collective latency α from NCCL's ring model (REFERENCE.md: ≈ 8.4 µs base + 3.4 µs per NVLink
# step, 14 µs per network step): base + one step of the link. The α-β model has no hop count,
# so this is the start-up cost of one collective, not of a full ring pass.
_NVLINK_ALPHA = 8.4e-6 + 3.4e-6  # 11.8 µs
_NETWORK_ALPHA = 8.4e-6 + 14e-6  # 22.4 µs
# What kernels reach of the datasheet peaks (shared by the GPU presets): cuBLAS/cuDNN GEMMs of
# training shapes run at 70–85% of tensor-core peak (NVIDIA's Deep Learning Performance guide,
# "Matrix Multiplication Background"), and a streaming copy at ~90% of HBM bandwidth (BabelStream
# on V100/A100/H100). A kernel launch with its grid set-up costs a few µs (CUDA launch latency
# ≈ 3–5 µs; XLA launches each fusion on its own).
# The host's share of a step (JAX's dispatch of a program and its buffers) as `profile_cluster`
# measured it on a lent H100 machine (16 vCPUs of a virtualised Xeon;
# benchmarks/results/cost_model_gpu.json): 50 µs to launch a program and wait for it, 1.9 µs
# per input or output buffer; and on a lent H200 what each kernel adds
# where the buffers moved (`KernelTiming.update_per_kernel_s`): 1.55, 1.17 and 0.81 µs in three
# measurements; the median.
_GPU_COMPUTE_EFFICIENCY = 0.75
_GPU_MEMORY_EFFICIENCY = 0.9
_GPU_KERNEL_OVERHEAD_S = 4e-6
_GPU_EFFICIENCIES = {
    "compute_efficiency": _GPU_COMPUTE_EFFICIENCY,
    "memory_efficiency": _GPU_MEMORY_EFFICIENCY,
    "kernel_overhead_s": _GPU_KERNEL_OVERHEAD_S,
    "launch_overhead_s": 50e-6,
    "buffer_overhead_s": 1.9e-6,
    "kernel_update_s": 1.17e-6,
}

_PRESETS: dict[str, ClusterSpec] = {
    # AWS p3.16xlarge, Alpa's testbed (REFERENCE.md): 8 × V100 16 GB with NVLink, 25 Gb/s network.
    "8xV100-p3": ClusterSpec(
        num_hosts=1,
        devices_per_host=8,
        device_flops=125e12,  # V100 fp16 tensor-core peak (Alpa trained in fp16)
        device_memory=16e9,  # 16 GB HBM2 (decimal GB: leaves room for the CUDA context)
        intra_host_bandwidth=130e9,  # ≈ NCCL all-reduce bus bw on the DGX-1V-style NVLink mesh
        inter_host_bandwidth=25e9 / 8 / 8,  # 25 Gb/s = 3.125 GB/s per host, shared by 8 GPUs
        intra_host_latency=_NVLINK_ALPHA,
        inter_host_latency=_NETWORK_ALPHA,
        name="8xV100-p3",
        memory_bandwidth=900e9,  # V100 SXM2 HBM2 (datasheet)
        fp32_flops=15.7e12,  # V100 SXM2 fp32 (datasheet); no TF32 on Volta
        tf32_flops=15.7e12,
        **_GPU_EFFICIENCIES,
    ),
    # DGX/HGX A100 80 GB node.
    "8xA100-80G": ClusterSpec(
        num_hosts=1,
        devices_per_host=8,
        device_flops=312e12,  # A100 bf16 dense tensor-core peak
        device_memory=80e9,  # 80 GB HBM2e
        intra_host_bandwidth=200e9,  # NVLink all-reduce bus bw ≈ 200–208 GB/s (REFERENCE.md)
        inter_host_bandwidth=90e9 / 8,  # 4 × 200 Gb/s HDR ≈ 85–96 GB/s per node (REFERENCE.md)
        intra_host_latency=_NVLINK_ALPHA,
        inter_host_latency=_NETWORK_ALPHA,
        name="8xA100-80G",
        memory_bandwidth=2.039e12,  # A100 80GB SXM HBM2e (datasheet)
        fp32_flops=19.5e12,  # A100 fp32 (datasheet)
        tf32_flops=156e12,  # A100 TF32 dense tensor-core peak
        **_GPU_EFFICIENCIES,
    ),
    # DGX/HGX H100 80 GB (SXM) node.
    "8xH100-80G": ClusterSpec(
        num_hosts=1,
        devices_per_host=8,
        device_flops=989e12,  # H100 SXM bf16 dense tensor-core peak
        device_memory=80e9,  # 80 GB HBM3
        intra_host_bandwidth=370e9,  # NCCL ≈ 370 GB/s of the 450 GB/s NVLink line rate (REFERENCE)
        # 8 × 400 Gb/s NDR = 50 GB/s per GPU line rate; × 0.9, the measured/line ratio of the
        # A100's HDR figure above (90 of 100 GB/s), as REFERENCE.md has no measured NDR figure.
        inter_host_bandwidth=45e9,
        intra_host_latency=_NVLINK_ALPHA,
        inter_host_latency=_NETWORK_ALPHA,
        name="8xH100-80G",
        memory_bandwidth=3.35e12,  # H100 SXM HBM3 (datasheet)
        fp32_flops=67e12,  # H100 SXM fp32 (datasheet)
        tf32_flops=494.7e12,  # H100 SXM TF32 dense tensor-core peak
        # `profile_cluster` on a lent H200 (the same Hopper SMs and clocks;
        # benchmarks/results/cost_model_gpu.json): a 4096-row column reduction's loop,
        # 0.96 G rows/s. V100 and A100: none
        # measured, so their column reductions are priced by their bytes.
        column_reduction_rate=0.96e9,
        # the same with an element-wise output fused in: 0.34 and 0.36 G rows/s per array on
        # two lent H200s
        column_reduction_array_rate=0.35e9,
        **_GPU_EFFICIENCIES,
    ),
}
PRESETS: Mapping[str, ClusterSpec] = MappingProxyType(_PRESETS)
"""Single-host node presets by name; `ClusterSpec.preset("Nx<name>")` gives N hosts of one."""


def preset_names() -> list[str]:
    """Names of the single-host presets (each also reachable with an "Nx" host-count prefix)."""
    return sorted(PRESETS)
