"""ShardParallel's planner: an intra-op sharding for every op of one stage, chosen by an ILP.

Pipeline: group followers with their leaders (`groups`), find repeated layers (classes), list each
group's strategies and costs and each edge's resharding (`menus`), solve the ILP with a memory
budget (`ilp`), and write the result as a `StagePlan`: how every input is stored, the spec of every
node's outputs, the operands to reshard before a node, and the nodes whose partial sums are
reduce-scattered or, with micro-batches, reduced once per step.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from autopar.planner.batch_dims import batch_dims
from autopar.planner.cluster import ClusterSpec
from autopar.planner.cost import LogicalMesh, logical_mesh
from autopar.planner.errors import InvalidArgumentError, MemoryBudgetError
from autopar.planner.explicit import split_spec
from autopar.planner.gradients import (
    SUM_PRIMITIVES,
    GradientChain,
    gradient_chains,
    gradient_part,
    gradient_reduction,
    param_inputs,
)
from autopar.planner.graph import OpGraph, ValueKind, nodes_by_primitive
from autopar.planner.groups import (
    Group,
    Grouping,
    Value,
    assign_classes,
    group_graph,
    input_value,
    structure_signature,
)
from autopar.planner.ilp import (
    DEFAULT_SOLVER,
    DEFAULT_TIME_LIMIT_S,
    OVERLAP_PENALTY,
    ClassCosts,
    EdgeClass,
    IntraOpIlp,
    MemoryModel,
    Solution,
)
from autopar.planner.markers import GRAD_BOUNDARY, PARAM_USE
from autopar.planner.memory import (
    Liveness,
    held_values,
    live_bytes,
    liveness,
    top_eqn,
    unreduced_sum_bytes,
    value_aval,
    whole_accumulator_bytes,
)
from autopar.planner.menus import Costs, Edge, MenuBuilder, MeshCache
from autopar.planner.plan import (
    MeshPlan,
    OpGroupCost,
    PartialSumLowering,
    Plan,
    PlanMethod,
    Predicted,
    Spec,
    StagePlan,
    replicated,
)
from autopar.planner.program import Program, StepSignature
from autopar.planner.progress import phase
from autopar.planner.roofline import Roofline, fresh_memory_s, launch_s
from autopar.planner.strategy import Strategy, split_size, storage_specs, without_axes
from autopar.planner.summary import format_bytes

logger = logging.getLogger(__name__)

_BUDGET_CORRECTIONS = 3  # re-solves when the emission takes a plan over its memory budget
# Storing a byte costs this fraction of moving it: breaks ties towards less memory.
_STORAGE_TIE_BREAK = 1e-3
TOP_OP_GROUPS = 8  # classes of op groups a stage plan lists in `op_costs`
_GRADIENT_PASS_THROUGH = ("convert_element_type", "copy", "transpose", "reshape", "add_any")
# Ops whose result on each device's operand blocks is that device's partial sum: the plan lowers
# their reduce-scatters explicitly, so every backend emits one (GSPMD leaves an all-reduce and a
# slice where no pass turns them into a reduce-scatter, as on the CPU backend).
_EXPLICIT_SUMS = (*SUM_PRIMITIVES, "conv_general_dilated")


@dataclasses.dataclass(frozen=True)
class IntraOpConfig:
    """What the ILP may choose (from `AutoShardingOption`), as plain planner arguments."""

    memory_budget_per_device: float | None = None
    force_data_parallel: bool = False
    force_zero_stage_3: bool = False
    prefer_reduce_scatter: bool = False
    solver: str = DEFAULT_SOLVER
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    reuse_repeated_layers: bool = True
    pinned_inputs: tuple[tuple[str, Spec], ...] = ()  # (input path, storage spec) fixed
    force_batch_dim_to_mesh_dim: int | None = None
    relative_gap: float | None = None  # accept plans this close to optimal (None: the solver's)
    presolve: bool = True  # HiGHS's presolve (`ilp.IntraOpIlp`)
    round_relaxation: bool = False  # plans from the LP relaxation rounded (`ilp.IntraOpIlp`)
    # With micro-batches: reduce gradients once per step (all-reduces always; reduce-scatters
    # where the budget has room for their whole accumulators, largest first), not per micro-batch.
    reduce_gradients_once: bool = True

    def budget(self, cluster: ClusterSpec) -> float:
        """Bytes per device a plan may use: the set budget, else the cluster's device memory."""
        return self.memory_budget_per_device or cluster.device_memory


def _gradient_sums(graph: OpGraph) -> set[str]:
    """Nodes that sum gradients (and the layout ops after them): only the update waits for them."""
    found: set[str] = set()
    for boundary in nodes_by_primitive(graph, GRAD_BOUNDARY):
        grads = zip(boundary.inputs, boundary.params["grad_of"], strict=True)
        stack = [r for r, of in grads if of >= 0]
        while stack:
            ref = stack.pop()
            if ref.kind is not ValueKind.NODE or ref.node in found:
                continue
            node = graph.node(ref.node)
            found.add(node.id)
            if node.primitive in _GRADIENT_PASS_THROUGH:
                stack.extend(node.inputs)
    return found


def input_roles(program: Program) -> dict[int, str]:
    """Each step input's role: "batch" (split per micro-batch), "param" (read through a
    parameter use) or "state" (optimizer state, counters)."""
    params = set(param_inputs(program.graph).values())
    batch = set(program.signature.batch_inputs)
    return {
        i: "batch" if i in batch else "param" if i in params else "state"
        for i in range(len(program.graph.inputs))
    }


def program_structure(program: Program) -> int:
    """A hash equal for programs that are the same up to the order of their ops and inputs
    (`groups.structure_signature`): they plan alike on any mesh."""
    return structure_signature(
        group_graph(program.graph), input_roles(program), program.signature.output_to_input
    )


class _InputMenus:
    """Storage specs each step input may take, restricted by the config's force options."""

    def __init__(self, program: Program, mesh: LogicalMesh, config: IntraOpConfig) -> None:
        self.sig = program.signature
        self.mesh = mesh
        self.config = config
        self.roles = input_roles(program)
        self.all_axes = tuple(mesh.axis_names)
        self.n = mesh.num_devices
        self.pinned = dict(config.pinned_inputs)

    def penalised(self, i: int, spec: Spec) -> bool:
        """prefer_reduce_scatter: optimizer state stored whole costs as if it were gathered."""
        return self.config.prefer_reduce_scatter and self.roles[i] == "state" and not any(spec)

    def __call__(self, i: int) -> list[Spec]:
        shape = self.sig.input_avals[i].shape
        if self.sig.input_paths[i] in self.pinned:
            return [self.pinned[self.sig.input_paths[i]]]
        specs = storage_specs(shape, self.mesh)
        forced = self.config.force_data_parallel or self.config.force_zero_stage_3
        if not forced:
            return specs
        if self.roles[i] == "batch":
            spec = (self.all_axes,) + replicated(len(shape) - 1)
            return [spec] if shape and shape[0] % self.n == 0 else [replicated(len(shape))]
        if self.config.force_zero_stage_3:
            return [split_spec(shape, self.all_axes, self.n)]
        return [replicated(len(shape))]


