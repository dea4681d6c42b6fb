"""`parallelize` and `plan`: the one-line entry points."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar.context import current_runtime
from autopar.methods import (
    ParallelMethod,
    PipeshardParallel,
    PlanRequest,
    ShardParallel,
)
from autopar.options import AutoLayerOption, AutoShardingOption
from autopar.plan_store import PlanCache, tracing_record
from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import InvalidArgumentError
from autopar.planner.explain import Explanation, PlanningContext, explain_plan
from autopar.planner.pipeline import StepParts, split_step
from autopar.planner.plan import MeshPlan, Plan
from autopar.planner.program import Program
from autopar.planner.progress import phase
from autopar.planner.schedules import PipelineSchedule
from autopar.remat import RematTrace
from autopar.runtime.executable import Executable
from autopar.runtime.executors import StepToBuild, StepToTime
from autopar.tracing import (
    ArrayTree,
    TracedStep,
    abstract_arguments,
    abstract_value,
    argument_names,
    check_batch_leaves,
    is_array_like,
    resolve_argnums,
    trace_step,
    traced_leaves,
)

logger = logging.getLogger(__name__)

_MAX_SIGNATURES = 256  # call signatures remembered per parallelized function

Argnums = Sequence[int] | str


def _check_method(method: Any) -> ParallelMethod:
    if method is None:
        return ShardParallel()
    if not isinstance(method, ParallelMethod):
        raise InvalidArgumentError(
            "method must be ShardParallel, DataParallel, Zero2Parallel, Zero3Parallel, "
            f"PipeshardParallel, PlanFile, FollowParallel or CreateStateParallel, got {method!r}"
        )
    return method


def _planned(
    traced: TracedStep,
    method: ParallelMethod,
    mesh: MeshPlan,
    cluster: ClusterSpec,
    devices: Sequence[jax.Device],
    remat_trace: RematTrace,
    stage_timer: Callable[[], Any] | None = None,
) -> tuple[TracedStep, Plan]:
    """The plan of `traced` and the traced step it is for (`ParallelMethod.plan_step`): a
    cached one, or a new one (then cached, unless it recomputes layers: it is for another
    trace than the one the cache is keyed by)."""
    cache = PlanCache.from_env() if method.cacheable else None
    key = cache and PlanCache.key(traced.program.fingerprint, cluster, method, mesh)
    found = cache and cache.load(key)
    if found:
        return traced, found
    request = PlanRequest(traced, mesh, cluster, tuple(devices), remat_trace, stage_timer)
    traced_for, plan = method.plan_step(request)
    if plan.tracing is None:
        record = tracing_record(method.regather_params, method.layer_option)
        plan = dataclasses.replace(plan, tracing=record)
    if cache and traced_for is traced:
        cache.store(key, plan)
    return traced_for, plan


def _planning_context(
    plan: Plan,
    traced: TracedStep,
    method: ParallelMethod,
    mesh: MeshPlan,
    cluster: ClusterSpec,
    retrace: Callable[[ParallelMethod], TracedStep],
) -> PlanningContext:
    """What explaining `plan` needs besides its data (`planner.explain.PlanningContext`).

    `retrace(method)` traces the same step for another method: as ShardParallel traces it (for
    the single-mesh baselines) or cut into layers (for pipeline baselines)."""
    k = traced.num_micro_batches
    option = getattr(method, "auto_sharding_option", None) or AutoShardingOption()
    pipelined = plan.pipeline_schedule is not None
    n = mesh.num_devices
    if len(mesh.shape) == 2:
        cluster_shape = tuple(mesh.shape)
    else:
        cluster_shape = cluster.physical_mesh_shape if n == cluster.num_devices else (1, n)

    @functools.cache
    def single_mesh_program() -> Program:
        return retrace(ShardParallel(num_micro_batches=k)).program

    @functools.cache
    def layered(num_layers: int) -> tuple[StepParts, Program]:
        step = traced
        if not pipelined:
            layers = AutoLayerOption(layer_num=num_layers)
            step = retrace(PipeshardParallel(num_micro_batches=k, layer_option=layers))
        parts = split_step(step.closed_jaxpr, step.program.signature.batch_inputs)
        return parts, step.program

    single_mesh = mesh
    if pipelined:  # the baselines' mesh: all the pipeline's devices, as ShardParallel has them
        hosts, per_host = cluster_shape
        shape, axes = ((per_host,), ("x",)) if hosts == 1 else (cluster_shape, ("x", "y"))
        single_mesh = MeshPlan(shape, axes, mesh.device_indices)
    reuse = method.traced_as_shard_parallel
    return PlanningContext(
        program=traced.program,
        cluster=cluster,
        mesh=single_mesh,
        cluster_shape=cluster_shape,
        intra=option.to_config(),
        num_micro_batches=k,
        schedule=PipelineSchedule.parse(plan.pipeline_schedule or "1f1b"),
        single_mesh_program=None if reuse else single_mesh_program,
        layered=layered,
    )


def trace_for_method(
    fun: Callable,
    args: Sequence[Any],
    method: ParallelMethod,
    argnums: tuple[tuple[int, ...], ...],
    remat: AutoLayerOption | None = None,
) -> TracedStep:
    """Trace `fun(*args)` as `method` needs it (micro-batch shapes; regathering for FSDP), or
    with its loss cut into `remat`'s recomputed layers (`autopar.remat`), which regather by
    themselves.

    `argnums` is (static, batch, donate), as `tracing.resolve_argnums` returns them.
    """
    static, batch, donate = argnums
    layers = method.layer_option
    with phase(f"tracing {getattr(fun, '__name__', 'the step')}"):
        return trace_step(
            fun,
            args,
            static_argnums=static,
            batch_argnums=batch,
            donate_argnums=donate,
            regather_params=method.regather_params and remat is None,
            num_micro_batches=method.num_micro_batches or 1,
            layer_option=remat or layers,
        )


def _shape_key(x: Any) -> tuple:
    """Shape, dtype and weak type of an argument leaf: what a plan depends on. Not its sharding,
    which the executable's own outputs carry and which must not force a new plan. (A Ray
    `RemoteArray` has no jax type but carries its aval.)"""
    aval = abstract_value(x)
    return (tuple(aval.shape), aval.dtype, getattr(aval, "weak_type", False))


def _call_signature(args: Sequence[Any]) -> tuple[list[Any], Any]:
    """All leaves of `args`, and a key that equal calls share: the runtime's session, the tree
    structure, each array leaf's abstract value (shape, dtype, weak type; under explicit
    sharding also its abstract sharding, which at worst splits one executable's calls over two
    keys), and every other leaf's type and value (static leaves are part of the program). None
    where a leaf cannot be hashed. Built on every call: jax arrays' cached avals keep it cheap
    (6 µs for 109 leaves, against 31 µs reading shape, dtype and weak type one by one). A Ray
    `RemoteArray` carries its aval too."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    signature = []
    for x in leaves:
        aval = getattr(x, "aval", None)  # not isinstance(x, jax.Array): an ABC check, 170 ns
        if isinstance(aval, jax.core.ShapedArray):
            signature.append(aval)
        elif is_array_like(x):
            signature.append(_shape_key(x))
        else:
            signature.append((type(x), x))
    key = (current_runtime().session, treedef, tuple(signature))
    try:
        hash(key)
    except TypeError:
        return leaves, None
    return leaves, key


