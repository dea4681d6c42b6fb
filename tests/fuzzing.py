"""Property-based fuzzing of autopar: random small layered models and random methods / meshes /
micro-batch counts, each parallel run held against the serial `jax.jit` step.

The property: from the same initial state, `steps` steps of `autopar.parallelize(train_step,
method=...)` give the parameters (and metrics) of `steps` serial full-batch steps, to a relative
error of 1e-5, or autopar refuses with an `autopar.AutoparError` that says why. Anything else
(another exception, a numerical mismatch) is a bug.

A case is drawn from its seed alone (`draw_case(seed)`), so any failure reproduces with
`run_case(draw_case(seed))`. Used by tests/test_fuzz.py (fixed seeds) and benchmarks/fuzz.py
(many seeds). The caller must have set up the devices (8 simulated CPU devices) before jax ran.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
import traceback
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import autopar
from autopar.planner.schedules import SCHEDULES

TOLERANCE = 1e-5
NUM_DEVICES = 8
WIDTHS = (8, 16, 32)
ACTIVATIONS = ("relu", "gelu", "tanh", "silu")
NORMS = ("none", "flax", "manual")
MICRO_BATCHES = (1, 2, 4)
MESHES = (None, (2, 4), (4, 2), (8,))
VOCAB = 16  # token ids of embedding inputs
SEQ_LEN = 4  # tokens per example of embedding inputs
CLASSES = 8  # outputs of the head (cross-entropy classes or regression targets)
DROPOUT_RATE = 0.25
LEARNING_RATE = 0.1
TRACEBACK_FRAMES = 6
_REPO = pathlib.Path(__file__).resolve().parent.parent
_AUTOPAR_ROOTS = tuple(_REPO / name for name in ("autopar", "planner", "runtime"))
# Biases start non-zero: a leaf that starts at zero holds only the summed updates, whose
# float32 noise (eager and jit differ by ~1e-5 there) would read as a relative mismatch.
BIAS_INIT = nn.initializers.normal(0.5)


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """One drawn case: the model, the method and the data, all decided by `seed`.

    Method fields that a method does not take are None (e.g. `layer_option` outside
    PipeshardParallel; `num_micro_batches` None means the method's default of one).
    """

    seed: int
    # model
    widths: tuple[int, ...]  # one hidden width per layer (depth = len(widths))
    residual: bool
    norm: str  # "none", "flax" (nn.LayerNorm) or "manual" (hand-written layer norm)
    activation: str
    embed: bool  # nn.Embed over int tokens (B, SEQ_LEN) instead of float inputs (B, in_dim)
    in_dim: int  # width of float inputs, or of the embedding
    dropout: bool
    loss: str  # "ce" (mean cross-entropy) or "mse"
    has_aux: bool
    # method
    method: str  # "shard", "dp", "zero2", "zero3" or "pipeshard"
    num_micro_batches: int | None
    mesh: tuple[int, ...] | None  # None: all devices; else the shape of a jax.make_mesh mesh
    layer_option: str | None = None  # "manual" or "auto"
    layer_num: int | None = None  # AutoLayerOption(layer_num)
    stage_option: str | None = None  # "auto" or "uniform"
    num_stages: int | None = None  # UniformStageOption(num_stages)
    schedule: str | None = None  # one of SCHEDULES
    # data
    batch_size: int = NUM_DEVICES

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def micro_batches(self) -> int:
        """Micro-batches the step actually runs (None means one)."""
        return self.num_micro_batches or 1

    def describe(self) -> str:
        """A short id without spaces (pytest ids, table rows): seed, model, method, mesh, batch."""
        model = [
            "w" + ".".join(map(str, self.widths)),
            self.activation,
            *(["res"] if self.residual else []),
            *([f"ln-{self.norm}"] if self.norm != "none" else []),
            "emb" if self.embed else f"in{self.in_dim}",
            *(["drop"] if self.dropout else []),
            self.loss + ("+aux" if self.has_aux else ""),
        ]
        method = self.method + (f"-k{self.num_micro_batches}" if self.num_micro_batches else "")
        if self.method == "pipeshard":
            layers = "manual" if self.layer_option == "manual" else f"auto{self.layer_num}"
            stages = "autostage" if self.stage_option == "auto" else f"uni{self.num_stages}"
            method += f"-{layers}-{stages}-{self.schedule}"
        mesh = "all" if self.mesh is None else "x".join(map(str, self.mesh))
        return f"s{self.seed}-{'-'.join(model)}-{method}-m{mesh}-b{self.batch_size}"

    def make_method(self) -> Any:
        """The autopar method object (builds the mesh, so the devices must exist)."""
        devices = None
        if self.mesh is not None:
            names = ("a", "b")[: len(self.mesh)]
            devices = jax.make_mesh(self.mesh, names)
        k = self.num_micro_batches
        if self.method == "shard":
            return autopar.ShardParallel(devices=devices, num_micro_batches=k)
        if self.method in ("dp", "zero2", "zero3"):
            kind = {
                "dp": autopar.DataParallel,
                "zero2": autopar.Zero2Parallel,
                "zero3": autopar.Zero3Parallel,
            }[self.method]
            return kind(devices=devices, num_micro_batches=k)
        layer_option = (
            autopar.ManualLayerOption()
            if self.layer_option == "manual"
            else autopar.AutoLayerOption(layer_num=self.layer_num)
        )
        stage_option = (
            autopar.AutoStageOption()
            if self.stage_option == "auto"
            else autopar.UniformStageOption(num_stages=self.num_stages)
        )
        return autopar.PipeshardParallel(
            devices=devices,
            num_micro_batches=self.micro_batches,
            layer_option=layer_option,
            stage_option=stage_option,
            pipeline_schedule=self.schedule,
        )


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """What one case gave. `status`: "match", "mismatch", "refused" (an AutoparError) or "crash"
    (any other exception). `error` is the exception's first line (refusals and crashes) or the
    worst leaf (mismatches); `traceback` the last frames of a crash and `location` its deepest
    frame in autopar/, planner/ or runtime/ (file:line), which tells bugs apart."""

    case: FuzzCase
    status: str
    max_relative_error: float | None = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    location: str | None = None  # the deepest frame of a crash in autopar's own code
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the property holds: a match, or a refusal whose message names something."""
        return self.status == "match" or (self.status == "refused" and bool(self.error))


def _pick(rng: np.random.Generator, options: tuple | list) -> Any:
    return options[int(rng.integers(len(options)))]


def draw_case(seed: int) -> FuzzCase:
    """The case of `seed`: a random model, method, mesh and micro-batch count.

    Dropout is drawn only for one micro-batch: each micro-batch draws its mask from the same
    key, so with several the result legitimately differs from the full-batch step.
    """
    rng = np.random.default_rng(seed)
    depth = int(rng.integers(1, 5))
    widths = tuple(int(_pick(rng, WIDTHS)) for _ in range(depth))
    residual = bool(rng.random() < 0.5)
    norm = str(_pick(rng, NORMS))
    activation = str(_pick(rng, ACTIVATIONS))
    embed = bool(rng.random() < 0.5)
    in_dim = int(_pick(rng, (8, 16)))
    loss = str(_pick(rng, ("ce", "mse")))
    has_aux = bool(rng.random() < 0.5)

    method = str(_pick(rng, ("shard", "shard", "dp", "zero2", "zero3", "pipeshard", "pipeshard")))
    mesh = _pick(rng, MESHES)
    k = int(_pick(rng, MICRO_BATCHES))
    pipeline: dict[str, Any] = {}
    if method == "shard":
        num_micro_batches = None if rng.random() < 0.4 else k  # ShardParallel() is the default
    elif method == "pipeshard":
        num_micro_batches = k
        manual = bool(rng.random() < 0.5)
        # Auto layers cluster the dense ops (one per layer and the head): at most depth + 1.
        layers = depth if manual else int(rng.integers(1, min(depth + 1, 4) + 1))
        auto_stages = bool(rng.random() < 0.3)
        stages = [s for s in (1, 2, 4, 8) if s <= layers and NUM_DEVICES % s == 0]
        pipeline = {
            "layer_option": "manual" if manual else "auto",
            "layer_num": None if manual else layers,
            "stage_option": "auto" if auto_stages else "uniform",
            "num_stages": None if auto_stages else int(_pick(rng, stages)),
            "schedule": str(_pick(rng, SCHEDULES)),
        }
    else:
        num_micro_batches = None if rng.random() < 0.2 else k
    micro_batches = num_micro_batches or 1
    dropout = micro_batches == 1 and bool(rng.random() < 0.4)
    batch_size = NUM_DEVICES * micro_batches * int(_pick(rng, (1, 2)))
    return FuzzCase(
        seed=seed,
        widths=widths,
        residual=residual,
        norm=norm,
        activation=activation,
        embed=embed,
        in_dim=in_dim,
        dropout=dropout,
        loss=loss,
        has_aux=has_aux,
        method=method,
        num_micro_batches=num_micro_batches,
        mesh=mesh,
        batch_size=batch_size,
        **pipeline,
    )


# ------------------------------------------------------------------ the model and its step


class ManualLayerNorm(nn.Module):
    """Layer norm written out, so the planner sees mean/var/rsqrt rather than flax's ops."""

    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        bias = self.param("bias", BIAS_INIT, (x.shape[-1],))
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias


class FuzzModel(nn.Module):
    """Layers of dense + activation (+ norm, dropout, residual), a pipeline boundary between
    layers, and a dense head in the last layer."""

    widths: tuple[int, ...]
    residual: bool
    norm: str
    activation: str
    embed: bool
    in_dim: int
    dropout: bool

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = True) -> jax.Array:
        act = getattr(nn, self.activation)
        if self.embed:
            x = nn.Embed(VOCAB, self.in_dim, name="embed")(x)
        for i, width in enumerate(self.widths):
            if i > 0:
                autopar.mark_pipeline_boundary()
            h = act(nn.Dense(width, bias_init=BIAS_INIT, name=f"dense_{i}")(x))
            if self.norm == "flax":
                h = nn.LayerNorm(bias_init=BIAS_INIT, name=f"norm_{i}")(h)
            elif self.norm == "manual":
                h = ManualLayerNorm(name=f"norm_{i}")(h)
            if self.dropout:
                h = nn.Dropout(DROPOUT_RATE, deterministic=not train)(h)
            if self.residual:
                skip = x if x.shape[-1] == width else nn.Dense(width, False, name=f"proj_{i}")(x)
                h = h + skip
            x = h
        return nn.Dense(CLASSES, bias_init=BIAS_INIT, name="head")(x)