@dataclasses.dataclass
class _Problem:
    """Everything the ILP and the emission need, indexed by group."""

    grouping: Grouping
    builder: MenuBuilder
    group_costs: list[Costs]
    edges: list[Edge]
    live: Liveness
    num_classes: int
    inputs: _InputMenus
    platform: str  # the cluster's: the CPU backend copies more buffers into layout
    chains: list[GradientChain]  # with micro-batches: the gradients that may be reduced once
    grad_end: int  # the last step of the gradient part (accumulators live until then)

    @functools.cached_property
    def param_uses(self) -> frozenset[str]:
        """The parameter-use markers: a parameter gathered there is an alias of it."""
        return frozenset(n.id for n in nodes_by_primitive(self.grouping.graph, PARAM_USE))

    @functools.cached_property
    def copies(self) -> list[tuple[int, np.ndarray, int, int]]:
        """`_copies`, found once for every memory model of this problem (stacked ones too)."""
        return _copies(self)

    @functools.cached_property
    def internal_copies(self) -> list[tuple[int, None, np.ndarray, int, int]]:
        """`_internal_copies`, found once like `copies`."""
        return _internal_copies(self)


def _forced_batch_axis(mesh: LogicalMesh, config: IntraOpConfig) -> int | None:
    """The mesh axis the batch dim is forced onto; None when free (no option, or an axis of
    one device, which splits nothing)."""
    axis = config.force_batch_dim_to_mesh_dim
    if axis is None:
        return None
    if axis >= len(mesh.shape):
        raise InvalidArgumentError(
            f"force_batch_dim_to_mesh_dim={axis} needs a mesh with {axis + 1} axes; the mesh "
            f"has shape {mesh.shape}"
        )
    return axis if mesh.shape[axis] > 1 else None


@dataclasses.dataclass(frozen=True)
class ProgramAnalysis:
    """What building a program's ILP derives from the program alone, on any mesh: its groups
    and their classes, liveness, gradient part, chains and sums, and the roofline's per-node
    caches. A pipeline layer is planned on every candidate logical mesh (14 for 64 devices):
    one analysis serves them all (`ShardingProblem(analysis=...)`). Read-only once made."""

    program: Program
    cluster: ClusterSpec
    reuse_repeated_layers: bool
    grouping: Grouping
    num_classes: int
    grad_part: set[str]
    complete_chains: list[GradientChain]
    gradient_sums: set[str]
    live: Liveness
    roofline: Roofline

    @classmethod
    def of(cls, program: Program, cluster: ClusterSpec, config: IntraOpConfig) -> ProgramAnalysis:
        graph = program.graph
        grouping = group_graph(graph)
        if config.reuse_repeated_layers:
            num_classes = assign_classes(grouping, input_roles(program))
        else:
            for group in grouping.groups:
                group.cls = group.index
            num_classes = len(grouping.groups)
        cpu, dfs = cluster.platform == "cpu", cluster.dfs_schedule
        live = liveness(grouping, program.signature, cpu=cpu, dfs=dfs)
        return cls(
            program,
            cluster,
            config.reuse_repeated_layers,
            grouping,
            num_classes,
            gradient_part(graph),
            [c for c in gradient_chains(graph) if c.complete],
            _gradient_sums(graph),
            live,
            Roofline(grouping, live.fused, cluster),
        )

    def serves(self, program: Program, cluster: ClusterSpec, config: IntraOpConfig) -> bool:
        """Whether this is `of(program, cluster, config)` (the very program)."""
        return (
            self.program is program
            and self.cluster == cluster
            and self.reuse_repeated_layers == config.reuse_repeated_layers
        )


def _build(
    program: Program,
    mesh: LogicalMesh,
    cluster: ClusterSpec,
    config,
    k: int,
    analysis: ProgramAnalysis | None = None,
    cache: MeshCache | None = None,
) -> _Problem:
    if analysis is None or not analysis.serves(program, cluster, config):
        analysis = ProgramAnalysis.of(program, cluster, config)
    if not config.reuse_repeated_layers:
        cache = None  # its groups have no structure to share by
    grouping, live = analysis.grouping, analysis.live
    inputs = _InputMenus(program, mesh, config)
    weights = dict.fromkeys(analysis.grad_part, float(k)) if k > 1 else {}
    once = k > 1 and config.reduce_gradients_once
    chains = analysis.complete_chains if once else []
    axis = _forced_batch_axis(mesh, config)
    batch = program.signature.batch_inputs
    forced = {} if axis is None else batch_dims(grouping, batch, mesh, axis)
    builder = MenuBuilder(
        grouping,
        mesh,
        analysis.roofline,
        weights,
        analysis.gradient_sums,
        inputs,
        forced,
        None if axis is None else mesh.axis_names[axis],
        accumulable=frozenset(node for c in chains for node in c.sums),
        cache=cache,
    )
    group_costs = [builder.group_costs(g) for g in grouping.groups]
    edges = builder.edges() + _alias_edges(program.signature, grouping, builder)
    grad_end = max((live.step_of_node.get(n, 0) for n in analysis.grad_part), default=0)
    return _Problem(
        grouping,
        builder,
        group_costs,
        edges,
        live,
        analysis.num_classes,
        inputs,
        cluster.platform,
        chains,
        grad_end,
    )


def _value_bytes(problem: _Problem, value: Value) -> tuple[int, tuple, np.ndarray]:
    """(group, local value, per-choice bytes per device) of a value."""
    grouping, builder = problem.grouping, problem.builder
    group = grouping.groups[grouping.group_of_value(value)]
    lv = builder.local_value(group, value)
    aval = value_aval(grouping, value)
    menu = builder.menu(group)
    sizes = np.array(
        [
            builder.spec_bytes(aval.shape, aval.dtype.itemsize, specs[lv])
            for specs in menu.value_specs
        ]
    )
    return group.index, lv, sizes


def _unreduced_sums(problem: _Problem) -> list[tuple[int, None, np.ndarray, int, int]]:
    """Partial sums exist whole before they are reduced, at their node's step: per choice,
    (group, None, extra bytes, step, step) beyond the node's reduced output
    (`memory.unreduced_sum_bytes`)."""
    grouping, builder, cpu = problem.grouping, problem.builder, problem.platform == "cpu"
    buffers = []
    of_class: dict[tuple[int, int], np.ndarray] = {}  # by (class, member): alike in like layers
    for group in grouping.groups:
        menu = builder.menu(group)
        for j, member in enumerate(group.members):
            sizes = of_class.get((group.cls, j))
            if sizes is None:
                aval = grouping.graph.node(member).out_avals[0]
                sizes = of_class[group.cls, j] = np.zeros(len(menu))
                for k, strategies in enumerate(menu.strategies):
                    s = strategies[j]
                    if s.partial_axes and split_size(builder.mesh, s.partial_axes) > 1:
                        sizes[k] = unreduced_sum_bytes(
                            builder.mesh, aval, s.out_specs[0], s.partial_axes, cpu
                        )
            if sizes.any():
                step = problem.live.step_of_node[member]
                buffers.append((group.index, None, sizes, step, step))
    return buffers