def _input_positions(args: Sequence[Any], static: tuple[int, ...]) -> tuple[int, ...]:
    """Where the executable's flat inputs (`ArrayTree.flatten` of the dynamic arguments) sit
    among the leaves of all of `args`."""
    positions, offset = [], 0
    for i, arg in enumerate(args):
        count = jax.tree_util.tree_structure(arg).num_leaves
        if i not in static:
            tree = ArrayTree.of(arg)
            held = {j for j, _ in tree.statics}
            positions += [offset + j for j in range(count) if j not in held]
        offset += count
    return tuple(positions)


def _unhashable(names: Sequence[str], args: Sequence[Any], static: tuple[int, ...]) -> str:
    """The path of the first static argument or static leaf that cannot be hashed."""
    for i, arg in enumerate(args):
        pairs = [((), arg)] if i in static else jax.tree_util.tree_flatten_with_path(arg)[0]
        traced = [False] if i in static else traced_leaves(arg)
        for (path, x), is_traced in zip(pairs, traced, strict=True):
            if is_traced:
                continue
            try:
                hash(x)
            except TypeError:
                return f"{names[i]}{jax.tree_util.keystr(path)}"
    return "an argument"


class ParallelizedFunc:
    """A train step wrapped by `autopar.parallelize`. Executables are cached per input shapes."""

    def __init__(
        self,
        fun: Callable,
        *,
        static_argnums: Argnums,
        donate_argnums: Argnums,
        batch_argnums: Sequence[int],
        method: Any,
    ) -> None:
        if not callable(fun):
            raise InvalidArgumentError(f"parallelize expects a function, got {fun!r}")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.method = _check_method(method)
        self._runner = self.method.runner(fun)  # runs fun by another step's plan, or None
        self._static_argnums = static_argnums
        # An eval step returns no new state: by default it must not consume the train state.
        follows = not self.method.returns_state and donate_argnums == "auto"
        self._donate_argnums = () if follows else donate_argnums
        self._batch_argnums = tuple(batch_argnums)
        self._executables: dict[Any, Executable] = {}
        self._plans: dict[Any, tuple[TracedStep, Plan]] = {}
        self._contexts: dict[Any, PlanningContext] = {}  # beside each plan, for `explain`
        # Per call signature (`_call_signature`): the executable and where its flat inputs
        # sit among all the arguments' leaves, so that a repeated call skips `_key`'s walk.
        self._dispatch: dict[Any, tuple[Executable, tuple[int, ...]]] = {}

    @property
    def batch_argnums(self) -> tuple[int, ...]:
        """The arguments whose leaves have the batch as dim 0."""
        return self._batch_argnums

    def _argnums(self, args: Sequence[Any]) -> tuple[tuple[int, ...], ...]:
        if self._runner is not None:
            raise InvalidArgumentError(
                f"a function parallelized with {type(self.method).__name__} is only called: it "
                "runs by another step's plan and has none of its own (ask that step, e.g. "
                "train_step.get_plan)"
            )
        return resolve_argnums(
            args, self._static_argnums, self._batch_argnums, self._donate_argnums
        )

    def _key(self, args: Sequence[Any], static: tuple[int, ...]) -> Any:
        dynamic = tuple(a for i, a in enumerate(args) if i not in static)
        tree = ArrayTree.of(dynamic)
        leaves = tree.flatten(dynamic)
        statics = tuple((i, args[i]) for i in static)
        try:
            hash((statics, tree))
        except TypeError as e:
            self._check_batch(args)  # names the offending batch leaf, if it is one
            where = _unhashable(argument_names(self.fun, len(args)), args, static)
            raise InvalidArgumentError(
                f"{where} is neither an array nor hashable ({e}): "
                "arguments' leaves must be arrays or numbers (traced), or hashable values "
                "that are part of the program (static_argnums, or non-array leaves)"
            ) from e
        avals = tuple(_shape_key(x) for x in leaves)
        return (static, statics, tree, avals), leaves

    def _check_batch(self, args: Sequence[Any]) -> None:
        names = argument_names(self.fun, len(args))
        for i in self._batch_argnums:
            check_batch_leaves(names[i % len(args)], args[i], self.method.num_micro_batches or 1)

    def _traced_plan(self, args: Sequence[Any], key: Any) -> tuple[TracedStep, Plan]:
        if key not in self._plans:
            self._check_batch(args)
            runtime = current_runtime()
            mesh, devices = self.method.mesh(runtime.cluster_spec, runtime.devices or None)
            argnums = self._argnums(args)
            traced = trace_for_method(self.fun, args, self.method, argnums)
            abstract = abstract_arguments(args, argnums[0])
            remat = functools.partial(trace_for_method, self.fun, abstract, self.method, argnums)
            timing = StepToTime(
                self.fun,
                abstract,
                argnums,
                tracing_record(self.method.regather_params, self.method.layer_option),
                self.method.num_micro_batches or 1,
                traced.program.fingerprint,
                tuple(devices[i] for i in mesh.device_indices) if devices else (),
            )
            timer = functools.partial(runtime.executor.stage_timer, timing)
            traced, plan = _planned(
                traced, self.method, mesh, runtime.cluster_spec, devices, remat, timer
            )
            retrace = functools.partial(_retrace, self.fun, abstract, argnums=argnums)
            cluster = runtime.cluster_spec
            context = _planning_context(plan, traced, self.method, mesh, cluster, retrace)
            self._plans[key], self._contexts[key] = (traced, plan), context
        return self._plans[key]

    def get_plan(self, *args: Any) -> Plan:
        """The plan for these arguments (traced and planned once per input shapes)."""
        key, _ = self._key(args, self._argnums(args)[0])
        return self._traced_plan(args, key)[1]

    def explain(self, *args: Any) -> Explanation:
        """The plan for these arguments next to DP, ZeRO-2, ZeRO-3, Megatron and pipeline
        baselines priced by the same cost model, and the op groups that cost it most
        (`planner.explain.Explanation`; `str()` of it is a table; `.chosen.plan` the plan)."""
        key, _ = self._key(args, self._argnums(args)[0])
        plan = self._traced_plan(args, key)[1]
        return explain_plan(plan, self._contexts[key])

    def get_executable(self, *args: Any) -> Executable:
        """The compiled executable for these arguments, compiled once per input shapes/statics."""
        return self._executable(args, *self._key(args, self._argnums(args)[0]))[0]

    def _executable(self, args, key, leaves) -> tuple[Executable, list[Any]]:
        runtime = current_runtime()
        executable = self._executables.get((key, runtime.session))
        if executable is None:
            traced, plan = self._traced_plan(args, key)
            _, devices = self.method.mesh(runtime.cluster_spec, runtime.devices or None)
            argnums = self._argnums(args)
            step = StepToBuild(traced, plan, self.fun, args, argnums, devices)
            executable = runtime.executor.build(step)
            self._executables[key, runtime.session] = executable
        return executable, leaves

    def __call__(self, *args: Any) -> Any:
        if self._runner is not None:
            return self._runner(*args)
        all_leaves, signature = _call_signature(args)
        found = self._dispatch.get(signature) if signature is not None else None
        if found is not None:
            executable, positions = found
            return executable.call_flat([all_leaves[p] for p in positions])
        static = self._argnums(args)[0]
        executable, leaves = self._executable(args, *self._key(args, static))
        if signature is not None:
            if len(self._dispatch) >= _MAX_SIGNATURES:  # leaves hashed by identity, new per call
                self._dispatch.clear()
            self._dispatch[signature] = (executable, _input_positions(args, static))
        return executable.call_flat(leaves)

    def preshard_dynamic_args(self, *args: Any) -> tuple[Any, ...]:
        """`args` with every array placed where the step's plan reads it (static arguments as
        they are): put a batch or a restored state in place ahead of the step (Alpa's name).
        On Ray the arrays move to the mesh workers and come back as `RemoteArray`s."""
        static = self._argnums(args)[0]
        executable, leaves = self._executable(args, *self._key(args, static))
        dynamic = tuple(a for i, a in enumerate(args) if i not in static)
        placed = iter(ArrayTree.of(dynamic).unflatten(executable.place_flat(leaves)))
        return tuple(a if i in static else next(placed) for i, a in enumerate(args))


