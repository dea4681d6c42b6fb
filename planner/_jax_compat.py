"""The one place autopar reaches into jax internals (`jax._src`); everything else uses public jax.

Needed to name the user's source line of an eqn in errors, and to re-emit a differentiated
`checkpoint` (remat) eqn with its original parameters: the public `jax.checkpoint` always records
``differentiated=False``, and only differentiated remats get the optimization barrier that stops
XLA from merging the backward recomputation with the forward pass.
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
    """Trace `body` over `args` and bind it as a `checkpoint` eqn with the given remat params.

    Arguments and results may be pytrees of arrays (unreduced partial sums are)."""
    flat, in_tree = jax.tree.flatten(list(args))
    closed, out_shape = jax.make_jaxpr(
        lambda *a: list(body(*jax.tree.unflatten(in_tree, a))), return_shape=True
    )(*flat)
    jaxpr = convert_constvars_jaxpr(closed.jaxpr)
    new_params = {k: v for k, v in params.items() if k != "jaxpr"}
    outs = remat_p.bind(*closed.consts, *flat, jaxpr=jaxpr, **new_params)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def source_line(eqn: Any) -> str | None:
    """The user's source line that created `eqn` ("file.py:12 (fn)"), where JAX recorded it."""
    from jax._src import source_info_util

    summary = source_info_util.summarize(eqn.source_info)
    return None if not summary or summary.startswith("unknown") else summary