def _whole_accumulators(problem: _Problem) -> list[tuple[int, None, np.ndarray, int, int]]:
    """A gradient reduce-scattered once per step is accumulated whole on each device, from the
    step's start until its gradients are done: per choice, (group, None, extra bytes beyond its
    slice, 0, last gradient step). A gradient of several sums has one accumulator: each sum's
    share is counted (in its boundary's dtype; the chain keeps the element count)."""
    chain_of = {n: chain for chain in problem.chains for n in chain.sums}
    grouping, builder = problem.grouping, problem.builder
    buffers = []
    for group in grouping.groups:
        menu = builder.menu(group)
        sizes = np.zeros(len(menu))
        for j, member in enumerate(group.members):
            chain = chain_of.get(member)
            if chain is None:
                continue
            aval = grouping.graph.node(member).out_avals[0]
            itemsize = grouping.graph.node(chain.boundary).in_avals[chain.position].dtype.itemsize
            for k, strategies in enumerate(menu.strategies):
                s = strategies[j]
                if s.accumulated and s.reduce_scatters:
                    extra = whole_accumulator_bytes(
                        builder.mesh, aval, s.out_specs[0], s.partial_axes
                    )
                    sizes[k] += extra * itemsize / aval.dtype.itemsize / len(chain.sums)
        if sizes.any():
            buffers.append((group.index, None, sizes, 0, problem.grad_end))
    return buffers


def _copy_bytes(problem: _Problem, value: Value, aval, have: Spec, need: Spec | None) -> float:
    """Bytes per device of the buffer a read of `value` stored as `have` takes as `need`: its
    resharded copy; none for no resharding, a no-op (size-1 axes) or a slice inside the
    reader's fusion (`MenuBuilder.copy_bytes`)."""
    if need is None or need == have:
        return 0.0
    fused = value in problem.live.fused
    return problem.builder.copy_bytes(aval.shape, aval.dtype.itemsize, have, need, fused)


def _copy_span(problem: _Problem, node_id: str) -> tuple[int, int]:
    """The steps a resharded copy read by `node_id` lives: until the node runs; a parameter
    gathered at its use (an alias of it) until that use's last reader."""
    start = problem.live.step_of_node[node_id]
    if node_id not in problem.param_uses:
        return start, start
    return start, problem.live.last_use.get((node_id, 0), start)


def _copies(problem: _Problem) -> list[tuple[int, np.ndarray, int, int]]:
    """The resharded copies the edges' reads make: per read that copies for some pair of
    choices, (edge, bytes per (producer spec, consumer need), first step, last step), as the
    emission counts them (`_emit`)."""
    grouping = problem.grouping
    found = []
    of_kind: dict[tuple, np.ndarray] = {}  # by (edge kind, read, fused): alike in like layers
    for i, edge in enumerate(problem.edges):
        aval = value_aval(grouping, edge.value)
        for r, j in enumerate(edge.readers):
            key = (edge.kind, r, edge.value in problem.live.fused)
            sizes = of_kind.get(key)
            if sizes is None:
                sizes = of_kind[key] = np.array(
                    [
                        [
                            _copy_bytes(problem, edge.value, aval, have, needs[r])
                            for needs in edge.needs
                        ]
                        for have in edge.haves
                    ]
                )
            if sizes.any():
                member = grouping.groups[edge.consumer].members[j]
                found.append((i, sizes, *_copy_span(problem, member)))
    return found


def _internal_copies(problem: _Problem) -> list[tuple[int, None, np.ndarray, int, int]]:
    """The resharded copies of values a group's members read from each other: per read that
    copies under some choice, (group, None, bytes per choice, first step, last step)."""
    grouping, builder = problem.grouping, problem.builder
    found = []
    of_class: dict[tuple, np.ndarray] = {}  # by (class, member, operand, fused): as above
    for group in grouping.groups:
        menu = builder.menu(group)
        for j, member in enumerate(group.members):
            node = grouping.graph.node(member)
            for pos, ref in enumerate(node.inputs):
                value = grouping.value_of(ref)
                if value is None or grouping.group_of_value(value) != group.index:
                    continue
                key = (group.cls, j, pos, value in problem.live.fused)
                sizes = of_class.get(key)
                if sizes is None:
                    lv, aval = builder.local_value(group, value), node.in_avals[pos]
                    choices = zip(menu.strategies, menu.value_specs, strict=True)
                    sizes = of_class[key] = np.array(
                        [
                            _copy_bytes(
                                problem, value, aval, specs[lv], strategies[j].in_specs[pos]
                            )
                            for strategies, specs in choices
                        ]
                    )
                if sizes.any():
                    span = _copy_span(problem, member)
                    found.append((group.index, None, sizes, *span))
    return found


@dataclasses.dataclass(frozen=True)
class Stash:
    """A pipeline stage's activations held by its other micro-batches in flight: the results of
    its program's first `num_forward` top-level eqns (the forward part) that later eqns read,
    `copies` times (the micro-batches in flight besides the one the program runs). The ILP
    counts them at every step, so it trades them against the rest of the stage's memory."""

    num_forward: int
    copies: int

    def __post_init__(self) -> None:
        if self.num_forward < 0 or self.copies < 0:
            raise ValueError(f"Stash needs counts >= 0, got {self}")