def parallelize(
    fun: Callable | None = None,
    *,
    static_argnums: Argnums = "auto",
    donate_argnums: Argnums = "auto",
    batch_argnums: Sequence[int] = (1,),
    method: Any = None,
) -> Any:
    """Parallelize a train step over the runtime's devices. Usable bare or with arguments.

    Example::

        @autopar.parallelize(method=autopar.Zero3Parallel(num_micro_batches=4))
        def train_step(state, batch):
            grads = autopar.grad(loss_fn)(state.params, batch)
            return state.apply_gradients(grads=grads)

    Args:
      static_argnums: arguments baked into the program ("auto": non-array arguments).
      donate_argnums: arguments whose buffers the step may reuse ("auto": all but batch/static;
        none for FollowParallel, whose eval step leaves the train state as it is).
      batch_argnums: arguments whose leaves have the batch as dim 0 (split over devices).
      method: ShardParallel() (default: automatic sharding by ILP), DataParallel(),
        Zero2Parallel(), Zero3Parallel(), PipeshardParallel(...) (pipeline stages),
        PlanFile(path) (a saved plan), FollowParallel(train_step) (an eval step placed like
        the train step) or CreateStateParallel(train_step, batch) (a state born sharded).
    """
    if fun is None:
        return functools.partial(
            parallelize,
            static_argnums=static_argnums,
            donate_argnums=donate_argnums,
            batch_argnums=batch_argnums,
            method=method,
        )
    return ParallelizedFunc(
        fun,
        static_argnums=static_argnums,
        donate_argnums=donate_argnums,
        batch_argnums=batch_argnums,
        method=method,
    )


