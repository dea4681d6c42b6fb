"""The `autopar plan` command: plans bundled models and module:function targets for clusters that
are not here, writes JSON and PNG, and refuses bad input with one line and exit code 2."""

import json
import os
import re
import struct
import subprocess
import sys
import textwrap

import pytest

import autopar
from autopar import cli

GPT_TINY = ["plan", "gpt", "--cluster", "8xV100-p3", "--size", "tiny"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(argv, capsys):
    """(exit code, stdout, stderr) of `autopar` run in this process."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG file, after checking its signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def check_png(path) -> None:
    width, height = png_size(path)
    assert width >= 800 and height >= 250
    assert path.stat().st_size > 10_000


@pytest.fixture
def captured_plans(monkeypatch):
    """The plans the CLI makes while the test runs."""
    plans = []
    real = autopar.api.plan_in_context

    def plan_in_context(*args, **kwargs):
        found = real(*args, **kwargs)
        plans.append(found[0])
        return found

    monkeypatch.setattr(autopar.api, "plan_in_context", plan_in_context)
    return plans


def test_plan_gpt_writes_json_and_png(tmp_path, capsys, captured_plans):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    code, out, err = run([*GPT_TINY, "--json", str(out_json), "--png", str(out_png)], capsys)
    assert code == 0, err
    (plan,) = captured_plans
    assert "stage 0: sub-mesh 1x8" in out and "logical mesh (x=8)" in out
    assert "predicted per step" in out and "MFU" in out
    assert "state.params['block_{0..1}']['attn']['query']['kernel']" in out
    assert "planning gpt (tiny) for 8xV100-p3" in err
    assert autopar.Plan.from_json(out_json.read_text()) == plan
    check_png(out_png)


def test_plan_pipeshard_prints_every_stage_and_explains(tmp_path, capsys):
    out_png = tmp_path / "pipeline.png"
    argv = ["plan", "mlp", "--cluster", "8xV100-p3", "--method", "pipeshard"]
    argv += ["--layers", "2", "--stages", "2", "--micro-batches", "4", "--explain"]
    argv += ["--schedule", "zero_bubble"]
    code, out, err = run([*argv, "--png", str(out_png), "-q"], capsys)
    assert code == 0, err
    assert "zero_bubble pipeline" in out
    assert "stage 0: layers [0,1) on sub-mesh 1x4" in out
    assert "stage 1: layers [1,2) on sub-mesh 1x4" in out
    assert "predicted pipeline bubble" in out
    assert "autopar explain" in out and "Pipeline 2xDP" in out
    assert err == ""  # -q: no progress log
    check_png(out_png)


def test_plan_as_a_subprocess():
    result = subprocess.run(
        [sys.executable, "-m", "autopar", *GPT_TINY, "--cluster", "2x8xV100-p3"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "AUTOPAR_PLAN_CACHE": "off"},
    )
    assert result.returncode == 0, result.stderr
    assert "on 16 device(s)" in result.stdout and "logical mesh (x=2 x y=8)" in result.stdout
    assert "planned in" in result.stderr


def test_module_function_target(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_step.py").write_text(
        textwrap.dedent(
            """
            from autopar.models import MLPConfig, abstract_train_inputs, mlp

            def make(batch=32):
                step, state, data = abstract_train_inputs(mlp, MLPConfig(), batch)
                return step, (state, data)

            def odd():
                return make(batch=12)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(["plan", "my_step:make", "--cluster", "8xA100-80G", "-q"], capsys)
    assert code == 0, err
    assert "batch['x']" in out
    code, _, err = run(["plan", "my_step:odd", "--cluster", "8xA100-80G"], capsys)
    assert code == 2 and "batch['x'] has batch dimension 12" in err


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD_INPUTS = {
    "unknown preset": (["plan", "gpt", "--cluster", "8xTPU-v9"], "unknown cluster preset"),
    "malformed spec": (["plan", "gpt", "--cluster", "{spec:not json}"], "is not valid JSON"),
    "spec missing keys": (["plan", "gpt", "--cluster", "{spec:missing}"], "missing keys"),
    "target not importable": (
        ["plan", "no_such_module_xyz:make", "--cluster", "8xV100-p3"],
        "cannot import target 'no_such_module_xyz:make'",
    ),
    "unknown family": (["plan", "resnet", "--cluster", "8xV100-p3"], "unknown target 'resnet'"),
    "unknown size": ([*GPT_TINY[:-1], "7B"], "unknown size '7B' for gpt"),
    "batch vs micro-batches": (
        [*GPT_TINY, "--batch", "12", "--micro-batches", "4"],
        r"--batch 12 must be divisible by micro-batches \(4\) x devices \(8\)",
    ),
    "batch vs devices": ([*GPT_TINY, "--batch", "4"], "must be divisible by"),
    "output directory": ([*GPT_TINY, "--json", "/no/such/dir/p.json"], "directory"),
    "missing --cluster": (["plan", "gpt"], "required: --cluster"),
    "bad micro-batches": ([*GPT_TINY, "--micro-batches", "0"], "must be a positive integer"),
}


@pytest.mark.parametrize("argv,message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, argv, message):
    specs = {
        "{spec:not json}": _write(tmp_path, "bad.json", "{not json"),
        "{spec:missing}": _write(tmp_path, "partial.json", json.dumps({"num_hosts": 1})),
    }
    argv = [specs.get(a, a) for a in argv]
    outputs = ["--json", str(tmp_path / "out.json"), "--png", str(tmp_path / "out.png")]
    before = set(tmp_path.iterdir())
    code, out, err = run(argv + ([] if "--json" in argv else outputs), capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert set(tmp_path.iterdir()) == before


def test_families_are_registered_with_their_sizes():
    assert set(cli.FAMILIES) >= {"gpt", "mlp"}
    for family in cli.FAMILIES.values():
        assert family.size_names()[0] == cli.TINY
        assert family.default_size in family.size_names()
    assert "1.3B" in cli.FAMILIES["gpt"].size_names()
    assert cli.FAMILIES["gpt"].make_config("1.3B").hidden == 2048
