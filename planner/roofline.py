"""Seconds one op takes on one device: a roofline over the kernels XLA fuses it into.

An op runs as fast as the slower of its arithmetic and its memory traffic allow:
time = max(FLOPs / (peak for its dtype × compute efficiency), bytes / (memory bandwidth ×
memory efficiency)), plus the launch floor of each kernel. Bytes follow the fusion rules of the
memory model (`planner.memory.liveness`): an op fused into its readers writes nothing and
launches nothing; an operand computed inside the reader's fusion is not read from memory. So an
element-wise chain is one kernel that reads its inputs and writes its result once, and the
optimizer update (element-wise over every parameter and both Adam moments) is memory-bound.

Six op classes do not run at the matmul peak or the streaming bandwidth, and a spec that
measured them (`autopar.profile_cluster()`) prices them at their own rates:

* transcendentals (XLA's class: `exp`, `log`, `tanh`, `logistic`, `erf`, `sqrt`, ...) take
  `transcendental_rate` elements/s, an order of magnitude below an add on a CPU (a polynomial per
  element), instead of one FLOP per element;
* convolutions run at `conv_flops`, which XLA:CPU reaches at well under its matmul peak, or
  where slower, at the rate of a matmul of the same FLOPs: a GPU runs them as implicit GEMMs
  (an H200 takes 3.3 µs for a 1 MFLOP one and 5 µs for 67 MFLOP, as it does for matmuls);
* a transpose that moves the minor (contiguous) dimension reads with a stride, which XLA:CPU does
  element by element, at `transpose_bandwidth` bytes (read + written) per second, whether it is
  materialized or fused into its reader's loop. A transpose that only contractions read stays
  free (XLA folds it into them), and so does one of a contraction's result where XLA has the
  contraction write it transposed (on a CPU, a dot whose operands can swap). On a CPU a dot's
  operands are copied into plain matrices where they are not laid out as one
  (`planner.dot_layout`): each copy is a kernel, priced like a transpose, except where XLA fuses
  the element-wise loop that writes the operand into it at a row stride that is a multiple of
  `ClusterSpec.aliasing_stride`: every line that loop walks for one output row falls in the
  same few cache sets, and it reads each element of each of its arrays at
  `ClusterSpec.aliased_loop_s_at` its lines in flight (`Roofline.aliased_loop`);
* a matmul whose lhs contracts a dimension other than its minor one (a weight gradient x^T·dy)
  runs at `ClusterSpec.transposed_matmul_rate` of its result's columns per device
  (`result_columns`): XLA:CPU leaves it to Eigen, at a fraction of its matmul kernels' rate,
  which packs the transposed lhs first (a narrow result runs slower: 64 columns at about half
  the rate of 256);
* a column reduction (one that keeps the minor dimension: a bias or layer-norm gradient, batch
  norm statistics) on a GPU walks its rows in a loop per thread block, at
  `column_reduction_rate` rows/s whatever its width, where that is slower than its bytes, and
  at `column_reduction_array_rate` rows/s per array of its operand's size that its kernel
  reads or writes where XLA fuses element-wise outputs of that shape into it
  (`Roofline.column_reduction_s`);
* a pool (a reduce-window) visits each output's window element by element on a CPU, at
  `window_reduction_rate` window elements/s, and max pooling's gradient, which XLA:CPU expands
  into int32 iotas, a selecting reduce-window and a scatter, takes each window at
  `ClusterSpec.select_and_scatter_rate_at` its operand's bytes (`Roofline.window_s`).

A contraction runs at its peak times `ClusterSpec.matmul_fraction` of its FLOPs per device: a
small matmul leaves cores or tensor-core units idle and pays set-up that a large one amortizes
(XLA:CPU runs a 128x64x64 matmul on one of two cores, at under half the peak; an H200 takes
3 µs for a 256x128x128 one, 1% of its peak). A weight gradient runs at the slower of that and
its transposed-matmul rate, that of a large one of its width. On a GPU, element-wise loops over one
shape that read a common operand, or where one reads what another writes, are one
multi-output kernel (`Roofline.kernel_leader`).

Per-device bytes depend on how each operand and output is split, which the caller knows: the
ILP's menus from a strategy's specs, the data-parallel methods from the batch dims.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from autopar.planner.cluster import ClusterSpec
from autopar.planner.dot_layout import LayoutCopy, layout_copies, swaps_free_dims
from autopar.planner.graph import OpNode, ValueKind
from autopar.planner.groups import Grouping, Value
from autopar.planner.memory import value_aval
from autopar.planner.primitives import NO_KERNEL, PRIMITIVES, FlopRule, names_where

# What the roofline reads off `primitives.PRIMITIVES` besides `NO_KERNEL`: contractions (their
# own peak), XLA's transcendental class.
_CONTRACTIONS = frozenset(
    n
    for n, info in PRIMITIVES.items()
    if info.flops in (FlopRule.DOT_GENERAL, FlopRule.CONVOLUTION)
)
_TRANSCENDENTAL = names_where("transcendental")
_FUSED = names_where("fuses")  # element-wise: loop fusions, as the memory model fuses them
# Pools of one operand: the reduce-windows `ClusterSpec.window_reduction_rate` prices.
_WINDOW_REDUCTIONS = frozenset({"reduce_window_sum", "reduce_window_max", "reduce_window_min"})
# XLA:GPU reduces more rows than this in two kernels of about √rows each (its tree reduction
# rewriter, which spares it atomics): an H200 sums a 4096-row float32 array over its rows in one
# kernel and a 16384-row one in two (`ClusterSpec.column_reduction_rate`).
COLUMN_REDUCTION_SPLIT = 4096


def op_time(flops: float, nbytes: float, peak_flops: float, cluster: ClusterSpec) -> float:
    """Roofline seconds of `flops` at `peak_flops` against `nbytes` of memory traffic (no launch
    floor). Without a memory bandwidth in the spec, memory traffic is not priced."""
    compute = flops / (peak_flops * cluster.compute_efficiency)
    if cluster.memory_bandwidth is None:
        return compute
    return max(compute, nbytes / (cluster.memory_bandwidth * cluster.memory_efficiency))


def launch_s(num_buffers: int, num_kernels: int, cluster: ClusterSpec) -> float:
    """Host seconds to launch one program with `num_buffers` input and output buffers and
    `num_kernels` kernels and collect its results (JAX's dispatch, and on a GPU the update of
    the program's graph: a step's outputs move every step), which a step that waits for its
    results adds to its device time."""
    return (
        cluster.launch_overhead_s
        + num_buffers * cluster.buffer_overhead_s
        + num_kernels * cluster.kernel_update_s
    )


def fresh_memory_s(temp_bytes: float, cluster: ClusterSpec) -> float:
    """Seconds a step spends faulting in its `temp_bytes` of temporaries (one block) where the
    allocator maps them afresh every step: from `fresh_memory_threshold` bytes, at
    `fresh_memory_rate` (see `autopar.planner.cluster`); 0 where memory is pooled."""
    if cluster.fresh_memory_rate is None or temp_bytes < cluster.fresh_memory_threshold:
        return 0.0
    return temp_bytes / cluster.fresh_memory_rate


def _highest_precision(node: OpNode) -> bool:
    precision = node.params.get("precision")
    names = [str(p) for p in (precision if isinstance(precision, tuple) else (precision,))]
    return any("HIGHEST" in name for name in names)


def _column_reduction(node: OpNode) -> bool:
    """Whether `node` reduces some dimensions of its operand and keeps its minor one."""
    axes = node.params.get("axes")
    if not axes or not node.in_avals or not node.out_avals:
        return False
    shape = node.in_avals[0].shape
    return len(shape) - 1 not in axes and math.prod(shape[a] for a in axes) > 1


def _transposed_lhs(node: OpNode) -> bool:
    """Whether a dot_general's lhs contracts a dimension other than its minor one."""
    if node.primitive != "dot_general":
        return False
    (lhs_contracting, _), _ = node.params["dimension_numbers"]
    return any(d != len(node.in_avals[0].shape) - 1 for d in lhs_contracting)


