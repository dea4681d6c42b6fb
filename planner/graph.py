"""Op graph of a traced train step: the IR that the planner and the runtime share.

`build_graph` turns a `ClosedJaxpr` into an `OpGraph` whose nodes are the jaxpr's equations, with
call-like equations (``jit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``,
``checkpoint``/``remat2``) inlined so that the planner sees the ops inside them. Control flow
(``scan``, ``while``, ``cond``) stays one node. Node ids are equation *paths*: top-level equation
``i`` is ``"i"``, equation ``j`` of the body inlined at ``i`` is ``"i/j"``, and so on.
`inlined_body` is the single place that decides what is inlined, so the runtime's interpreter can
walk exactly the same structure. Nothing here touches devices.

Example::

    graph = build_graph(jax.make_jaxpr(train_step)(state, batch))
    print(len(graph), graph.total_flops)
"""

from __future__ import annotations

import enum
import logging
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal

from autopar.planner._compat import PARAM_LAYOUT_ERRORS, warn_unknown_params
from autopar.planner.primitives import PRIMITIVES, FlopRule

logger = logging.getLogger(__name__)


class ValueKind(enum.Enum):
    """Where a value comes from."""

    INPUT = "input"  # a top-level jaxpr invar
    NODE = "node"  # an output of a node
    CONST = "const"  # a top-level ClosedJaxpr const
    LITERAL = "literal"  # a literal, or a const of an inlined inner ClosedJaxpr


