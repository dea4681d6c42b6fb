"""The roofline cost model: per-op time from FLOPs at the dtype's peak against bytes moved, fusion
as the memory model sees it, the op classes priced at measured rates of their own
(transcendentals, convolutions, minor-dimension transposes), and the plans that follow from it on
the V100 preset."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.models import MLPConfig, abstract_train_inputs, gpt, mlp
from autopar.planner.cluster import PRESETS, ClusterSpec
from autopar.planner.graph import build_graph
from autopar.planner.groups import group_graph
from autopar.planner.plan import Plan
from autopar.planner.roofline import Roofline, op_time

V100 = ClusterSpec.preset("8xV100-p3")
A100 = ClusterSpec.preset("8xA100-80G")
F32 = np.dtype("float32")

_RATE_FIELDS = ("transcendental_rate", "conv_flops", "transpose_bandwidth")  # added in format 8
_FORMAT_9_FIELDS = ("transposed_matmul_flops", "fresh_memory_rate", "fresh_memory_threshold")
_FORMAT_10_FIELDS = ("launch_overhead_s", "buffer_overhead_s", "all_to_all_factor")
_FORMAT_11_FIELDS = ("kernel_update_s",)
_FORMAT_12_FIELDS = ("matmul_efficiency",)
_FORMAT_13_FIELDS = ("column_reduction_rate",)
_FORMAT_14_FIELDS = ("column_reduction_array_rate",)
_FORMAT_15_FIELDS = ("window_reduction_rate", "select_and_scatter_rate", "dfs_schedule")
_FORMAT_16_FIELDS = ("narrow_transposed_matmul_flops", "cached_select_and_scatter_rate")
_FORMAT_17_FIELDS = ("aliasing_stride", "aliased_loop_rate", "many_lines_aliased_loop_rate")
_FORMAT_18_FIELDS = ("collective_cache_bytes", "cached_intra_host_bandwidth")
_ROOFLINE_FIELDS = (
    "memory_bandwidth",
    "fp32_flops",
    "tf32_flops",
    "compute_efficiency",
    "memory_efficiency",
    "kernel_overhead_s",
    *_RATE_FIELDS,
    *_FORMAT_9_FIELDS,
    *_FORMAT_10_FIELDS,
    *_FORMAT_11_FIELDS,
    *_FORMAT_12_FIELDS,
    *_FORMAT_13_FIELDS,
    *_FORMAT_14_FIELDS,
    *_FORMAT_15_FIELDS,
    *_FORMAT_16_FIELDS,
    *_FORMAT_17_FIELDS,
    *_FORMAT_18_FIELDS,
)
# A CPU device with measured op-class rates (the figures are round, not a real CPU's).
CPU = dataclasses.replace(
    ClusterSpec.local(1), transcendental_rate=1e8, conv_flops=50e9, transpose_bandwidth=2e9
)


def test_op_time_is_the_slower_of_compute_and_memory():
    spec = dataclasses.replace(V100, compute_efficiency=0.5, memory_efficiency=0.5)
    # 1 GFLOP at 15.7 TFLOP/s x 0.5 = 127 us; 1 MB at 450 GB/s = 2.2 us: compute-bound.
    assert op_time(1e9, 1e6, 15.7e12, spec) == pytest.approx(1e9 / 7.85e12)
    # 1 MFLOP = 0.13 us against 100 MB at 450 GB/s = 222 us: memory-bound.
    assert op_time(1e6, 1e8, 15.7e12, spec) == pytest.approx(1e8 / 450e9)
    unknown = dataclasses.replace(spec, memory_bandwidth=None)  # older specs: FLOPs only
    assert op_time(1e6, 1e8, 15.7e12, unknown) == pytest.approx(1e6 / 7.85e12)


def test_peak_depends_on_dtype_and_precision():
    bf16, f16 = np.dtype(jnp.bfloat16), np.dtype("float16")
    assert A100.peak_flops(bf16, matmul=True) == A100.peak_flops(f16) == 312e12
    assert A100.peak_flops(F32, matmul=True) == 156e12  # TF32: JAX's default precision
    assert A100.peak_flops(F32, matmul=True, highest_precision=True) == 19.5e12
    assert A100.peak_flops(F32) == 19.5e12  # element-wise fp32: no tensor cores
    assert V100.peak_flops(F32, matmul=True) == 15.7e12  # Volta has no TF32
    old = ClusterSpec(1, 8, 1e12, 16e9, 1e10, 1e10, 1e-5, 1e-5)  # fields of format 6 only
    assert old.peak_flops(F32, matmul=True) == old.peak_flops(bf16) == 1e12


@pytest.mark.parametrize(
    "field, value",
    [
        ("memory_bandwidth", 0.0),
        ("memory_bandwidth", float("inf")),
        ("compute_efficiency", 1.5),
        ("memory_efficiency", 0.0),
        ("kernel_overhead_s", -1e-6),
        ("tf32_flops", "fast"),
        ("transcendental_rate", 0.0),
        ("conv_flops", -1.0),
        ("transpose_bandwidth", float("nan")),
        ("column_reduction_rate", -1e9),
        ("column_reduction_array_rate", 0.0),
        ("window_reduction_rate", -1.0),
        ("select_and_scatter_rate", float("inf")),
        ("narrow_transposed_matmul_flops", 0.0),
        ("cached_select_and_scatter_rate", -1.0),
        ("aliasing_stride", 0.0),
        ("aliased_loop_rate", -1.0),
        ("many_lines_aliased_loop_rate", float("nan")),
        ("collective_cache_bytes", 0.0),
        ("launch_overhead_s", -1e-6),
        ("buffer_overhead_s", float("nan")),
        ("kernel_update_s", -1e-6),
        ("all_to_all_factor", 0.0),
        ("dfs_schedule", "yes"),
    ],
)
def test_roofline_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(V100, **{field: value})


def test_spec_without_roofline_fields_loads_with_flop_only_defaults(tmp_path):
    d = {k: v for k, v in V100.to_dict().items() if k not in _ROOFLINE_FIELDS}
    spec = ClusterSpec.from_dict(d)
    assert spec.memory_bandwidth is None and spec.kernel_overhead_s == 0.0
    assert spec.compute_efficiency == spec.memory_efficiency == 1.0
    assert ClusterSpec.from_dict(V100.to_dict()) == V100


def test_element_wise_chain_reads_and_writes_once():
    """tanh(x * 2 + 1) is one fused kernel: it reads x and writes the result, nothing between."""
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    one = V100.with_devices(1, 1)
    plan = autopar.plan(lambda s, x: (s, jnp.tanh(x * 2.0 + 1.0)), 0.0, x, cluster_spec=one)
    memory_s = 2 * x.size * 4 / (V100.memory_bandwidth * V100.memory_efficiency)
    # The kernel is priced as the sum of its members' rooflines: mul's arithmetic hides under
    # its read of x, tanh's under its write; add, with no memory traffic, adds its arithmetic.
    add_s = x.size / (V100.fp32_flops * V100.compute_efficiency)
    expected = memory_s + add_s + V100.kernel_overhead_s
    assert plan.predicted.compute_s == pytest.approx(expected, rel=1e-6)


def _compute_s(fun, state, x, spec: ClusterSpec) -> float:
    return autopar.plan(fun, state, x, cluster_spec=spec).predicted.compute_s


def test_transcendentals_run_at_the_measured_rate():
    """exp over 1 Mi elements: 10 ms at 1e8 elements/s, far above its 1 ms of memory traffic;
    without a rate it is one FLOP per element, hidden under the traffic."""
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    memory_s = 2 * x.size * 4 / (CPU.memory_bandwidth * CPU.memory_efficiency)
    step = lambda s, x: (s, jnp.exp(x))  # noqa: E731
    assert _compute_s(step, 0.0, x, CPU) == pytest.approx(x.size / 1e8 + CPU.kernel_overhead_s)
    unmeasured = dataclasses.replace(CPU, transcendental_rate=None)
    assert _compute_s(step, 0.0, x, unmeasured) == pytest.approx(memory_s + CPU.kernel_overhead_s)


def _max_pool(x):
    """A ResNet's max pool: 3x3 windows, stride 2, each spatial side padded by one."""
    padding = ((0, 0), (1, 1), (1, 1), (0, 0))
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), padding)


