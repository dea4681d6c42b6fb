"""What autopar knows about each primitive, in one table: `PRIMITIVES[name]`.

A record says how the op's FLOPs are counted (`FlopRule`; `graph.FLOP_RULES` holds the
functions) and the facts the other phases read:

* `elementwise`: its output has its operands' shape and takes their sharding (`follow_rules`);
* `fuses`: XLA fuses it into the op that reads it, so its result is never a buffer of its own
  (`memory`); `fuses_operands`: XLA fuses the element-wise ops that feed it into it (reductions,
  transposes);
* `expensive`: XLA keeps its result instead of recomputing it in every fusion that reads it
  (`IsExpensive`);
* `aliases`: its output is its operand's buffer relabelled (no copy);
* `transcendental`: priced at the measured transcendental rate (`roofline`, XLA's
  transcendental class);
* `kernel`: False for markers and relabels, which launch nothing.

How an op may be sharded stays with its rule (`leader_rules`, `follow_rules`, registered per
primitive in `strategy`), as do the batch-dim mappers (`batch_dims`) and the partial-sum
lowerings (`gradients`); `tests/test_primitives.py` checks that every primitive any of them
knows has a record here, so the tables cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping

from autopar.planner.markers import GRAD_BOUNDARY, LAYER_BOUNDARY, PARAM_USE, PIPELINE_BOUNDARY


class FlopRule(enum.Enum):
    """How an op's FLOPs are counted (the functions are `graph.FLOP_RULES`)."""

    ELEMENTWISE = "one per output element"
    REDUCTION = "one per element of the first operand"
    SCATTER_COMBINE = "one per update"
    DATA_MOVEMENT = "none"
    DOT_GENERAL = "two per multiply-add of a contraction"
    CONVOLUTION = "two per multiply-add of a window"
    SORT = "n log2 n comparisons per sorted row"
    SCAN = "length times the body"
    WHILE = "body and condition once"
    COND = "the costliest branch"


@dataclasses.dataclass(frozen=True, slots=True)
class PrimitiveInfo:
    """What autopar knows about one primitive (the module docstring)."""

    name: str
    flops: FlopRule
    elementwise: bool = False
    fuses: bool = False
    fuses_operands: bool = False
    expensive: bool = False
    aliases: bool = False
    transcendental: bool = False
    kernel: bool = True


# One operation per element; they take their operands' sharding and fuse. (`one_minus_square`,
# tanh's derivative 1 - x², is jax 0.11's.)
_ARITHMETIC = """
neg sign floor ceil round is_finite abs not and or xor population_count clz add add_any sub mul
max min integer_pow nextafter shift_left shift_right_arithmetic shift_right_logical eq ne lt le
gt ge select_n clamp real imag conj complex reduce_precision square one_minus_square mulhi
"""
# XLA's transcendental class (what `HloCostAnalysis` counts as transcendentals, not FLOPs).
_TRANSCENDENTAL = """
exp exp2 expm1 log log1p tanh logistic pow sqrt rsqrt cbrt erf erfc erf_inv atan2 sin cos tan
asin acos atan sinh cosh asinh acosh atanh
"""
# Element-wise ops XLA does not duplicate into several fusions (`IsExpensive`).
_EXPENSIVE = (
    _TRANSCENDENTAL
    + """
div rem lgamma digamma igamma igammac igamma_grad_a random_gamma_grad polygamma zeta bessel_i0e
bessel_i1e regularized_incomplete_beta threefry2x32
"""
)
# Element-wise in shape and sharding, but no arithmetic: conversions, copies, key bits.
_ELEMENTWISE_MOVES = "convert_element_type copy stop_gradient random_seed random_fold_in"
_REDUCTIONS = """
reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor reduce argmax argmin
cumsum cumprod cummax cummin cumlogsumexp reduce_window_sum reduce_window_max reduce_window_min
reduce_window select_and_gather_add select_and_scatter_add
"""
_FUSES_OPERANDS = "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or transpose"
_DATA_MOVEMENT = """
reshape broadcast_in_dim broadcast_to transpose slice concatenate gather scatter dynamic_slice
dynamic_update_slice bitcast_convert_type squeeze pad rev iota stack unstack split tile
optimization_barrier sharding_constraint reshard device_put layout_constraint pvary zeros_like
empty random_wrap random_unwrap random_bits random_split
"""
# Fused into their readers besides the element-wise ops.
_FUSED_MOVES = "broadcast_in_dim reshape squeeze iota"
# Their output is their operand's buffer: markers, bitcasts, layout folded into the reader.
_ALIASES = f"{PARAM_USE} reshape squeeze transpose"
# Move no data: markers, and relabels of their operand's buffer.
_NO_KERNEL = f"""
{GRAD_BOUNDARY} {LAYER_BOUNDARY} {PIPELINE_BOUNDARY} {PARAM_USE}
optimization_barrier sharding_constraint reshard device_put pvary layout_constraint stop_gradient
random_wrap random_unwrap reshape squeeze transpose
"""
_SCATTER_COMBINE = "scatter-add scatter_add scatter-sub scatter-mul scatter-min scatter-max"
_ONE_OFF = {
    "dot_general": FlopRule.DOT_GENERAL,
    "conv_general_dilated": FlopRule.CONVOLUTION,
    "sort": FlopRule.SORT,
    "scan": FlopRule.SCAN,
    "while": FlopRule.WHILE,
    "cond": FlopRule.COND,
    GRAD_BOUNDARY: FlopRule.DATA_MOVEMENT,
    LAYER_BOUNDARY: FlopRule.DATA_MOVEMENT,
    PIPELINE_BOUNDARY: FlopRule.DATA_MOVEMENT,
    PARAM_USE: FlopRule.DATA_MOVEMENT,
}


def _table() -> dict[str, PrimitiveInfo]:
    records: dict[str, PrimitiveInfo] = {}

    def add(names: str, **facts: object) -> None:
        for name in names.split():
            record = records.get(name) or PrimitiveInfo(name, FlopRule.DATA_MOVEMENT)
            records[name] = dataclasses.replace(record, **facts)

    elementwise = {"elementwise": True, "fuses": True}
    add(_ARITHMETIC, flops=FlopRule.ELEMENTWISE, **elementwise)
    add(_EXPENSIVE, flops=FlopRule.ELEMENTWISE, expensive=True, **elementwise)
    add(_TRANSCENDENTAL, transcendental=True)
    add(_ELEMENTWISE_MOVES, flops=FlopRule.DATA_MOVEMENT, **elementwise)
    add(_REDUCTIONS, flops=FlopRule.REDUCTION)
    add(_DATA_MOVEMENT, flops=FlopRule.DATA_MOVEMENT)
    add(_SCATTER_COMBINE, flops=FlopRule.SCATTER_COMBINE)
    for name, rule in _ONE_OFF.items():
        add(name, flops=rule)
    add(_FUSED_MOVES, fuses=True)
    add(_FUSES_OPERANDS, fuses_operands=True)
    add(_ALIASES, aliases=True)
    add(_NO_KERNEL, kernel=False)
    return records


PRIMITIVES: Mapping[str, PrimitiveInfo] = types.MappingProxyType(_table())


def names_where(fact: str) -> frozenset[str]:
    """The primitives for which the boolean `fact` of their record holds."""
    return frozenset(name for name, info in PRIMITIVES.items() if getattr(info, fact))


NO_KERNEL = frozenset(PRIMITIVES) - names_where("kernel")  # markers, relabels: launch nothing
