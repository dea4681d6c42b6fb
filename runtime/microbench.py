"""Micro-benchmarks behind `autopar.profile_cluster`: matmuls, a streaming kernel, the kernel
floor, the op classes with rates of their own (transcendentals, convolutions, minor-dimension
transposes, weight gradients, a GPU's column reductions, max pools and their gradients, a CPU's
element-wise loops fused into transposing copies at an aliasing stride), the
host's cost to launch a program, and collectives, timed on the devices themselves.

Compute runs on every local device at once (`shard_map` over them, no communication), so a
figure is what one device gets while its neighbours work too: the same on GPUs, and the honest
share of the cores for simulated CPU devices. Each op is a step x -> new x of the same shape and
placement (x is donated, so no buffer is copied or allocated between runs). A program of `chain`
steps, each reading the one before (an `optimization_barrier` between them stops XLA fusing
them), is timed. On a CPU one op's time is t_chain / chain: an upper bound by what the program
pays once (Python's dispatch, a few µs) over `chain`, so that a rate is never overstated. (The
difference with a program of one step, (t_chain − t_1) / (chain − 1), cancels that cost but
swung by half with the one-step program's noise there: a 1024³ matmul read 540 to 810 GFLOP/s on
two cores that reach about 520.) On an accelerator a program's launch and wait cost 50–150 µs,
more than a mid-sized op takes (an H200 runs a 1.2 GFLOP convolution in 11.5 µs; a chain of 4
read 47 µs per convolution), so there the difference is taken. Each program is compiled, run
once to warm up, then timed `repeats` times: the least of those times counts, since noise (other
processes, a core's clock changing, a thread pool waking) only ever adds time.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.planner.cluster import (
    ALIASED_LOOP_LINES,
    SELECT_AND_SCATTER_BYTES,
    TRANSPOSED_MATMUL_COLUMNS,
)
from autopar.planner.cost import Collective
from autopar.planner.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

KIB, MIB = 1 << 10, 1 << 20
_TINY = 8  # side of the matmuls that measure the kernel floor
# The rate benchmarks' shapes: a 3x3 convolution of 64 to 64 channels over 32x32 images (a
# ResNet stage's, enough channels to fill the matmul micro-kernels), and transposes of 512x512
# float32 planes (1 MiB: beyond one core's L2 cache, as a transposed activation is).
_CONV_SIDE, _CONV_CHANNELS = 32, 64
_TRANSPOSE_SIDE = 512
# A weight gradient's matmul: (4096, 256)^T · (4096, 256), as a layer's input and output
# gradient over a batch of tokens give it; a narrow one has a y of 64 columns.
_GRAD_ROWS, _GRAD_SIDE = 4096, TRANSPOSED_MATMUL_COLUMNS[1]
# A bias gradient's column reduction: the most rows XLA:GPU reduces in one kernel
# (`planner.roofline.COLUMN_REDUCTION_SPLIT`), 64 columns (256 B a row: its bytes are nothing).
_COLUMN_ROWS, _COLUMN_WIDTH = 4096, 64
# Shapes for a column reduction with an output of its operand's shape, tried in this order
# until XLA:GPU fuses the two into one kernel: it does so for a GPT-2's layer norm gradients
# over 1024x128, but an H200 left `_column_with_output` in two kernels there and fused it at
# 512x32.
_COLUMN_ARRAY_SHAPES = ((1024, 128), (512, 32))


class MatmulKind(enum.Enum):
    """A matmul precision, and the `ClusterSpec` field its best rate sets."""

    BF16 = "bfloat16"
    FP32 = "float32"  # JAX's default precision: TF32 tensor cores on GPUs that have them
    FP32_HIGHEST = "float32-highest"  # jax.lax.Precision.HIGHEST: true fp32

    @property
    def dtype(self) -> Any:
        return jnp.bfloat16 if self is MatmulKind.BF16 else jnp.float32

    @property
    def precision(self) -> Any:
        return jax.lax.Precision.HIGHEST if self is MatmulKind.FP32_HIGHEST else None

    @property
    def spec_field(self) -> str:
        return {"bfloat16": "device_flops", "float32": "tf32_flops"}.get(self.value, "fp32_flops")


@dataclasses.dataclass(frozen=True, slots=True)
class ProfileSizes:
    """How much `measure_cluster` measures. The defaults are what `profile_cluster` uses. Sizes
    grow until one timed run of the next one (`chain` ops, and one to spare) would take longer than
    `max_run_s` (time grows as size³ for matmuls, as size for collectives; at least one matmul
    and two collective sizes are measured), so slow devices stay quick to profile and fast
    ones reach sizes that show their peak."""

    matmul_sizes: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)  # square m = k = n
    ramp_sides: tuple[int, ...] = tuple(32 * 2**i for i in range(8))  # (2s, s) @ (s, s), to 4096
    ramp_ops: int = 32  # matmuls in each ramp program (against 1)
    stream_bytes: int = 64 * MIB  # per device buffer of the streaming kernel
    kernel_ops: int = 256  # tiny ops in the kernel-floor program (against 1)
    launch_buffers: int = 64  # inputs (and as many outputs) of the launch program (against 1)
    collective_bytes: tuple[int, ...] = tuple(256 * KIB * 4**i for i in range(6))  # to 256 MiB
    chain: int = 4  # ops per timed program
    repeats: int = 5  # timed runs per program (the least counts)
    max_run_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("matmul_sizes", "ramp_sides", "collective_bytes"):
            value = getattr(self, name)
            ok = isinstance(value, tuple) and value and all(_positive_int(v) for v in value)
            if not ok or list(value) != sorted(set(value)):
                raise InvalidArgumentError(
                    f"ProfileSizes.{name}={value!r} must be a non-empty tuple of increasing "
                    "positive ints"
                )
        counts = ("stream_bytes", "kernel_ops", "ramp_ops", "launch_buffers", "chain", "repeats")
        for name in counts:
            value = getattr(self, name)
            least = 2 if name in ("kernel_ops", "ramp_ops", "launch_buffers", "chain") else 1
            if not _positive_int(value) or value < least:
                raise InvalidArgumentError(
                    f"ProfileSizes.{name}={value!r} must be an int of at least {least}"
                )
        if not (isinstance(self.max_run_s, int | float) and self.max_run_s > 0):
            raise InvalidArgumentError(
                f"ProfileSizes.max_run_s={self.max_run_s!r} must be a positive number of seconds"
            )

    def too_slow(self, seconds: float, growth: float) -> bool:
        """Whether a run of an op that took `seconds` grown `growth` times exceeds the limit
        (process 0 decides for all processes, which must run the same programs)."""
        return _agreed((1 + self.chain) * seconds * growth) > self.max_run_s


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclasses.dataclass(frozen=True, slots=True)
class MatmulTiming:
    """One (m, k) @ (k, n) matmul of `kind` on one device (all local devices running one)."""

    kind: MatmulKind
    m: int
    k: int
    n: int
    seconds: float

    @property
    def flops_per_s(self) -> float:
        return 2 * self.m * self.k * self.n / self.seconds


@dataclasses.dataclass(frozen=True, slots=True)
class StreamTiming:
    """`x * a + b` over a float32 buffer on one device; `num_bytes` = read + written."""

    num_bytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.seconds


@dataclasses.dataclass(frozen=True, slots=True)
class KernelTiming:
    """A program of `num_kernels` tiny dependent matmuls against one of a single one, each
    timed with its buffer donated (it stays in place from launch to launch) and not donated (the
    output is a fresh buffer that the next launch reads: the buffers move, as a train step's
    outputs do)."""

    num_kernels: int
    seconds_one: float
    seconds_many: float
    seconds_one_moved: float
    seconds_many_moved: float

    @property
    def per_kernel_s(self) -> float:
        """(t_N − t_1) / (N − 1), at least 0: one kernel's floor without the dispatch."""
        return max(0.0, (self.seconds_many - self.seconds_one) / (self.num_kernels - 1))

    @property
    def update_per_kernel_s(self) -> float:
        """What each kernel adds to a launch whose buffers moved since the last one, beyond
        what the moved buffers cost themselves, at least 0. XLA:GPU runs a program as one CUDA
        graph and updates its kernels' arguments before launching it again; a CPU has no graph."""
        moved = self.seconds_many_moved - self.seconds_one_moved
        return max(0.0, (moved - (self.seconds_many - self.seconds_one)) / (self.num_kernels - 1))


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchTiming:
    """One call (launch and wait for the results) of a program that does no work, with one
    input and one output buffer against `num_buffers` of each: the host's share of a step."""

    num_buffers: int
    seconds_one: float
    seconds_many: float

    @property
    def per_buffer_s(self) -> float:
        """What one more input or output buffer adds to a launch, at least 0."""
        return max(0.0, (self.seconds_many - self.seconds_one) / (2 * (self.num_buffers - 1)))

    @property
    def launch_s(self) -> float:
        """A launch without its buffers, at least 0."""
        return max(0.0, self.seconds_one - 2 * self.per_buffer_s)