POOLED = dataclasses.replace(CPU, window_reduction_rate=1e8, select_and_scatter_rate=1e6)


@pytest.mark.parametrize("gradient", [False, True], ids=["pool", "gradient"])
def test_pools_and_their_gradients_run_at_the_measured_rates(gradient):
    """A max pool of 32 images of 32x32x16 has 131072 windows of 9 elements: 11.8 ms at 1e8
    window elements/s where its 2.5 MiB of bytes take under 0.1 ms; its gradient
    (`select_and_scatter_add`) takes 131 ms at 1e6 windows/s. Unmeasured, both are priced by
    their bytes (XLA:CPU runs them ten to a hundred times slower than that)."""
    x = jax.ShapeDtypeStruct((32, 32, 32, 16), jnp.float32)
    windows = 32 * 16 * 16 * 16
    if gradient:
        dy = jax.ShapeDtypeStruct((32, 16, 16, 16), jnp.float32)
        step = lambda s, xy: (s, jax.vjp(_max_pool, xy[0])[1](xy[1])[0])  # noqa: E731
        args, field, seconds = (x, dy), "select_and_scatter_rate", windows / 1e6
        nbytes = 4 * (dy.size + 2 * x.size)  # reads the gradient and x, writes x's shape
    else:
        step = lambda s, x: (s, _max_pool(x))  # noqa: E731
        args, field, seconds = x, "window_reduction_rate", 9 * windows / 1e8
        nbytes = 4 * (x.size + windows)
    unmeasured = dataclasses.replace(POOLED, **{field: None})
    bytes_s = nbytes / (CPU.memory_bandwidth * CPU.memory_efficiency)
    assert seconds > 10 * bytes_s
    priced = _compute_s(step, 0.0, args, POOLED) - _compute_s(step, 0.0, args, unmeasured)
    assert priced == pytest.approx(seconds - bytes_s, rel=1e-6)