def plan(
    fun: Callable,
    *args: Any,
    method: Any = None,
    cluster_spec: ClusterSpec | None = None,
    batch_argnums: Sequence[int] = (1,),
    static_argnums: Sequence[int] = (),
) -> Plan:
    """Plan `fun(*args)` without compiling and without the target devices.

    `args` may be `jax.ShapeDtypeStruct`s; `cluster_spec` may describe a cluster that is not here
    (default: the current runtime's). `autopar.explain` takes the same arguments and puts the
    plan next to the classic layouts.

    Example::

        plan = autopar.plan(train_step, state_shapes, batch_shapes,
                            cluster_spec=autopar.ClusterSpec.preset("2x8xA100-80G"))
        print(plan.summary())
    """
    return plan_in_context(fun, args, method, cluster_spec, batch_argnums, static_argnums)[0]


def explain(
    fun: Callable,
    *args: Any,
    method: Any = None,
    cluster_spec: ClusterSpec | None = None,
    batch_argnums: Sequence[int] = (1,),
    static_argnums: Sequence[int] = (),
) -> Explanation:
    """`autopar.plan(fun, *args, ...)` next to DP, ZeRO-2, ZeRO-3, Megatron and pipeline
    baselines priced by the same cost model on the same devices, and the op groups that cost it
    most (`planner.explain.Explanation`: `str()` of it is a table, `.chosen.plan` the plan).

    Example::

        print(autopar.explain(train_step, state_shapes, batch_shapes,
                              cluster_spec=autopar.ClusterSpec.preset("2x8xA100-80G")))
    """
    made = plan_in_context(fun, args, method, cluster_spec, batch_argnums, static_argnums)
    return explain_plan(*made)


