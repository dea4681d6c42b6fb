"""α-β cost model: seconds for compute, collectives and resharding on a logical mesh.

Every collective over n devices costs α + β·f(n)·B, with α the latency, β = 1/bandwidth (bus
bandwidth, as NCCL reports it) and B bytes; the f(n) of each collective is REFERENCE.md's
"Communication" table (Alpa's `LogicalDeviceMesh` model). A collective over one device is free.

Where a link has a cached bandwidth (`ClusterSpec.cached_intra_host_bandwidth`: XLA:CPU's
collectives between simulated devices are copies through the host's shared caches), the share of
a collective's bytes that its buffers' footprint (`Collective.device_bytes`) holds within
`ClusterSpec.collective_cache_bytes` per device moves at the cached bandwidth, the rest at the
link's.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

from autopar.planner.cluster import ClusterSpec

AxisRef = str | int
"""A mesh axis, by name or by index."""
DimSpec = tuple[str, ...] | None
"""How one tensor dim is split: None (not split) or the mesh axes it is split over, major first."""
Spec = tuple[DimSpec, ...]
"""A tensor's sharding: one `DimSpec` per tensor dim."""


def _check_n(n: int) -> None:
    if n < 1:
        raise ValueError(f"a collective needs at least 1 device, got n={n}")