class DropoutTrainState(TrainState):
    """A train state that carries the dropout key, split every step."""

    rng: jax.Array


def _model(case: FuzzCase) -> FuzzModel:
    return FuzzModel(
        widths=case.widths,
        residual=case.residual,
        norm=case.norm,
        activation=case.activation,
        embed=case.embed,
        in_dim=case.in_dim,
        dropout=case.dropout,
    )


def make_batch(case: FuzzCase) -> dict[str, np.ndarray]:
    """Inputs (int tokens or floats) and targets (int classes or floats) of `case`."""
    rng = np.random.default_rng(case.seed + 1_000_003)
    lead = (case.batch_size, SEQ_LEN) if case.embed else (case.batch_size,)
    if case.embed:
        x = rng.integers(0, VOCAB, lead, dtype=np.int32)
    else:
        x = rng.standard_normal((*lead, case.in_dim), dtype=np.float32)
    if case.loss == "ce":
        y = rng.integers(0, CLASSES, lead, dtype=np.int32)
    else:
        y = rng.standard_normal((*lead, CLASSES), dtype=np.float32)
    return {"x": x, "y": y}


def create_state(case: FuzzCase) -> TrainState:
    """The initial state of `case` (deterministic in its seed, so it can be made twice)."""
    model = _model(case)
    batch = make_batch(case)
    x = jnp.asarray(batch["x"][:1])
    params = model.init(jax.random.key(case.seed), x, train=False)["params"]
    tx = optax.sgd(LEARNING_RATE)
    if case.dropout:
        return DropoutTrainState.create(
            apply_fn=model.apply, params=params, tx=tx, rng=jax.random.key(case.seed)
        )
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def make_train_step(case: FuzzCase) -> Callable:
    """The train step of `case`: `(state, batch) -> (new_state, metrics)`, differentiating with
    `autopar.value_and_grad` (plain jax outside autopar)."""

    def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
        rngs, new_rng = {}, None
        if case.dropout:
            new_rng, dropout_key = jax.random.split(state.rng)
            rngs = {"dropout": dropout_key}

        def loss_fn(params):
            out = state.apply_fn({"params": params}, batch["x"], rngs=rngs)
            if case.loss == "ce":
                loss = optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()
                aux = {"accuracy": jnp.mean(jnp.argmax(out, -1) == batch["y"])}
            else:
                loss = jnp.mean(jnp.square(out - batch["y"]))
                aux = {"mean_abs_error": jnp.mean(jnp.abs(out - batch["y"]))}
            return (loss, aux) if case.has_aux else loss

        value, grads = autopar.value_and_grad(loss_fn, has_aux=case.has_aux)(state.params)
        loss, aux = value if case.has_aux else (value, {})
        state = state.apply_gradients(grads=grads)
        if case.dropout:
            state = state.replace(rng=new_rng)
        return state, {"loss": loss, **aux}

    return train_step