@dataclass(frozen=True, slots=True)
class ValueRef:
    """A node operand: input/const index, (producer node, output index), or a literal value."""

    kind: ValueKind
    index: int
    node: str | None = None
    literal: Any = field(default=None, compare=False)  # not in eq/hash: arrays are unhashable


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Shape and dtype of a value (extended dtypes such as PRNG keys are kept as they are)."""

    shape: tuple[int, ...]
    dtype: Any

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class OpNode:
    """One primitive application, with its operands, avals and costs."""

    id: str
    primitive: str
    inputs: tuple[ValueRef, ...]
    in_avals: tuple[TensorInfo, ...]
    out_avals: tuple[TensorInfo, ...]
    flops: float
    bytes_accessed: float
    params: Mapping[str, Any] = field(compare=False, repr=False)
    remat_region: str | None = None


@dataclass(frozen=True, slots=True)
class OpGraph:
    """Nodes in program (topological) order, top-level input avals and output refs."""

    inputs: tuple[TensorInfo, ...]
    nodes: tuple[OpNode, ...]
    outputs: tuple[ValueRef, ...]
    _index: dict[str, OpNode] = field(init=False, repr=False, compare=False)
    _readers: dict[str | int, tuple[tuple[str, int], ...]] = field(
        init=False, repr=False, compare=False
    )  # keyed by producer node id (str) or top-level input index (int)

    def __post_init__(self) -> None:
        index: dict[str, OpNode] = {}
        readers: dict[str | int, list[tuple[str, int]]] = {}
        for node in self.nodes:
            if node.id in index:
                raise ValueError(f"duplicate node id {node.id!r} in OpGraph")
            for pos, ref in enumerate(node.inputs):
                self._check_ref(ref, index, f"operand {pos} of node {node.id!r}")
                if ref.kind in (ValueKind.NODE, ValueKind.INPUT):
                    key = ref.node if ref.kind is ValueKind.NODE else ref.index
                    readers.setdefault(key, []).append((node.id, pos))
            index[node.id] = node
        for k, ref in enumerate(self.outputs):
            self._check_ref(ref, index, f"graph output {k}")
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_readers", {k: tuple(v) for k, v in readers.items()})

    def _check_ref(self, ref: ValueRef, index: Mapping[str, OpNode], where: str) -> None:
        if ref.kind is ValueKind.NODE:
            producer = index.get(ref.node)
            if producer is None or not 0 <= ref.index < len(producer.out_avals):
                raise ValueError(f"{where} reads {ref}, which no earlier node produces")
        elif ref.kind is ValueKind.INPUT and not 0 <= ref.index < len(self.inputs):
            raise ValueError(f"{where} reads input {ref.index}; OpGraph has {len(self.inputs)}")

    def node(self, node_id: str) -> OpNode:
        """The node with id `node_id` (O(1))."""
        try:
            return self._index[node_id]
        except KeyError:
            raise KeyError(f"no node {node_id!r} in OpGraph of {len(self)} nodes") from None

    def consumers(self, node_id: str) -> tuple[tuple[str, int], ...]:
        """(node id, operand position) of every node reading any output of node `node_id`."""
        self.node(node_id)
        return self._readers.get(node_id, ())

    def input_consumers(self, i: int) -> tuple[tuple[str, int], ...]:
        """(node id, operand position) of every node reading top-level input `i`."""
        if not 0 <= i < len(self.inputs):
            raise IndexError(f"input {i} out of range: OpGraph has {len(self.inputs)} inputs")
        return self._readers.get(i, ())

    def producer(self, ref: ValueRef) -> OpNode | None:
        """The node producing `ref`, or None for inputs, consts and literals."""
        return self.node(ref.node) if ref.kind is ValueKind.NODE else None

    @property
    def total_flops(self) -> float:
        return sum(node.flops for node in self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)


# ----------------------------------------------------------------------------- inlining

# Call-like primitive -> the param holding its body (a ClosedJaxpr or an open Jaxpr).
# jax 0.10.2 names pjit "jit", remat "remat2", core.call_p "call"; closed_call is "eval_jaxpr"
# from 0.11.1; the others are kept for older/newer spellings.
_INLINED_BODY_PARAM = {
    **dict.fromkeys(("jit", "pjit", "remat2", "checkpoint"), "jaxpr"),
    **dict.fromkeys(("closed_call", "eval_jaxpr", "call", "core_call"), "call_jaxpr"),
    **dict.fromkeys(("custom_jvp_call", "custom_vjp_call"), "call_jaxpr"),
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}
_CHECKPOINT_PRIMITIVES = frozenset({"remat2", "checkpoint"})


def inlined_body(eqn: JaxprEqn) -> tuple[Jaxpr, list[Any]] | None:
    """The body jaxpr and its consts if `eqn` is inlined into the graph, else None.

    The body's invars take the eqn's operands in order, its constvars the returned consts, and
    the eqn's outvars are the body's outvars.
    """
    param = _INLINED_BODY_PARAM.get(eqn.primitive.name)
    if param is None or param not in eqn.params:
        return None
    body = eqn.params[param]
    jaxpr, consts = (body.jaxpr, list(body.consts)) if isinstance(body, ClosedJaxpr) else (body, [])
    if len(jaxpr.constvars) != len(consts):
        raise ValueError(
            f"{eqn.primitive.name} body has {len(jaxpr.constvars)} constvars but "
            f"{len(consts)} consts"
        )
    return jaxpr, consts


def is_checkpoint(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a rematerialisation (``jax.checkpoint``) region."""
    return eqn.primitive.name in _CHECKPOINT_PRIMITIVES


