"""Marker primitives that tell autopar where gradients are computed and where parameters are used.

`autopar.grad` / `autopar.value_and_grad` behave like jax's, and leave two kinds of identity markers
in the traced program:

* ``autopar_param_use[index=i]`` on every differentiated parameter leaf where the loss uses it.
  A plan may constrain it (e.g. FSDP: stored sharded, replicated at use). With ``regather=True``
  (methods that shard parameters), the loss runs under ``jax.checkpoint`` with a policy that never
  saves these outputs, so the gathered parameter is gathered again in the backward pass instead
  of being kept alive from the forward pass (SimpleFSDP's selective rematerialisation).
* ``autopar_grad_boundary[grad_of=(...)]`` on the value, aux and gradient leaves returned by the
  gradient computation. It separates computing gradients from applying them, which gradient
  accumulation and pipelining need. ``grad_of[k]`` is the param index operand k is the gradient
  of, or -1 for the loss value and aux outputs.

Pipelining adds two more (see `autopar.layering`):

* ``autopar_pipeline_boundary``, with no operands, where the user calls `mark_pipeline_boundary()`
  between layers of the loss.
* ``autopar_layer_boundary[layer=k, kind=...]`` on the values that cross from earlier layers into
  layer k. Its JVP marks the tangents (kind "tangent") and its transpose the cotangents (kind
  "backward"), so the differentiated step carries every boundary in the backward pass too.

Outside autopar the markers lower to nothing, so the decorated step runs under plain ``jax.jit``.
The primitives and their names live on the planner's ground floor (`autopar.planner.markers`),
which reads programs by them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from autopar.planner.markers import grad_boundary_p, param_use_p, pipeline_boundary_p


def mark_pipeline_boundary() -> None:
    """End a layer of the loss here (for `ManualLayerOption`); a no-op anywhere else.

    Example::

        def loss_fn(params, batch):
            x = layer_1(params, batch)
            autopar.mark_pipeline_boundary()
            return layer_2(params, x)
    """
    pipeline_boundary_p.bind()


@dataclasses.dataclass(slots=True)
class _TraceState:
    """Per-trace state: the next free parameter index, whether to regather in backward, and how
    to rewrite the loss before differentiating it (pipelining cuts it into layers)."""

    regather_params: bool = False
    next_param_index: int = 0
    loss_transform: Callable[[Callable], Callable] | None = None


_TRACE_STATE: contextvars.ContextVar[_TraceState | None] = contextvars.ContextVar(
    "autopar_trace_state", default=None
)


@contextlib.contextmanager
def tracing_scope(
    *, regather_params: bool, loss_transform: Callable[[Callable], Callable] | None = None
) -> Iterator[None]:
    """Scope of one autopar trace: numbers parameters from 0, sets the regather mode and the
    loss rewrite."""
    token = _TRACE_STATE.set(
        _TraceState(regather_params=regather_params, loss_transform=loss_transform)
    )
    try:
        yield
    finally:
        _TRACE_STATE.reset(token)


def _never_save_param_use(prim: Any, *_: Any, **__: Any) -> bool:
    """Checkpoint policy: save every residual except gathered parameters."""
    return prim is not param_use_p


def _normalize_argnums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def held_by_module(tree: Any) -> list[bool]:
    """For each leaf of `tree`, whether an equinox Module holds it. equinox's rule
    (`eqx.is_array`) is that a Module's Python numbers are hyperparameters (a dropout rate, a
    norm's epsilon): static under `eqx.filter_jit`, not differentiated by `eqx.filter_grad`, and
    absent from an optimizer state built with `eqx.filter(model, eqx.is_inexact_array)`."""
    equinox = sys.modules.get("equinox")  # a Module exists only where equinox was imported
    if equinox is None:
        return [False] * len(jax.tree_util.tree_leaves(tree))
    held: list[bool] = []
    for top in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, equinox.Module)):
        if isinstance(top, equinox.Module):
            held += [True] * len(jax.tree_util.tree_leaves(top))
        else:
            held.append(False)
    return held


def _differentiable(x: Any, in_module: bool) -> bool:
    """Whether `value_and_grad` differentiates a leaf: float arrays, and Python floats but those
    of an equinox Module (`held_by_module`)."""
    if isinstance(x, float):
        return not in_module
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.numpy.inexact)


def value_and_grad(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, **jax_kwargs: Any
) -> Callable:
    """Like `jax.value_and_grad`, and marks parameter uses and the gradient boundary for autopar.

    Leaves that are not float arrays (an equinox Module's functions, integer counters, PRNG
    keys) are held constant and get `None` gradients, as `equinox.filter_value_and_grad` does.

    Example::

        loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch)
    """
    nums = _normalize_argnums(argnums)

    def wrapped(*args: Any, **kwargs: Any):
        state = _TRACE_STATE.get() or _TraceState()
        first_index = state.next_param_index
        trees = [jax.tree_util.tree_flatten(args[num]) for num in nums]
        masks = [
            [_differentiable(x, m) for x, m in zip(leaves, held_by_module(args[num]), strict=True)]
            for num, (leaves, _) in zip(nums, trees, strict=True)
        ]
        diff_leaves = [
            [x for x, d in zip(leaves, mask, strict=True) if d]
            for (leaves, _), mask in zip(trees, masks, strict=True)
        ]
        total = sum(map(len, diff_leaves))
        state.next_param_index += total

        def rebuild(k: int, diff: Sequence[Any]) -> Any:
            """Argument nums[k] with `diff` in place of its differentiated leaves."""
            leaves, treedef = trees[k]
            diff = iter(diff)
            merged = [next(diff) if d else x for x, d in zip(leaves, masks[k], strict=True)]
            return jax.tree_util.tree_unflatten(treedef, merged)

        def marked(*diff_args: Any, **kw: Any):
            index = first_index
            full_args = list(args)
            for k, (num, diff) in enumerate(zip(nums, diff_args, strict=True)):
                used = [param_use_p.bind(x, index=index + j) for j, x in enumerate(diff)]
                index += len(diff)
                full_args[num] = rebuild(k, used)
            return fun(*full_args, **kw)

        def with_kwargs(*diff_args: Any):
            return marked(*diff_args, **kwargs)

        inner = state.loss_transform(with_kwargs) if state.loss_transform else with_kwargs
        if state.regather_params:
            inner = jax.checkpoint(inner, policy=_never_save_param_use)

        value, grads = jax.value_and_grad(
            inner, argnums=tuple(range(len(nums))), has_aux=has_aux, **jax_kwargs
        )(*diff_leaves)
        value_leaves, value_tree = jax.tree_util.tree_flatten(value)
        grad_leaves = [g for per_arg in grads for g in per_arg]
        grad_of = (-1,) * len(value_leaves) + tuple(range(first_index, first_index + total))
        marked_out = grad_boundary_p.bind(*value_leaves, *grad_leaves, grad_of=grad_of)
        value = jax.tree_util.tree_unflatten(value_tree, marked_out[: len(value_leaves)])
        grad_iter = iter(marked_out[len(value_leaves) :])
        grads = tuple(
            _grad_tree(treedef, mask, grad_iter)
            for (_, treedef), mask in zip(trees, masks, strict=True)
        )
        if isinstance(argnums, int):
            grads = grads[0]
        return value, grads

    return wrapped


def _grad_tree(treedef: Any, mask: Sequence[bool], grads: Iterator[Any]) -> Any:
    """The gradient tree of one argument: its gradients where differentiated, else None."""
    return jax.tree_util.tree_unflatten(treedef, [next(grads) if d else None for d in mask])


def grad(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, **jax_kwargs: Any
) -> Callable:
    """Like `jax.grad`, and marks parameter uses and the gradient boundary for autopar.

    Example::

        grads = autopar.grad(loss_fn)(state.params, batch)
    """
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux, **jax_kwargs)

    def wrapped(*args: Any, **kwargs: Any):
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped
