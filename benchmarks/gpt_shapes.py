"""What the planner benchmarks share: Alpa's GPT shapes, abstract inputs and the traced step."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import jax

import autopar
from autopar.api import trace_for_method
from autopar.models import GPTConfig, abstract_train_inputs, gpt
from autopar.planner.ilp import DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S, SOLVERS
from autopar.tracing import TracedStep, resolve_argnums

RESULTS = pathlib.Path(__file__).parent / "results"
MODELS = ("125M", "350M", "1.3B")


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--models, --global-batch, --micro-batches, --dtype and --log-level."""
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--micro-batches", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--log-level", default="WARNING")


def add_solver_arguments(parser: argparse.ArgumentParser) -> None:
    """--solver and --time-limit, defaulting to the library's (what a user gets)."""
    parser.add_argument("--solver", default=DEFAULT_SOLVER, choices=SOLVERS)
    parser.add_argument(
        "--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="per ILP solve, seconds"
    )


def gpt_inputs(config: GPTConfig, global_batch: int) -> tuple[Any, dict[str, jax.ShapeDtypeStruct]]:
    """Abstract train state (no parameters allocated) and an abstract global batch."""
    _, state, batch = abstract_train_inputs(gpt, config, global_batch)
    return state, batch


def trace_gpt_step(method: autopar.ShardParallel, state: Any, batch: dict[str, Any]) -> TracedStep:
    """What `autopar.plan` traces for `method`: the GPT step on micro-batch shapes."""
    args = (state, batch)
    step = gpt.make_train_step(autopar.value_and_grad)
    return trace_for_method(step, args, method, resolve_argnums(args, (), (1,), "auto"))