@pytest.mark.parametrize(
    "batch, rate",
    [(4, 4e6), (32, 2e6), (64, 1e6)],
    ids=["in cache", "between", "beyond"],
)
def test_pool_gradients_run_faster_where_the_caches_hold_their_operand(batch, rate):
    """The gradient of a max pool over images of 32x32x16 float32 (64 KiB each): 4 of them
    (256 KiB, under `SELECT_AND_SCATTER_BYTES[0]`) at `cached_select_and_scatter_rate`, 64
    (4 MiB) at `select_and_scatter_rate`, 32 (2 MiB) two thirds of the way in log bytes."""
    cached = dataclasses.replace(POOLED, cached_select_and_scatter_rate=4e6)
    x = jax.ShapeDtypeStruct((batch, 32, 32, 16), jnp.float32)
    dy = jax.ShapeDtypeStruct((batch, 16, 16, 16), jnp.float32)
    step = lambda s, xy: (s, jax.vjp(_max_pool, xy[0])[1](xy[1])[0])  # noqa: E731
    windows = dy.size
    priced = _compute_s(step, 0.0, (x, dy), cached) - _compute_s(step, 0.0, (x, dy), POOLED)
    assert priced == pytest.approx(windows / rate - windows / 1e6, rel=1e-6)


# A GPU whose column reductions walk 1e9 rows/s (an H200 measured about that).
GPU_ROWS = dataclasses.replace(V100.with_devices(1, 1), column_reduction_rate=1e9)


