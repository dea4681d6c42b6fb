"""Per-device memory of a plan: which buffers exist, when they are live, and how big they are.

The model mirrors XLA's compiled memory analysis, so that predictions can be held against
`Executable.memory_stats()`: peak = arguments + outputs that do not reuse a donated argument +
the most temporary bytes live at any step. Steps are the graph's nodes in `schedule` order
(program order, updates as early as they can run), or where the spec says XLA:CPU uses its DFS
memory scheduler (`ClusterSpec.dfs_schedule`, which `autopar.simulate_cpu_devices` selects) in
that scheduler's order (`cpu_schedule`).

XLA fuses element-wise ops into their readers, so their results never exist as buffers, and
their operands live until the fusion runs. A node's output is *materialized* unless it is an
element-wise/layout op whose readers all fuse it (element-wise/layout ops or reductions) and
XLA would recompute it in each: always for one reader or a scalar constant, and for several
readers unless the op, or what fuses into it, is expensive (`_EXPENSIVE`, XLA's `IsExpensive`).
An op that only relabels its operand's buffer (`_ALIASES`) extends that buffer's life instead.
An element-wise fusion writes its result over an operand of the same shape that dies there.
On the CPU backend, a dot operand not laid out the way its matmul reads it is first copied
(`planner.dot_layout`), and max pooling's gradient is expanded into index buffers
(`_cpu_buffers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from autopar.planner.cost import LogicalMesh, spec_bytes_per_device
from autopar.planner.dot_layout import layout_copies
from autopar.planner.graph import OpNode, TensorInfo, nodes_by_primitive
from autopar.planner.groups import Grouping, Value, input_value
from autopar.planner.markers import GRAD_BOUNDARY, PARAM_USE
from autopar.planner.plan import Spec
from autopar.planner.primitives import NO_KERNEL, names_where
from autopar.planner.program import StepSignature
from autopar.planner.strategy import spec_axes, split_size, without_axes

_ALIASES = names_where("aliases")  # relabel their operand's buffer (`primitives`)
_FUSED = names_where("fuses")
_EXPENSIVE = names_where("expensive")  # XLA's `IsExpensive`: kept, not recomputed per fusion
_FUSES_OPERANDS = _FUSED | names_where("fuses_operands")


@dataclasses.dataclass(frozen=True, slots=True)
class Liveness:
    """Temporary buffers as (value, first step, last step), plus the step count and the outputs.

    Arguments are live throughout and are not listed; `outputs` are the values the step returns
    that do not reuse a donated argument's buffer. `step_of_node` is the schedule.
    """

    temporaries: tuple[tuple[Value, int, int], ...]
    num_steps: int
    outputs: tuple[Value, ...]
    step_of_node: dict[str, int]
    last_use: dict[Value, int]  # of each buffer and each view of one (`_ALIASES`)
    fused: frozenset[Value]  # computed inside each reader's fusion: never a buffer


def schedule(grouping: Grouping, old_value_readers: dict[str, list[str]]) -> list[OpNode]:
    """Program order, except that what follows the gradients (the update) runs as early as it can.

    XLA's scheduler updates each parameter as soon as its gradient exists, which frees the
    gradient; the jaxpr computes every gradient first. Memory follows XLA's order. An update that
    writes a donated argument's buffer in place still waits for every other reader of the old
    value (the backward pass may read a weight after its gradient exists): `old_value_readers`
    maps each such update to those readers (`_in_place_updates`). A parameter use runs right
    before its first reader: XLA gathers a parameter where it is needed, not where the step
    names it (a recomputed region names its parameters first).
    """
    nodes = list(grouping.planned_nodes())
    graph = grouping.graph
    after_grads = {
        reader
        for b in nodes_by_primitive(graph, GRAD_BOUNDARY)
        for reader, _ in graph.consumers(b.id)
    }
    time: dict[str, float] = {}
    for index, node in enumerate(nodes):
        if node.id in after_grads:
            producers = [
                time[v[0]] for r in node.inputs if (v := grouping.value_of(r)) and v[0] is not None
            ]
            readers = [time[r] for r in old_value_readers.get(node.id, ()) if r in time]
            time[node.id] = max(producers + readers, default=-1.0)
            after_grads.update(reader for reader, _ in graph.consumers(node.id))
        else:
            time[node.id] = float(index)
    for node in nodes:
        first = [time[r] for r, _ in graph.consumers(node.id) if r in time]
        if node.primitive == PARAM_USE and first:
            time[node.id] = min(first) - 0.5
    return [node for _, _, node in sorted((time[n.id], i, n) for i, n in enumerate(nodes))]


def cpu_schedule(
    grouping: Grouping,
    nodes: Sequence[OpNode],
    fused: set[Value],
    old_value_readers: dict[str, list[str]],
) -> list[OpNode]:
    """`nodes` (in a topological order) in the order of XLA:CPU's DFS memory scheduler, which
    `autopar.simulate_cpu_devices` selects: a post-order walk from the step's outputs that
    visits each op's operands in decreasing order of the users beyond the first summed over
    their subtree, then of the bytes their subtree defines (XLA's `DFSMemoryScheduler`). The
    first output so reached is the first layer's update, whose subtree is the forward pass and
    every input gradient: the other layers' weight gradients run after the whole backward pass,
    which keeps their operands live through it (Wide-ResNet's peak read 0.85 of XLA's in
    program order). Ops that XLA fuses into their readers, or that launch no kernel, count no
    users and no bytes, as XLA sees fusions; an in-place update waits for the readers of the
    value it overwrites (XLA's control edges); ties go in program order. What no output needs,
    which XLA removes, runs right after its operands."""
    position = {n.id: i for i, n in enumerate(nodes)}
    operands: dict[str, list[str]] = {}
    users: dict[str, set[str]] = {n.id: set() for n in nodes}
    for n in nodes:
        producers = (v[0] for v in map(grouping.value_of, n.inputs) if v and v[0] is not None)
        operands[n.id] = list(dict.fromkeys(p for p in producers if p in position))
        for producer in operands[n.id]:
            users[producer].add(n.id)
    extra_users: dict[str, int] = {}
    total_bytes: dict[str, int] = {}
    defined = 0
    for n in nodes:
        is_kernel = n.primitive not in NO_KERNEL and any(
            (n.id, o) not in fused for o in range(len(n.out_avals))
        )
        own = sum(a.nbytes for a in n.out_avals) if is_kernel else 0
        defined += own
        extra = max(len(users[n.id]) - 1, 0) if is_kernel else 0
        extra_users[n.id] = min(extra + sum(extra_users[o] for o in operands[n.id]), len(nodes))
        total_bytes[n.id] = min(own + sum(total_bytes[o] for o in operands[n.id]), defined)

    def first(node_id: str) -> tuple[int, int, int]:
        return (-extra_users[node_id], -total_bytes[node_id], position[node_id])

    order: list[str] = []
    done: set[str] = set()

    def walk(start: str) -> None:
        stack = [(start, False)]
        while stack:
            node_id, expanded = stack.pop()
            if node_id in done:
                continue
            if expanded:
                done.add(node_id)
                order.append(node_id)
                continue
            stack.append((node_id, True))
            waits = [r for r in old_value_readers.get(node_id, ()) if r in position]
            for before in reversed(sorted(operands[node_id], key=first) + waits):
                if before not in done:
                    stack.append((before, False))

    roots = (grouping.value_of(ref) for ref in grouping.graph.outputs)
    produced = dict.fromkeys(v[0] for v in roots if v and v[0] in position)
    for root in sorted(produced, key=first):
        walk(root)
    # What no output needs XLA removes: it runs right after its operands here, holding them
    # no longer than they live anyway.
    slot = {node_id: (t, 0) for t, node_id in enumerate(order)}
    for n in nodes:
        if n.id not in slot:
            after = max((slot[o][0] for o in operands[n.id]), default=-1)
            slot[n.id] = (after, 1 + position[n.id])
    return sorted(nodes, key=lambda n: slot[n.id])


def _in_place_updates(
    grouping: Grouping, signature: StepSignature, readers: dict[Value, list[str]]
) -> dict[str, list[str]]:
    """For each node whose output reuses a donated argument's buffer: the argument's readers."""
    updates: dict[str, list[str]] = {}
    for j, i in enumerate(signature.output_to_input):
        value = grouping.value_of(grouping.graph.outputs[j])
        if i is None or i not in signature.donated_inputs or value is None or value[0] is None:
            continue
        writer = value[0]
        updates[writer] = [r for r in readers.get((None, i), []) if r != writer]
    return updates


def _buffers(
    grouping: Grouping, nodes: Iterable[OpNode]
) -> tuple[dict[Value, Value], dict[Value, list[str]]]:
    """(value -> the value whose buffer it is, through `_ALIASES`; buffer -> its readers, and
    a view of one (a value in `_ALIASES`) -> the readers of it and of its own views)."""
    buffer: dict[Value, Value] = {}
    viewed: dict[Value, Value] = {}  # a view -> the value it views
    readers: dict[Value, list[str]] = {}
    for n in nodes:
        operands = [grouping.value_of(ref) for ref in n.inputs]
        for value in operands:
            if value is not None:
                readers.setdefault(buffer.get(value, value), []).append(n.id)
            while value in viewed:
                readers.setdefault(value, []).append(n.id)
                value = viewed[value]
        if n.primitive in _ALIASES and operands[0] is not None:
            buffer[(n.id, 0)] = buffer.get(operands[0], operands[0])
            viewed[(n.id, 0)] = operands[0]
    return buffer, readers


def _fused_values(
    grouping: Grouping,
    nodes: Sequence[OpNode],
    buffer: dict[Value, Value],
    readers: dict[Value, list[str]],
    output_set: set[Value],
) -> set[Value]:
    """The values computed inside each reader's fusion, never a buffer (the module docstring);
    `nodes` in a topological order."""
    graph = grouping.graph
    fused: set[Value] = set()
    costly: dict[str, bool] = {}  # the op with what fuses into it: too costly to compute twice
    for n in nodes:
        operands = [v for v in map(grouping.value_of, n.inputs) if v and v[0] is not None]
        costly[n.id] = n.primitive in _EXPENSIVE or any(
            v in fused and costly[v[0]] for v in operands
        )
        for value in ((n.id, o) for o in range(len(n.out_avals))):
            users = readers.get(value, [])
            if value in buffer or value in output_set or not users or n.primitive not in _FUSED:
                continue
            if all(not a.shape for a in n.in_avals) or (  # a constant: recomputed at each use
                all(graph.node(u).primitive in _FUSES_OPERANDS for u in users)
                and (len(users) == 1 or not costly[n.id])
            ):
                fused.add(value)
    return fused


def liveness(
    grouping: Grouping, signature: StepSignature, *, cpu: bool = False, dfs: bool = False
) -> Liveness:
    """Live ranges of the materialized temporary buffers of the step, in `schedule` order
    (`cpu` and `dfs`: in `cpu_schedule` order); `cpu`: with the buffers XLA:CPU adds
    (`_cpu_buffers`).

    A fused op runs inside the fusion of its reader, so its operands live until that reader runs.
    """
    buffer, readers = _buffers(grouping, grouping.planned_nodes())
    updates = _in_place_updates(grouping, signature, readers)
    nodes = schedule(grouping, updates)
    graph = grouping.graph
    outputs = [grouping.value_of(ref) for ref in graph.outputs]
    output_set = {buffer.get(v, v) for v in outputs if v is not None}
    aliased = {
        outputs[j]
        for j, i in enumerate(signature.output_to_input)
        if i is not None and i in signature.donated_inputs
    }
    fused = _fused_values(grouping, nodes, buffer, readers, output_set)
    if cpu and dfs:
        nodes = cpu_schedule(grouping, nodes, fused, updates)
    step_of = {n.id: t for t, n in enumerate(nodes)}
    run_step: dict[str, int] = {}  # when a node's result is computed: fused ops in their reader
    materialized: list[Value] = []  # in reverse schedule order
    for n in reversed(nodes):
        values = ((n.id, o) for o in range(len(n.out_avals)))
        used = [v for v in values if v not in buffer and readers.get(v)]
        if used and all(v in fused for v in used):
            run_step[n.id] = max(run_step[u] for v in used for u in readers[v])
        else:
            run_step[n.id] = step_of[n.id]
            materialized += [v for v in reversed(used) if v not in output_set]
    materialized.reverse()
    last_use = {v: max(run_step[u] for u in users) for v, users in readers.items()}
    ends = {v: last_use[v] for v in materialized}
    ending: dict[int, list[Value]] = {}
    for v in materialized:
        ending.setdefault(ends[v], []).append(v)
    for v in materialized:  # an element-wise fusion writes over an operand that dies there
        n, t = graph.node(v[0]), step_of[v[0]]
        if n.primitive in _FUSED:
            aval = n.out_avals[v[1]]
            for u in ending.get(t, ()):
                if ends[u] == t and value_aval(grouping, u) == aval:
                    ends[u] = t - 1
                    break
    temporaries = [(v, step_of[v[0]], ends[v]) for v in materialized]
    if cpu:
        temporaries += _cpu_buffers(grouping, nodes, step_of)
    extra_outputs = tuple(
        v
        for j, v in enumerate(outputs)
        if v is not None and v not in aliased and v not in outputs[:j]
    )
    return Liveness(
        tuple(temporaries), len(nodes), extra_outputs, step_of, last_use, frozenset(fused)
    )


def _cpu_buffers(
    grouping: Grouping, nodes: Sequence[OpNode], step_of: dict[str, int]
) -> list[tuple[Value, int, int]]:
    """XLA:CPU's buffers that the jaxpr does not show, each as (a value of its size, first
    step, last step):

    * a dot operand copied into the layout its matmul reads (`planner.dot_layout`), at the dot;
    * max pooling's gradient, `select_and_scatter_add`, which XLA:CPU's SelectAndScatterExpander
      turns into a selection (a reduce-window over the operand, padded where the window is, and
      an int32 iota of its shape per dimension, giving each window's value and its index per
      dimension) and a scatter of the gradient. The selection needs only the forward operand,
      and XLA schedules it in the forward pass: its operand-sized inputs and source-sized
      outputs live from where the operand is computed to the scatter (a Wide-ResNet of 32
      images: 52 MiB of the 188 MiB of temporaries at XLA's peak, which the model missed). A
      step that is a max pool alone has its selection just before its scatter: there this
      over-counts by the scatter's output (1.2-1.3 of XLA's peak)."""
    buffers = []
    for n in nodes:
        at = step_of[n.id]
        if n.primitive == "dot_general":
            for copy in layout_copies(grouping.graph, n):
                value = grouping.value_of(n.inputs[copy.position])
                if not copy.written_by_fusion and value is not None:
                    buffers.append((value, at, at))
        elif n.primitive == "select_and_scatter_add":
            source, operand = (grouping.value_of(ref) for ref in n.inputs[:2])
            if source is None or operand is None:
                continue
            start = step_of.get(operand[0], 0)  # 0: an argument
            aval = n.in_avals[1]
            per_index = -(-4 // aval.dtype.itemsize)  # an int32 index in operand-sized units
            indices = len(aval.shape) * per_index
            padded = any(lo or hi for lo, hi in n.params["padding"])
            buffers += [(operand, start, at)] * (indices + padded)
            buffers += [(source, start, at)] * (1 + indices)
    return buffers


def live_bytes(num_steps: int, buffers: Iterable[tuple[float, int, int]]) -> np.ndarray:
    """Bytes live at each step of buffers given as (bytes, first step, last step)."""
    diff = np.zeros(num_steps + 1)
    for size, start, end in buffers:
        diff[start] += size
        diff[end + 1] -= size
    return np.cumsum(diff)[:num_steps]


def whole_peak_bytes(grouping: Grouping, live: Liveness) -> float:
    """The step's peak with every argument, output and temporary whole. A plan on n devices
    splits a value at most n ways, so at its peak it holds at least this / n per device (a
    floor of the ILP's memory model, which adds only non-negative terms to these values)."""
    inputs = (input_value(g.leader) for g in grouping.groups if g.is_input)
    base = sum(value_aval(grouping, value).nbytes for value in inputs)
    base += sum(value_aval(grouping, value).nbytes for value in live.outputs)
    if not live.num_steps:
        return float(base)
    temps = ((value_aval(grouping, v).nbytes, start, end) for v, start, end in live.temporaries)
    return float(base + live_bytes(live.num_steps, temps).max())


def reduction_copy_bytes(
    mesh: LogicalMesh, aval: TensorInfo, spec: Spec, partial_axes: tuple[str, ...], cpu: bool
) -> float:
    """What summing partial sums over `partial_axes` into `spec` writes beyond its input and
    result. On the CPU backend an all-reduce writes a new buffer, and a reduce-scatter whose dim
    is not the outermost one first copies its input (a collective sends contiguous chunks; the
    dot wrote row-major); elsewhere nothing."""
    if not cpu:
        return 0.0
    reduced = spec_bytes_per_device(aval.shape, aval.dtype.itemsize, spec, mesh)
    if not set(partial_axes) <= set(spec_axes(spec)):
        return reduced
    dim = next(d for d, e in enumerate(spec) if e and set(partial_axes) <= set(e))
    outer = [
        size // split_size(mesh, e or ())
        for size, e in zip(aval.shape[:dim], spec[:dim], strict=True)
    ]
    return reduced * split_size(mesh, partial_axes) if any(m > 1 for m in outer) else 0.0


def unreduced_sum_bytes(
    mesh: LogicalMesh, aval: TensorInfo, spec: Spec, partial_axes: tuple[str, ...], cpu: bool
) -> float:
    """What a node's partial sums take at its step beyond its output, `spec` as summed over
    `partial_axes`: the whole local sum a reduce-scatter reads, and the copies of
    `reduction_copy_bytes`."""
    copies = reduction_copy_bytes(mesh, aval, spec, partial_axes, cpu)
    if not set(partial_axes) <= set(spec_axes(spec)):
        return copies
    whole = without_axes(spec, partial_axes)
    return spec_bytes_per_device(aval.shape, aval.dtype.itemsize, whole, mesh) + copies


def whole_accumulator_bytes(
    mesh: LogicalMesh, aval: TensorInfo, spec: Spec, axes: tuple[str, ...]
) -> float:
    """What a gradient's accumulator takes beyond its slice when it is reduced (into `spec`,
    over `axes`) once per step, after the last micro-batch, instead of per micro-batch."""
    whole = spec_bytes_per_device(aval.shape, aval.dtype.itemsize, without_axes(spec, axes), mesh)
    return whole - spec_bytes_per_device(aval.shape, aval.dtype.itemsize, spec, mesh)


def value_aval(grouping: Grouping, value: Value) -> TensorInfo:
    node, i = value
    if node is None:
        return grouping.graph.inputs[i]
    return grouping.graph.node(node).out_avals[i]


def held_values(grouping: Grouping, num_forward: int) -> list[Value]:
    """Results of the first `num_forward` top-level eqns (a pipeline stage's forward part) that
    a later eqn reads: each micro-batch keeps them from its forward to its backward, so a stage
    with several micro-batches in flight holds one copy per micro-batch."""
    held: dict[Value, None] = {}
    for node in grouping.planned_nodes():
        if top_eqn(node.id) < num_forward:
            continue
        for ref in node.inputs:
            value = grouping.value_of(ref)
            if value is not None and value[0] is not None and top_eqn(value[0]) < num_forward:
                held[value] = None
    return list(held)


def top_eqn(node_id: str) -> int:
    """The top-level eqn a node comes from (ids are eqn paths, `graph`)."""
    return int(node_id.split("/")[0])
