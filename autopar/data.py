"""Feed a parallelized step: batches placed where its plan reads them, a few steps ahead."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Any

from autopar.planner.errors import InvalidArgumentError, check_positive_int


def prefetch_batches(
    train_step: Any, batches: Iterable[Any], *args: Any, prefetch: int = 2
) -> Iterator[Any]:
    """Yield each batch of `batches` already in the sharding `train_step`'s plan reads it in.

    `args` are the step's other arguments (e.g. the state, or arrays shaped like it): the
    batch goes at the step's first batch argument. Transfers are asynchronous, so keeping
    `prefetch` batches in flight overlaps them with the steps that run meanwhile.

    Example::

        for batch in autopar.prefetch_batches(train_step, loader, state):
            state, metrics = train_step(state, batch)
    """
    check_positive_int("prefetch", prefetch)
    batch_argnums = getattr(train_step, "batch_argnums", None)
    if not batch_argnums:
        raise InvalidArgumentError(
            f"prefetch_batches feeds a step made by autopar.parallelize, got {train_step!r}"
        )
    position = batch_argnums[0] if batch_argnums[0] >= 0 else batch_argnums[0] + len(args) + 1
    if not 0 <= position <= len(args):
        raise InvalidArgumentError(
            f"the step reads its batch as argument {position}, but only {len(args)} other "
            "arguments were given"
        )
    pending: collections.deque[Any] = collections.deque()
    for batch in batches:
        call = list(args)
        call.insert(position, batch)
        pending.append(train_step.preshard_dynamic_args(*call)[position])
        if len(pending) > prefetch:
            yield pending.popleft()
    while pending:
        yield pending.popleft()