# ------------------------------------------------------------------ running a case


def relative_error(actual: Any, expected: Any) -> tuple[float, str]:
    """Largest, over leaves, of ||a - e|| / ||e|| (absolute where the expected leaf is zero),
    and the path of that leaf. Same measure as tests/conftest.py's `relative_error`."""
    worst, where = 0.0, ""
    expected_leaves = jax.tree_util.tree_leaves_with_path(expected)
    for a, (path, e) in zip(jax.tree.leaves(actual), expected_leaves, strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale, diff = np.linalg.norm(e), np.linalg.norm(a - e)
        error = diff / scale if scale > 0 else diff
        if not error <= worst:  # NaN counts as the worst
            worst, where = float(error), jax.tree_util.keystr(path)
    return worst, where


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _traceback_tail(error: BaseException, frames: int = TRACEBACK_FRAMES) -> str:
    """The last `frames` frames (file:line in function) of where `error` was raised."""
    summary = traceback.extract_tb(error.__traceback__)[-frames:]
    return "\n".join(f"{f.filename}:{f.lineno} in {f.name}" for f in summary)


def _autopar_location(error: BaseException) -> str | None:
    """file:line of the deepest frame of `error` in autopar's packages (None if none is)."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = pathlib.Path(frame.filename).resolve()
        if any(path.is_relative_to(root) for root in _AUTOPAR_ROOTS):
            return f"{path.relative_to(_REPO)}:{frame.lineno}"
    return None


def run_case(case: FuzzCase, steps: int = 2) -> CaseResult:
    """Run `case` serially (`jax.jit`) and parallelized, `steps` steps each from the same
    initial state, and compare parameters and metrics. Never raises (except KeyboardInterrupt)."""
    start = time.perf_counter()
    try:
        batch = make_batch(case)
        train_step = make_train_step(case)
        serial, serial_step = create_state(case), jax.jit(train_step)
        for _ in range(steps):
            serial, serial_metrics = serial_step(serial, batch)
        jax.block_until_ready(serial)
        method = case.make_method()
        step = autopar.parallelize(train_step, method=method)
        state = create_state(case)
        for _ in range(steps):
            state, metrics = step(state, batch)
        params_error, where = relative_error(state.params, serial.params)
        metrics_error, metric = relative_error(metrics, serial_metrics)
        if metrics_error > params_error:
            worst, where = metrics_error, f"metrics{metric}"
        else:
            worst, where = params_error, f"params{where}"
    except autopar.AutoparError as error:
        return CaseResult(
            case,
            "refused",
            error_type=type(error).__name__,
            error=_first_line(error),
            seconds=time.perf_counter() - start,
        )
    except Exception as error:  # noqa: BLE001 - any other exception is what we are looking for
        return CaseResult(
            case,
            "crash",
            error_type=type(error).__name__,
            error=_first_line(error),
            traceback=_traceback_tail(error),
            location=_autopar_location(error),
            seconds=time.perf_counter() - start,
        )
    status = "match" if worst <= TOLERANCE else "mismatch"
    return CaseResult(
        case,
        status,
        max_relative_error=worst,
        error=None if status == "match" else f"{where}: relative error {worst:.3g}",
        seconds=time.perf_counter() - start,
    )