def all_reduce_cost(num_bytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: α + 2(n−1)/n · B / bw (a reduce-scatter then an all-gather)."""
    _check_n(n)
    return 0.0 if n == 1 else latency + 2 * (n - 1) / n * num_bytes / bandwidth


def all_gather_cost(num_bytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather, B = the gathered (output) size: α + (n−1)/n · B / bw."""
    _check_n(n)
    return 0.0 if n == 1 else latency + (n - 1) / n * num_bytes / bandwidth


def reduce_scatter_cost(num_bytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring reduce-scatter, B = the input size: α + (n−1)/n · B / bw."""
    _check_n(n)
    return 0.0 if n == 1 else latency + (n - 1) / n * num_bytes / bandwidth


def all_to_all_cost(num_bytes: float, n: int, bandwidth: float, latency: float) -> float:
    """All-to-all, B = the per-device buffer: α + (n−1)/n² · B · (n/2) / bw.

    Alpa's form, equal to (n−1)/(2n) · B: the n/2 is Alpa's penalty factor, fitted so the
    theoretical cost matched its V100 + NVLink measurements.
    """
    _check_n(n)
    return 0.0 if n == 1 else latency + (n - 1) / n**2 * num_bytes * (n / 2) / bandwidth


class Collective(enum.Enum):
    """The collectives the model prices; `.cost` is the per-axis formula above."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"

    def cost(self, num_bytes: float, n: int, bandwidth: float, latency: float) -> float:
        return _FORMULAS[self](num_bytes, n, bandwidth, latency)

    def device_bytes(self, num_bytes: float, n: int) -> float:
        """Bytes of input and output buffer each of the n devices holds for it, with B as its
        formula takes it: all-reduce and all-to-all B in and B out, all-gather B/n in and B out,
        reduce-scatter B in and B/n out."""
        if self in (Collective.ALL_REDUCE, Collective.ALL_TO_ALL):
            return 2.0 * num_bytes
        return num_bytes * (1 + 1 / n)


_FORMULAS = {
    Collective.ALL_REDUCE: all_reduce_cost,
    Collective.ALL_GATHER: all_gather_cost,
    Collective.REDUCE_SCATTER: reduce_scatter_cost,
    Collective.ALL_TO_ALL: all_to_all_cost,
}


@dataclasses.dataclass(frozen=True, slots=True)
class LogicalMesh:
    """A 1D or 2D device mesh with one bandwidth (bytes/s) and latency (s) per axis."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    bandwidths: tuple[float, ...]
    latencies: tuple[float, ...]
    all_to_all_factor: float = 1.0  # `ClusterSpec.all_to_all_factor`
    # per axis, the bandwidth within `cache_bytes` (`ClusterSpec.cached_intra_host_bandwidth`);
    # None: `bandwidths` at every size
    cached_bandwidths: tuple[float | None, ...] | None = None
    cache_bytes: float | None = None  # `ClusterSpec.collective_cache_bytes`

    def __post_init__(self) -> None:
        fields = (self.axis_names, self.bandwidths, self.latencies)
        if len(self.shape) not in (1, 2) or any(len(f) != len(self.shape) for f in fields):
            raise ValueError(
                f"LogicalMesh needs 1 or 2 axes and one name, bandwidth and latency per axis; "
                f"got shape={self.shape}, axis_names={self.axis_names}, "
                f"bandwidths={self.bandwidths}, latencies={self.latencies}"
            )
        if self.cached_bandwidths is not None and (
            len(self.cached_bandwidths) != len(self.shape) or not self.cache_bytes
        ):
            raise ValueError(
                f"LogicalMesh.cached_bandwidths={self.cached_bandwidths} needs one entry per "
                f"axis of {self.shape} and a positive cache_bytes, got {self.cache_bytes!r}"
            )
        if any(s < 1 for s in self.shape) or len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(
                f"LogicalMesh sizes must be >= 1 and names unique: "
                f"shape={self.shape}, axis_names={self.axis_names}"
            )

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_index(self, axis: AxisRef) -> int:
        if axis in self.axis_names:  # a name, the common case (the cost model asks ~100k times)
            return self.axis_names.index(axis)
        if isinstance(axis, int) and 0 <= axis < len(self.shape):
            return axis
        raise ValueError(f"mesh axis {axis!r} is not in mesh with axes {self.axis_names}")

    def axis_size(self, axis: AxisRef) -> int:
        return self.shape[self.axis_index(axis)]

    def collective_cost(
        self, kind: Collective, num_bytes: float, axes: AxisRef | Sequence[AxisRef]
    ) -> float:
        """`kind` over the devices spanned by `axes` (n = product of their sizes).

        Simplification: a collective over several axes runs at the slowest axis's bandwidth and
        pays the largest latency once, as if it were one ring over all n devices; it runs at a
        cached bandwidth only where every one of its axes has one.
        """
        idx = [self.axis_index(a) for a in ((axes,) if isinstance(axes, str | int) else axes)]
        if not idx:
            return 0.0
        n = math.prod(self.shape[i] for i in idx)
        if n == 1:
            return 0.0
        bandwidth = min(self.bandwidths[i] for i in idx)
        latency = max(self.latencies[i] for i in idx)
        bytes_s = kind.cost(num_bytes, n, bandwidth, 0.0)
        cached = self._cached_bandwidth(idx)
        if cached is not None:
            footprint = kind.device_bytes(num_bytes, n)
            beyond = max(0.0, footprint - self.cache_bytes) / footprint if footprint else 0.0
            bytes_s *= beyond + (1 - beyond) * bandwidth / cached
        if kind is Collective.ALL_TO_ALL:
            bytes_s *= self.all_to_all_factor
        return latency + bytes_s

    def _cached_bandwidth(self, idx: Sequence[int]) -> float | None:
        """The cached bandwidth of a collective over the axes at `idx`: the slowest of theirs,
        None where one of them has none."""
        if self.cached_bandwidths is None:
            return None
        cached = [self.cached_bandwidths[i] for i in idx]
        return None if None in cached else min(cached)

    def all_reduce_cost(self, num_bytes: float, axes: AxisRef | Sequence[AxisRef]) -> float:
        return self.collective_cost(Collective.ALL_REDUCE, num_bytes, axes)

    def all_gather_cost(self, num_bytes: float, axes: AxisRef | Sequence[AxisRef]) -> float:
        return self.collective_cost(Collective.ALL_GATHER, num_bytes, axes)

    def reduce_scatter_cost(self, num_bytes: float, axes: AxisRef | Sequence[AxisRef]) -> float:
        return self.collective_cost(Collective.REDUCE_SCATTER, num_bytes, axes)

    def all_to_all_cost(self, num_bytes: float, axes: AxisRef | Sequence[AxisRef]) -> float:
        return self.collective_cost(Collective.ALL_TO_ALL, num_bytes, axes)


def logical_mesh(
    cluster: ClusterSpec, shape: Sequence[int], axis_names: Sequence[str] | None = None
) -> LogicalMesh:
    """View the first prod(shape) devices of `cluster` (host-major) as a 1D or 2D mesh.

    An axis gets intra-host figures when each of its device groups stays inside one host:
    for (a, b), axis 1 (contiguous devices) when b divides devices_per_host, axis 0 when the whole
    mesh fits in one host; a 1D mesh of n when n <= devices_per_host. Otherwise inter-host figures,
    which for a 1D mesh across hosts is conservative (one ring has the whole NIC to itself).
    """
    shape = tuple(shape)
    if len(shape) not in (1, 2) or any(s < 1 for s in shape):
        raise ValueError(f"logical mesh shape must be 1D or 2D with sizes >= 1, got {shape}")
    if math.prod(shape) > cluster.num_devices:
        raise ValueError(
            f"logical mesh {shape} needs {math.prod(shape)} devices but cluster {cluster.name!r} "
            f"has {cluster.num_devices} ({cluster.num_hosts}x{cluster.devices_per_host})"
        )
    names = tuple(axis_names) if axis_names is not None else ("x", "y")[: len(shape)]
    per_host = cluster.devices_per_host
    if len(shape) == 1:
        intra = [shape[0] <= per_host]
    else:
        intra = [math.prod(shape) <= per_host, per_host % shape[1] == 0]
    figures = [link_figures(cluster, i) for i in intra]
    cached = tuple(c for *_, c in figures)
    return LogicalMesh(
        shape=shape,
        axis_names=names,
        bandwidths=tuple(bw for bw, *_ in figures),
        latencies=tuple(lat for _, lat, _ in figures),
        all_to_all_factor=cluster.all_to_all_factor,
        cached_bandwidths=None if all(c is None for c in cached) else cached,
        cache_bytes=cluster.collective_cache_bytes,
    )


def link_figures(cluster: ClusterSpec, intra_host: bool) -> tuple[float, float, float | None]:
    """(bandwidth, latency, cached bandwidth or None) of a mesh axis within or across hosts."""
    if intra_host:
        return (
            cluster.intra_host_bandwidth,
            cluster.intra_host_latency,
            cluster.cached_intra_host_bandwidth,
        )
    return cluster.inter_host_bandwidth, cluster.inter_host_latency, None


def _normalize_spec(spec: Sequence[DimSpec | str], shape: Sequence[int], mesh: LogicalMesh) -> Spec:
    """Accept "x" for ("x",); check rank, axis names and that no axis splits two dims."""
    if len(spec) != len(shape):
        raise ValueError(
            f"sharding spec {spec} has {len(spec)} entries for a tensor of shape {tuple(shape)}"
        )
    out = tuple(
        None if d is None else (d,) if isinstance(d, str) else tuple(d) or None for d in spec
    )
    used = [a for d in out if d for a in d]
    for a in used:
        if a not in mesh.axis_names:
            raise ValueError(f"axis {a!r} of spec {spec} is not in mesh axes {mesh.axis_names}")
    if len(used) != len(set(used)):
        raise ValueError(f"sharding spec {spec} uses a mesh axis on more than one dim")
    return out


def spec_bytes_per_device(
    shape: Sequence[int], dtype_bytes: float, spec: Sequence[DimSpec | str], mesh: LogicalMesh
) -> float:
    """Bytes one device holds: total bytes / product of the sizes of the axes that split it."""
    spec = _normalize_spec(spec, shape, mesh)
    tiles = math.prod(mesh.axis_size(a) for d in spec if d for a in d)
    return math.prod(shape) * dtype_bytes / tiles


def resharding_cost(
    mesh: LogicalMesh,
    shape: Sequence[int],
    dtype_bytes: float,
    src_spec: Sequence[DimSpec | str],
    dst_spec: Sequence[DimSpec | str],
) -> float:
    """Seconds to change a tensor's sharding from `src_spec` to `dst_spec` (REFERENCE.md)."""
    return sum(
        mesh.collective_cost(kind, num_bytes, axes)
        for kind, num_bytes, axes in resharding_collectives(
            mesh, shape, dtype_bytes, src_spec, dst_spec
        )
    )


def resharding_collectives(
    mesh: LogicalMesh,
    shape: Sequence[int],
    dtype_bytes: float,
    src_spec: Sequence[DimSpec | str],
    dst_spec: Sequence[DimSpec | str],
) -> list[tuple[Collective, float, tuple[str, ...]]]:
    """The collectives (kind, bytes as the formulas take them, axes) that reshard a tensor.

    Per dim, the axes both specs share as a prefix stay; the rest of src's are removed and the
    rest of dst's added. Then, following REFERENCE.md's resharding rules:
    - adding splits (replicated → sharded) is a local slice: free;
    - an axis removed from one dim and added to another moves: an all-to-all over it;
    - an axis only removed: an all-gather over it, of the per-device size under dst. New splits
      of dims that lose no axis are sliced first, so the collectives move as little as possible;
      those of dims that do are sliced after them, so the collectives carry their bytes too;
    - anything else (an axis reordered within a dim): gather to replicated, then slice.
    """
    src = _normalize_spec(src_spec, shape, mesh)
    dst = _normalize_spec(dst_spec, shape, mesh)
    removed: dict[str, int] = {}  # axis -> dim it leaves
    added: dict[str, int] = {}  # axis -> dim it joins
    for dim, (s, d) in enumerate(zip(src, dst, strict=True)):
        s, d = s or (), d or ()
        keep = 0
        while keep < min(len(s), len(d)) and s[keep] == d[keep]:
            keep += 1
        removed.update((a, dim) for a in s[keep:])
        added.update((a, dim) for a in d[keep:])
    if not removed:
        return []
    if any(added.get(a) == dim for a, dim in removed.items()):
        src_axes = tuple(a for d in src if d for a in d)
        return [(Collective.ALL_GATHER, math.prod(shape) * dtype_bytes, src_axes)]
    moved = tuple(a for a in removed if a in added)
    gathered = tuple(a for a in removed if a not in added)
    sliced_late = [a for a, dim in added.items() if a not in removed and dim in removed.values()]
    comm_bytes = spec_bytes_per_device(shape, dtype_bytes, dst, mesh) * math.prod(
        mesh.axis_size(a) for a in sliced_late
    )
    steps = []
    if gathered:
        steps.append((Collective.ALL_GATHER, comm_bytes, gathered))
    if moved:
        steps.append((Collective.ALL_TO_ALL, comm_bytes, moved))
    return steps


def result_bytes(mesh: LogicalMesh, kind: Collective, num_bytes: float, axes) -> float:
    """Bytes of a collective's result on one device, as the compiled HLO shows it.

    `num_bytes` is what the cost formulas take: the buffer for all-reduce and all-to-all, the
    gathered size for all-gather, the input size for reduce-scatter (whose result is 1/n of it).
    """
    n = math.prod(mesh.axis_size(a) for a in axes)
    if n == 1:  # over one device: XLA emits no collective
        return 0.0
    if kind is Collective.REDUCE_SCATTER:
        return num_bytes / n
    return num_bytes
