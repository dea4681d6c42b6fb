"""Sharded checkpoints on orbax: Alpa's `save_checkpoint` and `restore_checkpoint`.

A plan places a train state on one mesh, or (pipeline plans) on one sub-mesh per stage. Saving
lets every process write only the shards it holds; restoring reads each array straight into the
sharding the next plan wants, so a state moves between device counts, methods and pipeline
sub-meshes without ever being gathered onto one device.

Example::

    autopar.save_checkpoint("/ckpt", state, step=1000)
    target = step_fn.get_executable(state, batch).input_shardings[0]
    state = autopar.restore_checkpoint("/ckpt", 1000, target)
"""

from __future__ import annotations

import logging
import numbers
import os
import pathlib
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from autopar.planner._compat import single_device_sharding
from autopar.planner.errors import InvalidArgumentError

if TYPE_CHECKING:
    import orbax.checkpoint as ocp


def _orbax():
    """orbax, imported on first use: importing autopar (and its planner) does not load it."""
    import orbax.checkpoint

    return orbax.checkpoint


logger = logging.getLogger(__name__)

KeyPath = tuple[Any, ...]


def _leaf_name(path: KeyPath) -> str:
    """`params.dense_0.kernel`: the same spelling for a TrainState's attributes, a dict's keys
    and the nested dicts orbax stores, so a target tree is matched to a checkpoint by name."""
    return jax.tree_util.keystr(path, simple=True, separator=".") or "<root>"


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise InvalidArgumentError(f"step={step!r} must be a non-negative integer")
    return int(step)


def _manager(directory: pathlib.Path, *, create: bool) -> ocp.CheckpointManager:
    """One manager per call: steps are directories `<directory>/<step>` holding one
    StandardCheckpointHandler item (its metadata is readable without a restore target)."""
    ocp = _orbax()
    return ocp.CheckpointManager(
        directory,
        item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(create=create),
    )


def save_checkpoint(ckpt_dir: str | os.PathLike, state: Any, step: int) -> pathlib.Path:
    """Save the pytree `state` of jax (or NumPy) arrays as `ckpt_dir/<step>`; returns that path.

    Each process writes the shards it holds (arrays may live on different sub-meshes); the call
    returns once the checkpoint is committed, so a restore can follow at once.
    """
    step = _check_step(step)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    if not leaves:
        raise InvalidArgumentError("state has no arrays to save")
    for path, leaf in leaves:
        if not isinstance(leaf, jax.Array | np.ndarray):
            raise InvalidArgumentError(
                f"state leaf {_leaf_name(path)} is a {type(leaf).__name__}, not an array; "
                "checkpoints hold jax arrays (e.g. a TrainState after a train step)"
            )
    directory = pathlib.Path(ckpt_dir).absolute()
    with _manager(directory, create=True) as manager:
        if step in manager.all_steps():
            raise InvalidArgumentError(
                f"step={step} already exists in ckpt_dir={str(directory)!r}; "
                "choose a new step or another directory"
            )
        manager.save(step, args=_orbax().args.StandardSave(state), force=True)
        manager.wait_until_finished()
    nbytes = sum(leaf.nbytes for _, leaf in leaves)
    logger.info("saved step %d: %d arrays, %d bytes, to %s", step, len(leaves), nbytes, directory)
    return directory / str(step)


def _abstract_leaf(name: str, stored: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    """The stored shape and dtype with the target sharding (None: the first local device)."""
    if sharding is None:
        sharding = single_device_sharding(jax.local_devices()[0])
    elif not isinstance(sharding, jax.sharding.Sharding):
        raise InvalidArgumentError(
            f"target_shardings leaf {name} is a {type(sharding).__name__}, "
            "not a jax.sharding.Sharding or None"
        )
    shape = tuple(stored.shape)
    try:
        abstract = jax.ShapeDtypeStruct(shape, stored.dtype, sharding=sharding)
        sharding.shard_shape(shape)  # raises where a mesh axis does not divide a dimension
    except ValueError as e:
        raise InvalidArgumentError(
            f"target sharding of {name} cannot hold its stored shape {shape}: {e}"
        ) from e
    return abstract


def _abstract_targets(stored: Any, shardings: dict[str, Any], step: int) -> Any:
    """The checkpoint's tree (as orbax stores it) with a ShapeDtypeStruct per array, each with
    the sharding that `shardings` gives the leaf of the same name."""
    stored_names = [_leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(stored)[0]]
    missing = [name for name in stored_names if name not in shardings]
    unknown = sorted(set(shardings) - set(stored_names))
    if missing or unknown:
        differs = (
            f"checkpoint leaf {missing[0]} is not in target_shardings"
            if missing
            else f"target_shardings leaf {unknown[0]} is not in the checkpoint"
        )
        raise InvalidArgumentError(
            f"target_shardings does not match the checkpoint of step {step}: {differs} "
            f"({len(shardings)} target leaves, {len(stored_names)} stored arrays)"
        )
    return jax.tree_util.tree_map_with_path(
        lambda path, meta: _abstract_leaf(_leaf_name(path), meta, shardings[_leaf_name(path)]),
        stored,
    )


def restore_checkpoint(ckpt_dir: str | os.PathLike, step: int, target_shardings: Any) -> Any:
    """Restore step `step` of `ckpt_dir`, each array read straight into its target sharding.

    `target_shardings` is shaped like the saved state (e.g. a plan's
    `executable.input_shardings[0]`, a TrainState) with a `jax.sharding.Sharding` or None (the
    first local device) per array. The mesh may differ from the one saved from: every device
    reads only its own shard. Returns a tree of the type of `target_shardings`, so a
    TrainState's static fields (apply_fn, tx) come from it.
    """
    step = _check_step(step)
    targets, treedef = jax.tree_util.tree_flatten_with_path(
        target_shardings, is_leaf=lambda x: x is None
    )
    shardings = {_leaf_name(path): sharding for path, sharding in targets}
    directory = pathlib.Path(ckpt_dir).absolute()
    if not directory.is_dir():
        raise InvalidArgumentError(f"ckpt_dir={str(directory)!r} is not a directory")
    with _manager(directory, create=False) as manager:
        steps = sorted(manager.all_steps())
        if step not in steps:
            raise InvalidArgumentError(
                f"step={step} is not in ckpt_dir={str(directory)!r}; saved steps: {steps or 'none'}"
            )
        abstract = _abstract_targets(manager.item_metadata(step).tree, shardings, step)
        restored = manager.restore(step, args=_orbax().args.StandardRestore(abstract))
    by_name = {_leaf_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
    state = jax.tree_util.tree_unflatten(treedef, [by_name[_leaf_name(p)] for p, _ in targets])
    nbytes = sum(x.nbytes for x in by_name.values())
    logger.info(
        "restored step %d: %d arrays, %d bytes, from %s", step, len(by_name), nbytes, directory
    )
    return state