@pytest.mark.parametrize(
    "shape, axes, rows",
    [
        ((4096, 64), (0,), 4096),  # a bias gradient: rows over the rate
        ((16, 256, 32), (0, 1), 4096),  # batch norm statistics over (batch, pixels)
        ((16384, 64), (0,), None),  # split by XLA: two kernels of 128 rows
        ((4096, 64), (1,), 0),  # the minor dimension reduced: a row reduction, at its bytes
    ],
    ids=["column", "column over two dims", "split", "row"],
)
def test_column_reductions_walk_their_rows_at_the_measured_rate(shape, axes, rows):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    step = lambda s, x: (s, jnp.sum(x, axis=axes))  # noqa: E731
    bytes_s = (
        (x.size + x.size // math.prod(shape[a] for a in axes))
        * 4
        / (GPU_ROWS.memory_bandwidth * GPU_ROWS.memory_efficiency)
    )
    if rows is None:  # 2 x sqrt(16384) rows and the second kernel's floor
        walk_s = 2 * 128 / 1e9 + GPU_ROWS.kernel_overhead_s
    else:
        walk_s = rows / 1e9
    floor = GPU_ROWS.kernel_overhead_s
    assert _compute_s(step, 0.0, x, GPU_ROWS) == pytest.approx(max(bytes_s, walk_s) + floor)
    unmeasured = dataclasses.replace(GPU_ROWS, column_reduction_rate=None)
    assert _compute_s(step, 0.0, x, unmeasured) == pytest.approx(bytes_s + floor)


# ... and whose column reductions with fused outputs walk 1e8 rows/s per array (an H200: 0.34e9)
GPU_ARRAYS = dataclasses.replace(GPU_ROWS, column_reduction_array_rate=1e8)


def _streamed_s(num_bytes: float, spec: ClusterSpec) -> float:
    return num_bytes / (spec.memory_bandwidth * spec.memory_efficiency)


def _reduces_what_it_writes(s, x):
    y = x * 2 + 1
    return s, (jnp.sum(y, axis=0), y)


def _reduces_beside_a_loop(s, x):
    return s, (jnp.sum(x, axis=0), x * 2 + 1)


@pytest.mark.parametrize("step", [_reduces_what_it_writes, _reduces_beside_a_loop])
def test_a_column_reduction_with_a_fused_output_walks_its_rows_per_array(step):
    """x (1024x64) read and y = 2x + 1 written by one GPU kernel that also sums y or x over its
    rows: 2 arrays x 1024 rows at 1e8 rows/s, one kernel floor. Without the array rate, the
    plain row walk; on a CPU, where XLA fuses no such kernel, two kernels at their bytes."""
    x = jax.ShapeDtypeStruct((1024, 64), jnp.float32)
    loop_s = _streamed_s(2 * x.size * 4, GPU_ARRAYS)  # the element-wise output's bytes
    floor = GPU_ARRAYS.kernel_overhead_s
    assert _compute_s(step, 0.0, x, GPU_ARRAYS) == pytest.approx(loop_s + 2 * 1024 / 1e8 + floor)
    plain = dataclasses.replace(GPU_ARRAYS, column_reduction_array_rate=None)
    assert _compute_s(step, 0.0, x, plain) == pytest.approx(loop_s + 1024 / 1e9 + floor, rel=0.05)
    cpu = dataclasses.replace(GPU_ARRAYS, platform="cpu")
    reduce_s = _streamed_s((x.size + 64) * 4, cpu)
    assert _compute_s(step, 0.0, x, cpu) == pytest.approx(
        loop_s + max(reduce_s, 1024 / 1e9) + 2 * floor
    )


def test_a_column_reduction_whose_operand_only_it_reads_walks_its_rows_once():
    """2x + 1 computed inside the reduction's kernel and written nowhere: no array to write, so
    the plain row walk prices it even where the array rate is set."""
    x = jax.ShapeDtypeStruct((1024, 64), jnp.float32)
    step = lambda s, x: (s, jnp.sum(x * 2 + 1, axis=0))  # noqa: E731
    read_s = _streamed_s(x.size * 4, GPU_ARRAYS)  # the fused loop's read of x
    expected = read_s + max(_streamed_s(64 * 4, GPU_ARRAYS), 1024 / 1e9)
    expected += GPU_ARRAYS.kernel_overhead_s
    assert _compute_s(step, 0.0, x, GPU_ARRAYS) == pytest.approx(expected, rel=0.01)  # + FLOPs


def test_a_split_reduced_dimension_leaves_each_device_fewer_rows():
    """A bias gradient over 4096 rows split 4 ways (data parallel): each device walks 1024."""
    x = jax.ShapeDtypeStruct((4096, 64), jnp.float32)
    four = dataclasses.replace(V100.with_devices(1, 4), column_reduction_rate=1e6)
    plan = autopar.plan(
        lambda s, x: (s, jnp.sum(x, axis=0)),
        0.0,
        x,
        cluster_spec=four,
        method=autopar.DataParallel(),
    )
    assert plan.predicted.compute_s == pytest.approx(1024 / 1e6 + four.kernel_overhead_s)


def test_convolutions_run_at_the_measured_rate_or_a_matmul_of_their_size():
    x = jax.ShapeDtypeStruct((8, 32, 32, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.float32)
    flops = 2 * 8 * 32 * 32 * 64 * 64 * 9

    def step(w, x):
        dims = ("NHWC", "HWIO", "NHWC")
        return w, jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)

    # compute-bound: an achieved rate, which compute_efficiency does not scale again
    assert _compute_s(step, w, x, CPU) == pytest.approx(flops / 50e9 + CPU.kernel_overhead_s)
    peak = CPU.device_flops * CPU.compute_efficiency
    unmeasured = dataclasses.replace(CPU, conv_flops=None)
    assert _compute_s(step, w, x, unmeasured) == pytest.approx(flops / peak + CPU.kernel_overhead_s)
    # where a matmul of its FLOPs runs slower than conv_flops (a small one), at that rate: a
    # GPU runs convolutions as implicit GEMMs (75 MFLOP here: 1% of the peak is 10 GFLOP/s)
    ramp = dataclasses.replace(CPU, matmul_efficiency=((1e6, 0.01), (1e12, 0.01)))
    small = peak * 0.01
    assert small < 50e9
    assert _compute_s(step, w, x, ramp) == pytest.approx(flops / small + CPU.kernel_overhead_s)


def test_weight_gradient_matmuls_run_at_the_measured_transposed_rate():
    """x^T·y contracts x's major dim: priced at `transposed_matmul_flops`; x·w at the peak."""
    spec = dataclasses.replace(CPU, transposed_matmul_flops=20e9)
    x = jax.ShapeDtypeStruct((4096, 256), jnp.float32)
    flops = 2 * 4096 * 256 * 256
    peak = spec.peak_flops(F32, matmul=True) * spec.compute_efficiency
    gradient = lambda w, x: (w, jax.lax.dot_general(x, x, (((0,), (0,)), ((), ()))))  # noqa: E731
    forward = lambda w, x: (w, x @ w)  # noqa: E731
    overhead = spec.kernel_overhead_s
    assert _compute_s(gradient, 0.0, x, spec) == pytest.approx(flops / 20e9 + overhead)
    assert _compute_s(forward, _W, x, spec) == pytest.approx(flops / peak + overhead)
    unmeasured = dataclasses.replace(spec, transposed_matmul_flops=None)
    assert _compute_s(gradient, 0.0, x, unmeasured) == pytest.approx(flops / peak + overhead)


NARROW = dataclasses.replace(CPU, transposed_matmul_flops=20e9, narrow_transposed_matmul_flops=10e9)


@pytest.mark.parametrize(
    "lhs_columns, rhs_columns, rate",
    [
        (256, 256, 20e9),
        (256, 64, 10e9),
        (64, 256, 20e9),
        (64, 128, 15e9),
        (64, 32, 6e9),
        (64, 512, 24e9),
    ],
    ids=["wide", "narrow result", "narrow lhs", "between", "narrower", "wider"],
)
def test_weight_gradient_rate_follows_the_columns_of_its_result(lhs_columns, rhs_columns, rate):
    """x^T·y with a result of y's columns: 20 GFLOP/s measured at 256 columns and 10 at 64 fix
    R = 30 and N½ = 128 in rate = R·N / (N + N½) (a packing cost per lhs element plus the
    FLOPs at R), which reads 15 at 128 columns, 6 at 32 and 24 at 512. The lhs's width does not
    count (XLA:CPU ran 64x16384·16384x256 at 275 GFLOP/s and 256x16384·16384x64 at 163 on a
    host that runs 256-column ones at 280)."""
    rows = 4096
    x = jax.ShapeDtypeStruct((rows, lhs_columns), jnp.float32)
    y = jax.ShapeDtypeStruct((rows, rhs_columns), jnp.float32)
    gradient = lambda w, xy: (w, jax.lax.dot_general(*xy, (((0,), (0,)), ((), ()))))  # noqa: E731
    flops = 2 * rows * lhs_columns * rhs_columns
    seconds = flops / rate + NARROW.kernel_overhead_s
    assert _compute_s(gradient, 0.0, (x, y), NARROW) == pytest.approx(seconds)
    wide_only = dataclasses.replace(NARROW, narrow_transposed_matmul_flops=None)
    wide_s = flops / 20e9 + NARROW.kernel_overhead_s
    assert _compute_s(gradient, 0.0, (x, y), wide_only) == pytest.approx(wide_s)


@pytest.mark.parametrize("narrow", [30e9, 4e9], ids=["narrow faster", "under a quarter"])
def test_weight_gradient_rates_off_the_packing_law_price_every_width_at_the_wide_one(narrow):
    spec = dataclasses.replace(NARROW, narrow_transposed_matmul_flops=narrow)
    assert [spec.transposed_matmul_rate(n) for n in (16, 64, 256, 4096)] == [20e9] * 4


def test_the_ilp_prices_a_weight_gradient_by_its_columns_per_device(monkeypatch):
    """On 2 devices a strategy that splits the 256 columns of x^T·y's result leaves each device
    128 (`result_columns` of the strategy's output spec), one that keeps them whole 256."""
    seen = set()
    priced = Roofline.seconds

    def spied(self, node, flops, in_bytes, out_bytes, columns=None):
        if node.primitive == "dot_general":
            seen.add(columns)
        return priced(self, node, flops, in_bytes, out_bytes, columns)

    monkeypatch.setattr(Roofline, "seconds", spied)
    x = jax.ShapeDtypeStruct((4096, 256), jnp.float32)
    gradient = lambda w, x: (w, jax.lax.dot_general(x, x, (((0,), (0,)), ((), ()))))  # noqa: E731
    spec = dataclasses.replace(NARROW, devices_per_host=2)
    autopar.plan(gradient, 0.0, x, cluster_spec=spec, method=autopar.ShardParallel())
    assert {128.0, 256.0} <= seen


# 1 ns per element and array read at 512 lines in flight, 3 ns at 1536, 4 KiB set span
ALIASED = dataclasses.replace(
    CPU, aliasing_stride=4096, aliased_loop_rate=1e9, many_lines_aliased_loop_rate=1e9 / 3
)


def test_an_aliased_loop_slows_with_its_lines_in_flight():
    """The first measured point's time up to its lines, then linear through both; None where a
    figure is missing."""
    at = [ALIASED.aliased_loop_s_at(lines) for lines in (256, 512, 1024, 1536, 2048)]
    assert at == pytest.approx([1e-9, 1e-9, 2e-9, 3e-9, 4e-9])
    for field in ("aliasing_stride", "aliased_loop_rate", "many_lines_aliased_loop_rate"):
        assert dataclasses.replace(ALIASED, **{field: None}).aliased_loop_s_at(512) is None


def _expert_output(width: int):
    """'egch,ehm->gecm' over h = a * b (an MoE expert layer's second einsum over its
    activation, two arrays read): XLA:CPU copies h to [e, h, g, c] with the product fused in,
    walking g x c = 512 rows per output row, `width` floats apart."""
    a = jax.ShapeDtypeStruct((4, 16, 32, width), jnp.float32)
    w = jax.ShapeDtypeStruct((4, width, 8), jnp.float32)

    def step(w, xs):
        return w, jnp.einsum("egch,ehm->gecm", xs[0] * xs[1], w)

    return step, w, (a, a)


@pytest.mark.parametrize("width, aliased", [(1024, True), (1000, False)])
def test_a_loop_fused_into_a_copy_at_an_aliasing_stride_is_priced_by_its_lines(width, aliased):
    """At 1024 floats (4 KiB) the copy's loop reads 2 arrays over 512 rows, 1024 lines in
    flight: 2 ns per element and array, instead of the transpose rate; at 1000 floats it is
    priced as any copy."""
    step, w, xs = _expert_output(width)
    elements = xs[0].size
    copy_s = 2 * elements * 4 / CPU.transpose_bandwidth
    law_s = elements * 2 * ALIASED.aliased_loop_s_at(1024)
    extra = _compute_s(step, w, xs, ALIASED) - _compute_s(step, w, xs, CPU)
    assert extra == pytest.approx(law_s - copy_s if aliased else 0.0, abs=1e-9)


def test_the_roofline_reads_an_aliased_loops_rows_and_arrays():
    """512 rows (g x c) walked per output row, the 2 arrays the product reads; a GPU copies
    nothing, and a spec without the loop rates prices no such loop."""
    step, w, xs = _expert_output(1024)
    grouping = group_graph(build_graph(jax.make_jaxpr(step)(w, xs)))
    (dot,) = [n for n in grouping.graph.nodes if n.primitive == "dot_general"]
    roofline = Roofline(grouping, frozenset(), ALIASED)
    (copy,) = roofline.layout_copies(dot)[0]
    assert roofline.aliased_loop(dot, copy) == (512, 2)
    assert Roofline(grouping, frozenset(), CPU).aliased_loop(dot, copy) is None
    gpu = dataclasses.replace(ALIASED, platform="gpu")
    assert Roofline(grouping, frozenset(), gpu).layout_copies(dot)[0] == ()


RAMP = ((1e6, 0.25), (1e8, 0.75))  # a quarter of the peak at 1 MFLOP, three quarters at 100


def test_matmul_fraction_is_linear_in_log_flops_between_the_measured_points():
    spec = dataclasses.replace(CPU, matmul_efficiency=RAMP)
    assert spec.matmul_fraction(1e3) == spec.matmul_fraction(1e6) == 0.25  # below: the first
    assert spec.matmul_fraction(1e7) == pytest.approx(0.5)  # halfway in log FLOPs
    assert spec.matmul_fraction(1e8) == spec.matmul_fraction(1e12) == 0.75  # above: the last
    assert CPU.matmul_fraction(1.0) == 1.0  # no curve: every size at the peak


@pytest.mark.parametrize(
    "curve",
    [
        ((1e8, 0.5), (1e6, 0.75)),  # FLOPs decreasing
        ((1e6, 0.5), (1e6, 0.75)),  # FLOPs repeated
        ((1e6, 0.0),),  # no rate
        ((1e6, 1.5),),  # above the peak
        ((-1.0, 0.5),),
        ((1e6,),),  # not a pair
        "fast",
    ],
)
def test_matmul_efficiency_is_validated(curve):
    with pytest.raises(ValueError, match="matmul_efficiency"):
        dataclasses.replace(CPU, matmul_efficiency=curve)


def test_small_matmuls_run_at_their_share_of_the_peak():
    """(64, 64) @ (64, 64) is 0.5 MFLOP: a quarter of the peak (below the first point); the
    (4096, 256) @ (256, 256) matmul's 537 MFLOP, above the last point, three quarters."""
    spec = dataclasses.replace(CPU, matmul_efficiency=RAMP, memory_bandwidth=None)
    peak = spec.peak_flops(F32, matmul=True) * spec.compute_efficiency
    for rows, cols, fraction in ((64, 64, 0.25), (4096, 256, 0.75)):
        x = jax.ShapeDtypeStruct((rows, cols), jnp.float32)
        w = jnp.zeros((cols, cols))
        flops = 2 * rows * cols * cols
        expected = flops / (peak * fraction) + spec.kernel_overhead_s
        assert _compute_s(lambda w, x: (w, x @ w), w, x, spec) == pytest.approx(expected)


def test_matmul_efficiency_round_trips_through_json():
    spec = dataclasses.replace(CPU, matmul_efficiency=RAMP)
    assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_temporaries_mapped_afresh_each_step_cost_their_bytes_at_the_fresh_rate():
    """From `fresh_memory_threshold` bytes of temporaries up, a step pays them at
    `fresh_memory_rate` (page faults); below it, or with pooled memory, nothing."""
    step, state, data = abstract_train_inputs(mlp, MLPConfig(256, 256, 256, 2), 4096)
    spec = dataclasses.replace(CPU, fresh_memory_rate=1e9, fresh_memory_threshold=1.0)
    plan = autopar.plan(step, state, data, cluster_spec=spec)
    inputs = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((state, data)))
    temporaries = plan.predicted.memory_per_device_bytes - inputs
    assert temporaries > 4096 * 256 * 4  # activations of a layer at least
    for free in (dataclasses.replace(spec, fresh_memory_threshold=1e15), CPU):
        cheaper = autopar.plan(step, state, data, cluster_spec=free).predicted
        assert plan.predicted.compute_s - cheaper.compute_s == pytest.approx(temporaries / 1e9)


