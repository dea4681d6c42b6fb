"""`autopar.profile_cluster`: a `ClusterSpec` measured on the devices at hand.

The presets hold datasheet figures; a profile holds what this machine reaches, for the cost
model's roofline and α-β formulas (`autopar.planner.cost`). Every figure is an achieved rate, so
`compute_efficiency` and `memory_efficiency` are 1:

- `device_flops`, `tf32_flops`, `fp32_flops`: the median matmul rate over a few shapes in bf16,
  fp32 at JAX's default precision and fp32 at `Precision.HIGHEST` (`microbench.measure_matmuls`);
- `matmul_efficiency`: how a matmul's rate grows with its size, from float32 matmuls of growing
  size (`microbench.measure_matmul_ramp`, `matmul_efficiency`);
- `memory_bandwidth`: a streaming `x * a + b` (bytes read + written per second);
- `kernel_overhead_s`: one tiny kernel's cost inside a program (not Python's dispatch);
- `kernel_update_s`: what each kernel adds to a launch whose buffers moved since the last one
  (a chain of tiny kernels whose buffer is not donated against the same chain donated;
  `KernelTiming.update_per_kernel_s`);
- `launch_overhead_s`, `buffer_overhead_s`: Python's dispatch, the host's cost to launch a
  program and wait for it, and what each input or output buffer adds (`microbench.measure_launch`);
- `transcendental_rate`, `conv_flops`, `transpose_bandwidth`: the rates of the op classes the
  roofline prices on their own (`autopar.planner.roofline`): `exp` over a streaming buffer
  (elements/s), a 3x3 convolution (FLOP/s; its batch grows until a run takes long enough),
  transposes of 1 MiB planes (bytes/s);
- `transposed_matmul_flops`, `narrow_transposed_matmul_flops`: a float32 weight gradient x^T·y
  (its lhs contracts its major dimension; its rows grow as the convolution's batch does) with a
  result 256 and 64 columns wide, FLOP/s;
- `column_reduction_rate`: on a GPU, rows per second a column reduction walks (a bias
  gradient's mean over 4096 rows, beyond its kernels' floors); None on a CPU, whose column
  reductions stream;
- `column_reduction_array_rate`: on a GPU, rows per second per full-shape array a column
  reduction walks where XLA fuses an element-wise output of its operand's shape into it
  (`microbench.measure_column_reduction_arrays`); None on a CPU, or where XLA fuses none;
- `window_reduction_rate`, `select_and_scatter_rate`: a 3x3 max pool (stride 1, so a step keeps
  its shape) over 4 MiB of 32x32 images of 64 channels per device, window elements per second,
  and the gradient of one of stride 2 (`select_and_scatter_add`), windows per second;
  `cached_select_and_scatter_rate` that gradient over 512 KiB of images, which the caches hold;
- `aliasing_stride`, `aliased_loop_rate`, `many_lines_aliased_loop_rate`: on a CPU, the span of
  its L1 data cache's sets (size over ways, read from Linux's sysfs; None elsewhere), and an
  element-wise loop fused into a transposing copy whose rows lie that far apart, over temporaries
  XLA packs back to back: 256 rows reading 2 arrays and 512 rows reading 3, elements x arrays
  per second (`microbench.measure_aliased_loop`);
- `fresh_memory_rate`: what writing a step's temporaries costs where the allocator maps them
  afresh every step (allocations of at least `fresh_memory_threshold`, glibc's 32 MiB): bytes
  per second of the extra time of a streaming kernel writing a new buffer over writing in place;
  None where that costs nothing (memory pooled, as GPU runtimes do);
- `intra_host_*` / `inter_host_*`: α (latency) and 1/β (bus bandwidth) fitted per physical
  mesh axis (1 within a host, 0 across hosts) to all-reduce, all-gather and reduce-scatter
  timings, t = α + β·f(n)·B with the f(n) of the cost model's formulas (`fit_link`);
- `collective_cache_bytes`, `cached_intra_host_bandwidth`: on a CPU, the last-level cache (from
  sysfs) over the host's devices, and the bandwidth within a host of the bytes whose buffers fit
  there, fitted with the others where the collectives beyond it ran slower; None elsewhere;
- `all_to_all_factor`: how many times that link's bytes term the all-to-alls take
  (`fit_all_to_all`; XLA:CPU's run several times slower than Alpa's formula);
- `device_memory`: the device's `bytes_limit`; on CPU, physical RAM over the profiled devices.

An axis of one device has no link to time. Collectives over one device are free in the cost
model, so its figures are never used, but a spec needs numbers: `intra_host_*` then hold what
moving bytes inside one device costs (`memory_bandwidth`, `kernel_overhead_s`) and
`inter_host_*` (one host) copy `intra_host_*`, as `ClusterSpec.local` does.
`ClusterProfile.unmeasured` names the fields filled so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from autopar.planner.cluster import (
    ALIASED_LOOP_LINES,
    GLIBC_MMAP_THRESHOLD,
    PLATFORMS,
    TRANSPOSED_MATMUL_COLUMNS,
    ClusterSpec,
    xla_cpu_dfs_scheduler,
)
from autopar.planner.cost import Collective, LogicalMesh, link_figures
from autopar.planner.errors import InvalidArgumentError
from autopar.planner.progress import progress_bar
from autopar.runtime.microbench import (
    CollectiveTiming,
    KernelTiming,
    LaunchTiming,
    MatmulKind,
    MatmulTiming,
    ProfileSizes,
    RateKind,
    RateTiming,
    StreamTiming,
    measure_aliased_loop,
    measure_collectives,
    measure_column_reduction,
    measure_column_reduction_arrays,
    measure_convolution,
    measure_fresh_memory,
    measure_kernel_floor,
    measure_launch,
    measure_matmul_ramp,
    measure_matmuls,
    measure_select_and_scatter,
    measure_stream,
    measure_transcendental,
    measure_transpose,
    measure_transposed_matmul,
    measure_window_reduction,
    physical_mesh,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ClusterProfile",
    "CollectiveTiming",
    "KernelTiming",
    "LaunchTiming",
    "Link",
    "MatmulKind",
    "MatmulTiming",
    "ProfileSizes",
    "RateKind",
    "RateTiming",
    "StreamTiming",
    "efficiency_text",
    "fit_all_to_all",
    "fit_link",
    "matmul_efficiency",
    "measure_cluster",
    "predicted_collective_s",
    "profile_cluster",
]

DEFAULT_SIZES = ProfileSizes()
# How much slower (seconds per byte) collectives beyond the cache must run for the profile to
# keep a cached bandwidth: closer than that, the timings' noise (10-20% on a CPU host) decides
SLOWER_BEYOND_CACHE = 1.05
_INTRA = ("intra_host_bandwidth", "intra_host_latency")
_INTER = ("inter_host_bandwidth", "inter_host_latency")
_CACHE_INFO = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")  # Linux's view of cpu0's caches


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterProfile:
    """A measured `ClusterSpec` with the timings it was made from (for benchmarks and plots).

    `rates` holds one timing per `RateKind`; `collectives` lists each timing as (physical axis,
    kind, B, n, seconds); `unmeasured` the
    spec fields that no measurement set (see the module docstring); `seconds` the profile's
    wall time. `to_dict` / `from_dict` round-trip through JSON."""

    spec: ClusterSpec
    matmul: tuple[MatmulTiming, ...]
    matmul_ramp: tuple[MatmulTiming, ...]
    stream: StreamTiming
    kernel: KernelTiming
    launch: LaunchTiming
    rates: tuple[RateTiming, ...]
    collectives: tuple[CollectiveTiming, ...]
    unmeasured: tuple[str, ...]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; `ClusterProfile.from_dict` reads it back unchanged."""
        return {
            "spec": self.spec.to_dict(),
            "matmul": [_record_dict(t) for t in self.matmul],
            "matmul_ramp": [_record_dict(t) for t in self.matmul_ramp],
            "stream": _record_dict(self.stream),
            "kernel": _record_dict(self.kernel),
            "launch": _record_dict(self.launch),
            "rates": [_record_dict(t) for t in self.rates],
            "collectives": [_record_dict(t) for t in self.collectives],
            "unmeasured": list(self.unmeasured),
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterProfile:
        """Build from `to_dict()`'s output; a missing or malformed entry is named."""
        if not isinstance(d, Mapping):
            raise InvalidArgumentError(
                f"ClusterProfile.from_dict needs a mapping from to_dict(), got {type(d).__name__}"
            )
        expected = {f.name for f in dataclasses.fields(cls)}
        if set(d) != expected:
            raise InvalidArgumentError(
                f"ClusterProfile.from_dict: missing keys {sorted(expected - set(d))}, unknown "
                f"keys {sorted(set(d) - expected)}; pass the output of ClusterProfile.to_dict()"
            )
        try:
            return cls(
                spec=ClusterSpec.from_dict(d["spec"]),
                matmul=tuple(_record(MatmulTiming, r) for r in d["matmul"]),
                matmul_ramp=tuple(_record(MatmulTiming, r) for r in d["matmul_ramp"]),
                stream=_record(StreamTiming, d["stream"]),
                kernel=_record(KernelTiming, d["kernel"]),
                launch=_record(LaunchTiming, d["launch"]),
                rates=tuple(_record(RateTiming, r) for r in d["rates"]),
                collectives=tuple(_record(CollectiveTiming, r) for r in d["collectives"]),
                unmeasured=tuple(str(f) for f in d["unmeasured"]),
                seconds=float(d["seconds"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"ClusterProfile.from_dict: malformed entry ({type(e).__name__}: {e}); pass the "
                "output of ClusterProfile.to_dict()"
            ) from e

    def summary(self) -> str:
        """The spec's figures, one line per kind of measurement."""
        s = self.spec
        lines = [
            f"{s.name}: {s.num_hosts} host(s) x {s.devices_per_host} {s.platform} device(s), "
            f"profiled in {self.seconds:.1f} s",
            f"  matmul (per device): bf16 {_si(s.device_flops)}FLOP/s, fp32 "
            f"{_si(s.tf32_flops)}FLOP/s at default precision, {_si(s.fp32_flops)}FLOP/s at "
            "highest",
            f"  matmul rate by size: {efficiency_text(s.matmul_efficiency)}",
            f"  memory (per device): {_si(s.memory_bandwidth)}B/s streaming, "
            f"{_si(s.device_memory)}B; kernel floor {s.kernel_overhead_s * 1e6:.2f} us",
            f"  host: {s.launch_overhead_s * 1e6:.1f} us to launch a program, "
            f"{s.buffer_overhead_s * 1e6:.2f} us per input or output buffer, "
            f"{s.kernel_update_s * 1e6:.2f} us per kernel where the buffers moved",
            f"  op classes (per device): transcendentals {_si(s.transcendental_rate)}element/s, "
            f"convolutions {_si(s.conv_flops)}FLOP/s, minor-dimension transposes "
            f"{_si(s.transpose_bandwidth)}B/s, weight-gradient matmuls "
            f"{_si(s.transposed_matmul_flops)}FLOP/s ({_si(s.narrow_transposed_matmul_flops)}"
            f"FLOP/s 64 columns wide), max pools {_si(s.window_reduction_rate)}window "
            f"element/s, their gradients {_si(s.select_and_scatter_rate)}window/s "
            f"({_si(s.cached_select_and_scatter_rate)}window/s in cache)",
            f"  fresh memory: {_fresh(s)}; column reductions: {_column(s)}",
            f"  loops fused into transposing copies: {aliased_loop_text(s)}",
        ]
        for where, fields in (("within a host", _INTRA), ("across hosts", _INTER)):
            bandwidth, latency = (getattr(s, f) for f in fields)
            measured = fields[0] not in self.unmeasured
            note = "" if measured else " (no link to measure: see ClusterProfile.unmeasured)"
            lines.append(
                f"  {where}: bus bandwidth {_si(bandwidth)}B/s{_cached(s, fields)}, latency "
                f"{latency * 1e6:.1f} us{note}"
            )
        if self.collectives:
            lines.append(f"  all-to-all: {s.all_to_all_factor:.3g}x Alpa's formula on that link")
        return "\n".join(lines)


def _si(value: float | None) -> str:
    if value is None:
        return "? "
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


_ENUM_FIELDS = {MatmulTiming: MatmulKind, RateTiming: RateKind, CollectiveTiming: Collective}


def efficiency_text(points: Sequence[tuple[float, float]]) -> str:
    """`ClusterSpec.matmul_efficiency` in words: '12% at 131 kFLOP, ...'."""
    if not points:
        return "not measured (every size at the peak)"
    return ", ".join(f"{e:.0%} at {_si(f)}FLOP" for f, e in points)


def _record_dict(record: Any) -> dict[str, Any]:
    d = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    if "kind" in d:
        d["kind"] = d["kind"].value
    return d


def _record(cls: type, d: Mapping[str, Any]) -> Any:
    d = dict(d)
    if cls in _ENUM_FIELDS:
        d["kind"] = _ENUM_FIELDS[cls](d["kind"])
    return cls(**d)


# ----------------------------------------------------------------------------- fitting


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """One mesh axis's fitted figures: latency α (s), bus bandwidth (bytes/s) and, where the
    fit found collectives faster while their buffers fit in the cache, the bandwidth there."""

    latency: float
    bandwidth: float
    cached_bandwidth: float | None = None


def fit_link(timings: Sequence[CollectiveTiming], cache_bytes: float | None = None) -> Link:
    """The `Link` of one mesh axis from its collective timings.

    Fits t = α + β·x with x = f(n)·B, the cost model's formula at bandwidth 1 and latency 0,
    by least squares on relative error (timings span orders of magnitude); a negative α is
    refitted through the origin. With `cache_bytes` (per device), x splits as the cost model
    splits it: the share whose buffers fit (`Collective.device_bytes`) at the cached bandwidth,
    the rest at the link's; the split is kept where timings fall on both sides of it and those
    beyond run `SLOWER_BEYOND_CACHE` times slower or more, otherwise one bandwidth. A fit whose
    bytes cost < 1% of the largest timing (sizes too small to see a bandwidth) keeps its
    latency and takes the best rate reached, x / t, as the bandwidth (a lower bound)."""
    x = np.array([t.kind.cost(t.num_bytes, t.num_devices, 1.0, 0.0) for t in timings])
    y = np.array([t.seconds for t in timings])
    if len(timings) < 2 or np.any(y <= 0) or np.any(x <= 0):
        raise InvalidArgumentError(
            f"fit_link needs at least 2 timings with positive seconds and bytes, got {timings!r}"
        )
    if cache_bytes is not None:
        footprint = np.array([t.kind.device_bytes(t.num_bytes, t.num_devices) for t in timings])
        beyond = np.maximum(0.0, footprint - cache_bytes) / footprint
        if np.any(beyond > 0) and np.sum(beyond < 1) >= 2:
            alpha, cached, uncached = _latency_and_rates([x * (1 - beyond), x * beyond], y)
            if uncached > SLOWER_BEYOND_CACHE * cached > 0:
                return Link(alpha, 1.0 / uncached, 1.0 / cached)
    alpha, beta = _latency_and_rates([x], y)
    if beta * x.max() <= 0.01 * (alpha + beta * x.max()):  # bytes < 1% of the largest's time
        bandwidth = float(np.max(x / y))
        logger.warning(
            "collective times did not grow with size (%d timings up to %d bytes): bandwidth "
            "set to the best rate reached, %.3g B/s",
            len(timings),
            max(t.num_bytes for t in timings),
            bandwidth,
        )
        return Link(alpha, bandwidth)
    return Link(alpha, 1.0 / beta)


def _latency_and_rates(columns: Sequence[np.ndarray], seconds: np.ndarray) -> list[float]:
    """(α, c_1, ...) of t ≈ α + Σ c_j·columns_j by least squares on relative error, α >= 0 (a
    negative one is refitted through the origin)."""
    alpha, *rates = _relative_least_squares([np.ones_like(seconds), *columns], seconds)
    if alpha >= 0:
        return [alpha, *rates]
    return [0.0, *_relative_least_squares(columns, seconds)]


def _relative_least_squares(
    columns: Sequence[np.ndarray], seconds: np.ndarray, fixed: np.ndarray | float = 0.0
) -> list[float]:
    """The c of t ≈ fixed + Σ c_j·columns_j that minimize Σ (prediction / t − 1)²."""
    relative = np.stack([c / seconds for c in columns], axis=1)
    coefficients, *_ = np.linalg.lstsq(relative, 1.0 - fixed / seconds, rcond=None)
    return [float(c) for c in coefficients]


def fit_all_to_all(
    timings: Sequence[CollectiveTiming],
    links: Mapping[int, Link],
    cache_bytes: float | None = None,
) -> float:
    """`ClusterSpec.all_to_all_factor`: the scale of the all-to-alls' bytes term, on the
    `links` of their axes (with `cache_bytes` per device on the links that have a cached
    bandwidth), by least squares on relative error; 1 where none was timed."""
    a2a = [t for t in timings if t.kind is Collective.ALL_TO_ALL]
    if not a2a:
        return 1.0
    latency = np.array([links[t.axis].latency for t in a2a])
    bytes_s = np.array([_collective_s(t, links[t.axis], cache_bytes) for t in a2a]) - latency
    seconds = np.array([t.seconds for t in a2a])
    (factor,) = _relative_least_squares([bytes_s], seconds, fixed=latency)
    return max(1e-3, factor)


def _collective_s(
    timing: CollectiveTiming, link: Link, cache_bytes: float | None, all_to_all_factor: float = 1
) -> float:
    """The cost model's time for `timing`'s collective on `link`."""
    cached = link.cached_bandwidth
    mesh = LogicalMesh(
        shape=(timing.num_devices,),
        axis_names=("a",),
        bandwidths=(link.bandwidth,),
        latencies=(link.latency,),
        all_to_all_factor=all_to_all_factor,
        cached_bandwidths=None if cached is None else (cached,),
        cache_bytes=None if cached is None else cache_bytes,
    )
    return mesh.collective_cost(timing.kind, timing.num_bytes, "a")


def predicted_collective_s(spec: ClusterSpec, timing: CollectiveTiming) -> float:
    """What the cost model predicts for `timing`'s collective with `spec`'s figures."""
    bandwidth, latency, cached = link_figures(spec, not (timing.axis == 0 and spec.num_hosts > 1))
    link = Link(latency, bandwidth, cached)
    return _collective_s(timing, link, spec.collective_cache_bytes, spec.all_to_all_factor)


def _peaks(matmul: Sequence[MatmulTiming]) -> dict[str, float]:
    """The median rate of each `MatmulKind` over the shapes measured, by the `ClusterSpec`
    field it sets. Not the best: one short timing that caught the machine between hiccups would
    set it (a 512³ matmul once measured 760 GFLOP/s on two cores that reach 480)."""
    return {
        k.spec_field: statistics.median(t.flops_per_s for t in matmul if t.kind is k)
        for k in MatmulKind
    }


def matmul_efficiency(
    ramp: Sequence[MatmulTiming], floor_s: float, peak_flops: float
) -> tuple[tuple[float, float], ...]:
    """`ClusterSpec.matmul_efficiency` from the ramp's timings: each one's rate beyond the
    kernel floor (which the roofline adds to every kernel) over `peak_flops`, at most 1 and
    never falling as matmuls grow (noise aside, a bigger matmul keeps the units a smaller one
    filled). The ramp stops once a size reaches 90% of the peak, so where the largest fell short,
    8 times its FLOPs (the next size) is taken to run at the peak. A matmul no slower than the
    floor tells nothing and is left out."""
    points: list[tuple[float, float]] = []
    best = 0.0
    for t in sorted(ramp, key=lambda t: t.m * t.k * t.n):
        flops, beyond = 2.0 * t.m * t.k * t.n, t.seconds - floor_s
        if beyond > 0:
            best = max(best, min(1.0, flops / beyond / peak_flops))
            points.append((flops, best))
    if points and points[-1][1] < 1:
        points.append((8 * points[-1][0], 1.0))
    return tuple(points)


def build_spec(
    devices: Sequence[jax.Device],
    matmul: Sequence[MatmulTiming],
    matmul_ramp: Sequence[MatmulTiming],
    stream: StreamTiming,
    kernel: KernelTiming,
    launch: LaunchTiming,
    rates: Sequence[RateTiming],
    collectives: Sequence[CollectiveTiming],
) -> tuple[ClusterSpec, tuple[str, ...]]:
    """The spec of `devices` from its measurements, and the fields no measurement set."""
    shape = physical_mesh(devices)[0].devices.shape
    hosts, per_host = (1, shape[0]) if len(shape) == 1 else shape
    platform = devices[0].platform
    # a CPU's simulated devices copy through the host's caches, which they share
    cache = last_level_cache_bytes() if platform == "cpu" else None
    cache_bytes = None if cache is None else cache / per_host
    links = {  # all-to-all is fitted on the link the other collectives give (`fit_all_to_all`)
        axis: fit_link(
            [t for t in collectives if t.axis == axis and t.kind is not Collective.ALL_TO_ALL],
            cache_bytes if axis == 1 else None,  # across hosts: a network, no cache
        )
        for axis in sorted({t.axis for t in collectives})
    }
    unmeasured: tuple[str, ...] = ()
    if 1 not in links:  # one device per host: a copy inside the device
        links[1] = Link(kernel.per_kernel_s, stream.bytes_per_s)
        unmeasured += _INTRA
    if 0 not in links:  # one host
        links[0] = Link(links[1].latency, links[1].bandwidth)
        unmeasured += _INTER
    cached_bandwidth = links[1].cached_bandwidth
    peaks = _peaks(matmul)
    rated = {t.kind.spec_field: t.rate for t in rates}  # fresh memory: None if it is free
    if rated.get("aliased_loop_rate"):
        rated["aliasing_stride"] = l1_set_span()
    if rated.get("transpose_bandwidth"):  # moves what the streaming kernel moves, at best: a
        # GPU's layout assignment can make some of a measured chain's transposes free (an H200
        # read 8.4 TB/s, over its 4.1 TB/s of streaming)
        rated["transpose_bandwidth"] = min(rated["transpose_bandwidth"], stream.bytes_per_s)
    spec = ClusterSpec(
        num_hosts=hosts,
        devices_per_host=per_host,
        device_memory=_device_memory(devices),
        intra_host_bandwidth=links[1].bandwidth,
        inter_host_bandwidth=links[0].bandwidth,
        intra_host_latency=links[1].latency,
        inter_host_latency=links[0].latency,
        cached_intra_host_bandwidth=cached_bandwidth,
        collective_cache_bytes=None if cached_bandwidth is None else cache_bytes,
        name=f"profiled-{platform}-{len(devices)}",
        platform=platform,
        memory_bandwidth=stream.bytes_per_s,
        compute_efficiency=1.0,  # achieved rates, not datasheet peaks
        memory_efficiency=1.0,
        kernel_overhead_s=kernel.per_kernel_s,
        launch_overhead_s=launch.launch_s,
        buffer_overhead_s=launch.per_buffer_s,
        kernel_update_s=kernel.update_per_kernel_s,
        all_to_all_factor=fit_all_to_all(collectives, links, cache_bytes),
        matmul_efficiency=matmul_efficiency(
            matmul_ramp, kernel.per_kernel_s, peaks[MatmulKind.FP32.spec_field]
        ),
        **peaks,  # device_flops (bf16), tf32_flops, fp32_flops
        **rated,
        dfs_schedule=platform == "cpu" and xla_cpu_dfs_scheduler(),
    )
    return spec, unmeasured


def aliased_loop_text(spec: ClusterSpec) -> str:
    """How `spec` prices element-wise loops fused into transposing copies, in words."""
    if spec.aliased_loop_s_at(0) is None:
        return "priced as any copy (no aliasing stride measured)"
    low, high = ALIASED_LOOP_LINES
    return (
        f"at a row stride of {spec.aliasing_stride:.0f} B, "
        f"{spec.aliased_loop_s_at(low) * 1e9:.2f} ns per element and array at {low} lines in "
        f"flight, {spec.aliased_loop_s_at(high) * 1e9:.2f} ns at {high}"
    )


def _cpu0_caches() -> list[dict[str, str]]:
    """Linux's sysfs record of each of cpu0's caches (level, type, size, ways); [] elsewhere."""
    caches = []
    for index in sorted(_CACHE_INFO.glob("index*")):
        try:
            names = ("level", "type", "size", "ways_of_associativity")
            caches.append({f: (index / f).read_text().strip() for f in names})
        except OSError:
            continue
    return caches


def _size_bytes(size: str) -> int | None:
    """sysfs's '48K' or '32M' in bytes; None if it reads otherwise."""
    unit = {"K": 2**10, "M": 2**20}.get(size[-1:])
    return int(size[:-1]) * unit if unit and size[:-1].isdigit() else None


def l1_set_span() -> float | None:
    """Bytes a CPU's L1 data cache spans with one line per set (its size over its ways), as
    Linux's sysfs gives cpu0's; None where it does not: rows that far apart share a set."""
    for cache in _cpu0_caches():
        size, ways = _size_bytes(cache["size"]), cache["ways_of_associativity"]
        if cache["level"] == "1" and cache["type"] == "Data" and size and ways.isdigit():
            return float(size // int(ways)) if int(ways) > 0 else None
    return None


def last_level_cache_bytes() -> float | None:
    """Bytes of cpu0's largest (last-level) cache, as Linux's sysfs gives it; None where it
    does not."""
    sizes = [_size_bytes(c["size"]) for c in _cpu0_caches() if c["type"] in ("Data", "Unified")]
    return float(max(s for s in sizes if s)) if any(sizes) else None


def _cached(spec: ClusterSpec, fields: tuple[str, str]) -> str:
    if fields != _INTRA or spec.cached_intra_host_bandwidth is None:
        return ""
    return (
        f" ({_si(spec.cached_intra_host_bandwidth)}B/s while a collective's buffers fit in "
        f"{_si(spec.collective_cache_bytes)}B of cache per device)"
    )


def _fresh(spec: ClusterSpec) -> str:
    if spec.fresh_memory_rate is None:
        return "pooled (no cost)"
    return (
        f"temporaries of {_si(spec.fresh_memory_threshold)}B or more are faulted in at "
        f"{_si(spec.fresh_memory_rate)}B/s every step"
    )


def _column(spec: ClusterSpec) -> str:
    if spec.column_reduction_rate is None:
        walked = "at the memory bandwidth (not measured)"
    else:
        walked = f"{spec.column_reduction_rate:.3g} rows/s walked"
    if spec.column_reduction_array_rate is None:
        return walked
    return f"{walked}, {spec.column_reduction_array_rate:.3g} rows/s per array with fused outputs"


def _device_memory(devices: Sequence[jax.Device]) -> float:
    """The device's memory limit, or (CPU) physical RAM shared by this host's profiled devices."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    stats = local[0].memory_stats()
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / len(local)


# ----------------------------------------------------------------------------- the entry points


def _check_devices(devices: Any) -> tuple[jax.Device, ...]:
    """`devices` as a tuple, or InvalidArgumentError saying what to pass instead."""
    hint = "pass a list of jax devices of one platform, e.g. jax.devices() or jax.devices()[:4]"
    if not isinstance(devices, list | tuple):
        raise InvalidArgumentError(f"devices={devices!r} is not a list; {hint}")
    if not devices:
        raise InvalidArgumentError(f"devices={devices!r} is empty; {hint}")
    others = [d for d in devices if not isinstance(d, jax.Device)]
    if others:
        raise InvalidArgumentError(f"devices holds {others[0]!r}, not a jax device; {hint}")
    platforms = sorted({d.platform for d in devices})
    if len(platforms) > 1:
        raise InvalidArgumentError(f"devices mixes platforms {platforms}; {hint}")
    if platforms[0] not in PLATFORMS:
        raise InvalidArgumentError(
            f"devices are {platforms[0]!r} devices, but a ClusterSpec describes one of "
            f"{PLATFORMS}; profile those"
        )
    if len(set(devices)) != len(devices):
        raise InvalidArgumentError(f"devices lists a device twice: {list(devices)}; {hint}")
    per_host: dict[int, int] = {}
    for d in devices:
        per_host[d.process_index] = per_host.get(d.process_index, 0) + 1
    if len(set(per_host.values())) > 1:
        raise InvalidArgumentError(
            f"devices per host (process) differ: {per_host}; a ClusterSpec is homogeneous, so "
            "pass the same number of devices from every host"
        )
    return tuple(devices)


def measure_cluster(devices: Any = None, *, sizes: ProfileSizes | None = None) -> ClusterProfile:
    """Measure `devices` (see the module docstring) and return the spec with its timings.

    `devices`: a list of jax devices of one platform, the same number on every host (process);
    default: the devices of autopar's runtime (`autopar.init`; all local devices without it),
    and on `autopar.init("ray")` the Ray cluster's hosts, measured by one mesh worker each.
    A multi-process call must be made by every process, like any SPMD program. `sizes` (default
    `DEFAULT_SIZES`) sets how much is measured; smaller sizes are for tests.
    """
    sizes = DEFAULT_SIZES if sizes is None else sizes
    if not isinstance(sizes, ProfileSizes):
        raise InvalidArgumentError(f"sizes={sizes!r} must be a ProfileSizes or None")
    if devices is None:
        from autopar.context import current_runtime

        runtime = current_runtime()
        if runtime.kind == "ray":
            return _measure_on_ray(runtime.executor, sizes)
        devices = runtime.devices
    devices = _check_devices(devices)
    start = time.perf_counter()
    local = [d for d in devices if d.process_index == jax.process_index()]
    bar = progress_bar(desc="profiling cluster", unit="measurement")
    try:
        matmul = measure_matmuls(local, sizes, bar.update)
        fp32 = _peaks(matmul)[MatmulKind.FP32.spec_field]
        matmul_ramp = measure_matmul_ramp(local, sizes, fp32, bar.update)
        stream = measure_stream(local, sizes)
        bar.update()
        kernel = measure_kernel_floor(local, sizes)
        bar.update()
        launch = measure_launch(local, sizes)
        bar.update()
        rates = []
        for measure in (
            measure_transcendental,
            measure_convolution,
            measure_transpose,
            measure_transposed_matmul,
        ):
            rates.append(measure(local, sizes))
            bar.update()
        rates.append(measure_transposed_matmul(local, sizes, TRANSPOSED_MATMUL_COLUMNS[0]))
        rates.append(measure_fresh_memory(local, sizes, GLIBC_MMAP_THRESHOLD))
        rates.append(measure_column_reduction(local, sizes, kernel.per_kernel_s))
        rates.append(measure_column_reduction_arrays(local, sizes, kernel.per_kernel_s))
        bar.update()
        rates.append(measure_window_reduction(local, sizes))
        rates.append(measure_select_and_scatter(local, sizes))
        rates.append(measure_select_and_scatter(local, sizes, cached=True))
        stride = l1_set_span() if local[0].platform == "cpu" else None
        for many_lines in (False, True):
            rates.append(measure_aliased_loop(local, sizes, stride, stream.bytes_per_s, many_lines))
        bar.update()
        collectives = measure_collectives(*physical_mesh(devices), sizes, bar.update)
    finally:
        bar.close()
    spec, unmeasured = build_spec(
        devices, matmul, matmul_ramp, stream, kernel, launch, rates, collectives
    )
    profile = ClusterProfile(
        spec,
        tuple(matmul),
        tuple(matmul_ramp),
        stream,
        kernel,
        launch,
        tuple(rates),
        tuple(collectives),
        unmeasured,
        time.perf_counter() - start,
    )
    logger.info("profiled %d %s device(s) in %.1f s", len(devices), spec.platform, profile.seconds)
    return profile


def profile_cluster(devices: Any = None) -> ClusterSpec:
    """A `ClusterSpec` of `devices` measured on them: matmul rates, memory bandwidth, kernel
    floor, the host's launch cost, the rates of transcendentals, convolutions and transposes,
    and per-axis link latency and bandwidth (see `measure_cluster` for `devices`).

    Example::

        spec = autopar.profile_cluster()               # all local devices, a few seconds
        json.dump(spec.to_dict(), open("spec.json", "w"))
        autopar.plan(step, state, batch, method=autopar.ShardParallel(), cluster_spec=spec)
    """
    return measure_cluster(devices).spec


def _measure_on_ray(cluster: Any, sizes: ProfileSizes) -> ClusterProfile:
    """`measure_cluster` run by one mesh worker per Ray host, joined into one SPMD program;
    the figures of host 0 (hosts are alike, as a ClusterSpec assumes)."""
    cluster.check_devices_free("profile_cluster")
    spec = cluster.cluster_spec
    workers = [cluster.start_worker(h, spec.devices_per_host) for h in range(spec.num_hosts)]
    try:
        cluster.wait([w.ping.remote() for w in workers], "starting the profiling workers")
        if len(workers) > 1:
            (address,) = cluster.wait([workers[0].coordinator_address.remote()], "a coordinator")
            joins = [w.join.remote(address, len(workers), p) for p, w in enumerate(workers)]
            cluster.wait(joins, "joining the profiling workers")
        results = cluster.wait(
            [w.profile_cluster.remote(sizes) for w in workers], "profiling the cluster"
        )
    finally:
        cluster.stop_workers(workers)
    return ClusterProfile.from_dict(results[0])
