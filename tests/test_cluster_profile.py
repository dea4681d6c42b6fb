"""`autopar.profile_cluster`: a ClusterSpec measured on the 8 simulated CPU devices (and on one,
and on Ray workers), its JSON round trips, the link fit on synthetic timings, bad arguments,
and the `autopar profile-cluster` command feeding `autopar plan --cluster`.

Measurements use `SMALL` sizes so the module runs in seconds; the defaults are what users get.
"""

import dataclasses
import functools
import json
import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar import cli
from autopar.planner.cost import Collective
from autopar.runtime import cluster_profile, microbench
from autopar.runtime.cluster_profile import (
    ClusterProfile,
    CollectiveTiming,
    KernelTiming,
    LaunchTiming,
    MatmulKind,
    MatmulTiming,
    ProfileSizes,
    RateKind,
    build_spec,
    fit_all_to_all,
    fit_link,
    l1_set_span,
    last_level_cache_bytes,
    matmul_efficiency,
    measure_cluster,
    predicted_collective_s,
)

KIB = 1 << 10
SMALL = ProfileSizes(
    matmul_sizes=(64,),
    stream_bytes=256 * KIB,
    kernel_ops=16,
    launch_buffers=8,
    collective_bytes=(4 * KIB, 64 * KIB),
    chain=2,
    repeats=3,
)
INTRA = ("intra_host_bandwidth", "intra_host_latency")
INTER = ("inter_host_bandwidth", "inter_host_latency")
# ray.init starts its processes with fork+exec while jax's threads run; exec makes that safe.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")


@pytest.fixture(scope="module")
def eight():
    return measure_cluster(jax.devices(), sizes=SMALL)


@pytest.fixture(scope="module")
def one():
    return measure_cluster(jax.devices()[:1], sizes=SMALL)


@pytest.fixture
def small_defaults(monkeypatch):
    """`profile_cluster` and the CLI measure `SMALL` sizes."""
    monkeypatch.setattr(cluster_profile, "DEFAULT_SIZES", SMALL)


def check_plausible(spec: autopar.ClusterSpec) -> None:
    """Figures a CPU device can have: positive, finite and within wide physical bounds."""
    for field in ("device_flops", "tf32_flops", "fp32_flops"):
        assert 1e7 < getattr(spec, field) < 1e14, field  # 10 MFLOP/s .. 100 TFLOP/s
    assert 1e7 < spec.memory_bandwidth < 1e13
    assert 0 < spec.intra_host_bandwidth < 1e13 and 0 < spec.inter_host_bandwidth < 1e13
    assert 0 <= spec.intra_host_latency < 0.1 and 0 <= spec.inter_host_latency < 0.1
    assert 0 <= spec.kernel_overhead_s < 0.01
    assert 0 < spec.launch_overhead_s < 0.01 and 0 <= spec.buffer_overhead_s < 0.001
    assert 1e6 < spec.transcendental_rate < 1e13  # elements/s
    assert 1e7 < spec.conv_flops < 1e14
    assert 1e6 < spec.transpose_bandwidth < 1e13
    assert 1e7 < spec.transposed_matmul_flops < 1e14
    assert 1e7 < spec.narrow_transposed_matmul_flops < 1e14
    assert 1e6 < spec.window_reduction_rate < 1e13  # window elements/s
    assert 1e3 < spec.select_and_scatter_rate < 1e12  # windows/s
    assert 1e3 < spec.cached_select_and_scatter_rate < 1e12
    assert spec.fresh_memory_rate is None or 1e6 < spec.fresh_memory_rate < 1e13
    if spec.aliasing_stride is not None:  # a Linux host's L1 data cache, size over ways
        assert 64 <= spec.aliasing_stride <= 64 * KIB
        assert 1e6 < spec.many_lines_aliased_loop_rate < 1e13  # elements x arrays / s
        assert 1e6 < spec.aliased_loop_rate < 1e13
    if spec.cached_intra_host_bandwidth is not None:  # collectives slowed beyond the cache
        assert spec.intra_host_bandwidth < spec.cached_intra_host_bandwidth < 1e13
        assert 4 * KIB <= spec.collective_cache_bytes <= 1 << 32
    assert spec.compute_efficiency == spec.memory_efficiency == 1.0
    assert spec.platform == "cpu" and 1e6 < spec.device_memory < 1e14