_W = jax.ShapeDtypeStruct((256, 256), jnp.float32)
TRANSPOSES = {
    # name: (step, whether the transpose is priced at transpose_bandwidth)
    "moves the minor dim": (lambda w, x: (w, jnp.transpose(x) * 2.0), True),
    "keeps the minor dim": (
        lambda w, x: (w, jnp.transpose(x.reshape(16, 16, 256), (1, 0, 2))),
        False,
    ),
    "read by a dot": (lambda w, x: (w, jnp.transpose(x) @ w), False),
    "of a dot's result": (lambda w, x: (w, jnp.transpose(x @ w) * 2.0), False),
}


@pytest.mark.parametrize("step, priced", TRANSPOSES.values(), ids=TRANSPOSES.keys())
def test_transposes_that_move_the_minor_dim_are_priced_unless_a_dot_absorbs_them(step, priced):
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    unmeasured = dataclasses.replace(CPU, transpose_bandwidth=None)
    extra = _compute_s(step, _W, x, CPU) - _compute_s(step, _W, x, unmeasured)
    expected = 2 * x.size * 4 / CPU.transpose_bandwidth if priced else 0.0  # read + written
    assert extra == pytest.approx(expected, abs=1e-12)


def test_gpu_presets_keep_the_plain_roofline():
    """No preset gives op-class rates (no sourced figures): GPU plans are priced as before."""
    for spec in PRESETS.values():
        assert all(getattr(spec, field) is None for field in _RATE_FIELDS), spec.name