class _Memory:
    """Memory per step (arguments + outputs + live temporaries) as the ILP's `MemoryModel`.

    Resharded copies are temporaries too, as the emission makes them: a copy inside a group
    depends on the group's choice; one on an edge on both ends' choices, so the ILP carries
    its bytes on the edge's variables (`MemoryModel.edge_coefficients`). Without them, a
    GPT-39B layer's least memory was 12.7 GiB by the ILP and 18.9 GiB as emitted.

    With `depth` d, the program is one of d like layers of a pipeline stage: what each layer
    holds all step long (its state arguments, its gradient accumulated over micro-batches, a
    gradient's whole accumulator) adds up over the stage, so d - 1 other layers' worth counts
    at every step, while temporaries come and go one layer at a time. `batch_inputs` are the
    arguments that are not state."""

    def __init__(
        self,
        problem: _Problem,
        stash: Stash | None,
        depth: int = 1,
        batch_inputs: Collection[int] = (),
    ) -> None:
        self.problem = problem
        self.num_forward = None if stash is None else stash.num_forward
        grouping = problem.grouping
        self.cls = np.array([g.cls for g in grouping.groups])
        inputs = [
            (g.leader, _value_bytes(problem, input_value(g.leader)))
            for g in grouping.groups
            if g.is_input
        ]
        self.input_sizes = {g: sizes for _, (g, _, sizes) in inputs}
        self.always = [found for _, found in inputs]
        self.always += [_value_bytes(problem, v) for v in problem.live.outputs]
        if stash is not None and stash.copies:
            held = held_values(grouping, stash.num_forward)
            self.always += [
                (g, lv, stash.copies * sizes)
                for g, lv, sizes in (_value_bytes(problem, v) for v in held)
            ]
        accumulators = _whole_accumulators(problem)
        self.temps = (
            [
                (*_value_bytes(problem, value), start, end)
                for value, start, end in problem.live.temporaries
            ]
            + _unreduced_sums(problem)
            + accumulators
        )
        if depth > 1:
            gradients = {  # the boundary's operands that are gradients (the rest pass through)
                value
                for boundary in nodes_by_primitive(grouping.graph, GRAD_BOUNDARY)
                for ref, of in zip(boundary.inputs, boundary.params["grad_of"], strict=True)
                if of >= 0 and (value := grouping.value_of(ref)) is not None
            }
            batch = set(batch_inputs)
            held_all_step = [found for i, found in inputs if i not in batch]
            held_all_step += [_value_bytes(problem, v) for v in sorted(gradients, key=str)]
            held_all_step += [(g, lv, sizes) for g, lv, sizes, _, _ in accumulators]
            self.always += [(g, lv, (depth - 1) * sizes) for g, lv, sizes in held_all_step]
        # resharded copies: within groups (a choice's own), between them (an edge's)
        self.internal = problem.internal_copies
        self.copies = problem.copies

    def evaluate_groups(self, group_choice: np.ndarray, copies: bool = True) -> np.ndarray:
        """Bytes per step of a choice per group; without `copies`, leaving out the resharded
        copies (the emission counts those itself, as it emits them)."""
        steps = self.problem.live.num_steps
        base = sum(sizes[group_choice[g]] for g, _, sizes in self.always)
        if not steps:
            return np.array([base])
        internal = self.internal if copies else []
        temps = [
            (sizes[group_choice[g]], start, end)
            for g, _, sizes, start, end in (*self.temps, *internal)
        ]
        edges = self.problem.edges
        temps += [
            (
                sizes[
                    edges[i].producer_choice[group_choice[edges[i].producer]],
                    edges[i].consumer_choice[group_choice[edges[i].consumer]],
                ],
                start,
                end,
            )
            for i, sizes, start, end in (self.copies if copies else ())
        ]
        return base + live_bytes(steps, temps)

    def model(self, edge_class_of: Sequence[int]) -> MemoryModel:
        """This memory as the ILP's model, with the edges merged into classes as
        `edge_class_of` (edge -> edge class) says."""

        def edge_coefficients(step: int) -> dict[int, np.ndarray]:
            per_edge: dict[int, np.ndarray] = {}
            for i, sizes, start, end in self.copies:
                if start <= step <= end:
                    c = edge_class_of[i]
                    per_edge[c] = per_edge.get(c, 0) + sizes
            return per_edge

        return MemoryModel(
            self.evaluate,
            self.coefficients,
            self.floor(),
            edge_coefficients,
            frozenset(edge_class_of[i] for i, *_ in self.copies),
        )

    def evaluate(self, class_choice: np.ndarray) -> np.ndarray:
        return self.evaluate_groups(class_choice[self.cls])

    def floor(self) -> float:
        """Bytes no choices hold less of at every step: each argument and output (and stashed
        copy) at its least."""
        return float(sum(sizes.min() for _, _, sizes in self.always))

    def coefficients(self, step: int) -> tuple[dict[int, np.ndarray], float]:
        per_class: dict[int, np.ndarray] = {}
        for g, _, sizes in self.always:
            c = self.cls[g]
            per_class[c] = per_class.get(c, 0) + sizes
        for g, _, sizes, start, end in (*self.temps, *self.internal):
            if start <= step <= end:
                c = self.cls[g]
                per_class[c] = per_class.get(c, 0) + sizes
        return per_class, 0.0


def _class_inputs(
    problem: _Problem, memory_sizes: dict[int, np.ndarray], bandwidth: float
) -> tuple[list[int], list[ClassCosts], list[EdgeClass], list[int]]:
    """Per-class costs and edges: groups of one class summed (they share variables); and each
    edge's edge class."""
    groups = problem.grouping.groups
    num_choices = [0] * problem.num_classes
    costs: list[ClassCosts | None] = [None] * problem.num_classes
    for g, group_cost in zip(groups, problem.group_costs, strict=True):
        n = len(group_cost.compute)
        if costs[g.cls] is None:
            num_choices[g.cls] = n
            costs[g.cls] = ClassCosts(np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n))
        c = costs[g.cls]
        c.compute += group_cost.compute
        c.blocking += group_cost.blocking
        c.overlap += group_cost.overlap
        if g.is_input:  # prefer storing less, where it costs nothing else
            sizes = memory_sizes[g.index]
            c.tie_break += _STORAGE_TIE_BREAK * sizes / bandwidth
            specs = problem.builder.menu(g).value_specs
            c.tie_break += [
                sizes[k] / bandwidth if problem.inputs.penalised(g.leader, spec[(-1, 0)]) else 0.0
                for k, spec in enumerate(specs)
            ]
    merged: list[EdgeClass] = []
    position: dict[tuple, int] = {}  # an edge class's key -> its index in `merged`
    edge_class_of = []  # per edge, its class's index
    for edge in problem.edges:
        h, g = groups[edge.producer].cls, groups[edge.consumer].cls
        key = (
            h,
            g,
            edge.producer_choice.tobytes(),
            edge.consumer_choice.tobytes(),
            edge.costs.blocking.shape,
        )
        if key not in position:
            position[key] = len(merged)
            zeros = np.zeros_like(edge.costs.blocking)
            merged.append(
                EdgeClass(h, g, edge.producer_choice, edge.consumer_choice, zeros, zeros.copy())
            )
        found = merged[position[key]]
        found.blocking += edge.costs.blocking
        found.overlap += edge.costs.overlap
        edge_class_of.append(position[key])
    return num_choices, costs, merged, edge_class_of


def _alias_edges(signature: StepSignature, grouping: Grouping, builder: MenuBuilder) -> list[Edge]:
    """An output that is the new value of an input is stored like that input, so the next step
    reads it as planned: where it is computed in another spec, resharding it into the input's
    storage (e.g. ZeRO-2 all-gathering updated parameters) is an edge to the input's group."""
    edges = []
    for j, i in enumerate(signature.output_to_input):
        value = grouping.value_of(grouping.graph.outputs[j])
        if i is None or value is None or value == input_value(i):
            continue
        edge = builder.storage_edge(value, grouping.groups[grouping.input_group[i]])
        if edge is not None:
            edges.append(edge)
    return edges


StructureStrategies = Mapping[int, tuple[Strategy, ...]]
"""A plan's strategies per group structure (`Group.structure`): a start for the ILP of a program
with groups of the same structures (`ShardingProblem.start_from`)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A candidate's plan (`ShardingProblem.candidate`) and its strategies by group structure."""

    plan: Plan
    strategies: StructureStrategies