def test_eight_devices_measure_every_collective_within_the_host(eight):
    spec = eight.spec
    check_plausible(spec)
    assert (spec.physical_mesh_shape, spec.name) == ((1, 8), "profiled-cpu-8")
    assert {t.kind for t in eight.matmul} == set(MatmulKind)
    bf16 = [t.flops_per_s for t in eight.matmul if t.kind is MatmulKind.BF16]
    assert spec.device_flops == statistics.median(bf16)  # robust to one lucky timing
    assert {(t.axis, t.kind, t.num_devices) for t in eight.collectives} == {
        (1, kind, 8) for kind in Collective
    }
    assert all(t.seconds > 0 for t in eight.collectives)
    assert spec.all_to_all_factor > 0 and "all-to-all:" in eight.summary()
    # One host: nothing crosses hosts, so the inter-host link copies the measured intra-host one.
    assert eight.unmeasured == INTER
    assert (spec.inter_host_bandwidth, spec.inter_host_latency) == (
        spec.intra_host_bandwidth,
        spec.intra_host_latency,
    )


def test_each_op_class_rate_sets_its_spec_field(one):
    """One timing per op class; the spec holds its rate (work / seconds), which a matmul's peak
    or the streaming bandwidth would not give: these ops run at rates of their own."""
    assert [t.kind for t in one.rates] == list(RateKind)
    for t in one.rates:
        gpu_only = t.kind in (RateKind.COLUMN_REDUCTION, RateKind.COLUMN_REDUCTION_ARRAY)
        aliased = t.kind in (RateKind.ALIASED_LOOP, RateKind.MANY_LINES_ALIASED_LOOP)
        if gpu_only or (aliased and l1_set_span() is None):  # no cache geometry to read
            assert t.seconds == 0 and getattr(one.spec, t.kind.spec_field) is None
            continue
        assert t.work > 0 and t.seconds > 0
        rate = t.work / t.seconds
        if t.kind is RateKind.TRANSPOSE:  # capped at the streaming kernel's (see below)
            rate = min(rate, one.stream.bytes_per_s)
        assert getattr(one.spec, t.kind.spec_field) == rate
    assert "transcendentals" in one.summary()
    assert "column reductions: at the memory bandwidth (not measured)" in one.summary()
    assert "loops fused into transposing copies:" in one.summary()
    assert one.spec.aliasing_stride == l1_set_span()


def test_a_transpose_is_never_priced_faster_than_the_streaming_kernel(one):
    """A transpose reads and writes what the streaming kernel does: a measured rate above the
    memory bandwidth (transposes that layout assignment made free) is capped at it."""
    fast = [
        dataclasses.replace(t, seconds=t.seconds / 1e6) if t.kind is RateKind.TRANSPOSE else t
        for t in one.rates
    ]
    parts = (one.matmul, one.matmul_ramp, one.stream, one.kernel, one.launch)
    spec, _ = build_spec(jax.devices()[:1], *parts, fast, one.collectives)
    assert spec.transpose_bandwidth == one.stream.bytes_per_s
    spec, _ = build_spec(jax.devices()[:1], *parts, one.rates, one.collectives)
    (transpose,) = [t for t in one.rates if t.kind is RateKind.TRANSPOSE]
    assert spec.transpose_bandwidth == min(transpose.rate, one.stream.bytes_per_s)


def test_the_launch_timing_splits_into_a_launch_and_a_cost_per_buffer(one):
    """t(n buffers in, n out) = launch + 2n x per-buffer, fitted to n = 1 and n = 8; the spec
    holds both parts and the summary names them."""
    launch = one.launch
    assert launch.num_buffers == SMALL.launch_buffers and launch.seconds_one > 0
    assert one.spec.launch_overhead_s == launch.launch_s
    assert one.spec.buffer_overhead_s == launch.per_buffer_s
    made_up = LaunchTiming(num_buffers=11, seconds_one=50e-6, seconds_many=90e-6)
    assert made_up.per_buffer_s == pytest.approx(2e-6)  # 40 µs over 20 more buffers
    assert made_up.launch_s == pytest.approx(46e-6)
    assert LaunchTiming(11, 50e-6, 40e-6).per_buffer_s == 0.0  # noise: never negative
    assert "to launch a program" in one.summary()


def test_the_matmul_ramp_gives_the_share_of_the_peak_by_size(one):
    """Matmuls of growing size, each's rate beyond the kernel floor over the fp32 peak: never
    above 1, never falling as matmuls grow, and the next size up at the peak where the largest
    fell short of it."""
    ramp = one.matmul_ramp
    assert ramp and all(t.kind is MatmulKind.FP32 and t.m == 2 * t.k == 2 * t.n for t in ramp)
    curve = one.spec.matmul_efficiency
    assert curve == matmul_efficiency(ramp, one.spec.kernel_overhead_s, one.spec.tf32_flops)
    fractions = [e for _, e in curve]
    if not curve:  # a floor inflated by a busy machine can swallow every matmul: no points
        assert all(t.seconds <= one.spec.kernel_overhead_s for t in ramp)
    else:
        assert fractions == sorted(fractions) and fractions[0] > 0 and fractions[-1] == 1.0
    made_up = [  # beyond a 1 µs floor: 1 MFLOP in 3 µs, 8 in 32 (a dip), 64 in 128
        MatmulTiming(MatmulKind.FP32, 2 * s, s, s, seconds)
        for s, seconds in ((64, 4e-6), (128, 33e-6), (256, 129e-6))
    ]
    peak = 2 * 128 * 64 * 64 / 1e-6  # 1 µs beyond the floor for 1 MFLOP
    flops = [2.0 * t.m * t.k * t.n for t in made_up]
    points = matmul_efficiency(made_up, 1e-6, peak)
    assert [f for f, _ in points] == [*flops, 8 * flops[2]]
    assert [e for _, e in points] == pytest.approx([1 / 3, 1 / 3, 0.5, 1.0])
    assert matmul_efficiency(made_up[:1], 5e-6, peak) == ()  # no slower than the floor
    assert "matmul rate by size" in one.summary()


def test_the_kernel_timing_splits_off_what_moved_buffers_add_per_kernel(one):
    """The chain of tiny kernels, donated and not: the floor per kernel where the buffer stays,
    and what each kernel adds where it moves (beyond what a moved buffer costs by itself)."""
    kernel = one.kernel
    assert kernel.num_kernels == SMALL.kernel_ops
    assert one.spec.kernel_overhead_s == kernel.per_kernel_s
    assert one.spec.kernel_update_s == kernel.update_per_kernel_s
    made_up = KernelTiming(11, 10e-6, 30e-6, 15e-6, 55e-6)  # moved: +5 µs, +2 µs per kernel
    assert made_up.per_kernel_s == pytest.approx(2e-6)
    assert made_up.update_per_kernel_s == pytest.approx(2e-6)
    assert KernelTiming(11, 10e-6, 30e-6, 15e-6, 30e-6).update_per_kernel_s == 0.0  # noise
    assert "per kernel where the buffers moved" in one.summary()


