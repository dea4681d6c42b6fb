"""ClusterSpec and the α-β cost model, checked against hand-computed numbers (no devices)."""

import dataclasses
import json

import pytest

from autopar.planner import cost
from autopar.planner.cluster import PRESETS, ClusterSpec, preset_names
from autopar.planner.cost import LogicalMesh, logical_mesh, resharding_cost, spec_bytes_per_device
from autopar.planner.errors import AutoparError, InvalidArgumentError

SPEC_KW = dict(
    num_hosts=2,
    devices_per_host=4,
    device_flops=1e12,
    device_memory=16e9,
    intra_host_bandwidth=100e9,
    inter_host_bandwidth=10e9,
    intra_host_latency=1e-5,
    inter_host_latency=2e-5,
)

# ---- formulas ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, expected",
    [
        (cost.all_reduce_cost, 2e-5 + 2 * 3 / 4 * 1e9 / 1e10),  # 0.15002
        (cost.all_gather_cost, 2e-5 + 3 / 4 * 1e9 / 1e10),  # 0.07502
        (cost.reduce_scatter_cost, 2e-5 + 3 / 4 * 1e9 / 1e10),
        (cost.all_to_all_cost, 2e-5 + 3 / 16 * 1e9 * 2 / 1e10),  # 0.03752
    ],
)
def test_collective_formulas(fn, expected):
    assert fn(1e9, 4, 1e10, 2e-5) == pytest.approx(expected)
    assert fn(1e9, 1, 1e10, 2e-5) == 0.0  # one device: no communication, no latency
    with pytest.raises(ValueError, match="n=0"):
        fn(1e9, 0, 1e10, 2e-5)


def test_hand_computed_numbers():
    assert cost.all_reduce_cost(1e9, 8, 100e9, 1e-5) == pytest.approx(0.01751)
    assert cost.all_to_all_cost(1e9, 4, 1e10, 2e-5) == pytest.approx(0.03752)
    assert cost.Collective.ALL_GATHER.cost(1e9, 4, 1e10, 0) == pytest.approx(0.075)


# ---- ClusterSpec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, flops, memory, intra_bw, inter_bw",
    [
        ("8xV100-p3", 125e12, 16e9, 130e9, 3.125e9 / 8),
        ("8xA100-80G", 312e12, 80e9, 200e9, 90e9 / 8),
        ("8xH100-80G", 989e12, 80e9, 370e9, 45e9),
    ],
)
def test_presets_have_documented_figures(name, flops, memory, intra_bw, inter_bw):
    spec = ClusterSpec.preset(name)
    assert (spec.name, spec.physical_mesh_shape, spec.num_devices) == (name, (1, 8), 8)
    assert (spec.device_flops, spec.device_memory) == (flops, memory)
    assert spec.intra_host_bandwidth == pytest.approx(intra_bw)
    assert spec.inter_host_bandwidth == pytest.approx(inter_bw)
    assert spec.intra_host_latency == pytest.approx(11.8e-6)
    assert spec.inter_host_latency == pytest.approx(22.4e-6)


def test_preset_names_and_host_prefix():
    assert preset_names() == sorted(PRESETS) and "8xV100-p3" in preset_names()
    two = ClusterSpec.preset("2x8xV100-p3")
    assert (two.num_hosts, two.devices_per_host, two.num_devices) == (2, 8, 16)
    assert two.name == "2x8xV100-p3"
    assert two.device_flops == ClusterSpec.preset("8xV100-p3").device_flops
    assert ClusterSpec.preset("8x8xH100-80G").physical_mesh_shape == (8, 8)
    assert ClusterSpec.preset("1x8xA100-80G") == ClusterSpec.preset("8xA100-80G")


@pytest.mark.parametrize("name", ["TPUv9", "2xV100-p3", "0x8xV100-p3", "x8xV100-p3"])
def test_unknown_preset_lists_known_ones(name):
    with pytest.raises(AutoparError, match=r"8xA100-80G, 8xH100-80G, 8xV100-p3|at least 1 host"):
        ClusterSpec.preset(name)