class ShardingProblem:
    """One program on one mesh with its menus, costs and ILP built once: `solve` plans it for a
    memory budget, and solving again under a tighter budget reuses the ILP's memory cuts.
    `stash`: a pipeline stage's activations held by its other micro-batches in flight, counted
    in every memory figure (the ILP's, the plan's prediction, the least memory). `analysis`:
    `ProgramAnalysis.of(program, cluster, config)`, where it is planned on several meshes.
    `cache`: a `MeshCache` of this mesh, cluster and config that other programs planned here
    share (menus and costs of the groups they have in common)."""

    def __init__(
        self,
        program: Program,
        mesh_plan: MeshPlan,
        cluster: ClusterSpec,
        config: IntraOpConfig,
        num_micro_batches: int,
        stash: Stash | None = None,
        analysis: ProgramAnalysis | None = None,
        cache: MeshCache | None = None,
    ) -> None:
        start = time.perf_counter()
        self.program, self.mesh_plan, self.cluster = program, mesh_plan, cluster
        self.num_micro_batches = num_micro_batches
        self.reduce_scatter_once = config.reduce_gradients_once and num_micro_batches > 1
        mesh = logical_mesh(cluster, mesh_plan.shape, mesh_plan.axis_names)
        self.problem = _build(program, mesh, cluster, config, num_micro_batches, analysis, cache)
        self.memory = _Memory(self.problem, stash)
        num_choices, costs, self.edges, self.edge_class_of = _class_inputs(
            self.problem, self.memory.input_sizes, max(mesh.bandwidths)
        )
        self.ilp = IntraOpIlp(
            num_choices,
            costs,
            self.edges,
            self.memory.model(self.edge_class_of),
            solver=config.solver,
            time_limit_s=config.time_limit_s,
            relative_gap=config.relative_gap,
            presolve=config.presolve,
            round_relaxation=config.round_relaxation,
        )
        self._least: tuple[np.ndarray, StagePlan, Predicted] | None = None
        self.build_seconds = time.perf_counter() - start

    def stacked(self, depth: int, stash: Stash) -> ShardingProblem:
        """This program as one of `depth` like layers of a pipeline stage: its ILP fits the
        state the `depth` layers hold all step (`_Memory`), `stash`'s copies of its stashed
        activations and its own temporaries within the budget, so it trades what adds up over
        a stage's layers against time. Its plans' memory is the stack's; plan it as a
        `candidate`. Its ILP chooses which gradients to reduce once per step within the
        stack's memory, so no pass adds more (`_scatter_once` counts one program's). Menus and
        costs are shared with this problem, not rebuilt."""
        memory = _Memory(self.problem, stash, depth, self.program.signature.batch_inputs)
        stacked = copy.copy(self)
        stacked.memory = memory
        stacked.reduce_scatter_once = False
        stacked.ilp = IntraOpIlp(
            self.ilp.num_choices,
            self.ilp.costs,
            self.ilp.edges,
            memory.model(self.edge_class_of),
            solver=self.ilp.solver,
            time_limit_s=self.ilp.time_limit_s,
            relative_gap=self.ilp.relative_gap,
            presolve=self.ilp.presolve,
            round_relaxation=self.ilp.round_relaxation,
        )
        stacked._least = None
        stacked.build_seconds = 0.0
        return stacked

    def solve(self, budget: float, start: Mapping[int, int] | None = None) -> Plan | None:
        """The fastest plan within `budget` bytes per device as emitted; None if none fits.
        The ILP solves of its budget corrections share one time limit. `start`: a choice per
        class for the ILP to start from (`start_from`)."""
        began = time.perf_counter()
        found = self._fitting_plan(budget, began + self.ilp.time_limit_s, start)
        if found is None:
            return None
        return self._plan(*found, budget, began, warn=True)

    def candidate(self, budget: float, correct: bool = False) -> Candidate | None:
        """A candidate to price, such as a pipeline layer: the ILP's fastest plan within
        `budget` by its own memory model, whatever the emission adds (the plan's prediction
        counts it), so no corrections' extra solves; None where none fits. With `correct`,
        one that the emission takes over `budget` is asked for less by its excess, once. Where
        the ILP finds none in its time limit, or none when asked for less, the plan of least
        memory stands in if it fits: a layer that fits must not drop out of a stage search
        because its ILP ran out of time. Its ILP may stop at the time limit by design, so it
        does not warn when it does."""
        began = time.perf_counter()
        found = self._emitted(budget, began + self.ilp.time_limit_s, None)
        excess = -math.inf if found is None else found[3].memory_per_device_bytes - budget
        if correct and excess > 0:
            deadline = time.perf_counter() + self.ilp.time_limit_s
            found = self._emitted(budget - excess, deadline, None)
        if found is None:
            if excess <= 0 and not self.ilp.out_of_time:
                return None  # the ILP proved none fits (its memory is a lower bound)
            found = (None, *self._least_memory_plan())
            if found[3].memory_per_device_bytes > budget:
                return None
        plan = self._plan(*found, budget, began, warn=False)
        return Candidate(plan, self._structure_strategies(found[1]))

    def start_from(self, chosen: Sequence[StructureStrategies]) -> dict[int, int]:
        """Per class, the menu choice of the strategies that plans of programs with groups of
        the same structure (`Candidate.strategies`, such as a stage's layers planned alone)
        chose for it, the most common where they differ: a start for `solve`."""
        start: dict[int, int] = {}
        for group in self.problem.grouping.groups:
            if group.cls in start or group.structure is None:
                continue
            votes = collections.Counter(c[group.structure] for c in chosen if group.structure in c)
            menu = self.problem.builder.menu(group).strategies
            for strategies, _ in votes.most_common():
                if strategies in menu:
                    start[group.cls] = menu.index(strategies)
                    break
        return start

    def _structure_strategies(self, choice: np.ndarray) -> StructureStrategies:
        """The strategies of `choice` (per group) by group structure."""
        found: dict[int, tuple[Strategy, ...]] = {}
        for group in self.problem.grouping.groups:
            if group.structure is not None and group.structure not in found:
                menu = self.problem.builder.menu(group)
                found[group.structure] = menu.strategies[choice[group.index]]
        return found

    def _plan(
        self,
        solution: Solution | None,
        choice: np.ndarray,
        stage: StagePlan,
        predicted: Predicted,
        budget: float,
        began: float,
        warn: bool,
    ) -> Plan:
        """The plan of `choice` within `budget` (`solution` None: the least-memory plan), its
        ILP solved since `began`; `warn`: say where the ILP stopped at its time limit."""
        program, problem = self.program, self.problem
        if warn and solution is not None and solution.timed_out:
            logger.warning(
                "the sharding ILP hit its time limit (%.3g s); using the best plan found, which "
                "may not be optimal (raise AutoShardingOption.time_limit_s)",
                self.ilp.time_limit_s,
            )
        if self.reduce_scatter_once:
            stage, predicted = self._scatter_once(choice, budget, stage, predicted)
        elapsed = self.build_seconds + time.perf_counter() - began
        self.build_seconds = 0.0  # counted in the first plan only
        logger.info(
            "sharding ILP: %d nodes in %d groups, %d classes, %d edges; solved in %.2f s",
            len(program.graph),
            len(problem.grouping.groups),
            problem.num_classes,
            len(self.edges),
            time.perf_counter() - began,
        )
        logger.debug("shard_parallel plan made in %.2f s (ILP built and solved)", elapsed)
        # Timings stay out of the plan: the same program and options give the same plan.
        if solution is None:
            outcome = "the least-memory plan (the faster ones do not fit as emitted)"
        else:
            outcome = (
                "optimal"
                if solution.optimal
                else "time limit hit, best found"
                if solution.timed_out
                else "rounded from its LP relaxation"
            )
        note = f"ILP over {len(problem.grouping.groups)} groups ({problem.num_classes} classes), "
        note += outcome
        sig = program.signature
        return Plan(
            method=PlanMethod.SHARD_PARALLEL,
            num_micro_batches=self.num_micro_batches,
            stages=(stage,),
            predicted=predicted,
            cluster=self.cluster,
            input_paths=sig.input_paths,
            output_paths=sig.output_paths,
            donated_inputs=sig.donated_inputs,
            fingerprint=program.fingerprint,
            notes=(note,),
        )

    def _emitted(
        self,
        target: float,
        deadline: float,
        forbidden: dict[int, list[int]] | None,
        start: Mapping[int, int] | None = None,
    ) -> tuple[Solution, np.ndarray, StagePlan, Predicted] | None:
        """The ILP's fastest choices within `target` and their plan as emitted (None: no
        choices fit `target`)."""
        solution = self.ilp.solve(target, deadline, forbidden, start)
        if solution is None:
            return None
        choice = solution.choices[self.memory.cls]
        stage, predicted = _emit(self.program, self.problem, self.mesh_plan, self.memory, choice)
        return solution, choice, stage, predicted

    def _fitting_plan(
        self, budget: float, deadline: float, start: Mapping[int, int] | None
    ) -> tuple[Solution | None, np.ndarray, StagePlan, Predicted] | None:
        """The fastest plan found whose emitted memory fits `budget` (None: none does).

        The ILP's memory counts resharded copies (`_copies`), but not all the emission adds
        (gradients it reduces once per step hold whole accumulators), so its plan may not fit
        as emitted: it is asked for less by the excess, a few times. Where that fails with
        gradients reduced once from whole accumulators in the menus, it is tried again without
        them; the pass after the ILP adds those that fit (`_scatter_once`). The plan of least
        memory is the last resort, also where the ILP runs out of time before any plan (a
        memory-bound stage of GPT-39B did, and was refused though 13.1 of its 14.9 GiB would
        do), so None means nothing fits. The solves share `deadline`."""
        twins = self._whole_accumulator_choices()
        for forbidden in (None, twins) if twins else (None,):
            target = budget
            for _ in range(1 + _BUDGET_CORRECTIONS):
                found = self._emitted(target, deadline, forbidden, start)
                if found is None:
                    if target == budget and forbidden is None and not self.ilp.out_of_time:
                        # The ILP's memory is a lower bound of the emitted plan's: none fits.
                        return None
                    break
                excess = found[3].memory_per_device_bytes - budget
                if excess <= 0:
                    return found
                target = min(target, float(self.memory.evaluate(found[0].choices).max())) - excess
        choice, stage, predicted = self._least_memory_plan()
        if predicted.memory_per_device_bytes > budget:
            return None
        return None, choice, stage, predicted

    def _whole_accumulator_choices(self) -> dict[int, list[int]]:
        """Per class, the menu's choices that reduce-scatter a gradient once per step."""
        found = {}
        for group in self.problem.grouping.groups:
            menu = self.problem.builder.menu(group)
            found[group.cls] = [
                k
                for k, strategies in enumerate(menu.strategies)
                if any(s.accumulated and s.reduce_scatters for s in strategies)
            ]
        return {c: ks for c, ks in found.items() if ks}

    def _scatter_once(
        self, choice: np.ndarray, budget: float, stage: StagePlan, predicted: Predicted
    ) -> tuple[StagePlan, Predicted]:
        """The plan with more of its split-stored gradients reduced once per step, largest
        first, as far as their whole accumulators fit in what `budget` leaves: those the ILP's
        menus cannot choose so (a gradient summed in several groups, or all-reduced and then
        stored split)."""
        problem = self.problem
        chosen = _chosen_strategies(problem, choice)
        room = budget - predicted.memory_per_device_bytes
        upgraded: set[str] = set()
        for chain, extra in sorted(
            _scatter_once_candidates(problem, chosen, stage), key=lambda c: -c[1]
        ):
            if extra <= room:
                upgraded.update(chain.sums)
                room -= extra
        if not upgraded:
            return stage, predicted
        found = _emit(
            self.program, problem, self.mesh_plan, self.memory, choice, frozenset(upgraded)
        )
        return found if found[1].memory_per_device_bytes <= budget else (stage, predicted)

    def _least_memory_plan(self) -> tuple[np.ndarray, StagePlan, Predicted]:
        """The choices (per group) of least memory as emitted, and their plan: of the ILP's
        least-memory choices and the fastest plan within that memory (many choices tie on the
        ILP's memory; what the emission adds may differ). The search for the fastest starts
        from the least-memory choices, so it has a plan from the outset: at the tightest budget
        a solve from nothing can run out of time before its first (GPT-39B's squeezed layers
        did, twice the time limit each)."""
        if self._least is None:
            least = self.ilp.least_memory_choices()
            candidates = [least]
            with contextlib.suppress(MemoryBudgetError):
                budget = float(self.memory.evaluate(least).max())
                fastest = self.ilp.solve(budget, start=dict(enumerate(least.tolist())))
                if fastest is not None:
                    candidates.append(fastest.choices)
            emit = functools.partial(_emit, self.program, self.problem, self.mesh_plan)
            plans = [(c, *emit(self.memory, c)) for c in (x[self.memory.cls] for x in candidates)]
            self._least = min(plans, key=lambda p: p[2].memory_per_device_bytes)
        return self._least

    def least_memory(self) -> float:
        """The least memory per device any plan of this problem needs, as emitted: what the ILP
        finds least, with what the emission adds."""
        return self._least_memory_plan()[2].memory_per_device_bytes

    def over_budget(self, budget: float, least: float | None = None) -> MemoryBudgetError:
        """The error for a budget nothing fits in, with the least memory that would fit
        (`least`, or `least_memory()`)."""
        least = self.least_memory() if least is None else least
        return MemoryBudgetError(
            f"no sharding plan fits the memory budget of {format_bytes(budget)} per device; the "
            f"least memory per device that would fit is about {format_bytes(least)} (set "
            "AutoShardingOption(memory_budget_per_device=...) or use more devices)",
            budget,
            least,
        )