def test_the_cache_geometry_is_read_off_sysfs(tmp_path, monkeypatch):
    """A 48 KiB 12-way L1 data cache spans 4 KiB with one line per set; no such cache, or a
    sysfs that says nothing usable: None (loops at aliasing strides are then priced as any
    copy). The last-level cache is the largest data or unified one."""

    def cache(index: int, level: int, kind: str, size: str, ways: str) -> None:
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (
            ("level", level),
            ("type", kind),
            ("size", size),
            ("ways_of_associativity", ways),
        ):
            (folder / name).write_text(f"{value}\n")

    monkeypatch.setattr(cluster_profile, "_CACHE_INFO", tmp_path)
    assert l1_set_span() is None
    cache(0, 1, "Instruction", "32K", "8")
    cache(1, 2, "Unified", "1024K", "16")
    assert l1_set_span() is None
    cache(2, 1, "Data", "48K", "12")
    assert l1_set_span() == 4096
    (tmp_path / "index2" / "ways_of_associativity").write_text("fully\n")
    assert l1_set_span() is None
    assert last_level_cache_bytes() == 1 << 20  # instruction caches do not count
    cache(3, 3, "Unified", "32M", "16")
    assert last_level_cache_bytes() == 32 << 20
    monkeypatch.setattr(cluster_profile, "_CACHE_INFO", tmp_path / "none")
    assert last_level_cache_bytes() is None


def test_one_device_has_no_link_and_says_so(one):
    spec = one.spec
    check_plausible(spec)
    assert (spec.physical_mesh_shape, spec.name) == ((1, 1), "profiled-cpu-1")
    assert one.collectives == ()
    assert one.unmeasured == INTRA + INTER
    assert spec.intra_host_bandwidth == spec.memory_bandwidth  # a copy inside the device
    assert spec.intra_host_latency == spec.kernel_overhead_s
    assert "no link to measure" in one.summary()


@pytest.mark.parametrize("which", ["one", "eight"])
def test_spec_and_profile_round_trip_through_json(which, request, tmp_path):
    profile = request.getfixturevalue(which)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(profile.spec.to_dict()))
    assert autopar.ClusterSpec.from_json_file(path) == profile.spec
    assert ClusterProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_profile_from_bad_dict_names_the_problem(one):
    d = one.to_dict()
    with pytest.raises(autopar.InvalidArgumentError, match=r"missing keys \['stream'\]"):
        ClusterProfile.from_dict({k: v for k, v in d.items() if k != "stream"})
    d["collectives"] = [{"axis": 1, "kind": "all-shuffle"}]
    with pytest.raises(autopar.InvalidArgumentError, match="all-shuffle"):
        ClusterProfile.from_dict(d)


def _synthetic(latency: float, bandwidth: float, n: int = 4) -> list[CollectiveTiming]:
    return [
        CollectiveTiming(1, kind, b, n, kind.cost(b, n, bandwidth, latency))
        for kind in Collective
        for b in (1 << 12, 1 << 16, 1 << 20)
    ]


def test_fit_link_recovers_the_cost_model_and_stays_physical():
    link = fit_link(_synthetic(7e-6, 40e9))
    assert link.latency == pytest.approx(7e-6, rel=1e-6)
    assert link.bandwidth == pytest.approx(40e9, rel=1e-6)
    assert link.cached_bandwidth is None
    # Times below the formula's zero-latency line would fit α < 0: α stays 0.
    shifted = [dataclasses.replace(t, seconds=t.seconds * 0.5) for t in _synthetic(0, 1e9)]
    shifted[0] = dataclasses.replace(shifted[0], seconds=shifted[0].seconds * 0.2)
    link = fit_link(shifted)
    assert link.latency == pytest.approx(0, abs=1e-12) and link.bandwidth > 0
    # Times that do not grow with size: all latency, and the best rate reached as bandwidth.
    flat = [dataclasses.replace(t, seconds=1e-4) for t in _synthetic(0, 1e9)]
    link = fit_link(flat)
    best = max(t.kind.cost(t.num_bytes, t.num_devices, 1, 0) / t.seconds for t in flat)
    assert link.bandwidth == pytest.approx(best) and link.latency == pytest.approx(1e-4)
    with pytest.raises(autopar.InvalidArgumentError, match="at least 2 timings"):
        fit_link(flat[:1])


