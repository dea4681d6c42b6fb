"""Planning is deterministic: the same program and options give the same plan, `to_json()` and
`explain()` table in fresh processes, whatever their string hash seed (`PYTHONHASHSEED`), and
HiGHS solves on one thread wherever it can (its MIP search depends on its thread count)."""

import json
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pulp

from autopar.planner.ilp import ClassCosts, IntraOpIlp, MemoryModel

# A ShardParallel plan with micro-batches (single-mesh baselines) and a pipeshard plan on two
# hosts (the stage DP, a pipeline baseline), each with its explanation, written as JSON.
_PLAN_AND_EXPLAIN = """
import json, sys
import autopar
from autopar.models import GPTConfig, abstract_train_inputs, gpt

def planned(family, config, batch, method, cluster):
    step, state, data = abstract_train_inputs(family, config, batch)
    spec = autopar.ClusterSpec.preset(cluster)
    explanation = autopar.explain(step, state, data, method=method, cluster_spec=spec)
    return {"plan": explanation.chosen.plan.to_json(), "explain": str(explanation)}

pipeline = autopar.PipeshardParallel(
    num_micro_batches=4, layer_option=autopar.AutoLayerOption(layer_num=2)
)
shard = autopar.ShardParallel(num_micro_batches=2)
found = {
    "shard": planned(gpt, GPTConfig(), 16, shard, "8xV100-p3"),
    "pipeshard": planned(gpt, GPTConfig(), 16, pipeline, "2x8xV100-p3"),
}
with open(sys.argv[1], "w") as f:
    json.dump(found, f)
"""


def _plan_in_fresh_process(path, hash_seed: str) -> dict:
    env = {
        **os.environ,
        "PYTHONHASHSEED": hash_seed,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "AUTOPAR_PLAN_CACHE": "off",
    }
    result = subprocess.run(
        [sys.executable, "-c", _PLAN_AND_EXPLAIN, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(path.read_text())


def test_same_plan_and_explanation_in_fresh_processes(tmp_path):
    first = _plan_in_fresh_process(tmp_path / "first.json", "0")
    second = _plan_in_fresh_process(tmp_path / "second.json", "12345")
    for case in ("shard", "pipeshard"):
        assert first[case]["plan"] == second[case]["plan"], case
        assert first[case]["explain"] == second[case]["explain"], case
    assert "Pipeline 2xDP" in first["pipeshard"]["explain"]


def _two_class_ilp() -> IntraOpIlp:
    def costs(compute):
        zeros = np.zeros(len(compute))
        return ClassCosts(np.array(compute), zeros, zeros, zeros)

    memory = MemoryModel(lambda choices: np.zeros(1), lambda step: ({}, 0.0))
    return IntraOpIlp([2, 3], [costs([2.0, 1.0]), costs([3.0, 1.0, 2.0])], [], memory)


def test_highs_thread_started_elsewhere_still_solves(caplog):
    """HiGHS refuses one thread where other code started it with more threads in the same
    thread: the ILP solves on those threads and warns, rather than finding no plan."""

    def start_highs_on_two_threads_then_plan(found: list) -> None:
        prob = pulp.LpProblem("other_code", pulp.LpMinimize)
        x = prob.add_variable("x", cat=pulp.LpBinary)
        prob += x
        prob += x >= 1
        prob.solve(pulp.HiGHS(msg=False, threads=2))
        found.append(_two_class_ilp().solve(float("inf")))

    found: list = []
    with caplog.at_level(logging.WARNING, logger="autopar.planner.ilp"):
        thread = threading.Thread(target=start_highs_on_two_threads_then_plan, args=(found,))
        thread.start()
        thread.join()
    assert found[0] is not None and found[0].choices.tolist() == [1, 1]
    assert any("refuses to solve on one thread" in r.getMessage() for r in caplog.records)
