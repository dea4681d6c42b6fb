"""CreateStateParallel: run a state-initialisation function so the state is born sharded.

The train step's plan says where every leaf of its state lives (for a pipeline plan, on several
sub-meshes). The initialisation function is compiled once per group of leaves that share a
device set, with `out_shardings` from the plan: XLA's SPMD partitioner then has each device
compute only its own shards (random keys are split per shard), so the whole state never exists
on one device, and the train step reads the result without moving it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar.context import current_runtime
from autopar.methods import ParallelMethod
from autopar.planner.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct) or hasattr(x, "__jax_array__")


@dataclasses.dataclass(frozen=True)
class CreateStateParallel(ParallelMethod):
    """Compile a state-initialisation function so its outputs are born where `train_step`'s
    plan stores them: each device computes only its shards, and no device ever holds the whole
    state. The outputs must be the train state `train_step` takes as argument `state_argnum`.
    The function has no plan of its own: it runs by `train_step`'s (`runner`).

    Args:
      train_step: the `ParallelizedFunc` whose plan places the state.
      other_args: `train_step`'s other arguments (e.g. an example batch; arrays or
        `jax.ShapeDtypeStruct`s), in order, without the state.
      state_argnum: where the state goes among `train_step`'s arguments.
    """

    train_step: Any
    other_args: tuple[Any, ...]
    state_argnum: int = 0
    devices: Any = None  # the protocol's; the train step's plan places the state
    num_micro_batches: int | None = None  # the protocol's; nothing is traced for a plan

    def __init__(self, train_step: Any, *other_args: Any, state_argnum: int = 0) -> None:
        object.__setattr__(self, "train_step", train_step)
        object.__setattr__(self, "other_args", other_args)
        object.__setattr__(self, "state_argnum", state_argnum)
        if not isinstance(state_argnum, int) or not 0 <= state_argnum <= len(other_args):
            raise InvalidArgumentError(
                f"state_argnum must be an int in [0, {len(other_args)}], got {state_argnum!r}"
            )

    def runner(self, fun: Callable) -> StateCreator:
        if not callable(getattr(self.train_step, "get_executable", None)):
            raise InvalidArgumentError(
                "CreateStateParallel places the state of a step made by autopar.parallelize, "
                f"got {self.train_step!r}"
            )
        return StateCreator(fun, self)


class StateCreator:
    """`fun` compiled to return the train state placed as `method.train_step` wants it."""

    def __init__(self, fun: Callable, method: CreateStateParallel) -> None:
        self.fun = fun
        self.method = method
        self._compiled: dict[Any, tuple[Any, list[tuple[list[int], Any]]]] = {}

    def _static(self, args: Sequence[Any]) -> tuple[int, ...]:
        """Arguments without arrays (a config, a seed as a Python int) are baked in."""
        return tuple(i for i, a in enumerate(args) if not any(map(_is_array, jax.tree.leaves(a))))

    def _step_executable(self, abstract_state: Any) -> Any:
        m = self.method
        step_args = list(m.other_args)
        step_args.insert(m.state_argnum, abstract_state)
        return m.train_step.get_executable(*step_args)

    def state_shardings(self, abstract_state: Any) -> Any:
        """Where the train step's plan stores each leaf of the state (a pytree of shardings)."""
        return self._step_executable(abstract_state).input_shardings[self.method.state_argnum]

    def _create_on_workers(self, args: Sequence[Any], static: tuple[int, ...]) -> Any:
        """On Ray: the state created by the train step's mesh workers, each leaf on the stage
        that reads it first, as `RemoteArray`s (the driver holds no device)."""

        def bound(*dynamic):
            it = iter(dynamic)
            return self.fun(*(a if i in static else next(it) for i, a in enumerate(args)))

        abstract = jax.eval_shape(bound, *(a for i, a in enumerate(args) if i not in static))
        executable = self._step_executable(abstract)
        positions = jax.tree_util.tree_leaves(
            executable.input_positions[self.method.state_argnum], is_leaf=lambda x: x is None
        )
        leaves = executable.create_state(self.fun, tuple(args), static, positions)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), leaves)

    def _build(self, args: Sequence[Any], static: tuple[int, ...]):
        def bound(*dynamic):
            it = iter(dynamic)
            return self.fun(*(a if i in static else next(it) for i, a in enumerate(args)))

        dynamic = [a for i, a in enumerate(args) if i not in static]
        abstract = jax.eval_shape(bound, *dynamic)
        leaves, tree = jax.tree_util.tree_flatten(abstract)
        try:
            shardings = jax.tree_util.tree_leaves(
                self.state_shardings(abstract), is_leaf=lambda x: x is None
            )
        except Exception as e:  # the train step's own code failed on this state
            raise InvalidArgumentError(
                f"CreateStateParallel: the train step cannot take what the function returns as "
                f"its state (argument {self.method.state_argnum}): {type(e).__name__}: {e}"
            ) from e
        groups: dict[Any, list[int]] = {}
        for i, s in enumerate(shardings):
            groups.setdefault(None if s is None else frozenset(s.device_set), []).append(i)
        parts = []
        for indices in groups.values():
            outs = tuple(shardings[i] for i in indices)

            def select(*dyn, indices=indices):
                flat = jax.tree_util.tree_leaves(bound(*dyn))
                return tuple(flat[i] for i in indices)

            out_shardings = None if outs[0] is None else outs
            parts.append((indices, jax.jit(select, out_shardings=out_shardings)))
        logger.info(
            "creating a state of %d arrays in place on %d device group(s)", len(leaves), len(parts)
        )
        return tree, parts

    def __call__(self, *args: Any) -> Any:
        static = self._static(args)
        if not current_runtime().executor.holds_devices:
            return self._create_on_workers(args, static)
        dynamic = [a for i, a in enumerate(args) if i not in static]
        key = (
            static,
            tuple(args[i] for i in static),
            tuple((x.shape, x.dtype) for x in jax.tree.leaves(dynamic)),
        )
        try:
            hash(key)
        except TypeError as e:
            raise InvalidArgumentError(
                f"arguments without arrays are baked into the program and must be hashable: {e}"
            ) from e
        if key not in self._compiled:
            self._compiled[key] = self._build(args, static)
        tree, parts = self._compiled[key]
        leaves: list[Any] = [None] * tree.num_leaves
        for indices, jitted in parts:
            for i, x in zip(indices, jitted(*dynamic), strict=True):
                leaves[i] = x
        return jax.tree_util.tree_unflatten(tree, leaves)