def _cached(latency: float, bandwidth: float, cached: float, cache_bytes: float, n: int = 4):
    """Timings from the cost model over a link with a cached bandwidth, n devices, B from 4 KiB
    to 16 MiB: some buffers fit in `cache_bytes` per device, some spill."""
    spec = dataclasses.replace(
        autopar.ClusterSpec.local(n),
        intra_host_bandwidth=bandwidth,
        intra_host_latency=latency,
        cached_intra_host_bandwidth=cached,
        collective_cache_bytes=cache_bytes,
    )
    timings = [
        CollectiveTiming(1, kind, b, n, 1.0)
        for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
        for b in (1 << 12, 1 << 16, 1 << 20, 1 << 24)
    ]
    return [dataclasses.replace(t, seconds=predicted_collective_s(spec, t)) for t in timings]


def test_fit_link_finds_the_bandwidth_within_the_cache():
    """Collectives whose buffers outgrow 1 MiB per device slow from 20 to 5 GB/s: given the
    cache, the fit recovers both; without it, or where the timings all fit, one bandwidth;
    where those beyond the cache run no slower, or barely, one bandwidth too."""
    timings = _cached(7e-6, 5e9, 20e9, float(1 << 20))
    link = fit_link(timings, cache_bytes=float(1 << 20))
    assert (link.latency, link.bandwidth, link.cached_bandwidth) == (
        pytest.approx(7e-6, rel=1e-5),
        pytest.approx(5e9, rel=1e-5),
        pytest.approx(20e9, rel=1e-5),
    )
    assert fit_link(timings).cached_bandwidth is None
    assert fit_link(timings, cache_bytes=float(1 << 30)).cached_bandwidth is None
    uniform = _synthetic(7e-6, 5e9)
    uniform = [t for t in uniform if t.kind is not Collective.ALL_TO_ALL]
    link = fit_link(uniform, cache_bytes=float(1 << 17))
    assert link.cached_bandwidth is None and link.bandwidth == pytest.approx(5e9, rel=1e-5)
    barely = _cached(7e-6, 5e9, 5.1e9, float(1 << 20))  # 2% slower beyond: noise, not a cache
    assert fit_link(barely, cache_bytes=float(1 << 20)).cached_bandwidth is None


@pytest.mark.parametrize("cache", [8 << 20, None])
def test_a_cpu_profile_fits_the_bandwidth_within_its_last_level_cache(eight, monkeypatch, cache):
    """The host's last-level cache (8 MiB here) over its 8 devices is the cache per device the
    collectives are fitted with; a host whose cache sysfs does not give: one bandwidth."""
    monkeypatch.setattr(cluster_profile, "last_level_cache_bytes", lambda: cache)
    timings = _cached(7e-6, 5e9, 20e9, float(1 << 20), n=8)
    parts = (eight.matmul, eight.matmul_ramp, eight.stream, eight.kernel, eight.launch)
    spec, _ = build_spec(jax.devices(), *parts, eight.rates, timings)
    if cache is None:
        assert spec.collective_cache_bytes is spec.cached_intra_host_bandwidth is None
        return
    assert spec.collective_cache_bytes == 1 << 20
    assert spec.cached_intra_host_bandwidth == pytest.approx(20e9, rel=1e-5)
    assert spec.intra_host_bandwidth == pytest.approx(5e9, rel=1e-5)
    assert (spec.inter_host_bandwidth, spec.inter_host_latency) == (
        spec.intra_host_bandwidth,
        spec.intra_host_latency,
    )
    profile = dataclasses.replace(eight, spec=spec, collectives=tuple(timings))
    assert "20 GB/s while a collective's buffers fit in 1.05 MB of cache" in profile.summary()