@pytest.mark.parametrize(
    "name, meant",
    [("8xV100p3", "8xV100-p3"), ("8xH100", "8xH100-80G"), ("2x8xA100-80", "2x8xA100-80G")],
)
def test_a_misspelt_preset_names_the_closest_one(name, meant):
    with pytest.raises(InvalidArgumentError, match=rf"did you mean '{meant}'\?"):
        ClusterSpec.preset(name)
    assert ClusterSpec.preset(meant).num_devices >= 8


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_hosts", 0),
        ("devices_per_host", 2.5),
        ("devices_per_host", True),
        ("device_flops", -1.0),
        ("device_memory", 0),
        ("intra_host_bandwidth", float("inf")),
        ("inter_host_bandwidth", "fast"),
        ("intra_host_latency", -1e-6),
        ("inter_host_latency", float("nan")),
        ("name", ""),
        ("platform", "tpu"),
    ],
)
def test_validation_names_field_and_value(field, value):
    with pytest.raises(InvalidArgumentError, match=rf"ClusterSpec\.{field} .*got {value!r}"):
        ClusterSpec(**{**SPEC_KW, field: value})


def test_zero_latency_is_allowed_and_numbers_are_normalised():
    spec = ClusterSpec(**{**SPEC_KW, "intra_host_latency": 0, "device_flops": 10**12})
    assert spec.intra_host_latency == 0.0 and isinstance(spec.device_flops, float)


@pytest.mark.parametrize("spec", [ClusterSpec(**SPEC_KW), *PRESETS.values(), ClusterSpec.local(4)])
def test_dict_and_json_round_trip(spec, tmp_path):
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec.to_dict()))
    assert ClusterSpec.from_json_file(path) == spec


def test_from_dict_names_missing_and_unknown_keys():
    d = ClusterSpec(**SPEC_KW).to_dict()
    del d["device_flops"]
    d["flops"] = 1.0
    with pytest.raises(
        ValueError, match=r"missing keys \['device_flops'\], unknown keys \['flops'"
    ):
        ClusterSpec.from_dict(d)
    d = ClusterSpec(**SPEC_KW).to_dict()
    del d["name"]  # optional
    assert ClusterSpec.from_dict(d).name == "custom"


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "needs a mapping"),
        ('{"num_hosts": 1}', "missing"),
    ],
)
def test_from_json_file_errors_name_the_file(tmp_path, content, problem):
    path = tmp_path / "bad_cluster.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"bad_cluster\.json.*{problem}"):
        ClusterSpec.from_json_file(path)
    with pytest.raises(ValueError, match=r"cannot read .*nope\.json"):
        ClusterSpec.from_json_file(tmp_path / "nope.json")