def result_columns(node: OpNode, splits: Sequence[int] | None = None) -> float:
    """The columns of a dot_general's result (its rhs's free dims, the last of the result: the
    N of the matmul XLA runs), per device where `splits` gives how many ways each dim of the
    result is split."""
    shape = node.out_avals[0].shape
    (_, rhs_contracting), (_, rhs_batch) = node.params["dimension_numbers"]
    free = len(node.in_avals[1].shape) - len(rhs_contracting) - len(rhs_batch)
    dims = range(len(shape) - free, len(shape))
    return math.prod(shape[d] / (splits[d] if splits else 1) for d in dims)


def node_peak(
    node: OpNode,
    flops: float,
    cluster: ClusterSpec,
    lhs_copied: bool = False,
    columns: float | None = None,
) -> float:
    """The FLOP/s peak `node` runs at doing `flops` per device: its operands' dtype for a
    contraction (TF32 for fp32 at default precision) times the share a matmul of its size
    reaches, its output's otherwise. A dot whose lhs is copied into a plain matrix first
    (`planner.dot_layout`) does not read it transposed; one that reads it transposed runs at
    the rate of its result's `columns` per device (`result_columns`; the whole result's where
    None)."""
    if node.primitive in _CONTRACTIONS:
        peak = cluster.peak_flops(node.in_avals[0].dtype, True, _highest_precision(node))
        peak *= cluster.matmul_fraction(flops)
        if node.primitive == "conv_general_dilated" and cluster.conv_flops is not None:
            return min(peak, cluster.conv_flops / cluster.compute_efficiency)  # an achieved rate
        if _transposed_lhs(node) and not lhs_copied:
            rate = cluster.transposed_matmul_rate(columns or result_columns(node))
            if rate is not None:
                return min(peak, rate / cluster.compute_efficiency)
        return peak
    avals = node.out_avals or node.in_avals
    return cluster.peak_flops(avals[0].dtype) if avals else cluster.device_flops  # no FLOPs