def test_all_to_all_is_fitted_as_a_factor_on_the_other_collectives_link():
    """All-to-alls 5x slower than Alpa's formula leave the link fitted to the other collectives
    as it is and set `all_to_all_factor` to 5, which the cost model then applies."""
    timings = [
        dataclasses.replace(t, seconds=7e-6 + 5 * (t.seconds - 7e-6))
        if t.kind is Collective.ALL_TO_ALL
        else t
        for t in _synthetic(7e-6, 40e9)
    ]
    others = [t for t in timings if t.kind is not Collective.ALL_TO_ALL]
    link = fit_link(others)
    assert (link.latency, link.bandwidth) == (pytest.approx(7e-6), pytest.approx(40e9))
    factor = fit_all_to_all(timings, {1: link})
    assert factor == pytest.approx(5)
    assert fit_all_to_all(others, {1: link}) == 1.0  # none timed
    spec = dataclasses.replace(
        autopar.ClusterSpec.local(4),
        intra_host_bandwidth=link.bandwidth,
        intra_host_latency=link.latency,
        all_to_all_factor=factor,
    )
    for t in timings:
        assert predicted_collective_s(spec, t) == pytest.approx(t.seconds)


def test_profile_cluster_defaults_to_the_runtime_devices(small_defaults):
    autopar.init("local", num_devices=1)
    try:
        spec = autopar.profile_cluster()
    finally:
        autopar.shutdown()
    assert spec.physical_mesh_shape == (1, 1)
    check_plausible(spec)


BAD_DEVICES = {
    "a device": (lambda: jax.devices()[0], "is not a list"),
    "empty": (lambda: [], r"devices=\[\] is empty"),
    "a string": (lambda: ["cpu:0"], "holds 'cpu:0', not a jax device"),
    "twice": (lambda: [jax.devices()[0]] * 2, "lists a device twice"),
}


@pytest.mark.parametrize("make,message", BAD_DEVICES.values(), ids=BAD_DEVICES.keys())
def test_bad_devices_are_named(make, message):
    with pytest.raises(autopar.InvalidArgumentError, match=message) as info:
        autopar.profile_cluster(make())
    assert "pass a list of jax devices" in str(info.value)


def test_bad_sizes_are_named():
    with pytest.raises(autopar.InvalidArgumentError, match=r"ProfileSizes.chain=1 .* at least 2"):
        ProfileSizes(chain=1)
    with pytest.raises(autopar.InvalidArgumentError, match="increasing positive ints"):
        ProfileSizes(matmul_sizes=(1024, 512))
    with pytest.raises(autopar.InvalidArgumentError, match="launch_buffers=1 .* at least 2"):
        ProfileSizes(launch_buffers=1)
    with pytest.raises(autopar.InvalidArgumentError, match="sizes='big' must be a ProfileSizes"):
        measure_cluster(sizes="big")


