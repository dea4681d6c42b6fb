"""One table per primitive (`planner.primitives`): every primitive any phase has a rule for has
a record there, the records are consistent, and FLOPs come from the record's rule."""

import math

import jax
import jax.numpy as jnp
import pytest

from autopar.planner import batch_dims, gradients
from autopar.planner.graph import FLOP_RULES, build_graph
from autopar.planner.primitives import PRIMITIVES, FlopRule, names_where
from autopar.planner.sharding_rules import FOLLOW_RULES, LEADER_RULES


@pytest.mark.parametrize(
    ("table", "rules"),
    [
        ("sharding rules", {**LEADER_RULES, **FOLLOW_RULES}),
        ("batch-dim mappers", batch_dims._MAPPERS),
        ("partial-sum lowerings", gradients._LOWERINGS),
        ("gradient sums", dict.fromkeys(gradients.SUM_PRIMITIVES)),
    ],
)
def test_every_primitive_with_a_rule_has_a_record(table, rules):
    missing = sorted(set(rules) - PRIMITIVES.keys())
    assert missing == [], f"{table} without a record in planner.primitives: {missing}"
    assert set(rules) <= FLOP_RULES.keys()


def test_records_are_consistent():
    elementwise, fuses = names_where("elementwise"), names_where("fuses")
    assert elementwise <= fuses  # XLA fuses element-wise ops into their readers
    assert names_where("transcendental") <= names_where("expensive") <= elementwise
    assert names_where("aliases") <= {n for n, i in PRIMITIVES.items() if not i.kernel} | {
        "transpose"
    }
    for name, info in PRIMITIVES.items():
        assert info.name == name
        if info.transcendental:
            assert info.flops is FlopRule.ELEMENTWISE


def test_flops_follow_the_records_rule():
    x = jnp.zeros((4, 256), jnp.float32)

    def step(x, w, key):
        y = jnp.sort(jnp.exp(x @ w), axis=1)
        return y, jax.random.split(key)

    graph = build_graph(jax.make_jaxpr(step)(x, jnp.zeros((256, 256)), jax.random.key(0)))
    flops = {node.primitive: node.flops for node in graph.nodes}
    assert flops["dot_general"] == 2 * 4 * 256 * 256
    assert flops["exp"] == 4 * 256  # a transcendental counts one per element
    assert flops["sort"] == pytest.approx(4 * 256 * math.log2(256))
    assert flops["random_split"] == 0
