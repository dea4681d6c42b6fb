"""Layers: the units the stage DP assigns to pipeline stages (Alpa §5, layer construction).

A layer is a run of consecutive top-level eqns of the loss's forward jaxpr. They come either from
the user's `autopar.mark_pipeline_boundary()` calls (`manual_layers`) or from clustering
(`cluster_layers`): cut the eqns into L runs of at most (1+δ)·FLOPs/L each, cutting where the
fewest bytes are live, so that little crosses from stage to stage; where the loss repeats a block,
at one place of the block, so that layers of equally many blocks are one program to plan.

Eqns that read only step inputs and constants (a parameter use, a constant broadcast) belong to no
particular place: they *float* to the layer of their first reader, so a parameter is used where
it is needed instead of being passed along from the first layer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

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


def _segment_ids(eqns: Sequence[JaxprEqn], heavy: list[int], floating: list[bool]) -> np.ndarray:
    """For each heavy op, an id of what runs from it up to the next heavy op: the primitives and
    result shapes of its non-floating eqns (equal ids: the same computation on the same shapes)."""
    ends = [*heavy[1:], len(eqns)]
    ids: dict[tuple, int] = {}
    return np.array(
        [
            ids.setdefault(
                tuple(
                    (e.primitive.name, *((v.aval.shape, str(v.aval.dtype)) for v in e.outvars))
                    for e, f in zip(eqns[start:end], floating[start:end], strict=True)
                    if not f
                ),
                len(ids),
            )
            for start, end in zip(heavy, ends, strict=True)
        ]
    )


def _repeat_phases(ids: np.ndarray) -> np.ndarray:
    """Phase of each heavy op within the loss's repeated block (a transformer block's heavy ops),
    -1 outside the repetition; all -1 when no block repeats. The period is the one under which
    the most heavy ops repeat, the shortest of those tied."""
    phases = np.full(len(ids), -1)
    matches = [int(np.sum(ids[:-p] == ids[p:])) for p in range(1, len(ids) // 2 + 1)]
    if not matches or max(matches) == 0:
        return phases
    period = int(np.argmax(matches)) + 1
    if max(matches) < period:  # not even two whole blocks alike
        return phases
    repeats = np.zeros(len(ids), dtype=bool)
    repeats[:-period] |= ids[:-period] == ids[period:]
    repeats[period:] |= ids[period:] == ids[:-period]
    phases[repeats] = np.arange(len(ids))[repeats] % period
    return phases


@dataclasses.dataclass(frozen=True)
class _CutPoints:
    """Where a layer may start (eqn indices: 0, one place between each two heavy ops, and the
    end), the bytes live at each of those places, and the FLOPs between them."""

    points: list[int]
    cost: np.ndarray  # per point
    flops_before: np.ndarray  # per eqn index, the total last
    cap: float  # the most FLOPs a layer may hold

    def share(self, a: int, b: int) -> float:
        """The share of all FLOPs in a layer from point a to point b."""
        flops = self.flops_before[self.points[b]] - self.flops_before[self.points[a]]
        return flops / self.flops_before[-1]


RunPenalty = Callable[[int, int], float]  # what a layer from point a to point b adds


def _fewest_cut_bytes(
    cuts: _CutPoints, layer_num: int, allowed: np.ndarray, penalty: RunPenalty
) -> tuple[float, list[int]] | None:
    """The least sum of cut costs and run penalties over `layer_num` runs within the FLOP cap,
    cutting only at allowed points (a DP over them): (that sum, each run's first eqn)."""
    last = len(cuts.points) - 1
    usable = [0, *(j for j in range(1, last) if allowed[j]), last]
    best = np.full((layer_num + 1, len(usable)), np.inf)
    back = np.zeros((layer_num + 1, len(usable)), dtype=np.int64)
    best[0, 0] = 0.0
    max_share = cuts.cap / cuts.flops_before[-1]
    for k in range(1, layer_num + 1):
        for j in range(1, len(usable)):
            for i in range(j - 1, -1, -1):
                a, b = usable[i], usable[j]
                share = cuts.share(a, b)
                if share > max_share:
                    break
                value = best[k - 1, i] + cuts.cost[b] + penalty(a, b)
                if value < best[k, j]:
                    best[k, j], back[k, j] = value, i
    if not np.isfinite(best[layer_num, -1]):
        return None
    starts, j = [], len(usable) - 1
    for k in range(layer_num, 0, -1):
        j = int(back[k, j])
        starts.append(cuts.points[usable[j]])
    return float(best[layer_num, -1]), sorted(starts)


def _least_largest_cut(
    cuts: _CutPoints, layer_num: int, allowed: np.ndarray, penalty: RunPenalty
) -> tuple[float, float, list[int]] | None:
    """The least achievable largest cut (bisection over the distinct cut costs), then the least
    sum among plans that respect it: (largest cut, sum, each run's first eqn)."""
    levels = np.unique(cuts.cost[allowed])
    lo, hi, found = 0, len(levels) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        result = _fewest_cut_bytes(cuts, layer_num, allowed & (cuts.cost <= levels[mid]), penalty)
        if result is None:
            lo = mid + 1
        else:
            found, hi = (float(levels[mid]), *result), mid - 1
    return found


def _block_aligned_layers(
    cuts: _CutPoints, layer_num: int, phases: np.ndarray
) -> tuple[float, float, list[int]] | None:
    """Layers whose cuts inside the repeated blocks all fall at one place of a block (of those
    places, the ones whose cuts cost least) and whose layers inside the blocks hold q whole
    blocks each (q the blocks per layer, rounded down or up): a plan of the fewest distinct
    layer programs. None if the FLOP cap allows no such plan."""
    period = int(phases.max()) + 1
    in_blocks = phases >= 0
    blocks = round(in_blocks.sum() / period)
    # Lexicographic: the largest cut (the bisection), then uneven layers, then the spread,
    # then the sum of cuts (below `weight`, as Σ share² ≤ 1).
    weight = 1e6 * (float(cuts.cost.sum()) + 1.0)
    worst = {p: cuts.cost[phases == p].max() for p in range(period) if (phases == p).any()}
    cheapest = [p for p, c in worst.items() if c == min(worst.values())]
    found = []
    for q in sorted({blocks // layer_num, -(-blocks // layer_num)} - {0}):

        def penalty(a: int, b: int, q: int = q) -> float:
            uneven = in_blocks[a] and in_blocks[b] and b - a != q * period
            return weight * (cuts.share(a, b) ** 2 + 2.0 * uneven)

        for phase in cheapest:
            allowed = ~in_blocks | (phases == phase)
            if (result := _least_largest_cut(cuts, layer_num, allowed, penalty)) is not None:
                found.append(result)
    return min(found, key=lambda f: f[:2], default=None)


def _leanest_point(live: np.ndarray, previous: int, heavy: int) -> int:
    """Where to cut before heavy op `heavy` (after heavy op `previous`): the place between them
    where the fewest bytes are live, the latest of those tied. A transformer block's residual add
    comes before its layer norm: cut there, and only the residual crosses to the next stage, not
    the residual and its normalised copy."""
    window = live[previous + 1 : heavy + 1]
    return previous + 1 + int(np.flatnonzero(window == window.min())[-1])


def cluster_layers(jaxpr: Jaxpr, layer_num: int, imbalance: float = DEFAULT_IMBALANCE) -> list[int]:
    """Layer index of each eqn: `layer_num` runs, each of at most (1+imbalance)·FLOPs/layer_num,
    cut between heavy ops where the fewest bytes are live (`_leanest_point`), minimising the
    most bytes live at any cut, then their sum, then the spread of FLOPs over layers.

    Where the loss repeats a block (transformer blocks), the cuts inside the repetition fall at
    one place of a block and the layers there hold equally many blocks, before the sum and the
    spread are weighed: layers of the same blocks are the same program, which the stage search
    plans once, where cheaper or better balanced cuts would leave layers to plan one by one.
    """
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
    live = _live_bytes_at_cuts(jaxpr, floating)
    flops_before = np.concatenate([[0.0], np.cumsum(flops)])
    points = [_leanest_point(live, a, b) for a, b in itertools.pairwise(heavy)]
    cuts = _CutPoints(
        points=[0, *points, len(eqns)],
        cost=np.array([0.0, *(live[c] for c in points), 0.0]),
        flops_before=flops_before,
        cap=(1 + imbalance) * flops_before[-1] / layer_num,
    )
    # A cut's place in the repeated block: the phase of the heavy op it comes right before.
    phases = np.concatenate([[-1], _repeat_phases(_segment_ids(eqns, heavy, floating))[1:], [-1]])
    found = _block_aligned_layers(cuts, layer_num, phases) if (phases >= 0).any() else None
    if found is None:
        # Σ (layer FLOP share)² ≤ 1: weighed by 0.5, the spread never outweighs a byte of cut.
        spread = lambda a, b: 0.5 * cuts.share(a, b) ** 2  # noqa: E731
        found = _least_largest_cut(cuts, layer_num, np.ones(len(cuts.points), bool), spread)
    if found is None:
        raise InvalidArgumentError(
            f"cannot split the loss into {layer_num} layers of at most {1 + imbalance:.2f}x the "
            "average FLOPs; use fewer layers"
        )
    starts = found[2]
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