def test_cli_writes_a_spec_that_plan_accepts(tmp_path, capsys, small_defaults):
    path = tmp_path / "spec.json"
    code = cli.main(["profile-cluster", "--out", str(path), "--devices", "2", "-q"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("profiled-cpu-2: 1 host(s) x 2 cpu device(s)")
    spec = autopar.ClusterSpec.from_json_file(path)
    assert spec.physical_mesh_shape == (1, 2)
    check_plausible(spec)
    code = cli.main(["plan", "mlp", "--cluster", str(path), "-q"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "profiled-cpu-2" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--out", "/no/such/dir/spec.json"], "--out '/no/such/dir/spec.json': directory"),
        (["--out", "{tmp}/s.json", "--devices", "99"], r"--devices 99: this machine has 8 cpu"),
        (["--out", "{tmp}/s.json", "--devices", "0"], "must be a positive integer"),
        ([], "required: --out"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    argv = ["profile-cluster", *(a.format(tmp=tmp_path) for a in argv)]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.xdist_group("ray")  # one local Ray instance at a time (`make test` runs -n 2)
def test_on_ray_each_host_is_a_mesh_worker():
    ray = pytest.importorskip("ray")
    from ray._private import state

    assert not ray.is_initialized()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        two_by_two = dataclasses.replace(autopar.ClusterSpec.local(2), num_hosts=2)
        autopar.init("ray", cluster_spec=two_by_two)
        try:
            profile = measure_cluster(sizes=SMALL)
        finally:
            autopar.shutdown()
        alive = [a for a in state.actors().values() if a["State"] == "ALIVE"]
    finally:
        ray.shutdown()
    assert profile.spec.physical_mesh_shape == (2, 2)
    assert profile.unmeasured == ()  # both axes have a link: across and within the hosts
    assert {(t.axis, t.num_devices) for t in profile.collectives} == {(0, 2), (1, 2)}
    check_plausible(profile.spec)
    assert alive == []


class _FakeDevice:
    platform = "gpu"


class _OnAccelerator:
    """Stands in for an array on an accelerator: `_op_s` asks only for its devices."""

    def devices(self):
        return {_FakeDevice()}


def test_on_an_accelerator_an_op_is_a_chain_less_a_program_of_one(monkeypatch):
    """A GPU program's launch and wait (50-150 µs) outweigh a mid-sized op: the op's time is
    (t_chain - t_1) / (chain - 1), not t_chain / chain."""
    launch, op = 100e-6, 10e-6
    monkeypatch.setattr(microbench, "_compiled", lambda fun, x, consts: fun)
    monkeypatch.setattr(microbench, "_chained", lambda step, times: times)
    timed = lambda times, x, consts, calls, repeats: (launch + times * op, x)  # noqa: E731
    monkeypatch.setattr(microbench, "_timed_calls", timed)
    sizes = dataclasses.replace(SMALL, chain=4)
    seconds = microbench._op_s(lambda body: body, None, _OnAccelerator(), (), sizes)
    assert seconds == pytest.approx(op)
    # where noise swallowed the ops, the upper bound t_chain / chain stands
    monkeypatch.setattr(microbench, "_timed_calls", lambda *a: (launch, a[1]))
    seconds = microbench._op_s(lambda body: body, None, _OnAccelerator(), (), sizes)
    assert seconds == pytest.approx(launch / 4)


def test_the_convolution_is_timed_at_growing_batches_until_a_run_would_be_too_long(monkeypatch):
    """Batches grow 4x while a run of the next stays within `max_run_s`; the last, largest
    convolution's timing counts (its rate is the best here, as on a GPU)."""
    batches = []

    def op_s(wrap, step, x, consts, sizes):
        batch = x.shape[0]
        batches.append(batch)
        return 1e-3 + batch * 1e-4  # a fixed cost amortized over more images

    monkeypatch.setattr(microbench, "_op_s", op_s)
    timing = microbench.measure_convolution(jax.devices()[:1], SMALL)
    assert batches == [1, 4, 16, 64]  # 64: (1 + 2) x 7.4 ms x 4 > 50 ms, the last measured
    assert timing.work == 2 * 64 * 32 * 32 * 64 * 64 * 9 and timing.seconds == 1e-3 + 64e-4


def test_the_fused_column_reduction_benchmark_keeps_its_values_finite_over_its_chain():
    """The profile chains `sizes.kernel_ops` of these steps on a GPU: each must leave x near 0.5
    and the column sums finite, or the timed kernels would run on infinities."""
    rows, width = 512, 32
    x, m = jnp.full((rows, width), 0.5, jnp.float32), jnp.full((width,), 0.25, jnp.float32)
    step = jax.jit(functools.partial(microbench._column_with_output, rows=rows))
    for _ in range(cluster_profile.DEFAULT_SIZES.kernel_ops):
        x, m = step((x, m))
    assert np.allclose(x, 0.5, atol=1e-3) and np.allclose(m, rows * 0.25, rtol=1e-2)
