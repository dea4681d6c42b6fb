"""The ``autopar`` command: plan a train step for a cluster you may not have, and look at it.

    autopar plan gpt --cluster 2x8xA100-80G --size 1.3B --batch 1024 --micro-batches 128
    autopar plan mymodels.train:make_step --cluster cluster.json --method pipeshard --png p.png

TARGET is a bundled model family (`FAMILIES`: ``gpt``, ``mlp``, ``moe``, ``wresnet``) at a size
from its size table (``--size``; ``tiny`` is the config class's defaults), or
``module:function``, a function returning ``(train_step, args)`` with args as
`jax.ShapeDtypeStruct`s (the batch is argument 1). SPEC is a `ClusterSpec` preset name,
optionally prefixed by a host count (``8xV100-p3``, ``2x8xA100-80G``, ``8x8xH100-80G``), or a
JSON file written from `ClusterSpec.to_dict()`. Planning is abstract (shapes only: nothing is
allocated, no device of that cluster is needed). The plan summary goes to stdout, progress to
stderr; ``--explain`` adds the comparison with baselines, ``--json`` writes ``plan.to_json()``
and ``--png`` the picture of `Plan.draw`.

    autopar profile-cluster --out cluster.json [--devices N]

``profile-cluster`` measures this machine's devices (`autopar.profile_cluster`: matmul rates,
memory bandwidth, kernel floor, collective latency and bandwidth; a few seconds) and writes the
`ClusterSpec` as JSON for ``plan --cluster``; its figures go to stdout.

Bad input (an unknown preset, a malformed ClusterSpec file, a TARGET that does not import, a
batch that does not divide into micro-batches x devices, a missing output directory) prints one
line ``autopar: error: ...`` on stderr, exits with code 2 and writes nothing; a step with no plan
that fits exits with code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

from autopar.planner.ilp import DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S, SOLVERS
from autopar.planner.schedules import AUTO_SCHEDULE, SCHEDULES

EXIT_USAGE = 2
EXIT_NO_PLAN = 1
TINY = "tiny"
logger = logging.getLogger("autopar.cli")


@dataclasses.dataclass(frozen=True)
class Family:
    """A bundled model family for the CLI: its module (with ``make_batch``,
    ``create_train_state`` and ``make_train_step``), its config class and, optionally, a
    module-level size table whose names the config class builds with ``<Config>.alpa(name)``.

    Size ``tiny`` is always there: the config class with its defaults (a few-layer model)."""

    module: str
    config: str
    sizes: str | None = None
    default_size: str = TINY

    def size_names(self) -> list[str]:
        table = getattr(importlib.import_module(self.module), self.sizes) if self.sizes else {}
        return [TINY, *table]

    def make_config(self, size: str, **overrides: Any) -> Any:
        """The config of `size` (`overrides` replace fields, e.g. dtype)."""
        module = importlib.import_module(self.module)
        cls = getattr(module, self.config)
        if size == TINY:
            return cls(**overrides)
        if size not in self.size_names():
            raise CliError(
                f"unknown size {size!r} for {self.module.rsplit('.', 1)[-1]}; known sizes: "
                f"{', '.join(self.size_names())}"
            )
        return cls.alpa(size, **overrides)


# One line per family; a new family with a size table and `<Config>.alpa` is one more line.
FAMILIES: dict[str, Family] = {
    "gpt": Family("autopar.models.gpt", "GPTConfig", "ALPA_GPT_SIZES", "1.3B"),
    "mlp": Family("autopar.models.mlp", "MLPConfig"),
    "moe": Family("autopar.models.moe", "MoEConfig", "ALPA_MOE_SIZES", "380M"),
    "wresnet": Family("autopar.models.wresnet", "WResNetConfig", "ALPA_WRESNET_SIZES", "250M"),
}


class CliError(Exception):
    """Bad command-line input: reported as one line, exit code 2, nothing written."""


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors raise `CliError` (one line) instead of printing usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = commands.add_parser(
        "plan",
        help="plan a train step for a cluster and print the plan",
        description="Plan TARGET for the cluster SPEC without its devices; print the summary.",
    )
    plan.add_argument("target", metavar="TARGET", help=f"{' | '.join(FAMILIES)} | module:function")
    plan.add_argument(
        "--cluster",
        metavar="SPEC",
        required=True,
        help="preset name with optional host count (8xV100-p3, 2x8xA100-80G, 8x8xH100-80G) "
        "or a ClusterSpec JSON file",
    )
    plan.add_argument("--method", choices=("shard", "pipeshard"), default="shard")
    plan.add_argument(
        "--size", help="model size from the family's size table, or 'tiny' (family default)"
    )
    plan.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="compute dtype of the model"
    )
    plan.add_argument(
        "--batch",
        type=_positive_int,
        help="global batch (default: devices x micro-batches); must be divisible by that",
    )
    plan.add_argument(
        "--micro-batches",
        type=_positive_int,
        default=None,
        help="gradient-accumulation / pipeline micro-batches (default: 1 for shard, "
        "2 x hosts (at least 4) for pipeshard)",
    )
    plan.add_argument(
        "--layers",
        type=_positive_int,
        help="pipeshard: layers to cut the model into (default: 2 x hosts, at least 2)",
    )
    plan.add_argument(
        "--stages",
        type=_positive_int,
        help="pipeshard: uniform stages of equal layers (default: Alpa's stage DP)",
    )
    plan.add_argument(
        "--schedule",
        choices=(*SCHEDULES, AUTO_SCHEDULE),
        default="1f1b",
        help="pipeshard: pipeline schedule (auto: the fastest predicted)",
    )
    plan.add_argument("--solver", choices=SOLVERS, default=DEFAULT_SOLVER)
    plan.add_argument(
        "--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="per ILP solve, seconds"
    )
    plan.add_argument("--explain", action="store_true", help="compare with baselines")
    plan.add_argument("--json", metavar="OUT", help="write the plan as JSON")
    plan.add_argument("--png", metavar="OUT", help="draw the plan (device grid, timeline)")
    plan.add_argument("-q", "--quiet", action="store_true", help="no progress log on stderr")
    profile = commands.add_parser(
        "profile-cluster",
        help="measure this machine's devices and write their ClusterSpec as JSON",
        description="Measure the local devices (matmuls, memory, collectives) and write the "
        "ClusterSpec JSON that plan --cluster reads.",
    )
    profile.add_argument("--out", metavar="PATH", required=True, help="the JSON file to write")
    profile.add_argument(
        "--devices", type=_positive_int, help="profile the first N local devices (default: all)"
    )
    profile.add_argument("-q", "--quiet", action="store_true", help="no progress log on stderr")
    return parser


# ----------------------------------------------------------------------------- inputs


def resolve_cluster(spec: str) -> Any:
    """A `ClusterSpec` from a preset name (optionally "Nx"-prefixed) or a JSON file."""
    from autopar.planner.cluster import ClusterSpec

    if spec.endswith(".json") or os.path.exists(spec):
        try:
            return ClusterSpec.from_json_file(spec)
        except ValueError as e:
            raise CliError(str(e)) from None
    try:
        return ClusterSpec.preset(spec)
    except ValueError as e:
        raise CliError(str(e)) from None


def _family_inputs(args: argparse.Namespace, family: Family, batch: int) -> tuple[Any, tuple]:
    import jax.numpy as jnp

    from autopar.models import abstract_train_inputs

    overrides = {"dtype": jnp.dtype(args.dtype)} if args.dtype else {}
    size = args.size or family.default_size
    try:
        config = family.make_config(size, **overrides)
    except TypeError as e:
        raise CliError(f"{args.target}: {e}") from None
    module = importlib.import_module(family.module)
    step, state, batch_shapes = abstract_train_inputs(module, config, batch)
    return step, (state, batch_shapes)


def _function_inputs(target: str) -> tuple[Any, tuple]:
    name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure is bad input here
        raise CliError(f"cannot import target {target!r}: {type(e).__name__}: {e}") from None
    fun = getattr(module, attr, None)
    if not callable(fun):
        raise CliError(f"target {target!r}: module {name!r} has no function {attr!r}")
    made = fun()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise CliError(
            f"target {target!r} must return (train_step, args), got {type(made).__name__}"
        )
    step, step_args = made
    if not isinstance(step_args, (tuple, list)) or len(step_args) < 2:
        raise CliError(
            f"target {target!r}: args must be a tuple (state, batch, ...) of "
            "jax.ShapeDtypeStruct trees, the batch second"
        )
    return step, tuple(step_args)


def resolve_target(args: argparse.Namespace, batch: int) -> tuple[Any, tuple]:
    """(train_step, abstract args) of TARGET."""
    if args.target in FAMILIES:
        return _family_inputs(args, FAMILIES[args.target], batch)
    if ":" not in args.target:
        raise CliError(
            f"unknown target {args.target!r}: use a model family ({', '.join(FAMILIES)}) or "
            "module:function"
        )
    given = [f"--{n}" for n in ("size", "dtype", "batch") if getattr(args, n) is not None]
    if given:
        raise CliError(
            f"{', '.join(given)} apply to bundled model families; {args.target} gives its own "
            "arguments"
        )
    return _function_inputs(args.target)


def check_batch(step_args: tuple, micro_batches: int, num_devices: int) -> None:
    """Every batch leaf (argument 1) must split into micro-batches x devices."""
    import jax

    need = micro_batches * num_devices
    leaves = jax.tree_util.tree_leaves_with_path(step_args[1])
    for path, leaf in leaves:
        shape = getattr(leaf, "shape", ())
        if not shape or shape[0] % need:
            name = "batch" + jax.tree_util.keystr(path)
            size = shape[0] if shape else "none (a scalar)"
            raise CliError(
                f"{name} has batch dimension {size}, which must be divisible by "
                f"micro-batches ({micro_batches}) x devices ({num_devices}) = {need}"
            )


def _check_output(path: str | None, option: str) -> None:
    if path is not None and not pathlib.Path(path).resolve().parent.is_dir():
        raise CliError(f"{option} {path!r}: directory {str(pathlib.Path(path).parent)!r} not found")


def _method(args: argparse.Namespace, cluster: Any, micro_batches: int) -> Any:
    import autopar

    option = autopar.AutoShardingOption(solver=args.solver, time_limit_s=args.time_limit)
    if args.method == "shard":
        return autopar.ShardParallel(num_micro_batches=micro_batches, auto_sharding_option=option)
    layers = args.layers or max(2, 2 * cluster.num_hosts)
    stages = (
        autopar.UniformStageOption(num_stages=args.stages)
        if args.stages
        else autopar.AutoStageOption()
    )
    return autopar.PipeshardParallel(
        num_micro_batches=micro_batches,
        layer_option=autopar.AutoLayerOption(layer_num=layers),
        stage_option=stages,
        pipeline_schedule=args.schedule,
        auto_sharding_option=option,
    )


# ----------------------------------------------------------------------------- command


def _progress_handler(quiet: bool) -> logging.Handler | None:
    if quiet:
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("autopar: %(message)s"))
    handler.setLevel(logging.INFO)
    return handler


def plan_command(args: argparse.Namespace) -> int:
    """`autopar plan`: see the module docstring."""
    cluster = resolve_cluster(args.cluster)
    if args.micro_batches is None:
        args.micro_batches = 1 if args.method == "shard" else max(4, 2 * cluster.num_hosts)
    k, n = args.micro_batches, cluster.num_devices
    batch = args.batch if args.batch is not None else k * n
    if args.target in FAMILIES and batch % (k * n):
        raise CliError(
            f"--batch {batch} must be divisible by micro-batches ({k}) x devices ({n}) of "
            f"{cluster.name} = {k * n}"
        )
    for path, option in ((args.json, "--json"), (args.png, "--png")):
        _check_output(path, option)
    step, step_args = resolve_target(args, batch)
    check_batch(step_args, k, n)
    method = _method(args, cluster, k)

    from autopar.api import plan_in_context
    from autopar.planner.explain import explain_plan

    what = args.target + (
        f" ({args.size or FAMILIES[args.target].default_size})" if args.target in FAMILIES else ""
    )
    logger.info(
        "planning %s for %s (%d devices): method %s, batch %d in %d micro-batch(es)",
        what,
        cluster.name,
        n,
        args.method,
        batch,
        k,
    )
    start = time.perf_counter()
    plan, context = plan_in_context(step, step_args, method, cluster, (1,), ())
    logger.info("planned in %.1f s", time.perf_counter() - start)
    print(plan.summary())
    if args.explain:
        start = time.perf_counter()
        logger.info("pricing the baselines")
        explanation = explain_plan(plan, context)
        logger.info("baselines priced in %.1f s", time.perf_counter() - start)
        print()
        print(explanation)
    if args.json:
        pathlib.Path(args.json).write_text(plan.to_json())
        logger.info("wrote %s", args.json)
    if args.png:
        plan.draw(args.png)
        logger.info("wrote %s", args.png)
    return 0


def profile_command(args: argparse.Namespace) -> int:
    """`autopar profile-cluster`: see the module docstring."""
    _check_output(args.out, "--out")
    import jax

    from autopar.runtime.cluster_profile import measure_cluster

    local = jax.local_devices()
    n = len(local) if args.devices is None else args.devices
    if n > len(local):
        raise CliError(
            f"--devices {n}: this machine has {len(local)} {local[0].platform} device(s) "
            "(simulate more CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    logger.info("profiling %d %s device(s)", n, local[0].platform)
    profile = measure_cluster(local[:n])
    print(profile.summary())
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(profile.spec.to_dict(), f, indent=2)
        f.write("\n")
    logger.info("wrote %s", args.out)
    return 0


COMMANDS = {"plan": plan_command, "profile-cluster": profile_command}


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autopar`` command with `argv` (default: sys.argv[1:]); returns the exit code."""
    parser = build_parser()
    root = logging.getLogger("autopar")
    handler, previous = None, (root.level, root.propagate)
    try:
        args = parser.parse_args(argv)
        handler = _progress_handler(args.quiet)
        if handler is not None:
            root.addHandler(handler)
            root.propagate = False  # absl (via orbax) may have configured the root logger
            if root.getEffectiveLevel() > logging.INFO:
                root.setLevel(logging.INFO)
        return COMMANDS[args.command](args)
    except CliError as e:
        print(f"autopar: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except Exception as e:
        from autopar.planner.errors import InvalidArgumentError, PlanningError, TracingError

        if isinstance(e, (InvalidArgumentError, TracingError)):
            print(f"autopar: error: {_one_line(e)}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(e, PlanningError):
            print(f"autopar: no plan: {_one_line(e)}", file=sys.stderr)
            return EXIT_NO_PLAN
        raise
    finally:
        if handler is not None:
            root.removeHandler(handler)
            root.level, root.propagate = previous


if __name__ == "__main__":
    sys.exit(main())