def test_with_devices_and_local():
    sub = ClusterSpec.preset("4x8xA100-80G").with_devices(2, 8)
    assert sub.physical_mesh_shape == (2, 8) and sub.device_flops == 312e12
    with pytest.raises(ValueError, match=r"\(1, 16\) does not fit .* \(4, 8\)"):
        ClusterSpec.preset("4x8xA100-80G").with_devices(1, 16)
    local = ClusterSpec.local(8)
    assert local.physical_mesh_shape == (1, 8) and local.name == "local-8"
    assert local.platform == "cpu" and all(p.platform == "gpu" for p in PRESETS.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        local.num_hosts = 2


# ---- logical meshes ------------------------------------------------------------------------------

V100_2x8 = ClusterSpec.preset("2x8xV100-p3")
INTRA = (V100_2x8.intra_host_bandwidth, V100_2x8.intra_host_latency)
INTER = (V100_2x8.inter_host_bandwidth, V100_2x8.inter_host_latency)


@pytest.mark.parametrize(
    "shape, axes",
    [
        ((2, 8), (INTER, INTRA)),
        ((1, 8), (INTRA, INTRA)),
        ((2, 4), (INTRA, INTRA)),
        ((4, 4), (INTER, INTRA)),
        ((1, 16), (INTER, INTER)),
        ((8,), (INTRA,)),
        ((16,), (INTER,)),
    ],
)
def test_logical_mesh_axis_figures(shape, axes):
    mesh = logical_mesh(V100_2x8, shape)
    assert mesh.shape == shape and mesh.axis_names == ("x", "y")[: len(shape)]
    assert mesh.bandwidths == tuple(bw for bw, _ in axes)
    assert mesh.latencies == tuple(lat for _, lat in axes)


def test_logical_mesh_errors_and_axis_lookup():
    with pytest.raises(ValueError, match=r"\(4, 8\) needs 32 devices .* has 16"):
        logical_mesh(V100_2x8, (4, 8))
    with pytest.raises(ValueError, match="1D or 2D"):
        logical_mesh(V100_2x8, (2, 2, 2))
    mesh = logical_mesh(V100_2x8, (2, 8), axis_names=("dp", "tp"))
    assert (mesh.num_devices, mesh.axis_size("tp"), mesh.axis_size(0)) == (16, 8, 2)
    with pytest.raises(ValueError, match=r"'z' is not in mesh with axes \('dp', 'tp'\)"):
        mesh.axis_size("z")


def test_mesh_collectives_over_several_axes_use_slowest_link():
    mesh = LogicalMesh((2, 4), ("x", "y"), bandwidths=(1e9, 1e10), latencies=(1e-5, 1e-6))
    assert mesh.all_reduce_cost(1e8, ("y",)) == pytest.approx(1e-6 + 2 * 3 / 4 * 1e8 / 1e10)
    assert mesh.all_reduce_cost(1e8, "x") == pytest.approx(1e-5 + 2 * 1 / 2 * 1e8 / 1e9)
    assert mesh.all_gather_cost(1e8, ("x", "y")) == pytest.approx(1e-5 + 7 / 8 * 1e8 / 1e9)
    assert mesh.reduce_scatter_cost(1e8, ()) == 0.0
    assert mesh.all_to_all_cost(1e8, ("y",)) == pytest.approx(1e-6 + 3 / 16 * 1e8 * 2 / 1e10)


# ---- resharding ----------------------------------------------------------------------------------

MESH = LogicalMesh((2, 4), ("x", "y"), bandwidths=(1e9, 1e10), latencies=(1e-5, 1e-6))
SHAPE = (1024, 1024)
TOTAL = 1024 * 1024 * 4  # float32


def test_spec_bytes_per_device():
    assert spec_bytes_per_device(SHAPE, 4, (None, None), MESH) == TOTAL
    assert spec_bytes_per_device(SHAPE, 4, (("x",), "y"), MESH) == TOTAL / 8
    assert spec_bytes_per_device(SHAPE, 2, ((), ("y",)), MESH) == TOTAL / 2 / 4


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        ((("x",), ("y",)), (("x",), ("y",)), 0.0),  # same
        ((None, None), (("x",), None), 0.0),  # replicated -> sharded: local slice
        ((("x",), None), (("x", "y"), None), 0.0),  # further split of the same dim
        ((None, ("y",)), (("x",), ("y",)), 0.0),
        # x removed from dim 0: all-gather over x of the per-device size under dst (TOTAL / 4)
        ((("x",), ("y",)), (None, ("y",)), 1e-5 + 1 / 2 * (TOTAL / 4) / 1e9),
        ((("x",), ("y",)), (None, None), 1e-5 + 7 / 8 * TOTAL / 1e9),
        # new split y on an untouched dim is sliced before gathering x
        ((("x",), None), (None, ("y",)), 1e-5 + 1 / 2 * (TOTAL / 4) / 1e9),
        # y moves from dim 0 to dim 1: all-to-all over y of the per-device shard
        ((("y",), None), (None, ("y",)), 1e-6 + 3 / 16 * (TOTAL / 4) * 2 / 1e10),
        # x and y swap dims: one all-to-all over both (slowest link)
        ((("x",), ("y",)), (("y",), ("x",)), 1e-5 + 7 / 64 * (TOTAL / 8) * 4 / 1e9),
        # x replaced by y within dim 0: gather x (carrying the y split), then slice y
        ((("x",), None), (("y",), None), 1e-5 + 1 / 2 * TOTAL / 1e9),
        # reorder within a dim: gather to replicated, then slice
        ((("x", "y"), None), (("y", "x"), None), 1e-5 + 7 / 8 * TOTAL / 1e9),
    ],
)
def test_resharding_cost_cases(src, dst, expected):
    assert resharding_cost(MESH, SHAPE, 4, src, dst) == pytest.approx(expected)


@pytest.mark.parametrize(
    "src, dst",
    [((("x",), None), (None, None)), ((("y",), None), (None, "y")), (("x", "y"), ("y", "x"))],
)
def test_resharding_cost_grows_with_bytes(src, dst):
    small = resharding_cost(MESH, (256, 1024), 4, src, dst)
    big = resharding_cost(MESH, (1024, 1024), 4, src, dst)
    assert 0 < small < big
    assert resharding_cost(MESH, (1024, 1024), 2, src, dst) < big


@pytest.mark.parametrize(
    "spec, message",
    [
        ((None,), r"has 1 entries for a tensor of shape \(1024, 1024\)"),
        ((("z",), None), r"axis 'z' .* not in mesh axes \('x', 'y'\)"),
        ((("x",), ("x",)), "more than one dim"),
    ],
)
def test_resharding_rejects_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        resharding_cost(MESH, SHAPE, 4, spec, (None, None))