# ----------------------------------------------------------------------------- FLOPs


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def dot_general_flops(eqn: JaxprEqn) -> float:
    """2 · Π(output dims) · Π(lhs contracting dims): one multiply and one add per term."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    return 2.0 * _size(eqn.outvars[0].aval) * math.prod(lhs_shape[d] for d in lhs_contract)


def conv_flops(eqn: JaxprEqn) -> float:
    """2 · output elements · (kernel spatial size · in-features per group)."""
    rhs_shape = eqn.invars[1].aval.shape
    dn = eqn.params.get("dimension_numbers")
    rhs_spec = dn.rhs_spec if dn is not None else range(len(rhs_shape))  # (out, in, *spatial)
    per_output = math.prod(rhs_shape[d] for d in rhs_spec[1:])  # in-features/group · spatial
    return 2.0 * _size(eqn.outvars[0].aval) * per_output


def elementwise_flops(eqn: JaxprEqn) -> float:
    """Output elements: one operation per element (transcendentals count as one)."""
    return float(sum(_size(v.aval) for v in eqn.outvars))


def reduction_flops(eqn: JaxprEqn) -> float:
    """Input elements of the first operand: one combine per element read."""
    return float(_size(eqn.invars[0].aval))


def scatter_combine_flops(eqn: JaxprEqn) -> float:
    """Elements of the updates operand (operand, indices, updates): one combine per update."""
    return float(_size(eqn.invars[2].aval))


def data_movement_flops(eqn: JaxprEqn) -> float:
    """0: copies, layout changes, indexing and markers do no arithmetic."""
    del eqn
    return 0.0


def scan_flops(eqn: JaxprEqn) -> float:
    """length · body FLOPs."""
    return eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"].jaxpr)


def while_flops(eqn: JaxprEqn) -> float:
    """Body + cond FLOPs *once*: the trip count is unknown when tracing, so this is a floor."""
    return jaxpr_flops(eqn.params["body_jaxpr"].jaxpr) + jaxpr_flops(eqn.params["cond_jaxpr"].jaxpr)


def cond_flops(eqn: JaxprEqn) -> float:
    """Max FLOPs over the branches (only one runs)."""
    return max((jaxpr_flops(b.jaxpr) for b in eqn.params["branches"]), default=0.0)


def sort_flops(eqn: JaxprEqn) -> float:
    """n·log2(n) comparisons per row of n sorted elements."""
    shape = eqn.invars[0].aval.shape
    n = shape[eqn.params["dimension"]] if shape else 1
    return float(_size(eqn.invars[0].aval) * math.log2(n)) if n > 1 else 0.0


_FLOP_FUNCTIONS: Mapping[FlopRule, Callable[[JaxprEqn], float]] = {
    FlopRule.ELEMENTWISE: elementwise_flops,
    FlopRule.REDUCTION: reduction_flops,
    FlopRule.SCATTER_COMBINE: scatter_combine_flops,
    FlopRule.DATA_MOVEMENT: data_movement_flops,
    FlopRule.DOT_GENERAL: dot_general_flops,
    FlopRule.CONVOLUTION: conv_flops,
    FlopRule.SORT: sort_flops,
    FlopRule.SCAN: scan_flops,
    FlopRule.WHILE: while_flops,
    FlopRule.COND: cond_flops,
}
FLOP_RULES: Mapping[str, Callable[[JaxprEqn], float]] = types.MappingProxyType(
    {name: _FLOP_FUNCTIONS[info.flops] for name, info in PRIMITIVES.items()}
)


def eqn_flops(eqn: JaxprEqn) -> float:
    """FLOPs of one eqn: its inlined body's, or by its record's rule (`primitives.PRIMITIVES`);
    0 if unknown."""
    body = inlined_body(eqn)
    if body is not None:
        return jaxpr_flops(body[0])
    rule = FLOP_RULES.get(eqn.primitive.name)
    if rule is None:
        logger.debug("no FLOP rule for primitive %r; counting 0 FLOPs", eqn.primitive.name)
        return 0.0
    try:
        return rule(eqn)
    except PARAM_LAYOUT_ERRORS as error:
        warn_unknown_params(eqn.primitive.name, "FLOP count (one per output element)", error)
        return elementwise_flops(eqn)


def jaxpr_flops(jaxpr: Jaxpr) -> float:
    """Sum of `eqn_flops` over the eqns of `jaxpr`."""
    return sum((eqn_flops(eqn) for eqn in jaxpr.eqns), 0.0)


# ----------------------------------------------------------------------------- building


def tensor_info(aval: Any) -> TensorInfo:
    """TensorInfo of a jax aval; tokens and other shapeless avals get shape () and 0 bytes."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return TensorInfo((), np.dtype("V0"))
    extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
    return TensorInfo(tuple(aval.shape), dtype if extended else np.dtype(dtype))


def _read(env: Mapping[Any, ValueRef], var: Any) -> ValueRef:
    if isinstance(var, Literal):
        return ValueRef(ValueKind.LITERAL, -1, literal=var.val)
    return env[var]