def _mlp_inputs(batch: int, width: int):
    config = MLPConfig(in_dim=width, hidden=width, out_dim=width, num_layers=6)
    return abstract_train_inputs(mlp, config, batch)


def _mlp_plan(batch: int, width: int):
    return autopar.plan(*_mlp_inputs(batch, width), cluster_spec=V100)


def _mlp_explained(batch: int, width: int):
    return autopar.explain(*_mlp_inputs(batch, width), cluster_spec=V100)


def _kernel_specs(plan) -> list:
    stage = plan.stages[0]
    return [
        spec
        for path, spec in zip(plan.input_paths, stage.input_specs, strict=True)
        if path.startswith("state.params") and path.endswith("['kernel']")
    ]


def test_small_batch_wide_mlp_gets_tensor_parallelism_on_v100():
    """Batch 8 x width 4096: a replicated plan reads every 64 MiB weight on every device and
    streams the whole Adam update; splitting the kernels is several times faster."""
    explanation = _mlp_explained(8, 4096)
    plan = explanation.chosen.plan
    assert all(any(spec) for spec in _kernel_specs(plan))  # every kernel split
    dp = next(r for r in explanation.baselines if r.name == "DP")
    assert dp.predicted.step_time_s > 3 * plan.predicted.step_time_s
    assert dp.predicted.compute_s > 3 * plan.predicted.compute_s  # memory-bound, not comm
    assert "DP" in str(explanation)