def plan_shard_parallel(
    program: Program,
    mesh_plan: MeshPlan,
    cluster: ClusterSpec,
    config: IntraOpConfig,
    num_micro_batches: int,
) -> Plan:
    """The ILP plan of `program` on `mesh_plan` (1D or 2D) for `cluster`'s costs."""
    with phase(f"sharding ILP on mesh {mesh_plan.shape}"):
        problem = ShardingProblem(program, mesh_plan, cluster, config, num_micro_batches)
        budget = config.budget(cluster)
        plan = problem.solve(budget)
    if plan is None:
        raise problem.over_budget(budget)
    return plan


def _chosen_strategies(problem: _Problem, choice: np.ndarray) -> dict[str, Strategy]:
    """Each planned node's strategy under the groups' `choice`."""
    chosen = {}
    for group in problem.grouping.groups:
        strategies = problem.builder.menu(group).strategies[choice[group.index]]
        chosen.update(zip(group.members, strategies, strict=True))
    return chosen


def _whole_accumulator_bytes(
    problem: _Problem, chain: GradientChain, spec: Spec, axes: tuple[str, ...]
) -> float:
    """What a gradient's accumulator takes beyond its slice when it is reduce-scattered once per
    step (into `spec`) instead of per micro-batch."""
    aval = problem.grouping.graph.node(chain.boundary).in_avals[chain.position]
    return whole_accumulator_bytes(problem.builder.mesh, aval, spec, axes)


