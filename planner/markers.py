"""The marker primitives autopar leaves in a traced step, and their names: the ground floor the
planner reads programs by (`autopar.markers` builds the user-facing `grad`, `value_and_grad`
and `mark_pipeline_boundary` on them; see its docstring for what each marker means).

Each is an identity op with JVP and batching rules; the layer boundary also marks tangents and
cotangents so the differentiated step carries every boundary in the backward pass. Outside
autopar they lower to nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

PARAM_USE = "autopar_param_use"
GRAD_BOUNDARY = "autopar_grad_boundary"
PIPELINE_BOUNDARY = "autopar_pipeline_boundary"
LAYER_BOUNDARY = "autopar_layer_boundary"


def _identity_primitive(name: str, multiple_results: bool) -> Primitive:
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    if multiple_results:
        prim.def_impl(lambda *xs, **_: list(xs))
        prim.def_abstract_eval(lambda *avals, **_: list(avals))
        mlir.register_lowering(prim, lambda ctx, *xs, **_: list(xs))
        ad.primitive_jvps[prim] = lambda primals, tangents, **p: (
            prim.bind(*primals, **p),
            tangents,
        )
        batching.primitive_batchers[prim] = lambda xs, dims, **p: (prim.bind(*xs, **p), dims)
    else:
        prim.def_impl(lambda x, **_: x)
        prim.def_abstract_eval(lambda aval, **_: aval)
        mlir.register_lowering(prim, lambda ctx, x, **_: [x])
        ad.primitive_jvps[prim] = lambda primals, tangents, **p: (
            prim.bind(*primals, **p),
            tangents[0],
        )
        batching.primitive_batchers[prim] = lambda xs, dims, **p: (prim.bind(*xs, **p), dims[0])
    return prim


param_use_p = _identity_primitive(PARAM_USE, multiple_results=False)
grad_boundary_p = _identity_primitive(GRAD_BOUNDARY, multiple_results=True)
pipeline_boundary_p = _identity_primitive(PIPELINE_BOUNDARY, multiple_results=True)
layer_boundary_p = _identity_primitive(LAYER_BOUNDARY, multiple_results=True)


def _mark_nonzero(values: Sequence[Any], avals: Sequence[Any], **params: Any) -> list[Any]:
    """Pass the non-zero (co)tangents through the layer boundary; symbolic zeros stay zeros."""
    keep = [i for i, v in enumerate(values) if type(v) is not ad.Zero]
    marked = layer_boundary_p.bind(*(values[i] for i in keep), **params)
    out = [ad.Zero(a) if type(v) is ad.Zero else v for v, a in zip(values, avals, strict=True)]
    for i, m in zip(keep, marked, strict=True):
        out[i] = m
    return out


def _layer_boundary_jvp(primals, tangents, *, layer: int, kind: str):
    avals = [t.aval for t in tangents]
    out = layer_boundary_p.bind(*primals, layer=layer, kind=kind)
    return out, _mark_nonzero(tangents, avals, layer=layer, kind="tangent")


def _layer_boundary_transpose(cotangents, *operands, layer: int, kind: str):
    avals = [x.aval for x in operands]
    return _mark_nonzero(cotangents, avals, layer=layer, kind="backward")


ad.primitive_jvps[layer_boundary_p] = _layer_boundary_jvp
ad.primitive_transposes[layer_boundary_p] = _layer_boundary_transpose