def test_large_batch_narrow_mlp_gets_data_parallelism_on_v100():
    """Batch 32768 x width 128: the batch is split, the small weights stay replicated."""
    plan = _mlp_plan(32768, 128)
    stage = plan.stages[0]
    batch = [s for p, s in zip(plan.input_paths, stage.input_specs, strict=True) if "batch" in p]
    assert all(spec[0] for spec in batch)
    assert not any(any(spec) for spec in _kernel_specs(plan))


def test_fp32_gpt_on_a100_is_not_priced_at_the_bf16_peak():
    """fp32 matmuls run at TF32 (half the bf16 peak) and element-wise work is memory-bound, so
    the predicted MFU against the 16-bit peak stays well below the old 95%."""
    step, state, data = abstract_train_inputs(gpt, gpt.GPTConfig(hidden=512, num_layers=2), 64)
    plan = autopar.plan(step, state, data, cluster_spec=A100)
    mfu = plan.predicted.flops / plan.predicted.step_time_s / plan.num_devices / A100.device_flops
    assert mfu < 0.5


@pytest.mark.parametrize(
    "version, missing",
    [
        (6, _ROOFLINE_FIELDS),
        (7, (*_RATE_FIELDS, *_FORMAT_9_FIELDS, *_FORMAT_10_FIELDS, *_FORMAT_11_FIELDS)),
        (8, (*_FORMAT_9_FIELDS, *_FORMAT_10_FIELDS, *_FORMAT_11_FIELDS, *_FORMAT_12_FIELDS)),
        (9, (*_FORMAT_10_FIELDS, *_FORMAT_11_FIELDS, *_FORMAT_12_FIELDS, *_FORMAT_13_FIELDS)),
        (10, (*_FORMAT_11_FIELDS, *_FORMAT_12_FIELDS, *_FORMAT_13_FIELDS)),
        (11, (*_FORMAT_12_FIELDS, *_FORMAT_13_FIELDS)),
        (12, (*_FORMAT_13_FIELDS, *_FORMAT_14_FIELDS)),
        (13, (*_FORMAT_14_FIELDS, *_FORMAT_15_FIELDS)),
        (14, (*_FORMAT_15_FIELDS, *_FORMAT_16_FIELDS)),
        (15, (*_FORMAT_16_FIELDS, *_FORMAT_17_FIELDS)),
        (16, (*_FORMAT_17_FIELDS, *_FORMAT_18_FIELDS)),
        (17, _FORMAT_18_FIELDS),
    ],
    ids=[f"format {v}" for v in range(6, 18)],
)
def test_older_plan_files_still_load(version, missing):
    plan = _mlp_plan(32768, 128)
    data = json.loads(plan.to_json())
    data["format_version"] = version
    for key in missing:
        data["cluster"].pop(key)
    if version <= 9:
        data["predicted"].pop("host_s")
    old = Plan.from_json(json.dumps(data))
    assert old.stages == plan.stages
    cluster = old.cluster
    defaults = {f.name: f.default for f in dataclasses.fields(ClusterSpec)}
    assert all(getattr(cluster, key) == defaults[key] for key in missing)


def test_rates_round_trip_through_json():
    assert ClusterSpec.from_dict(json.loads(json.dumps(CPU.to_dict()))) == CPU


LAUNCH = dataclasses.replace(CPU, launch_overhead_s=1e-3, buffer_overhead_s=1e-5)
NO_LAUNCH = dataclasses.replace(CPU, launch_overhead_s=0.0, buffer_overhead_s=0.0)