def _same_axes_sums(chain: GradientChain, chosen: dict[str, Strategy]) -> tuple[str, ...] | None:
    """The mesh axes all sums of a gradient are split over, if they are the same for all and
    the sums are reduced over devices (else None: the gradient cannot travel unreduced)."""
    strategies = [chosen.get(n) for n in chain.sums]
    if not strategies or any(s is None for s in strategies):
        return None
    axes = {s.partial_axes for s in strategies}
    return (
        axes.pop()
        if len(axes) == 1 and any(s.accumulated or s.reduce_scatters for s in strategies)
        else None
    )


def _scatter_once_candidates(
    problem: _Problem, chosen: dict[str, Strategy], stage: StagePlan
) -> list[tuple[GradientChain, float]]:
    """Gradients stored split that are reduced per micro-batch, with the extra bytes their
    whole accumulators would take if they were reduced once per step. (Those the ILP chose to
    reduce once are not: their accumulators are in the plan's memory already.)"""
    found = []
    for chain in problem.chains:
        axes = _same_axes_sums(chain, chosen)
        spec = stage.node_output_specs[chain.boundary][chain.position]
        if axes is None or spec is None:
            continue
        if all(chosen[n].accumulated and chosen[n].reduce_scatters for n in chain.sums):
            continue
        extra = _whole_accumulator_bytes(problem, chain, spec, axes)
        if extra > 0:
            found.append((chain, extra))
    return found


def _sums_reduced_once(
    problem: _Problem,
    chosen: dict[str, Strategy],
    boundary_spec: Callable[[GradientChain], Spec],
    scattered_once: frozenset[str],
) -> set[str]:
    """The gradient sums reduced once per step: those chosen so, where every sum of their
    gradient is, over the same axes (otherwise the gradient's partial sums could not be added
    up unreduced), and where the gradient is stored split, only reduce-scatters the ILP chose
    so (it charged their whole accumulators) or those `scattered_once` grants."""
    once: set[str] = set()
    for chain in problem.chains:
        axes = _same_axes_sums(chain, chosen)
        if axes is None or not all(chosen[n].accumulated for n in chain.sums):
            continue
        whole = _whole_accumulator_bytes(problem, chain, boundary_spec(chain), axes) > 0
        if not whole or all(n in scattered_once or chosen[n].reduce_scatters for n in chain.sums):
            once.update(chain.sums)
    return once