def test_all_to_all_factor_scales_only_the_all_to_all_bytes_term():
    plain = LogicalMesh((4,), ("x",), (1e9,), (1e-5,))
    slow = dataclasses.replace(plain, all_to_all_factor=3.0)
    nbytes = 1 << 20
    base = plain.all_to_all_cost(nbytes, "x")
    assert slow.all_to_all_cost(nbytes, "x") == pytest.approx(1e-5 + 3 * (base - 1e-5))
    assert slow.all_reduce_cost(nbytes, "x") == plain.all_reduce_cost(nbytes, "x")
    single = dataclasses.replace(slow, shape=(1,))
    assert single.all_to_all_cost(nbytes, "x") == 0.0
    spec = dataclasses.replace(ClusterSpec.local(4), all_to_all_factor=3.0)
    assert logical_mesh(spec, (4,)).all_to_all_factor == 3.0


def test_collectives_move_their_cached_share_at_the_cached_bandwidth():
    """With 1 MiB of cache per device at 8 GB/s over a 2 GB/s link: an all-reduce whose 2·B of
    buffers fit runs at 8 GB/s, one of 4 MiB (8 MiB of buffers, 1/8 of them cached) moves 7/8 of
    its bytes at 2 GB/s; a reduce-scatter of 4 MiB holds (1 + 1/4)·B per device."""
    cached = LogicalMesh(
        (4,), ("x",), (2e9,), (1e-5,), cached_bandwidths=(8e9,), cache_bytes=float(1 << 20)
    )
    small, big = 1 << 18, 4 << 20
    assert cached.all_reduce_cost(small, "x") == pytest.approx(1e-5 + 1.5 * small / 8e9)
    expected = 1e-5 + 1.5 * big * (7 / 8 / 2e9 + 1 / 8 / 8e9)
    assert cached.all_reduce_cost(big, "x") == pytest.approx(expected)
    footprint = big * 1.25
    cached_share = (1 << 20) / footprint
    expected = 1e-5 + 0.75 * big * ((1 - cached_share) / 2e9 + cached_share / 8e9)
    assert cached.reduce_scatter_cost(big, "x") == pytest.approx(expected)
    # the all-to-all factor scales the whole bytes term; one device stays free
    slow = dataclasses.replace(cached, all_to_all_factor=3.0)
    assert slow.all_to_all_cost(big, "x") - 1e-5 == pytest.approx(
        3 * (cached.all_to_all_cost(big, "x") - 1e-5)
    )
    assert dataclasses.replace(cached, shape=(1,)).all_reduce_cost(big, "x") == 0.0


def test_a_collective_runs_at_a_cached_bandwidth_only_where_all_its_axes_have_one():
    mesh = LogicalMesh(
        (2, 4),
        ("hosts", "devices"),
        (1e9, 2e9),
        (1e-5, 1e-6),
        cached_bandwidths=(None, 8e9),
        cache_bytes=float(1 << 30),
    )
    nbytes = 1 << 20
    assert mesh.all_gather_cost(nbytes, "devices") == pytest.approx(1e-6 + 3 / 4 * nbytes / 8e9)
    assert mesh.all_gather_cost(nbytes, "hosts") == pytest.approx(1e-5 + 1 / 2 * nbytes / 1e9)
    both = 1e-5 + 7 / 8 * nbytes / 1e9
    assert mesh.all_gather_cost(nbytes, ("hosts", "devices")) == pytest.approx(both)


def test_a_spec_with_a_collective_cache_gives_it_to_the_axes_within_a_host():
    spec = dataclasses.replace(
        ClusterSpec.local(8).with_devices(1, 4),
        num_hosts=2,
        cached_intra_host_bandwidth=40e9,
        collective_cache_bytes=4e6,
    )
    mesh = logical_mesh(spec, (2, 4))
    assert (mesh.cached_bandwidths, mesh.cache_bytes) == ((None, 40e9), 4e6)
    assert logical_mesh(ClusterSpec.local(8), (8,)).cached_bandwidths is None
    with pytest.raises(ValueError, match="go together"):
        dataclasses.replace(spec, collective_cache_bytes=None)
    with pytest.raises(ValueError, match="cached_intra_host_bandwidth must be a positive"):
        dataclasses.replace(spec, cached_intra_host_bandwidth=-1.0)
    with pytest.raises(ValueError, match="one entry per axis"):
        LogicalMesh((4,), ("x",), (1e9,), (0.0,), cached_bandwidths=(1e9,), cache_bytes=None)
