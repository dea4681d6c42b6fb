"""Layers: the units the stage DP assigns to pipeline stages (Alpa §5, layer construction).

A layer is a run of consecutive top-level eqns of the loss's forward jaxpr. They come either from
the user's `autopar.mark_pipeline_boundary()` calls (`manual_layers`) or from clustering
(`cluster_layers`): cut the eqns into L runs of at most (1+δ)·FLOPs/L each, cutting where the
fewest bytes are live, so that little crosses from stage to stage.

Eqns that read only step inputs and constants (a parameter use, a constant broadcast) belong to no
particular place: they *float* to the layer of their first reader, so a parameter is used where
it is needed instead of being passed along from the first layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var

from autopar.planner.errors import InvalidArgumentError
from autopar.planner.graph import eqn_flops, tensor_info
from autopar.planner.markers import PIPELINE_BOUNDARY

HEAVY_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})
DEFAULT_IMBALANCE = 0.5  # Alpa's δ: a layer may hold up to (1+δ) times the average FLOPs


def _nbytes(var: Var) -> int:
    return tensor_info(var.aval).nbytes


def _floating(jaxpr: Jaxpr) -> list[bool]:
    """Which eqns read only step inputs, constants and literals (and are not boundaries)."""
    produced: set[Var] = set()
    floating = []
    for eqn in jaxpr.eqns:
        reads_results = any(not isinstance(v, Literal) and v in produced for v in eqn.invars)
        floating.append(not reads_results and eqn.primitive.name != PIPELINE_BOUNDARY)
        produced.update(eqn.outvars)
    return floating


def _float_to_readers(jaxpr: Jaxpr, layer_of: list[int], floating: list[bool]) -> list[int]:
    """Move each floating eqn to the layer of its first reader (outputs stay in the last)."""
    last_layer = max(layer_of)
    reader_layer: dict[Var, int] = {v: last_layer for v in jaxpr.outvars if isinstance(v, Var)}
    result = list(layer_of)
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if floating[i]:
            readers = [reader_layer[v] for v in eqn.outvars if v in reader_layer]
            result[i] = min(readers, default=layer_of[i])
        for v in eqn.invars:
            if isinstance(v, Var) and result[i] >= 0:
                reader_layer[v] = min(reader_layer.get(v, result[i]), result[i])
    return result


def manual_layers(jaxpr: Jaxpr) -> list[int]:
    """Layer index of each eqn, from the `mark_pipeline_boundary()` eqns (which get -1)."""
    layer, layer_of = 0, []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == PIPELINE_BOUNDARY:
            layer_of.append(-1)
            layer += 1
        else:
            layer_of.append(layer)
    if layer == 0:
        raise InvalidArgumentError(
            "ManualLayerOption needs autopar.mark_pipeline_boundary() calls in the loss function; "
            "found none (use AutoLayerOption(layer_num=...) to cluster layers automatically)"
        )
    floating = _floating(jaxpr)
    layer_of = _float_to_readers(jaxpr, layer_of, floating)
    sizes = np.bincount(
        [k for k, f in zip(layer_of, floating, strict=True) if k >= 0 and not f],
        minlength=layer + 1,
    )
    if not sizes.all():
        raise InvalidArgumentError(
            f"layer {int(np.argmin(sizes))} of {layer + 1} computes nothing: "
            "mark_pipeline_boundary() is called twice in a row, or at the start or end of the loss"
        )
    return layer_of


def _live_bytes_at_cuts(jaxpr: Jaxpr, floating: list[bool]) -> np.ndarray:
    """bytes[p]: results of eqns before p that eqns at or after p (or the outputs) read."""
    n = len(jaxpr.eqns)
    defined_at: dict[Var, int] = {}
    last_read: dict[Var, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, Var) and v in defined_at:
                last_read[v] = i
        if not floating[i]:
            defined_at.update(dict.fromkeys(eqn.outvars, i))
    for v in jaxpr.outvars:
        if isinstance(v, Var) and v in defined_at:
            last_read[v] = n
    diff = np.zeros(n + 2)
    for v, end in last_read.items():  # live across cuts defined_at+1 .. end
        diff[defined_at[v] + 1] += _nbytes(v)
        diff[end + 1] -= _nbytes(v)
    return np.cumsum(diff)[: n + 1]


def cluster_layers(jaxpr: Jaxpr, layer_num: int, imbalance: float = DEFAULT_IMBALANCE) -> list[int]:
    """Layer index of each eqn: `layer_num` runs, each of at most (1+imbalance)·FLOPs/layer_num,
    cut right before heavy ops, minimising the most bytes live at any cut, then their sum, then
    the spread of FLOPs over layers (repeated blocks, whose cuts all cost the same, are shared
    out evenly)."""
    eqns = jaxpr.eqns
    floating = _floating(jaxpr)
    flops = np.array([0.0 if f else eqn_flops(e) for e, f in zip(eqns, floating, strict=True)])
    heavy = [
        i for i, e in enumerate(eqns) if e.primitive.name in HEAVY_PRIMITIVES and not floating[i]
    ]
    if layer_num > len(heavy):
        raise InvalidArgumentError(
            f"AutoLayerOption(layer_num={layer_num}) asks for more layers than the loss has heavy "
            f"ops (dot_general/convolution: {len(heavy)})"
        )
    if layer_num == 1:
        return [-1 if e.primitive.name == PIPELINE_BOUNDARY else 0 for e in eqns]
    cuts = heavy[1:]  # a layer starts right before a heavy op
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    cap = (1 + imbalance) * prefix[-1] / layer_num
    live = _live_bytes_at_cuts(jaxpr, floating)
    points = [0, *cuts, len(eqns)]
    cost = np.array([0.0, *(live[c] for c in cuts), 0.0])
    balance = 0.5  # Σ (layer FLOP share)² ≤ 1: the spread never outweighs a byte of cut cost

    def solve(allowed: np.ndarray) -> tuple[float, list[int]] | None:
        """Min-sum of cut costs over L runs using only allowed cut points (a DP over points)."""
        num = len(points)
        best = np.full((layer_num + 1, num), np.inf)
        back = np.zeros((layer_num + 1, num), dtype=np.int64)
        best[0, 0] = 0.0
        for k in range(1, layer_num + 1):
            for j in range(1, num):
                if not (allowed[j] or j == num - 1):
                    continue
                for i in range(j - 1, -1, -1):
                    run = prefix[points[j]] - prefix[points[i]]
                    if run > cap:
                        break
                    value = best[k - 1, i] + cost[j] + balance * (run / prefix[-1]) ** 2
                    if value < best[k, j]:
                        best[k, j], back[k, j] = value, i
        if not np.isfinite(best[layer_num, num - 1]):
            return None
        starts, j = [], num - 1
        for k in range(layer_num, 0, -1):
            j = int(back[k, j])
            starts.append(points[j])
        return float(best[layer_num, num - 1]), sorted(starts)

    # The least achievable largest cut first (bisection over the distinct cut costs), then the
    # least total among plans that respect it.
    levels = np.unique(cost)
    lo, hi, found = 0, len(levels) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        result = solve(cost <= levels[mid])
        if result is None:
            lo = mid + 1
        else:
            found, hi = result, mid - 1
    if found is None:
        raise InvalidArgumentError(
            f"cannot split the loss into {layer_num} layers of at most {1 + imbalance:.2f}x the "
            "average FLOPs; use fewer layers"
        )
    starts = found[1]
    run_of = np.searchsorted(starts, np.arange(len(eqns)), side="right") - 1
    layer_of = [
        -1 if e.primitive.name == PIPELINE_BOUNDARY else int(k)
        for e, k in zip(eqns, run_of, strict=True)
    ]
    return _float_to_readers(jaxpr, layer_of, floating)


def crossing_values(jaxpr: Jaxpr, layer_of: Sequence[int]) -> list[list[Var]]:
    """For each layer k ≥ 1, the results of earlier layers that layer k or later read
    (including the loss's outputs): what a boundary before layer k carries."""
    num_layers = max(layer_of) + 1
    defined: dict[Var, int] = {}
    last: dict[Var, int] = {}
    for eqn, k in zip(jaxpr.eqns, layer_of, strict=True):
        for v in eqn.invars:
            if isinstance(v, Var) and v in defined:
                last[v] = max(last.get(v, k), k)
        if k >= 0:
            defined.update(dict.fromkeys(eqn.outvars, k))
    for v in jaxpr.outvars:
        if isinstance(v, Var) and v in defined:
            last[v] = num_layers - 1
    crossing: list[list[Var]] = [[] for _ in range(num_layers)]
    for v, k in defined.items():
        for b in range(k + 1, last.get(v, k) + 1):
            crossing[b].append(v)
    return crossing


def eqn_order(jaxpr: Jaxpr, layer_of: Sequence[int]) -> list[list[JaxprEqn]]:
    """The eqns of each layer, in program order (boundary eqns dropped)."""
    layers: list[list[JaxprEqn]] = [[] for _ in range(max(layer_of) + 1)]
    for eqn, k in zip(jaxpr.eqns, layer_of, strict=True):
        if k >= 0:
            layers[k].append(eqn)
    return layers