def _make_node(
    eqn: JaxprEqn, node_id: str, inputs: tuple[ValueRef, ...], remat_region: str | None
) -> OpNode:
    in_avals = tuple(tensor_info(v.aval) for v in eqn.invars)
    out_avals = tuple(tensor_info(v.aval) for v in eqn.outvars)
    read_bytes = sum(
        a.nbytes for a, r in zip(in_avals, inputs, strict=True) if r.kind is not ValueKind.LITERAL
    )
    return OpNode(
        id=node_id,
        primitive=eqn.primitive.name,
        inputs=inputs,
        in_avals=in_avals,
        out_avals=out_avals,
        flops=eqn_flops(eqn),
        bytes_accessed=float(read_bytes + sum(a.nbytes for a in out_avals)),
        params=types.MappingProxyType(dict(eqn.params)),
        remat_region=remat_region,
    )


def _walk(
    jaxpr: Jaxpr,
    env: dict[Any, ValueRef],
    prefix: str,
    remat_region: str | None,
    nodes: list[OpNode],
) -> None:
    """Append the nodes of `jaxpr` to `nodes`, inlining call bodies; binds outvars in `env`."""
    for j, eqn in enumerate(jaxpr.eqns):
        path = f"{prefix}{j}"
        inputs = tuple(_read(env, v) for v in eqn.invars)
        body = inlined_body(eqn)
        if body is None:
            nodes.append(_make_node(eqn, path, inputs, remat_region))
            results = [ValueRef(ValueKind.NODE, k, path) for k in range(len(eqn.outvars))]
        else:
            inner, consts = body
            inner_env = {
                v: ValueRef(ValueKind.LITERAL, -1, literal=c)
                for v, c in zip(inner.constvars, consts, strict=True)
            }
            inner_env.update(zip(inner.invars, inputs, strict=True))
            region = path if is_checkpoint(eqn) else remat_region
            _walk(inner, inner_env, f"{path}/", region, nodes)
            results = [_read(inner_env, v) for v in inner.outvars]
        for var, ref in zip(eqn.outvars, results, strict=True):
            if not isinstance(var, DropVar):
                env[var] = ref


def build_graph(closed_jaxpr: ClosedJaxpr) -> OpGraph:
    """The OpGraph of `closed_jaxpr`, with call-like eqns inlined (see `inlined_body`).

    Example::

        graph = build_graph(jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(x, w))
        assert [n.primitive for n in graph.nodes] == ["dot_general", "tanh"]
    """
    return graph_with_refs(closed_jaxpr)[0]


def graph_with_refs(closed_jaxpr: ClosedJaxpr) -> tuple[OpGraph, dict[Any, ValueRef]]:
    """The OpGraph of `closed_jaxpr` and the ref each top-level var (input or eqn result) reads
    in it: what a rewrite of the jaxpr needs to act on what it found in the graph."""
    jaxpr = closed_jaxpr.jaxpr
    env: dict[Any, ValueRef] = {
        v: ValueRef(ValueKind.CONST, i) for i, v in enumerate(jaxpr.constvars)
    }
    env.update((v, ValueRef(ValueKind.INPUT, i)) for i, v in enumerate(jaxpr.invars))
    nodes: list[OpNode] = []
    _walk(jaxpr, env, "", None, nodes)
    graph = OpGraph(
        inputs=tuple(tensor_info(v.aval) for v in jaxpr.invars),
        nodes=tuple(nodes),
        outputs=tuple(_read(env, v) for v in jaxpr.outvars),
    )
    return graph, env


# ----------------------------------------------------------------------------- queries

PASS_THROUGH = ("convert_element_type", "copy", "autopar_param_use", "reshape")


def resolve_input(
    graph: OpGraph, ref: ValueRef, through: tuple[str, ...] = PASS_THROUGH
) -> int | None:
    """The top-level input index `ref` comes from via single-operand `through` nodes, or None."""
    while ref.kind is ValueKind.NODE:
        node = graph.node(ref.node)
        if node.primitive not in through or len(node.inputs) != 1:
            return None
        ref = node.inputs[0]
    return ref.index if ref.kind is ValueKind.INPUT else None


def nodes_by_primitive(graph: OpGraph, name: str) -> tuple[OpNode, ...]:
    """All nodes of `graph` whose primitive is `name`, in program order."""
    return tuple(node for node in graph.nodes if node.primitive == name)