class RateKind(enum.Enum):
    """An op class the roofline prices at its own rate, and the `ClusterSpec` field it sets."""

    TRANSCENDENTAL = "transcendental"  # exp over a float32 buffer: elements per second
    CONVOLUTION = "convolution"  # a float32 3x3 convolution: FLOP/s
    TRANSPOSE = "transpose"  # float32 planes transposed: bytes read + written per second
    TRANSPOSED_MATMUL = "transposed matmul"  # a float32 weight gradient x^T·y: FLOP/s
    # the same with a result 64 columns wide: FLOP/s
    NARROW_TRANSPOSED_MATMUL = "narrow transposed matmul"
    FRESH_MEMORY = "fresh memory"  # bytes/s of first writes to freshly mapped pages
    COLUMN_REDUCTION = "column reduction"  # rows/s a GPU's column reduction walks
    # rows/s per full-shape array a GPU's column reduction walks where XLA fuses element-wise
    # work of the reduced array's shape into it (its reads and side outputs)
    COLUMN_REDUCTION_ARRAY = "column reduction array"
    WINDOW_REDUCTION = "window reduction"  # a float32 3x3 max pool: window elements per second
    SELECT_AND_SCATTER = "select and scatter"  # a 3x3 max pool's gradient: windows per second
    # the same over an operand the caches hold: windows per second
    CACHED_SELECT_AND_SCATTER = "cached select and scatter"
    # elements x arrays read per second of an element-wise loop that XLA:CPU fuses into a
    # transposing copy at an aliasing row stride, at `ALIASED_LOOP_LINES[0]` lines in flight
    ALIASED_LOOP = "aliased loop"
    MANY_LINES_ALIASED_LOOP = "many lines aliased loop"  # the same at `ALIASED_LOOP_LINES[1]`

    @property
    def spec_field(self) -> str:
        return {
            "transcendental": "transcendental_rate",
            "convolution": "conv_flops",
            "transpose": "transpose_bandwidth",
            "transposed matmul": "transposed_matmul_flops",
            "narrow transposed matmul": "narrow_transposed_matmul_flops",
            "fresh memory": "fresh_memory_rate",
            "column reduction": "column_reduction_rate",
            "column reduction array": "column_reduction_array_rate",
            "window reduction": "window_reduction_rate",
            "select and scatter": "select_and_scatter_rate",
            "cached select and scatter": "cached_select_and_scatter_rate",
            "aliased loop": "aliased_loop_rate",
            "many lines aliased loop": "many_lines_aliased_loop_rate",
        }[self.value]