class Roofline:
    """Prices the nodes of `grouping` on `cluster`, given which values fuse into their readers."""

    def __init__(self, grouping: Grouping, fused: frozenset[Value], cluster: ClusterSpec) -> None:
        self.grouping = grouping
        self.fused = fused
        self.cluster = cluster
        self._traffic: dict[str, tuple[tuple[bool, ...], tuple[bool, ...], bool]] = {}
        # on a GPU: (node -> its kernel's leader, column reduction -> the arrays of its
        # operand's size its kernel reads and writes), from `_multi_output_fusions`
        self._fusions: tuple[dict[str, str], dict[str, int]] | None = None
        self._copies: dict[str, tuple[tuple[LayoutCopy, ...], bool]] | None = None
        self._loops: dict[tuple[str, LayoutCopy], tuple[int, int] | None] = {}

    def traffic(self, node: OpNode) -> tuple[tuple[bool, ...], tuple[bool, ...], bool]:
        """(operands read from memory, outputs written to memory, launches a kernel)."""
        found = self._traffic.get(node.id)
        if found is None:
            if node.primitive in NO_KERNEL:
                found = ((False,) * len(node.inputs), (False,) * len(node.out_avals), False)
            else:
                reads = tuple(
                    ref.kind is not ValueKind.LITERAL
                    and (value := self.grouping.value_of(ref)) is not None
                    and value not in self.fused
                    for ref in node.inputs
                )
                writes = tuple((node.id, o) not in self.fused for o in range(len(node.out_avals)))
                launches = any(writes) and self.kernel_leader(node) == node.id
                found = (reads, writes, launches)
            self._traffic[node.id] = found
        return found

    def kernel_leader(self, node: OpNode) -> str:
        """The node whose kernel `node` runs in: itself, or on a GPU the first node of its
        multi-output fusion. XLA:GPU fuses element-wise loops over one shape that read a common
        operand from memory, or where one reads what the other writes, into one kernel that
        writes each of their results (an Adam update writes a parameter and both its moments
        from one kernel), and fuses such loops over a column reduction's operand shape into the
        reduction's kernel (a layer norm gradient writes the input gradient's terms beside the
        scale's); XLA:CPU keeps them apart."""
        return self._gpu_fusions()[0].get(node.id, node.id)

    def _gpu_fusions(self) -> tuple[dict[str, str], dict[str, int]]:
        """`_multi_output_fusions` on a GPU, computed once; nothing joins on a CPU."""
        if self.cluster.platform != "gpu":
            return {}, {}
        if self._fusions is None:
            self._fusions = self._multi_output_fusions()
        return self._fusions

    def _multi_output_fusions(self) -> tuple[dict[str, str], dict[str, int]]:
        """Node -> the first node of its multi-output fusion (see `kernel_leader`), for the
        element-wise nodes that write a result and the column reductions, which join over
        their operand's shape. Operands of rank 0 (a learning rate, a step count) join
        nothing, and nodes join only at the same level (how many non-element-wise kernels lead
        to them, at most), so that no fusion waits for its own result through a matmul or a
        reduction. And column reduction -> its arrays (`_arrays_of_column_reductions`)."""
        graph = self.grouping.graph
        order: dict[str, int] = {}
        parent: dict[str, str] = {}

        def root(n: str) -> str:
            while parent[n] != n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        def join(a: str, b: str) -> None:
            a, b = sorted((root(a), root(b)), key=order.__getitem__)
            parent[b] = a

        reads: dict[str, frozenset[Value]] = {}  # what each node's fusion reads from memory
        level: dict[str, int] = {}
        first_reader: dict[tuple[Value, tuple[int, ...], int], str] = {}
        reductions: list[OpNode] = []
        for node in self.grouping.planned_nodes():
            order[node.id] = len(order)
            values = [v for ref in node.inputs if (v := self.grouping.value_of(ref)) is not None]
            reads[node.id] = frozenset().union(
                *(reads.get(v[0], frozenset()) if v in self.fused else {v} for v in values)
            )
            level[node.id] = max(
                (
                    level.get(v[0], 0) + (graph.node(v[0]).primitive not in _FUSED)
                    for v in values
                    if v[0]
                ),
                default=0,
            )
            if _column_reduction(node):
                reductions.append(node)
                shape = tuple(node.in_avals[0].shape)
            elif node.primitive in _FUSED and node.out_avals[0].shape:
                if all((node.id, o) in self.fused for o in range(len(node.out_avals))):
                    continue
                shape = tuple(node.out_avals[0].shape)
            else:
                continue
            parent[node.id] = node.id
            for value in reads[node.id]:
                if not value_aval(self.grouping, value).shape:
                    continue
                writer = value[0]
                same = writer in parent and level[writer] == level[node.id]
                if same and tuple(graph.node(writer).out_avals[0].shape) == shape:
                    join(node.id, writer)  # reads what another writes
                found = first_reader.setdefault((value, shape, level[node.id]), node.id)
                if found != node.id:
                    join(node.id, found)  # reads what another reads
        leaders = {n: root(n) for n in parent}
        return leaders, self._arrays_of_column_reductions(reductions, leaders, reads)

    def _arrays_of_column_reductions(
        self,
        reductions: list[OpNode],
        leaders: dict[str, str],
        reads: dict[str, frozenset[Value]],
    ) -> dict[str, int]:
        """Column reduction -> the arrays of its operand's size that its kernel reads from
        memory (not those it writes itself) and writes, for those whose kernel writes such an
        array (a side output)."""
        members: dict[str, list[str]] = {}
        for node_id, leader in leaders.items():
            members.setdefault(leader, []).append(node_id)
        graph, found = self.grouping.graph, {}
        for node in reductions:
            size = math.prod(node.in_avals[0].shape)
            ids = set(members[leaders[node.id]])
            group = [graph.node(n) for n in ids]
            written = sum(
                (m.id, o) not in self.fused and math.prod(aval.shape) == size
                for m in group
                if not _column_reduction(m)
                for o, aval in enumerate(m.out_avals)
            )
            if written:
                read = {
                    v
                    for m in group
                    for v in reads[m.id]
                    if v[0] not in ids and math.prod(value_aval(self.grouping, v).shape) == size
                }
                found[node.id] = len(read) + written
        return found

    def layout_copies(self, node: OpNode) -> tuple[tuple[LayoutCopy, ...], bool]:
        """(the layout copies around contraction `node` that it pays for, whether XLA copies
        its lhs): on a CPU, XLA copies a contraction's operands into the layout its library
        kernel reads where they are not laid out so, and a convolution's result into the layout
        the jaxpr asks for (`planner.dot_layout`); a value copied into one layout for several
        contractions is copied once, paid by the first. XLA:GPU's matmuls read strided
        operands, so a GPU pays none."""
        if self.cluster.platform != "cpu" or node.primitive not in _CONTRACTIONS:
            return (), False
        if self._copies is None:
            self._copies = self._contraction_layout_copies()
        return self._copies.get(node.id, ((), False))

    def _contraction_layout_copies(self) -> dict[str, tuple[tuple[LayoutCopy, ...], bool]]:
        graph, seen = self.grouping.graph, set()
        found = {}
        for node in self.grouping.planned_nodes():
            copies = layout_copies(graph, node)
            paid = []
            for copy in copies:
                source = node.id if copy.source is None else self.grouping.value_of(copy.source)
                if (source, copy.order) not in seen:
                    seen.add((source, copy.order))
                    paid.append(copy)
            if copies:
                found[node.id] = (tuple(paid), any(c.position == 0 for c in copies))
        return found

    def num_kernels(self, nodes: Iterable[OpNode]) -> int:
        """How many of `nodes` launch a kernel of their own (the rest fuse into their readers
        or launch nothing), and the layout copies they pay for: the kernels of a program made
        of them."""
        return sum(self.traffic(node)[2] + len(self.layout_copies(node)[0]) for node in nodes)

    def context(self, node: OpNode) -> tuple:
        """What `seconds` reads of `node`'s surroundings: the operands and outputs its kernel
        moves, a transpose's stride, the layout copies it pays for, a column reduction's fused
        arrays. Nodes alike in their own ops and in this are priced alike (`MenuBuilder`)."""
        copies, lhs_copied = self.layout_copies(node)
        return (
            self.traffic(node),
            self.strided_transpose(node),
            tuple((c.position, c.strided, self.aliased_loop(node, c)) for c in copies),
            lhs_copied,
            self._gpu_fusions()[1].get(node.id, 0),
        )

    def seconds(
        self,
        node: OpNode,
        flops: float,
        in_bytes: Sequence[float | None],
        out_bytes: Sequence[float],
        columns: float | None = None,
    ) -> float:
        """Seconds of `node` doing `flops` per device, with operands and outputs of the given
        per-device sizes (None for a literal operand) and, for a dot_general, its result's
        columns per device (`result_columns`; the whole result's where None)."""
        if self.strided_transpose(node):
            return 2 * sum(out_bytes) / self.cluster.transpose_bandwidth
        reads, writes, launches = self.traffic(node)
        nbytes = sum(b for b, r in zip(in_bytes, reads, strict=True) if r and b is not None)
        nbytes += sum(b for b, w in zip(out_bytes, writes, strict=True) if w)
        copies, lhs_copied = self.layout_copies(node)
        peak = node_peak(node, flops, self.cluster, lhs_copied, columns)
        seconds = op_time(flops, nbytes, peak, self.cluster)
        if node.primitive in _TRANSCENDENTAL and self.cluster.transcendental_rate is not None:
            # flops counts one per element (`planner.graph.elementwise_flops`)
            seconds = max(seconds, flops / self.cluster.transcendental_rate)
        seconds = max(seconds, self.column_reduction_s(node, in_bytes, out_bytes))
        seconds = max(seconds, self.window_s(node, in_bytes, out_bytes))
        seconds += sum(
            self.layout_copy_s(
                node, c, sum(out_bytes) if c.position is None else in_bytes[c.position] or 0.0
            )
            for c in copies
        )
        return seconds + (self.cluster.kernel_overhead_s if launches else 0.0)

    def column_reduction_s(
        self, node: OpNode, in_bytes: Sequence[float | None], out_bytes: Sequence[float]
    ) -> float:
        """Seconds beyond its kernel floor that `node`, with operands and outputs of the given
        per-device sizes, takes to walk its rows where it is a column reduction (its minor
        dimension kept) and the spec prices those (`ClusterSpec.column_reduction_rate`); 0
        otherwise. The rows are per device: a reduced dimension that is split leaves each
        device fewer. Above `COLUMN_REDUCTION_SPLIT` rows, two kernels of √rows each. Where
        XLA:GPU fuses element-wise outputs of its operand's shape into a kernel of one, each
        row costs per array of that shape the kernel reads or writes (`kernel_leader`,
        `ClusterSpec.column_reduction_array_rate`): an H200 took 18 µs for a layer norm
        gradient over 1024x256 rows that wrote two, 3.5 µs for a plain one. (Split in two,
        such outputs streamed at its bandwidth: their bytes price them.)"""
        rate = self.cluster.column_reduction_rate
        array_rate = self.cluster.column_reduction_array_rate
        if rate is None and array_rate is None:
            return 0.0
        if not _column_reduction(node) or not in_bytes[0] or not out_bytes[0]:
            return 0.0
        operand, result = node.in_avals[0], node.out_avals[0]
        elements_in = in_bytes[0] / np.dtype(operand.dtype).itemsize
        rows = elements_in / (out_bytes[0] / np.dtype(result.dtype).itemsize)
        split = rows > COLUMN_REDUCTION_SPLIT
        walked = 2 * math.sqrt(rows) if split else rows
        seconds = 0.0 if rate is None else walked / rate
        if array_rate is not None and not split:
            arrays = self._gpu_fusions()[1].get(node.id, 0)
            seconds = max(seconds, walked * arrays / array_rate)
        if seconds == 0.0:
            return 0.0
        return seconds + (self.cluster.kernel_overhead_s if split else 0.0)

    def window_s(
        self, node: OpNode, in_bytes: Sequence[float | None], out_bytes: Sequence[float]
    ) -> float:
        """Seconds beyond its kernel floor that `node`, with operands and outputs of the given
        per-device sizes, takes to visit its windows where it is a pool (each output's window
        elements at `ClusterSpec.window_reduction_rate`) or max pooling's gradient (each
        window, one per element of its source, at `ClusterSpec.select_and_scatter_rate_at`
        the bytes of its result, the pooled operand's shape) and the spec prices those; 0
        otherwise."""
        if node.primitive == "select_and_scatter_add":
            rate = self.cluster.select_and_scatter_rate_at(out_bytes[0])
            windows = (in_bytes[0] or 0.0) / np.dtype(node.in_avals[0].dtype).itemsize
        elif node.primitive in _WINDOW_REDUCTIONS:
            rate = self.cluster.window_reduction_rate
            outputs = out_bytes[0] / np.dtype(node.out_avals[0].dtype).itemsize
            windows = outputs * math.prod(node.params["window_dimensions"])
        else:
            return 0.0
        return 0.0 if rate is None else windows / rate

    def copy_s(self, nbytes: float, strided: bool) -> float:
        """Seconds of one kernel copying `nbytes` into another layout: read and written at the
        transpose rate where the minor dim moves, at the streaming rate otherwise."""
        if strided and self.cluster.transpose_bandwidth is not None:
            seconds = 2 * nbytes / self.cluster.transpose_bandwidth
        else:
            seconds = op_time(0.0, 2 * nbytes, self.cluster.device_flops, self.cluster)
        return seconds + self.cluster.kernel_overhead_s

    def layout_copy_s(self, node: OpNode, copy: LayoutCopy, nbytes: float) -> float:
        """Seconds of layout copy `copy` of contraction `node`, of `nbytes` per device: where it
        is an aliased loop (`aliased_loop`), each element of each array the loop reads at
        `ClusterSpec.aliased_loop_s_at` its lines in flight, and a kernel floor; otherwise
        `copy_s`."""
        loop = self.aliased_loop(node, copy)
        if loop is None:
            return self.copy_s(nbytes, copy.strided)
        rows, arrays = loop
        value = self.grouping.value_of(copy.source)
        elements = nbytes / value_aval(self.grouping, value).dtype.itemsize
        per_element_s = self.cluster.aliased_loop_s_at(rows * arrays)
        return elements * arrays * per_element_s + self.cluster.kernel_overhead_s

    def aliased_loop(self, node: OpNode, copy: LayoutCopy) -> tuple[int, int] | None:
        """(rows one output row walks, arrays read) of the element-wise loop that XLA:CPU fuses
        into strided layout copy `copy` of dot `node` (`LayoutCopy.written_by_fusion`), where
        the copy's minor dim walks its source at a stride that is a multiple of
        `ClusterSpec.aliasing_stride` and the spec prices such loops; None otherwise. Rows and
        stride are read off the source's whole shape: a device's share of a split minor dim
        walks at a shorter stride. A convolution's copies are left out: priced so, the zoo's
        Wide-ResNet read 1.44 of its measured step."""
        key = (node.id, copy)
        if key not in self._loops:
            self._loops[key] = self._aliased_loop(node, copy)
        return self._loops[key]

    def _aliased_loop(self, node: OpNode, copy: LayoutCopy) -> tuple[int, int] | None:
        cluster = self.cluster
        if node.primitive != "dot_general" or cluster.aliased_loop_s_at(1) is None:
            return None
        if not (copy.strided and copy.written_by_fusion):
            return None
        value = self.grouping.value_of(copy.source)
        if value is None:
            return None
        aval = value_aval(self.grouping, value)
        shape, minor = tuple(aval.shape), len(aval.shape) - 1
        walked = copy.order[-1]  # the source dim that the copy's minor dim runs along
        stride = aval.dtype.itemsize * math.prod(shape[walked + 1 :])
        if stride % cluster.aliasing_stride:
            return None
        rows = math.prod(shape[d] for d in copy.order[copy.order.index(minor) + 1 :])
        return rows, self._loop_arrays(value)

    def _loop_arrays(self, value: Value) -> int:
        """Arrays of `value`'s size that the element-wise loop writing it reads from memory:
        the operands of its chain of fused values that are not fused themselves."""
        graph, size = self.grouping.graph, value_aval(self.grouping, value).size
        found, seen, stack = set(), {value}, [value]
        while stack:
            for ref in graph.node(stack.pop()[0]).inputs:
                read = self.grouping.value_of(ref)
                if read is None or read in seen:
                    continue
                seen.add(read)
                if read in self.fused:
                    stack.append(read)
                elif value_aval(self.grouping, read).size == size:
                    found.add(read)
        return max(1, len(found))

    def strided_transpose(self, node: OpNode) -> bool:
        """Whether `node` is a transpose priced at `transpose_bandwidth`: one that moves the
        minor dimension and that no contraction absorbs (see the module doc)."""
        if node.primitive != "transpose" or self.cluster.transpose_bandwidth is None:
            return False
        permutation = node.params["permutation"]
        if permutation[-1] == len(permutation) - 1:
            return False
        graph = self.grouping.graph
        readers = [graph.node(c).primitive for c, _ in graph.consumers(node.id)]
        if all(r in _CONTRACTIONS for r in readers):
            return False  # the contractions read it transposed (`planner.dot_layout`)
        producer = graph.producer(node.inputs[0])
        if producer is None or producer.primitive not in _CONTRACTIONS:
            return True
        # XLA has a contraction write its result transposed; on a CPU a dot only where its
        # operands can swap (`planner.dot_layout.swaps_free_dims`)
        return (
            self.cluster.platform == "cpu"
            and producer.primitive == "dot_general"
            and not swaps_free_dims(producer, permutation)
        )
