"""Trace a user's train step to a canonical ClosedJaxpr plus what autopar needs to know about it.

Canonical means: nested `jax.jit` / call / custom-derivative bodies are inlined (the step is already
differentiated, so custom rules are no longer needed); `checkpoint` eqns stay, because they carry
the rematerialisation that keeps memory low. Node ids of `planner.graph` refer to this jaxpr.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

from autopar.layering import layered
from autopar.markers import held_by_module, tracing_scope
from autopar.options import LayerOption
from autopar.planner.errors import InvalidArgumentError, TracingError
from autopar.planner.fingerprint import jaxpr_fingerprint
from autopar.planner.found_gradients import mark_found_gradients
from autopar.planner.graph import (
    TensorInfo,
    inlined_body,
    is_checkpoint,
    tensor_info,
)
from autopar.planner.micro_batches import (
    check_mean_loss,
    hoist_batch_reads,
    recompute_for_update,
)
from autopar.planner.program import Program, StepSignature

_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


def traced_leaves(tree: Any) -> list[bool]:
    """For each leaf of `tree`, whether it is traced: an array, or a Python number (traced
    weakly typed, as `jax.jit` has a flax TrainState's step) unless an equinox Module holds it.
    Other leaves (an equinox Module's functions, flags and numbers, strings) are static, as
    `eqx.filter_jit` has them: part of the program, not inputs of it. (Traced, a Module's
    dropout rate would turn into an array the step differentiates and returns, unlike the
    optimizer state the user built beside the Module.)"""
    leaves = jax.tree_util.tree_leaves(tree)
    return [_traced(x, m) for x, m in zip(leaves, held_by_module(tree), strict=True)]


def _traced(x: Any, in_module: bool) -> bool:
    if is_array_like(x):
        return True
    number = isinstance(x, int | float | complex) and not isinstance(x, bool)
    return number and not in_module


@dataclasses.dataclass(frozen=True)
class ArrayTree:
    """A pytree's structure with its static leaves held aside (see `traced_leaves`):
    `flatten` gives the traced leaves, `unflatten` puts the static ones back."""

    treedef: Any
    statics: tuple[tuple[int, Any], ...]  # (position among all leaves, value)

    @classmethod
    def of(cls, tree: Any) -> ArrayTree:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        traced = traced_leaves(tree)
        statics = tuple((i, x) for i, x in enumerate(leaves) if not traced[i])
        return cls(treedef, statics)

    @property
    def num_leaves(self) -> int:
        """How many traced leaves the tree has."""
        return self.treedef.num_leaves - len(self.statics)

    def flatten(self, tree: Any) -> list[Any]:
        """The traced leaves of `tree` (shaped like this one), in order."""
        leaves = jax.tree_util.tree_leaves(tree)
        if not self.statics:
            return leaves
        static = {i for i, _ in self.statics}
        return [x for i, x in enumerate(leaves) if i not in static]

    def unflatten(self, values: Sequence[Any], *, with_statics: bool = True) -> Any:
        """The tree with `values` as its traced leaves; static leaves are put back (or None,
        for trees of shardings)."""
        if not self.statics:
            return jax.tree_util.tree_unflatten(self.treedef, values)
        values = iter(values)
        statics = dict(self.statics)
        leaves = [
            (statics[i] if with_statics else None) if i in statics else next(values)
            for i in range(self.treedef.num_leaves)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A traced step: the canonical jaxpr, its program view, and how to (un)flatten arguments."""

    fun_name: str
    closed_jaxpr: ClosedJaxpr
    program: Program
    in_tree: ArrayTree
    out_tree: ArrayTree
    static_argnums: tuple[int, ...]
    num_micro_batches: int

    def full_batch_avals(self) -> list[Any]:
        """Avals of the step's inputs as the caller passes them (batch inputs un-split)."""
        batch = set(self.program.signature.batch_inputs)
        k = self.num_micro_batches
        return [
            v.aval.update(shape=(v.aval.shape[0] * k, *v.aval.shape[1:])) if i in batch else v.aval
            for i, v in enumerate(self.closed_jaxpr.jaxpr.invars)
        ]


def argument_names(fun: Callable, num_args: int) -> list[str]:
    """Positional parameter names of `fun` for messages, falling back to ``arg{i}``."""
    try:
        params = [
            p.name
            for p in inspect.signature(fun).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(num_args)]


def abstract_value(x: Any) -> Any:
    """The aval of an argument leaf; objects that stand for arrays held elsewhere (a Ray
    `RemoteArray`) carry it as `.aval`."""
    aval = getattr(x, "aval", None)
    return aval if isinstance(aval, jax.core.ShapedArray) else jax.typeof(x)


def abstract_arguments(args: Sequence[Any], static: Sequence[int]) -> tuple[Any, ...]:
    """`args` with every array leaf of a non-static argument as a `jax.ShapeDtypeStruct`
    (weak type kept): what tracing the step again needs, holding no device memory."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct) or not (hasattr(x, "shape") or hasattr(x, "aval")):
            return x
        aval = abstract_value(x)
        weak = getattr(aval, "weak_type", False)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak)

    return tuple(a if i in static else jax.tree.map(leaf, a) for i, a in enumerate(args))


def is_array_like(x: Any) -> bool:
    """An array, or an object that stands for one (a numpy scalar, a ShapeDtypeStruct, a Ray
    `RemoteArray`)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) or isinstance(
        getattr(x, "aval", None), jax.core.ShapedArray
    )


def _check_argnums(name: str, argnums: Sequence[int], num_args: int) -> tuple[int, ...]:
    for i in argnums:
        if not isinstance(i, int) or not -num_args <= i < num_args:
            raise InvalidArgumentError(
                f"{name}={tuple(argnums)} is out of range: the function was called with "
                f"{num_args} positional argument(s)"
            )
    return tuple(sorted({i % num_args for i in argnums}))


def resolve_argnums(
    args: Sequence[Any],
    static_argnums: Sequence[int] | str,
    batch_argnums: Sequence[int],
    donate_argnums: Sequence[int] | str,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Resolve "auto" argnums and check ranges. Returns (static, batch, donate).

    "auto" static: arguments with no array or number leaf (a string, a callable, a config); the
    non-array leaves of other arguments (an equinox Module's functions) are static leaves.
    "auto" donate: every argument that is neither static nor a batch (the train state), as Alpa did.
    """
    n = len(args)
    batch = _check_argnums("batch_argnums", batch_argnums, n)
    if static_argnums == "auto":
        static = tuple(
            i for i, a in enumerate(args) if i not in batch and not any(traced_leaves(a))
        )
    else:
        static = _check_argnums("static_argnums", static_argnums, n)
    if set(static) & set(batch):
        raise InvalidArgumentError(
            f"arguments {sorted(set(static) & set(batch))} are both static and batch arguments"
        )
    if donate_argnums == "auto":
        donate = tuple(i for i in range(n) if i not in static and i not in batch)
    else:
        donate = _check_argnums("donate_argnums", donate_argnums, n)
    return static, batch, donate


def check_batch_leaves(arg_name: str, arg: Any, num_micro_batches: int) -> None:
    """Every leaf of a batch argument must be an array whose dim 0 splits into micro-batches."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
        where = f"{arg_name}{jax.tree_util.keystr(path)}"
        if not is_array_like(leaf):
            raise InvalidArgumentError(
                f"batch argument leaf {where} is a {type(leaf).__name__}, not an array: every "
                "leaf of a batch argument must be an array whose dim 0 is the batch; pass other "
                "values in a non-batch argument or via static_argnums"
            )
        if len(leaf.shape) == 0:
            raise InvalidArgumentError(
                f"batch argument leaf {where} is a scalar: it has no batch dimension to split"
            )
        if leaf.shape[0] % num_micro_batches:
            raise InvalidArgumentError(
                f"batch argument leaf {where} has shape {tuple(leaf.shape)}: its batch dimension "
                f"{leaf.shape[0]} is not divisible by num_micro_batches={num_micro_batches}"
            )


def _unsharded_aval(leaf: Any) -> Any:
    """The leaf's aval without the sharding a committed array carries: plans are made for
    shapes, and a step's outputs (placed by the plan) must trace like its first inputs."""
    return abstract_value(leaf).update(sharding=None)


def _micro_batch_aval(aval: Any, k: int) -> Any:
    return aval.update(shape=(aval.shape[0] // k, *aval.shape[1:]))


def inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with nested calls inlined, keeping `checkpoint` eqns (see module doc).

    The jaxpr is rewritten, not traced again: each inlined body's eqns are copied in with fresh
    variables (a body may be inlined more than once), its consts become the step's, and the
    call's results are the body's. Re-tracing did the same in 2.5 s on a 48-layer Flax GPT."""
    jaxpr = closed.jaxpr
    constvars, consts = list(jaxpr.constvars), list(closed.consts)
    eqns: list[JaxprEqn] = []

    def copy(body: Jaxpr, env: dict[Var, Any], fresh: bool) -> None:
        for eqn in body.eqns:
            invars = [v if isinstance(v, Literal) else env[v] for v in eqn.invars]
            inlined = None if is_checkpoint(eqn) else inlined_body(eqn)
            if inlined is not None:
                inner, inner_consts = inlined
                scope = dict(zip(inner.invars, invars, strict=True))
                for v, value in zip(inner.constvars, inner_consts, strict=True):
                    scope[v] = Var(v.aval)
                    constvars.append(scope[v])
                    consts.append(value)
                copy(inner, scope, fresh=True)
                results = [v if isinstance(v, Literal) else scope[v] for v in inner.outvars]
                env.update(zip(eqn.outvars, results, strict=True))
                continue
            outvars = [
                DropVar(v.aval) if isinstance(v, DropVar) else Var(v.aval) if fresh else v
                for v in eqn.outvars
            ]
            env.update(zip(eqn.outvars, outvars, strict=True))
            eqns.append(eqn.replace(invars=invars, outvars=outvars))

    env: dict[Var, Any] = {v: v for v in (*jaxpr.constvars, *jaxpr.invars)}
    copy(jaxpr, env, fresh=False)
    outvars = [v if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]
    inlined = Jaxpr(
        constvars, jaxpr.invars, outvars, eqns, effects=jaxpr.effects, debug_info=jaxpr.debug_info
    )
    return ClosedJaxpr(inlined, consts)


def _match_outputs_to_inputs(
    in_keys: Sequence[tuple[str, TensorInfo]], out_keys: Sequence[tuple[str, TensorInfo]]
) -> tuple[int | None, ...]:
    """Pair each output with the input it updates: same path below the argument, same aval."""
    free: dict[tuple[str, TensorInfo], list[int]] = {}
    for i, key in enumerate(in_keys):
        free.setdefault(key, []).append(i)
    return tuple(free[key].pop(0) if free.get(key) else None for key in out_keys)


def _strip_first_key(path: tuple) -> str:
    return jax.tree_util.keystr(path[1:])


def trace_step(
    fun: Callable,
    args: Sequence[Any],
    *,
    static_argnums: tuple[int, ...],
    batch_argnums: tuple[int, ...],
    donate_argnums: tuple[int, ...],
    regather_params: bool,
    num_micro_batches: int = 1,
    layer_option: LayerOption | None = None,
) -> TracedStep:
    """Trace `fun(*args)` (arrays or ShapeDtypeStructs) to a TracedStep.

    With `num_micro_batches` k > 1 the step is traced on micro-batches (batch dim divided by k),
    since that is the shape its gradient part runs on. With a `layer_option` the losses that
    `autopar.grad` differentiates are cut into layers with boundary markers (`layering`).
    """
    names = argument_names(fun, len(args))
    for i in batch_argnums:
        check_batch_leaves(names[i], args[i], num_micro_batches)
    dynamic = [i for i in range(len(args)) if i not in static_argnums]
    dyn_args = tuple(args[i] for i in dynamic)
    in_tree = ArrayTree.of(dyn_args)
    static = {i for i, _ in in_tree.statics}
    leaves_with_paths = [
        leaf
        for i, leaf in enumerate(jax.tree_util.tree_flatten_with_path(dyn_args)[0])
        if i not in static
    ]
    batch_leaf = [dynamic[p[0].idx] in batch_argnums for p, _ in leaves_with_paths]
    in_avals = [
        _micro_batch_aval(_unsharded_aval(leaf), num_micro_batches)
        if is_batch
        else _unsharded_aval(leaf)
        for (_, leaf), is_batch in zip(leaves_with_paths, batch_leaf, strict=True)
    ]

    fun_name = getattr(fun, "__name__", repr(fun))
    out_tree_box: list[Any] = []

    def traced(*flat):
        dyn = in_tree.unflatten(flat)
        full = list(args)
        for i, value in zip(dynamic, dyn, strict=True):
            full[i] = value
        out = fun(*full)
        out_tree = ArrayTree.of(out)
        out_tree_box.append(out_tree)
        return out_tree.flatten(out)

    try:
        transform = functools.partial(layered, option=layer_option) if layer_option else None
        with tracing_scope(regather_params=regather_params, loss_transform=transform):
            raw = jax.make_jaxpr(traced)(*in_avals)
    except _TRACER_ERRORS as e:
        first_line = str(e).strip().splitlines()[0]
        raise TracingError(
            f"autopar could not trace {fun_name}: Python control flow or a NumPy call depends "
            f"on a traced value ({type(e).__name__}: {first_line}). Use jax.lax.cond, "
            "jax.lax.while_loop or jnp.where for data-dependent control flow, or pass the value "
            "as a static argument with static_argnums=(...)."
        ) from e
    out_tree = out_tree_box[0]
    arg_of_leaf = [dynamic[p[0].idx] for p, _ in leaves_with_paths]
    input_paths = tuple(
        f"{names[arg_of_leaf[k]]}{_strip_first_key(p)}"
        for k, (p, _) in enumerate(leaves_with_paths)
    )
    batch_inputs = tuple(k for k, a in enumerate(arg_of_leaf) if a in batch_argnums)
    closed = inline_calls(raw)
    if num_micro_batches > 1 or layer_option is not None:
        closed = recompute_for_update(hoist_batch_reads(closed, batch_inputs, input_paths))
        check_mean_loss(closed, batch_inputs, num_micro_batches)
    in_infos = tuple(tensor_info(a) for a in in_avals)
    out_infos = tuple(tensor_info(v.aval) for v in closed.jaxpr.outvars)
    out_paths_raw = [
        p
        for p, _ in jax.tree_util.tree_flatten_with_path(
            out_tree.unflatten(range(out_tree.num_leaves), with_statics=False)
        )[0]
    ]
    output_paths = tuple(f"out{jax.tree_util.keystr(p)}" for p in out_paths_raw)
    state_inputs = [
        (k, (_strip_first_key(p), in_infos[k]))
        for k, (p, _) in enumerate(leaves_with_paths)
        if arg_of_leaf[k] not in batch_argnums
    ]
    # Outputs are usually (new_state, metrics) or new_state: try both alignments of the paths.
    candidates = []
    for strip in (True, False):
        out_keys = [
            ((_strip_first_key(p) if strip else jax.tree_util.keystr(p)), out_infos[j])
            for j, p in enumerate(out_paths_raw)
        ]
        pairing = _match_outputs_to_inputs([key for _, key in state_inputs], out_keys)
        candidates.append(tuple(None if m is None else state_inputs[m][0] for m in pairing))
    output_to_input = max(candidates, key=lambda c: sum(m is not None for m in c))

    signature = StepSignature(
        input_paths=input_paths,
        output_paths=output_paths,
        input_avals=in_infos,
        output_avals=out_infos,
        batch_inputs=batch_inputs,
        donated_inputs=tuple(k for k, a in enumerate(arg_of_leaf) if a in donate_argnums),
        output_to_input=output_to_input,
    )
    if num_micro_batches == 1 and layer_option is None:
        closed = mark_found_gradients(closed, batch_inputs, output_to_input)
    program = Program(closed, signature, jaxpr_fingerprint(closed))
    return TracedStep(
        fun_name=fun_name,
        closed_jaxpr=closed,
        program=program,
        in_tree=in_tree,
        out_tree=out_tree,
        static_argnums=static_argnums,
        num_micro_batches=num_micro_batches,
    )