@dataclasses.dataclass(frozen=True, slots=True)
class RateTiming:
    """One op of `kind` doing `work` (its unit: see `RateKind`) in `seconds` on one device."""

    kind: RateKind
    work: float
    seconds: float

    @property
    def rate(self) -> float | None:
        """work / seconds; None where the op cost nothing measurable (fresh memory on a runtime
        that pools it) or was not measured (a CPU's column reductions)."""
        return self.work / self.seconds if self.seconds > 0 else None


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveTiming:
    """One collective along physical mesh `axis` (0 across hosts, 1 within a host) over
    `num_devices` devices; `num_bytes` is the B of its formula in `autopar.planner.cost`."""

    axis: int
    kind: Collective
    num_bytes: int
    num_devices: int
    seconds: float


# ----------------------------------------------------------------------------- timing


def _compiled(
    fun: Callable, x: jax.Array, consts: Sequence[jax.Array], donated: bool = True
) -> Any:
    return jax.jit(fun, donate_argnums=0 if donated else ()).lower(x, *consts).compile()


def _timed_calls(
    compiled: Any, x: jax.Array, consts: Sequence[jax.Array], calls: int, repeats: int
) -> tuple[float, jax.Array]:
    """Least wall time of `calls` back-to-back calls `x = compiled(x, *consts)` after one
    warm-up call, and the last x (`x` is donated: its buffer is reused, never copied)."""
    x = jax.block_until_ready(compiled(x, *consts))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            x = compiled(x, *consts)
        jax.block_until_ready(x)
        times.append(time.perf_counter() - start)
    return min(times), x


def _chained(step: Callable, times: int) -> Callable:
    """`step` applied `times` times, each to the previous one's output, not fused together."""

    def run(x, *consts):
        for _ in range(times):
            x = jax.lax.optimization_barrier(step(x, *consts))
        return x

    return run


def _op_s(
    wrap: Callable[[Callable], Callable],
    step: Callable,
    x: jax.Array,
    consts: Sequence[jax.Array],
    sizes: ProfileSizes,
    fusible: bool = False,
) -> float:
    """Seconds of one `step(x, *consts) -> new x` (see the module docstring); `wrap` puts a
    per-device body on the mesh. On a CPU a `fusible` step is chained by back-to-back calls
    instead: XLA's CPU backend drops optimization barriers before fusing."""
    if next(iter(x.devices())).platform != "cpu":
        one = _compiled(wrap(_chained(step, 1)), x, consts)
        seconds_one, x = _timed_calls(one, x, consts, 1, sizes.repeats)
        chained = _compiled(wrap(_chained(step, sizes.chain)), x, consts)
        many, _ = _timed_calls(chained, x, consts, 1, sizes.repeats)
        if many > seconds_one:
            return (many - seconds_one) / (sizes.chain - 1)
        return many / sizes.chain  # noise swallowed the ops: the upper bound
    if fusible:
        single = _compiled(wrap(step), x, consts)
        many, _ = _timed_calls(single, x, consts, sizes.chain, sizes.repeats)
    else:
        chained = _compiled(wrap(_chained(step, sizes.chain)), x, consts)
        many, _ = _timed_calls(chained, x, consts, 1, sizes.repeats)
    return many / sizes.chain


def _least_chain_s(
    mesh: Mesh,
    step: Callable,
    x: jax.Array,
    consts: Sequence[jax.Array],
    ops: int,
    sizes: ProfileSizes,
    donated: bool = True,
) -> tuple[float, jax.Array]:
    """Least time of `4 * sizes.repeats` waited calls of a program of `ops` dependent steps
    x -> step(x, *consts) on each device of `mesh`, and the last x: the timing behind the kernel
    floor, the matmul ramp and column reductions, which difference chains of different lengths
    (long ones: a step of a few µs is lost in a launch's noise over a chain of `sizes.chain`)."""
    program = _per_device(mesh, 1 + len(consts))(_chained(step, ops))
    return _timed_calls(_compiled(program, x, consts, donated), x, consts, 1, 4 * sizes.repeats)


def _local_mesh(devices: Sequence[jax.Device]) -> Mesh:
    return Mesh(np.array(devices, dtype=object), ("d",))


def _per_device(mesh: Mesh, num_args: int) -> Callable[[Callable], Callable]:
    """Wrap a body so it runs on each device of `mesh` on its own block (dim 0 split)."""
    spec = PartitionSpec(mesh.axis_names)

    def wrap(body: Callable) -> Callable:
        return jax.shard_map(
            body, mesh=mesh, in_specs=(spec,) * num_args, out_specs=spec, check_vma=False
        )

    return wrap