def _emit(
    program: Program,
    problem: _Problem,
    mesh_plan: MeshPlan,
    memory: _Memory,
    choice: np.ndarray,
    scattered_once: frozenset[str] = frozenset(),
) -> tuple[StagePlan, Predicted]:
    """The stage plan of the ILP's `choice` and its prediction; the gradient sums in
    `scattered_once` are reduce-scattered once per step (`ShardingProblem._scatter_once`)."""
    grouping, builder = problem.grouping, problem.builder
    graph = grouping.graph

    def spec_of(value: Value) -> Spec:
        group = grouping.groups[grouping.group_of_value(value)]
        return builder.menu(group).value_specs[choice[group.index]][
            builder.local_value(group, value)
        ]

    node_outputs: dict[str, tuple[Spec | None, ...]] = {}
    node_inputs: dict[str, tuple[Spec | None, ...]] = {}
    partial_sums: dict[str, PartialSumLowering] = {}
    chosen = _chosen_strategies(problem, choice)
    # Reduce-scatters the ILP chose to reduce once: `_Memory` counts their whole accumulators.
    counted = {n for n, s in chosen.items() if s.accumulated and s.reduce_scatters}
    for node_id in scattered_once:
        chosen[node_id] = dataclasses.replace(chosen[node_id], accumulated=True)

    def boundary_spec(chain: GradientChain) -> Spec:
        """How the plan stores a gradient at the boundary: what its reduction yields."""
        if chain.boundary in chosen:
            return chosen[chain.boundary].out_specs[chain.position]
        ref = graph.node(chain.boundary).inputs[chain.position]
        aval = graph.node(chain.boundary).in_avals[chain.position]
        value = grouping.value_of(ref)
        return replicated(len(aval.shape)) if value is None else spec_of(value)

    once = _sums_reduced_once(problem, chosen, boundary_spec, scattered_once)
    for node_id, s in chosen.items():  # the other sums chosen so are reduced per micro-batch
        if s.accumulated and node_id not in once:
            chosen[node_id] = dataclasses.replace(s, accumulated=False)
    # Values that are each device's unreduced partial sums until the end of the step.
    once_chains = [c for c in problem.chains if set(c.sums) <= once]
    unreduced = {n: chosen[c.sums[0]].partial_axes for c in once_chains for n in c.nodes}
    # The prediction replays the plan: XLA reshards a value to a spec once for all its readers
    # in one remat region, except at parameter uses.
    totals = Costs.zeros(())
    by_class: dict[int, list[float]] = {}  # class -> [compute, communication] seconds
    flops = 0.0
    resharded: set[tuple] = set()
    reshard_temps = np.zeros(problem.live.num_steps + 1)  # differences: + at start, - after end
    for node in graph.nodes:
        if node.id not in grouping.group_of_node:  # transparent: outputs are its operands
            node_outputs[node.id] = tuple(
                None if (v := grouping.value_of(r)) is None else spec_of(v) for r in node.inputs
            )
            continue
        group = grouping.groups[grouping.group_of_node[node.id]]
        s = chosen[node.id]
        weight = builder.weights.get(node.id, 1.0)
        flops += weight * node.flops
        before = totals.at(())
        overlappable = node.id in builder.overlappable_nodes
        totals.add_at(
            (), builder.node_cost(group, node, s, weight, overlappable, node.id not in once)
        )
        node_outputs[node.id] = s.out_specs
        needs: list[Spec | None] = []
        for pos, ref in enumerate(node.inputs):
            value = grouping.value_of(ref)
            need = s.in_specs[pos]
            have = None if value is None else spec_of(value)
            if (
                value is None
                or need is None
                or need == have
                or (
                    value[0] in unreduced  # unreduced, only the other axes' layout counts
                    and without_axes(have, unreduced[value[0]])
                    == without_axes(need, unreduced[value[0]])
                )
            ):
                needs.append(None)
                continue
            needs.append(need)
            aval = node.in_avals[pos]
            # A checkpointed region is recomputed behind an optimization barrier, so XLA does not
            # CSE the reshards inside it with those outside: the backward pass reshards a forward
            # value again (e.g. an MoE's dispatched tokens for its expert weights' gradients).
            # A parameter use gathers on its own (a regather inside remat is not CSE'd away).
            # A pipeline stage's forward and backward parts are separate executables: each
            # reshards a value that both read.
            part = None if memory.num_forward is None else top_eqn(node.id) < memory.num_forward
            key = (value, need, node.remat_region, part)
            if node.id in problem.param_uses:
                key = node.id
            seconds, nbytes = builder.reshard(aval.shape, aval.dtype.itemsize, have, need)
            if key not in resharded:
                resharded.add(key)
                from_input = grouping.groups[grouping.group_of_value(value)].is_input
                hidden = from_input and builder.overlaps
                totals.add_comm((), weight * seconds, weight * nbytes, hidden)
            size = _copy_bytes(problem, value, aval, have, need)
            start, end = _copy_span(problem, node.id)
            reshard_temps[start] += size
            reshard_temps[end + 1] -= size
        after = totals.at(())
        spent = by_class.setdefault(group.cls, [0.0, 0.0])
        spent[0] += after[0] - before[0]
        spent[1] += after[1] + after[2] - before[1] - before[2]
        if any(n is not None for n in needs):
            node_inputs[node.id] = tuple(needs)
        if (
            (s.reduce_scatters or s.accumulated)
            and node.primitive in _EXPLICIT_SUMS
            and split_size(builder.mesh, s.partial_axes) > 1  # over size-1 axes: nothing to sum
        ):
            partial_sums[node.id] = PartialSumLowering(
                operand_specs=tuple(
                    spec if spec is not None else replicated(len(a.shape))
                    for spec, a in zip(s.in_specs, node.in_avals, strict=True)
                ),
                output_spec=s.out_specs[0],
                partial_axes=s.partial_axes,
                once_per_step=s.accumulated,
            )
    accumulators = 0.0  # whole where a reduce-scatter waits for the last micro-batch
    for chain in once_chains:  # reduced once, after the last micro-batch, as stored there
        aval = graph.node(chain.boundary).in_avals[chain.position]
        spec = node_outputs[chain.boundary][chain.position] or replicated(len(aval.shape))
        axes = unreduced[chain.nodes[0]]
        seconds, nbytes = builder.sum_cost(aval.shape, aval.dtype.itemsize, spec, axes)
        totals.add_comm((), seconds, nbytes, builder.overlaps)
        uncounted = 1 - len(counted.intersection(chain.sums)) / len(chain.sums)
        accumulators += uncounted * _whole_accumulator_bytes(problem, chain, spec, axes)
    reshard_temps[0] += accumulators
    reshard_temps[problem.grad_end + 1] -= accumulators
    sig = program.signature
    output_specs = []
    for j, (ref, aval) in enumerate(zip(graph.outputs, sig.output_avals, strict=True)):
        value, i = grouping.value_of(ref), sig.output_to_input[j]
        have = replicated(len(aval.shape)) if value is None else spec_of(value)
        stored = have if i is None else spec_of(input_value(i))  # see `_alias_edges`
        if stored != have:
            seconds, nbytes = builder.reshard(aval.shape, aval.dtype.itemsize, have, stored)
            totals.add_comm((), seconds, nbytes, False)
        output_specs.append(stored)
    stage = StagePlan(
        index=0,
        mesh=mesh_plan,
        input_specs=tuple(spec_of(input_value(i)) for i in range(len(sig.input_avals))),
        output_specs=tuple(output_specs),
        node_output_specs=node_outputs,
        node_input_specs=node_inputs,
        partial_sums=partial_sums,
        op_costs=_top_op_costs(program, grouping, by_class),
        gradient_reduction=(
            gradient_reduction(
                graph,
                {n for n, s in chosen.items() if split_size(builder.mesh, s.partial_axes) > 1},
                once,
                sig.input_paths,
            )
            if builder.weights
            else {}
        ),
    )
    compute, blocking, overlap, comm_bytes = totals.at(())
    per_step = memory.evaluate_groups(choice, copies=False)
    per_step = per_step + np.cumsum(reshard_temps)[: problem.live.num_steps]
    peak = float(per_step.max()) if len(per_step) else 0.0
    inputs = sum(
        builder.spec_bytes(a.shape, a.dtype.itemsize, spec)
        for a, spec in zip(sig.input_avals, stage.input_specs, strict=True)
    )
    cluster = builder.roofline.cluster
    compute += fresh_memory_s(peak - inputs, cluster)
    step_time = compute + blocking + OVERLAP_PENALTY * overlap + max(0.0, overlap - compute)
    host = launch_s(
        sig.num_buffers, builder.roofline.num_kernels(grouping.planned_nodes()), cluster
    )
    predicted = Predicted(
        step_time_s=step_time + host,
        compute_s=compute,
        communication_s=blocking + overlap,
        memory_per_device_bytes=peak,
        communication_bytes=comm_bytes,
        flops=flops,
        host_s=host,
    )
    return stage, predicted


def _short_dtype(dtype) -> str:
    name = getattr(dtype, "name", str(dtype))
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i")):
        if name.startswith(long):
            return short + name[len(long) :]
    return name


def _aval_text(aval) -> str:
    return f"{_short_dtype(aval.dtype)}[{','.join(map(str, aval.shape))}]"


def _describe_group(program: Program, grouping: Grouping, group: Group) -> str:
    """The leader of an op group in words: ``dot_general f32[8,64] x f32[64,256] -> f32[8,256]``
    for an op, ``input state.params['w'] (+3 ops)`` for a step input and what follows it."""
    if group.is_input:
        path = program.signature.input_paths[group.leader]
        followers = len(group.members)
        return f"input {path}" + (f" (+{followers} ops)" if followers else "")
    node = grouping.graph.node(group.leader)
    ins = " x ".join(_aval_text(a) for a in node.in_avals if a.shape)
    outs = ", ".join(_aval_text(a) for a in node.out_avals)
    return f"{node.primitive} {ins or 'scalars'} -> {outs}"


def _top_op_costs(
    program: Program, grouping: Grouping, by_class: dict[int, list[float]], top: int = TOP_OP_GROUPS
) -> tuple[OpGroupCost, ...]:
    """The `top` classes of op groups with the most predicted compute + communication."""
    first: dict[int, Group] = {}
    count: dict[int, int] = {}
    for group in grouping.groups:
        first.setdefault(group.cls, group)
        count[group.cls] = count.get(group.cls, 0) + 1
    ranked = sorted(by_class.items(), key=lambda item: -(item[1][0] + item[1][1]))
    found = []
    for cls, (compute, communication) in ranked[:top]:
        if compute + communication <= 0:
            break
        group = first[cls]
        node = group.leader
        if group.is_input:
            node = group.members[0] if group.members else f"input {group.leader}"
        found.append(
            OpGroupCost(
                description=_describe_group(program, grouping, group),
                first_node=str(node),
                count=count[cls],
                compute_s=compute,
                communication_s=communication,
            )
        )
    return tuple(found)
