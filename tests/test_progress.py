"""Progress on stderr while a plan is made: off by default where stderr is not a terminal, on
with AUTOPAR_PROGRESS=1, and then also for phases that are one long call (tracing, the ILP)."""

import time

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.planner.progress import phase, progress


def _step(w, x):
    return w - 0.1 * autopar.grad(lambda w: jnp.mean((x @ w) ** 2))(w)


ARGS = (jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((32, 64), jnp.float32))


@pytest.mark.parametrize("setting, shown", [("1", True), ("0", False), (None, False)])
def test_planning_phases_show_on_stderr_only_when_asked(monkeypatch, capfd, setting, shown):
    if setting is None:
        monkeypatch.delenv("AUTOPAR_PROGRESS", raising=False)  # stderr is not a terminal here
    else:
        monkeypatch.setenv("AUTOPAR_PROGRESS", setting)
    autopar.plan(_step, *ARGS, cluster_spec=autopar.ClusterSpec.local(2))
    err = capfd.readouterr().err  # (stdout may hold HiGHS's one-time banner)
    assert ("tracing _step" in err and "sharding ILP on mesh (2,)" in err) is shown
    assert bool(err.strip()) is shown


def test_a_phase_refreshes_its_seconds_while_it_runs(monkeypatch, capfd):
    monkeypatch.setenv("AUTOPAR_PROGRESS", "1")
    with phase("waiting", refresh_s=0.05):
        time.sleep(0.3)
    err = capfd.readouterr().err
    assert err.count("waiting: ") >= 3  # drawn at the start, refreshed, cleared at the end
    assert list(progress(range(3), desc="counted")) == [0, 1, 2]