def _filled(mesh: Mesh, shape: tuple[int, ...], dtype: Any, value: float) -> jax.Array:
    """A global array of `shape` (dim 0 split over all of `mesh`), made on the devices."""
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    return jax.jit(lambda: jnp.full(shape, value, dtype), out_shardings=sharding)()


def _uniform(mesh: Mesh, shape: tuple[int, ...]) -> jax.Array:
    """Float32 values uniform in [0, 1) laid out as `_filled`'s: for ops whose time depends on
    which element wins a comparison (a max pool's gradient ran 20% faster over zeros)."""
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    return jax.jit(lambda: jax.random.uniform(jax.random.key(0), shape), out_shardings=sharding)()


# ----------------------------------------------------------------------------- measurements


def measure_matmuls(
    devices: Sequence[jax.Device], sizes: ProfileSizes, tick: Callable[[], None]
) -> list[MatmulTiming]:
    """`MatmulTiming`s of every `MatmulKind`: growing squares, then one tall-skinny shape
    (4s, s) @ (s, s) with s half the largest square that ran."""
    mesh, d = _local_mesh(devices), len(devices)
    wrap = _per_device(mesh, 2)
    timings = []
    for kind in MatmulKind:

        def step(x, w, precision=kind.precision):
            return jnp.matmul(x, w, precision=precision)

        def run(m: int, k: int, kind=kind, step=step) -> MatmulTiming:
            x = _filled(mesh, (d * m, k), kind.dtype, 0.5)
            w = _filled(mesh, (d * k, k), kind.dtype, 1.0 / k)  # x @ w stays 0.5
            timing = MatmulTiming(kind, m, k, k, _op_s(wrap, step, x, (w,), sizes))
            tick()
            return timing

        largest = None
        for s in sizes.matmul_sizes:
            if largest is not None and sizes.too_slow(largest.seconds, (s / largest.m) ** 3):
                break
            largest = run(s, s)
            timings.append(largest)
        half = max(1, largest.m // 2)
        timings.append(run(4 * half, half))
    return timings


def measure_matmul_ramp(
    devices: Sequence[jax.Device], sizes: ProfileSizes, peak_flops: float, tick: Callable[[], None]
) -> list[MatmulTiming]:
    """Float32 matmuls (2s, s) @ (s, s) at default precision for growing s in
    `sizes.ramp_sides`, until one reaches 90% of `peak_flops` or the next would take too long:
    how a matmul's rate grows with its size. Each is (t_N − t_1) / (N − 1) of a chain of
    N = `sizes.ramp_ops` against a chain of one (small matmuls take less than the dispatch),
    each chain the least of `4 * sizes.repeats` waited calls."""
    mesh, d = _local_mesh(devices), len(devices)
    ops = sizes.ramp_ops
    timings: list[MatmulTiming] = []
    for s in sizes.ramp_sides:
        # the next size: 8x the FLOPs, in a program of `ops` matmuls (too_slow counts `chain`)
        if timings and sizes.too_slow(timings[-1].seconds, 8 * ops / sizes.chain):
            break
        x = _filled(mesh, (d * 2 * s, s), jnp.float32, 0.5)
        w = _filled(mesh, (d * s, s), jnp.float32, 1.0 / s)  # x @ w stays 0.5
        seconds = []
        for n in (1, ops):
            least, x = _least_chain_s(mesh, jnp.matmul, x, (w,), n, sizes)
            seconds.append(least)
        per_op = max(0.0, seconds[1] - seconds[0]) / (ops - 1)
        timings.append(MatmulTiming(MatmulKind.FP32, 2 * s, s, s, per_op))
        tick()
        share = timings[-1].flops_per_s / peak_flops if per_op > 0 else 0.0
        if _agreed(share) >= 0.9:  # process 0 decides for all: they run the same programs
            break
    return timings


def measure_stream(devices: Sequence[jax.Device], sizes: ProfileSizes) -> StreamTiming:
    """`x * a + b` over `sizes.stream_bytes` of float32 per device: read once, written once."""
    mesh, d = _local_mesh(devices), len(devices)
    elements = sizes.stream_bytes // 4
    x = _filled(mesh, (d * elements,), jnp.float32, 1.0)
    a, b = _filled(mesh, (d,), jnp.float32, 1.0), _filled(mesh, (d,), jnp.float32, 0.0)
    step = lambda x, a, b: x * a + b  # noqa: E731
    seconds = _op_s(_per_device(mesh, 3), step, x, (a, b), sizes, fusible=True)
    return StreamTiming(2 * 4 * elements, seconds)


def measure_transcendental(devices: Sequence[jax.Device], sizes: ProfileSizes) -> RateTiming:
    """`exp(-x)` over `sizes.stream_bytes` of float32 per device (it stays near 0.57, never
    overflowing): elements per second, its memory traffic included, as a streaming kernel
    of transcendentals runs."""
    mesh, d = _local_mesh(devices), len(devices)
    elements = sizes.stream_bytes // 4
    x = _filled(mesh, (d * elements,), jnp.float32, 0.5)
    step = lambda x: jnp.exp(-x)  # noqa: E731
    seconds = _op_s(_per_device(mesh, 1), step, x, (), sizes, fusible=True)
    return RateTiming(RateKind.TRANSCENDENTAL, elements, seconds)


def _grown(time_at: Callable[[int], RateTiming], first: int, sizes: ProfileSizes) -> RateTiming:
    """`time_at(n)` for n = first, 4·first, ... until a run of the next would take longer than
    `sizes.max_run_s`: the last timing, the largest op's, whose rate is the one a large op of its
    kind reaches and the least swayed by a program's launch (on a CPU the first size already
    runs long enough)."""
    n = first
    while True:
        timing = time_at(n)
        if sizes.too_slow(timing.seconds, 4):
            return timing
        n *= 4


def measure_convolution(devices: Sequence[jax.Device], sizes: ProfileSizes) -> RateTiming:
    """A 3x3 "SAME" convolution (NHWC) of `_CONV_CHANNELS` channels on `_CONV_SIDE`² images,
    first as many as `sizes.stream_bytes` / 16 of input hold (at least one), then more
    (`_grown`): FLOP/s (an H200's grows from 105 to 209 TFLOP/s between 16 and 256 images;
    `planner.roofline` prices small convolutions by `ClusterSpec.matmul_fraction`)."""
    mesh, d = _local_mesh(devices), len(devices)
    image = _CONV_SIDE * _CONV_SIDE * _CONV_CHANNELS
    weight = 1 / (9 * _CONV_CHANNELS)  # keeps x near 0.5
    w = _filled(mesh, (d * 3, 3, _CONV_CHANNELS, _CONV_CHANNELS), jnp.float32, weight)

    def step(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    def time_at(batch: int) -> RateTiming:
        x = _filled(mesh, (d * batch, _CONV_SIDE, _CONV_SIDE, _CONV_CHANNELS), jnp.float32, 0.5)
        seconds = _op_s(_per_device(mesh, 2), step, x, (w,), sizes)
        return RateTiming(RateKind.CONVOLUTION, 2 * batch * image * _CONV_CHANNELS * 9, seconds)

    return _grown(time_at, max(1, sizes.stream_bytes // 16 // (4 * image)), sizes)


def measure_transpose(devices: Sequence[jax.Device], sizes: ProfileSizes) -> RateTiming:
    """`_TRANSPOSE_SIDE`² float32 planes, as many as `sizes.stream_bytes` holds (at least one),
    each transposed (the minor dimension moves): bytes read + written per second."""
    mesh, d = _local_mesh(devices), len(devices)
    planes = max(1, sizes.stream_bytes // (4 * _TRANSPOSE_SIDE**2))
    x = _filled(mesh, (d * planes, _TRANSPOSE_SIDE, _TRANSPOSE_SIDE), jnp.float32, 1.0)
    step = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    seconds = _op_s(_per_device(mesh, 1), step, x, (), sizes, fusible=True)
    return RateTiming(RateKind.TRANSPOSE, 2 * 4 * planes * _TRANSPOSE_SIDE**2, seconds)


# A ResNet's max pool: 3x3 windows, each spatial side padded by one (stride 2 halves them).
_POOL_WINDOW = (1, 3, 3, 1)
_POOL_PADDING = ((0, 0), (1, 1), (1, 1), (0, 0))


def _max_pool(x: jax.Array, strides: tuple[int, ...]) -> jax.Array:
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, _POOL_WINDOW, strides, _POOL_PADDING)


def _pool_images(mesh: Mesh, sizes: ProfileSizes, nbytes: int = 0) -> tuple[jax.Array, int]:
    """`_CONV_SIDE`² images of `_CONV_CHANNELS` channels, as many per device as `nbytes` hold or
    where 0 `sizes.stream_bytes` / 16 (at least one: 4 MiB by default, beyond the caches, as
    training-size activations are), and that count."""
    image = _CONV_SIDE * _CONV_SIDE * _CONV_CHANNELS
    batch = max(1, (nbytes or sizes.stream_bytes // 16) // (4 * image))
    shape = (len(mesh.devices.flat) * batch, _CONV_SIDE, _CONV_SIDE, _CONV_CHANNELS)
    return _uniform(mesh, shape), batch


def measure_window_reduction(devices: Sequence[jax.Device], sizes: ProfileSizes) -> RateTiming:
    """A 3x3 max pool of stride 1 (so each step keeps its operand's shape) over `_pool_images`:
    window elements visited per second (XLA:CPU loops over them one by one)."""
    mesh = _local_mesh(devices)
    x, batch = _pool_images(mesh, sizes)
    step = lambda x: _max_pool(x, (1, 1, 1, 1))  # noqa: E731
    seconds = _op_s(_per_device(mesh, 1), step, x, (), sizes)
    windows = batch * _CONV_SIDE * _CONV_SIDE * _CONV_CHANNELS
    return RateTiming(RateKind.WINDOW_REDUCTION, windows * math.prod(_POOL_WINDOW), seconds)


def measure_select_and_scatter(
    devices: Sequence[jax.Device], sizes: ProfileSizes, cached: bool = False
) -> RateTiming:
    """The gradient of a 3x3 max pool of stride 2 over `_pool_images` (`select_and_scatter_add`,
    added to the images so a step keeps their shape and their values spread): windows per
    second, each the selection of its maximum and the scatter of its gradient there. `cached`:
    over `SELECT_AND_SCATTER_BYTES[0]` of images per device, which the caches hold."""
    mesh = _local_mesh(devices)
    x, batch = _pool_images(mesh, sizes, SELECT_AND_SCATTER_BYTES[0] if cached else 0)
    strides = (1, 2, 2, 1)
    pooled = jax.eval_shape(lambda x: _max_pool(x, strides), x).shape
    grad = _filled(mesh, pooled, jnp.float32, 1.0)

    def step(x, grad):
        return x + jax.vjp(lambda x: _max_pool(x, strides), x)[1](grad)[0]

    seconds = _op_s(_per_device(mesh, 2), step, x, (grad,), sizes)
    kind = RateKind.CACHED_SELECT_AND_SCATTER if cached else RateKind.SELECT_AND_SCATTER
    return RateTiming(kind, batch * math.prod(pooled[1:]), seconds)


def measure_transposed_matmul(
    devices: Sequence[jax.Device], sizes: ProfileSizes, columns: int = _GRAD_SIDE
) -> RateTiming:
    """x^T·y of a (rows, `_GRAD_SIDE`) and a (rows, `columns`) float32 block, first of
    `_GRAD_ROWS` rows, then of more (`_grown`): a weight gradient, whose lhs contracts its major
    dimension (XLA:CPU runs it outside its fast matmul kernels), with a result `columns` wide:
    FLOP/s, of kind `NARROW_TRANSPOSED_MATMUL` for the narrow width of
    `TRANSPOSED_MATMUL_COLUMNS`. (On an H200 the first size takes a few µs: a chain of 4 of
    them against one read 1.2 PFLOP/s, the launch's noise.)"""
    mesh, d = _local_mesh(devices), len(devices)
    narrow = columns == TRANSPOSED_MATMUL_COLUMNS[0]
    kind = RateKind.NARROW_TRANSPOSED_MATMUL if narrow else RateKind.TRANSPOSED_MATMUL

    def step(y, x):  # the gradient / rows written over y's first rows: y's sums stay ~1
        grad = jax.lax.dot_general(x, y, (((0,), (0,)), ((), ())))
        return jax.lax.dynamic_update_slice(y, grad / x.shape[0], (0, 0))

    def time_at(rows: int) -> RateTiming:
        x = _filled(mesh, (d * rows, _GRAD_SIDE), jnp.float32, 0.5)
        y = _filled(mesh, (d * rows, columns), jnp.float32, 1.0 / rows)
        seconds = _op_s(_per_device(mesh, 2), step, y, (x,), sizes)
        return RateTiming(kind, 2 * rows * _GRAD_SIDE * columns, seconds)

    return _grown(time_at, _GRAD_ROWS, sizes)


# An element-wise loop that XLA:CPU fuses into a transposing copy, as an MoE expert layer's
# activations get one: per device, experts' [rows, `_LOOP_MODEL`] tokens times [`_LOOP_MODEL`,
# columns] weights, one dot per array the loop reads (so that XLA packs the arrays back to back,
# as a step's temporaries), their product transposed to [columns, rows]. (rows, arrays) at each
# of `ALIASED_LOOP_LINES`.
_LOOP_MODEL = 128
_ALIASED_LOOPS = tuple(
    (lines // arrays, arrays) for lines, arrays in zip(ALIASED_LOOP_LINES, (2, 3), strict=True)
)


def _least_call_s(compiled: Any, args: Sequence[jax.Array], repeats: int) -> float:
    """Least wall time of `repeats` waited calls `compiled(*args)`, after one to warm up."""
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def measure_aliased_loop(
    devices: Sequence[jax.Device],
    sizes: ProfileSizes,
    stride: float | None,
    stream_bytes_per_s: float,
    many_lines: bool = False,
) -> RateTiming:
    """The loop of `_ALIASED_LOOPS[many_lines]` with rows `stride` bytes apart (columns of
    float32), as many experts as make each array about an eighth of `sizes.stream_bytes`:
    elements x arrays read per second. Its time is the program's against the same program with
    the loop untransposed, plus what that streaming loop takes at `stream_bytes_per_s` (it
    reads the arrays and writes the result once). Only on a CPU whose cache geometry gave a
    `stride`: otherwise seconds 0, no rate."""
    kind = RateKind.MANY_LINES_ALIASED_LOOP if many_lines else RateKind.ALIASED_LOOP
    rows, arrays = _ALIASED_LOOPS[many_lines]
    if devices[0].platform != "cpu" or stride is None:
        return RateTiming(kind, rows * arrays, 0.0)
    mesh, d = _local_mesh(devices), len(devices)
    columns = int(stride) // 4
    experts = max(1, sizes.stream_bytes // (8 * 4 * rows * columns))
    x = _filled(mesh, (d * experts, rows, _LOOP_MODEL), jnp.float32, 0.5)
    weights = [
        _filled(mesh, (d * experts, _LOOP_MODEL, columns), jnp.float32, 0.01 * (i + 1))
        for i in range(arrays)
    ]

    def program(transposed: bool) -> Any:
        def body(x, *weights):
            product = jnp.einsum("erm,emf->erf", x, weights[0]) * 0.5
            for w in weights[1:]:
                product = product * (1.0 + jnp.einsum("erm,emf->erf", x, w))
            return jnp.swapaxes(product, 1, 2) if transposed else product

        return _compiled(_per_device(mesh, 1 + arrays)(body), x, weights, donated=False)

    repeats = 4 * sizes.repeats
    transposed_s = _least_call_s(program(True), (x, *weights), repeats)
    streaming_s = _least_call_s(program(False), (x, *weights), repeats)
    elements = experts * rows * columns
    seconds = transposed_s - streaming_s + 4 * elements * (arrays + 1) / stream_bytes_per_s
    return RateTiming(kind, elements * arrays, max(0.0, seconds))


def measure_fresh_memory(
    devices: Sequence[jax.Device], sizes: ProfileSizes, threshold: float
) -> RateTiming:
    """The streaming `x * a + b` over at least 1.25 `threshold` bytes per device (where glibc
    maps an allocation afresh), writing a new buffer each call against writing x in place:
    bytes written per second of the extra time, the page faults of the first touch. Less than
    10% extra (a runtime that pools memory): seconds 0, no rate."""
    mesh, d = _local_mesh(devices), len(devices)
    elements = max(sizes.stream_bytes, int(1.25 * threshold)) // 4
    x = _filled(mesh, (d * elements,), jnp.float32, 1.0)
    a, b = _filled(mesh, (d,), jnp.float32, 1.0), _filled(mesh, (d,), jnp.float32, 0.0)
    step = _per_device(mesh, 3)(lambda x, a, b: x * a + b)
    in_place, x = _timed_calls(_compiled(step, x, (a, b)), x, (a, b), 1, sizes.repeats)
    fresh = _compiled(step, x, (a, b), donated=False)  # a new output every call
    seconds, _ = _timed_calls(fresh, x, (a, b), 1, sizes.repeats)
    extra = seconds - in_place
    return RateTiming(RateKind.FRESH_MEMORY, 4 * elements, extra if extra > 0.1 * in_place else 0)


def measure_column_reduction(
    devices: Sequence[jax.Device], sizes: ProfileSizes, floor_s: float
) -> RateTiming:
    """The mean over the rows of a (`_COLUMN_ROWS`, `_COLUMN_WIDTH`) float32 array written over
    its first row, `sizes.kernel_ops` of them in one program against one: rows per second of
    the time beyond two kernel floors `floor_s` (the reduction and the row write), the loop a
    GPU's column reduction runs per thread block. (An H200's trace shows 5.3 µs for the
    reduction and 0.9 µs for the write, where the bytes take 0.25 µs; timed over a chain of 4,
    the launch's noise read 18 to 24 µs.) Not measured on a CPU, whose column reductions stream
    at the memory bandwidth: seconds 0, no rate."""
    if devices[0].platform != "gpu":
        return RateTiming(RateKind.COLUMN_REDUCTION, _COLUMN_ROWS, 0.0)
    mesh, d = _local_mesh(devices), len(devices)
    x = _filled(mesh, (d * _COLUMN_ROWS, _COLUMN_WIDTH), jnp.float32, 0.5)
    step = lambda x: jax.lax.dynamic_update_slice(x, x.mean(0, keepdims=True), (0, 0))  # noqa: E731
    one, x = _least_chain_s(mesh, step, x, (), 1, sizes)
    many, _ = _least_chain_s(mesh, step, x, (), sizes.kernel_ops, sizes)
    seconds = (many - one) / (sizes.kernel_ops - 1) - 2 * floor_s
    return RateTiming(RateKind.COLUMN_REDUCTION, _COLUMN_ROWS, max(0.0, seconds))


def _column_with_output(
    carry: tuple[jax.Array, jax.Array], rows: int
) -> tuple[jax.Array, jax.Array]:
    """One kernel where XLA:GPU fuses it so: y = x/2 + 1/4 + m/(1000·rows) written out (values
    stay near 0.5), and the column sum of y·x; 2 full-shape arrays (x read, y written)."""
    x, m = carry
    y = x * 0.5 + 0.25 + m * (1e-3 / rows)
    return y, jnp.sum(y * x, axis=0)


def _fusions(compiled: Any) -> int:
    """Fusion kernels a compiled program launches (calls of fusions in its optimized HLO)."""
    return compiled.as_text().count(" fusion(")


def measure_column_reduction_arrays(
    devices: Sequence[jax.Device], sizes: ProfileSizes, floor_s: float
) -> RateTiming:
    """Rows per second per full-shape array of a column reduction into which XLA fuses an
    element-wise output of its operand's shape (`_column_with_output`): `sizes.kernel_ops` of
    them in one program against one, beyond a kernel floor `floor_s` each. Such a kernel walks
    its rows far slower than a plain one: on an H200 a GPT's layer norm gradient over
    1024x256 with two such outputs took 18 µs, a plain one 3.5 µs. Measured on a GPU, at the
    first shape of `_COLUMN_ARRAY_SHAPES` that XLA fuses so (one kernel per step); none fused, or
    a CPU (which fuses none so): seconds 0, no rate."""
    if devices[0].platform != "gpu":
        return RateTiming(RateKind.COLUMN_REDUCTION_ARRAY, 0.0, 0.0)
    mesh, d = _local_mesh(devices), len(devices)
    for rows, width in _COLUMN_ARRAY_SHAPES:
        carry = (
            _filled(mesh, (d * rows, width), jnp.float32, 0.5),
            _filled(mesh, (d * width,), jnp.float32, 0.25),
        )
        step = functools.partial(_column_with_output, rows=rows)
        if _fusions(_compiled(_per_device(mesh, 1)(_chained(step, 1)), carry, ())) != 1:
            logger.info("XLA does not fuse a %dx%d column reduction with an output", rows, width)
            continue
        one, carry = _least_chain_s(mesh, step, carry, (), 1, sizes)
        many, _ = _least_chain_s(mesh, step, carry, (), sizes.kernel_ops, sizes)
        seconds = (many - one) / (sizes.kernel_ops - 1) - floor_s
        return RateTiming(RateKind.COLUMN_REDUCTION_ARRAY, 2 * rows, max(0.0, seconds))
    return RateTiming(RateKind.COLUMN_REDUCTION_ARRAY, 0.0, 0.0)


def measure_kernel_floor(devices: Sequence[jax.Device], sizes: ProfileSizes) -> KernelTiming:
    """`sizes.kernel_ops` tiny dependent matmuls in one program against a single one, with the
    buffer donated and not (`KernelTiming`); each the least of `4 * sizes.repeats` waited calls."""
    mesh, d = _local_mesh(devices), len(devices)
    x = _filled(mesh, (d * _TINY, _TINY), jnp.float32, 0.5)
    w = _filled(mesh, (d * _TINY, _TINY), jnp.float32, 1.0 / _TINY)
    seconds = []
    for donated in (True, False):
        for ops in (1, sizes.kernel_ops):
            least, x = _least_chain_s(mesh, jnp.matmul, x, (w,), ops, sizes, donated)
            seconds.append(least)
    return KernelTiming(sizes.kernel_ops, *seconds)


def measure_launch(devices: Sequence[jax.Device], sizes: ProfileSizes) -> LaunchTiming:
    """Calls of a program that hands its donated inputs back as its outputs (no kernel runs),
    each waited for, with 1 and `sizes.launch_buffers` float32 inputs on every device: the
    least time of `20 * sizes.repeats` calls each (noise only ever adds time)."""
    mesh, d = _local_mesh(devices), len(devices)

    def least_call_s(n: int) -> float:
        xs = [_filled(mesh, (d,), jnp.float32, 1.0) for _ in range(n)]
        compiled = jax.jit(lambda *x: x, donate_argnums=tuple(range(n))).lower(*xs).compile()
        xs = jax.block_until_ready(compiled(*xs))
        times = []
        for _ in range(20 * sizes.repeats):
            start = time.perf_counter()
            xs = jax.block_until_ready(compiled(*xs))
            times.append(time.perf_counter() - start)
        return min(times)

    return LaunchTiming(sizes.launch_buffers, least_call_s(1), least_call_s(sizes.launch_buffers))


_OPS: dict[Collective, Callable[[jax.Array, str], jax.Array]] = {
    Collective.ALL_REDUCE: lambda x, axis: jax.lax.psum(x, axis),
    Collective.ALL_GATHER: lambda x, axis: jax.lax.all_gather(x, axis, tiled=True),
    Collective.REDUCE_SCATTER: lambda x, axis: jax.lax.psum_scatter(x, axis, tiled=True),
    Collective.ALL_TO_ALL: lambda x, axis: jax.lax.all_to_all(x, axis, 0, 0, tiled=True),
}


def _collective_step(collective: Callable, axis: str) -> Callable:
    """The collective, then its first element written into x in place: a dependency for the
    next one that moves no data (all-gather and reduce-scatter change the shape)."""

    def step(x):
        return jax.lax.dynamic_update_slice(x, collective(x, axis)[:1], (0,))

    return step


def _input_elements(kind: Collective, num_bytes: int, n: int) -> int:
    """float32 elements each device feeds `kind` when its formula's B is `num_bytes`
    (all-gather's B is its output), a multiple of n so that pieces divide evenly."""
    per_device = num_bytes // n if kind is Collective.ALL_GATHER else num_bytes
    return max(n, per_device // (4 * n) * n)


def measure_collectives(
    mesh: Mesh, physical_axes: Sequence[int], sizes: ProfileSizes, tick: Callable[[], None]
) -> list[CollectiveTiming]:
    """Every collective along every axis of `mesh` with more than one device, at growing B.
    `physical_axes[i]` is the physical mesh axis (0 hosts, 1 devices) of mesh axis i."""
    spec = PartitionSpec(mesh.axis_names)

    def wrap(body: Callable) -> Callable:
        return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)

    timings = []
    for name, axis in zip(mesh.axis_names, physical_axes, strict=True):
        n = mesh.shape[name]
        if n == 1:
            continue
        for kind, collective in _OPS.items():
            step = _collective_step(collective, name)
            done: list[CollectiveTiming] = []
            for num_bytes in sizes.collective_bytes:
                last = done[-1] if len(done) >= 2 else None
                if last is not None and sizes.too_slow(last.seconds, num_bytes / last.num_bytes):
                    break
                elements = _input_elements(kind, num_bytes, n)
                x = _filled(mesh, (mesh.size * elements,), jnp.float32, 1.0)
                b = 4 * elements * (n if kind is Collective.ALL_GATHER else 1)
                done.append(CollectiveTiming(axis, kind, b, n, _op_s(wrap, step, x, (), sizes)))
                tick()
            timings += done
    return timings


def _agreed(seconds: float) -> float:
    """Process 0's figure on every process, so that all take the same branch (they must run
    the same collectives in the same order)."""
    if jax.process_count() == 1:
        return seconds
    from jax.experimental import multihost_utils

    return float(multihost_utils.broadcast_one_to_all(np.float64(seconds)))


def physical_mesh(devices: Sequence[jax.Device]) -> tuple[Mesh, tuple[int, ...]]:
    """The (hosts, devices per host) mesh of `devices` (hosts by `process_index`), and the
    physical axis of each of its axes; one axis ("devices", physical axis 1) on one host."""
    by_host: dict[int, list[jax.Device]] = {}
    for device in devices:
        by_host.setdefault(device.process_index, []).append(device)
    rows = [by_host[h] for h in sorted(by_host)]
    if len(rows) == 1:
        return Mesh(np.array(rows[0], dtype=object), ("devices",)), (1,)
    grid = np.array(rows, dtype=object)
    return Mesh(grid, ("hosts", "devices")), (0, 1)
