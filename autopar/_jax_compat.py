"""The one place autopar reaches into jax internals (`jax._src`); everything else uses public jax.

Needed to re-emit a differentiated `checkpoint` (remat) eqn with its original parameters: the public
`jax.checkpoint` always records ``differentiated=False``, and only differentiated remats get the
optimization barrier that stops XLA from merging the backward recomputation with the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src.ad_checkpoint import remat_p
from jax._src.interpreters.partial_eval import convert_constvars_jaxpr


def bind_checkpoint(
    body: Callable[..., Sequence[Any]], args: Sequence[Any], params: dict[str, Any]
) -> list[Any]:
    """Trace `body` over `args` and bind it as a `checkpoint` eqn with the given remat params."""
    closed = jax.make_jaxpr(lambda *a: list(body(*a)))(*args)
    jaxpr = convert_constvars_jaxpr(closed.jaxpr)
    new_params = {k: v for k, v in params.items() if k != "jaxpr"}
    return remat_p.bind(*closed.consts, *args, jaxpr=jaxpr, **new_params)