def plan_in_context(
    fun: Callable,
    args: Sequence[Any],
    method: Any,
    cluster_spec: ClusterSpec | None,
    batch_argnums: Sequence[int],
    static_argnums: Sequence[int],
) -> tuple[Plan, PlanningContext]:
    """`autopar.plan`'s plan and the context `planner.explain.explain_plan` needs beside it:
    for tools that time planning and explaining apart (the CLI, the benchmarks)."""
    method = _check_method(method)
    cluster = cluster_spec if cluster_spec is not None else current_runtime().cluster_spec
    argnums = resolve_argnums(args, static_argnums, batch_argnums, "auto")
    traced = trace_for_method(fun, args, method, argnums)
    mesh = method.mesh(cluster)[0]
    abstract = abstract_arguments(args, argnums[0])
    remat = functools.partial(trace_for_method, fun, abstract, method, argnums)
    traced, plan = _planned(traced, method, mesh, cluster, (), remat)
    retrace = functools.partial(_retrace, fun, abstract, argnums=argnums)
    return plan, _planning_context(plan, traced, method, mesh, cluster, retrace)


def _retrace(
    fun: Callable,
    args: Sequence[Any],
    method: ParallelMethod,
    *,
    argnums: tuple[tuple[int, ...], ...],
) -> TracedStep:
    return trace_for_method(fun, args, method, argnums)