@pytest.mark.parametrize("method", [None, autopar.DataParallel()], ids=["ILP", "DataParallel"])
def test_a_step_pays_its_launch_and_each_buffer_on_the_host(method):
    """A step that waits for its results adds the host's launch and per-buffer costs to the
    device time: here 1 ms + 10 µs for each of the MLP's inputs and outputs."""
    step, state, data = abstract_train_inputs(mlp, MLPConfig(64, 64, 64, 2), 64)
    buffers = len(jax.tree.leaves((state, data))) + len(jax.tree.leaves(state)) + 1  # + loss
    plan, free = (
        autopar.plan(step, state, data, cluster_spec=spec, method=method)
        for spec in (LAUNCH, NO_LAUNCH)
    )
    launched = plan.predicted
    assert launched.compute_s == pytest.approx(free.predicted.compute_s)
    assert launched.host_s == pytest.approx(1e-3 + buffers * 1e-5) and free.predicted.host_s == 0
    assert launched.step_time_s - free.predicted.step_time_s == pytest.approx(launched.host_s)
    assert "host launches 1.31 ms" in plan.summary()


@pytest.mark.parametrize("method", [None, autopar.Zero3Parallel()], ids=["ILP", "ZeRO-3"])
def test_a_step_pays_the_update_of_each_kernel_on_the_host(method):
    """Where a launch updates each kernel (a GPU's graph, whose buffers move every step), the
    host pays it once per kernel the roofline counts: at least every matmul of the forward and
    backward passes, fewer than the step's ops (element-wise chains fuse into one kernel)."""
    step, state, data = abstract_train_inputs(mlp, MLPConfig(64, 64, 64, 2), 64)
    per_kernel = 1e-4
    plan, free = (
        autopar.plan(step, state, data, cluster_spec=spec, method=method)
        for spec in (dataclasses.replace(NO_LAUNCH, kernel_update_s=per_kernel), NO_LAUNCH)
    )
    kernels = plan.predicted.host_s / per_kernel
    assert kernels == pytest.approx(round(kernels))
    matmuls = 2 + 2 + 1  # 2 layers: a forward matmul each, 2 backward for one, 1 for the first
    assert matmuls <= round(kernels) < _num_ops(jax.make_jaxpr(step)(state, data).jaxpr)
    assert plan.predicted.compute_s == pytest.approx(free.predicted.compute_s)
    assert plan.predicted.step_time_s - free.predicted.step_time_s == pytest.approx(
        plan.predicted.host_s
    )


def _adam_like(state, grads):
    params, mu, nu = state
    mu = [0.9 * m + 0.1 * g for m, g in zip(mu, grads, strict=True)]
    nu = [0.99 * v + 0.01 * g * g for v, g in zip(nu, grads, strict=True)]
    params = [p - 1e-3 * m / (jnp.sqrt(v) + 1e-8) for p, m, v in zip(params, mu, nu, strict=True)]
    return (params, mu, nu), 0.0


@pytest.mark.parametrize("platform, kernels", [("gpu", 3), ("cpu", 9)])
def test_a_gpu_updates_each_parameter_and_its_moments_in_one_kernel(platform, kernels):
    """An Adam-like update of 3 parameters writes 9 arrays. XLA:GPU writes a parameter and
    both its moments from one multi-output kernel (they read the same gradient, and the
    parameter reads the moments written): 3 kernels; XLA:CPU runs a kernel per array."""
    spec = dataclasses.replace(  # a 1 s kernel floor: the compute time counts the kernels
        NO_LAUNCH.with_devices(1, 1), platform=platform, kernel_update_s=1e-4, kernel_overhead_s=1
    )
    arrays = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 3
    plan = autopar.plan(_adam_like, (arrays, arrays, arrays), arrays, cluster_spec=spec)
    assert plan.predicted.host_s == pytest.approx(kernels * 1e-4)
    assert round(plan.predicted.compute_s) == kernels


def _num_ops(jaxpr) -> int:
    """Equations of `jaxpr` and of every jaxpr nested in them (a jit's or a custom rule's body)."""
    nested = [p.jaxpr if hasattr(p, "jaxpr") else p for e in jaxpr.eqns for p in e.params.values()]
    return len(jaxpr.eqns) + sum(_num_ops(j) for j in nested if hasattr(j, "eqns"))


def test_a_pipeline_is_no_faster_than_its_host_launches_its_tasks():
    """Every forward and backward task of every stage and micro-batch is one launch from one
    host: with launches slower than any stage, the step is their sum."""
    step, state, data = abstract_train_inputs(mlp, MLPConfig(64, 64, 64, 4), 32)
    method = autopar.PipeshardParallel(
        num_micro_batches=4,
        layer_option=autopar.AutoLayerOption(layer_num=2),
        stage_option=autopar.UniformStageOption(2),
    )
    slow_host = dataclasses.replace(ClusterSpec.local(2), launch_overhead_s=1.0)
    plan = autopar.plan(step, state, data, cluster_spec=slow_host, method=method)
    assert plan.predicted.step_time_s == plan.predicted.host_s == 2 * 4 * 2 * 1.0  # S x M x (F, B)
