"""ShardParallel: the ILP's choices on MLP, attention, MoE and GPT, checked on the compiled
program (output shardings, collectives in the HLO, XLA's memory analysis) and against the serial
`jax.jit` step."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import relative_error
from jax.sharding import Mesh

import autopar
from autopar.api import trace_for_method
from autopar.models import GPTConfig, MoEConfig, abstract_train_inputs, gpt, moe
from autopar.planner import intra
from autopar.planner.batch_dims import batch_dims
from autopar.planner.cost import logical_mesh
from autopar.planner.groups import group_graph
from autopar.planner.intra import IntraOpConfig, ShardingProblem, program_structure
from autopar.planner.memory import value_aval
from autopar.planner.menus import MeshCache
from autopar.planner.plan import MeshPlan
from autopar.tracing import resolve_argnums

FOUR = jax.devices()[:4]


def _sgd_step(loss):
    def train_step(params, batch):
        grads = autopar.grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return train_step


def _mlp_loss(p, batch):
    h = jax.nn.relu(batch["x"] @ p["w1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def _mlp(batch_size, din, hidden):
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(k1, (din, hidden)) * 0.05,
        "w2": jax.random.normal(k2, (hidden, din)) * 0.05,
    }
    batch = {
        "x": jax.random.normal(k3, (batch_size, din)),
        "y": jax.random.normal(k4, (batch_size, din)),
    }
    return _sgd_step(_mlp_loss), params, batch


def _attention_loss(p, batch):
    x = batch["x"]
    q = jnp.einsum("bsd,dhk->bshk", x, p["wq"])
    k = jnp.einsum("bsd,dhk->bshk", x, p["wk"])
    v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
    a = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k) / 8.0, axis=-1)
    y = jnp.einsum("bqhk,hkd->bqd", jnp.einsum("bhqs,bshk->bqhk", a, v), p["wo"])
    return jnp.mean((y - batch["y"]) ** 2)


def _attention(batch_size, seq, d, heads):
    ks = jax.random.split(jax.random.PRNGKey(1), 6)
    hd = d // heads
    params = {
        name: jax.random.normal(key, shape) * 0.05
        for name, key, shape in [
            ("wq", ks[0], (d, heads, hd)),
            ("wk", ks[1], (d, heads, hd)),
            ("wv", ks[2], (d, heads, hd)),
            ("wo", ks[3], (heads, hd, d)),
        ]
    }
    batch = {
        "x": jax.random.normal(ks[4], (batch_size, seq, d)),
        "y": jax.random.normal(ks[5], (batch_size, seq, d)),
    }
    return _sgd_step(_attention_loss), params, batch


def _moe_loss(p, batch):
    """GShard-style MoE: tokens in groups, top-1 dispatch to capacity slots by einsum."""
    x = batch["x"]  # (groups, tokens per group, d)
    probs = jax.nn.softmax(jnp.einsum("gsd,de->gse", x, p["gate"]), axis=-1)
    experts, tokens = p["gate"].shape[1], x.shape[1]
    capacity = 2 * tokens // experts
    choice = jax.nn.one_hot(jnp.argmax(probs, axis=-1), experts)
    slot = jnp.sum(jnp.cumsum(choice, axis=1) * choice, axis=-1).astype(jnp.int32) - 1
    dispatch = choice[..., None] * jax.nn.one_hot(slot, capacity)[:, :, None, :]
    combine = dispatch * jnp.max(probs, axis=-1)[..., None, None]
    xe = jnp.einsum("gsd,gsec->egcd", x, dispatch)
    h = jax.nn.relu(jnp.einsum("egcd,edf->egcf", xe, p["w1"]))
    y = jnp.einsum("egcd,gsec->gsd", jnp.einsum("egcf,efd->egcd", h, p["w2"]), combine)
    return jnp.mean((y - batch["y"]) ** 2)


def _moe(groups=8, tokens=64, d=256, experts=4, ffn=1024):
    ks = jax.random.split(jax.random.PRNGKey(2), 5)
    params = {
        "gate": jax.random.normal(ks[0], (d, experts)) * 0.05,
        "w1": jax.random.normal(ks[1], (experts, d, ffn)) * 0.05,
        "w2": jax.random.normal(ks[2], (experts, ffn, d)) * 0.05,
    }
    batch = {
        "x": jax.random.normal(ks[3], (groups, tokens, d)),
        "y": jax.random.normal(ks[4], (groups, tokens, d)),
    }
    return _sgd_step(_moe_loss), params, batch


NHWC = ("NHWC", "HWIO", "NHWC")


def _convs_loss(p, batch):
    """Three 1x1 convolutions (NHWC) with relus between them."""
    h = batch["x"]
    for k, name in enumerate(("w1", "w2", "w3")):
        h = jax.lax.conv_general_dilated(
            jax.nn.relu(h) if k else h, p[name], (1, 1), "SAME", dimension_numbers=NHWC
        )
    return jnp.mean(h**2)


def _convs(batch_size=2, size=8, channels=512):
    """Few images, many channels: the plan splits channels, and reduce-scatters some partial
    sums of convolutions that split their input channels."""
    ks = jax.random.split(jax.random.PRNGKey(4), 4)
    params = {
        name: jax.random.normal(key, (1, 1, channels, channels)) * 0.05
        for name, key in zip(("w1", "w2", "w3"), ks[:3], strict=True)
    }
    batch = {"x": jax.random.normal(ks[3], (batch_size, size, size, channels))}
    return _sgd_step(_convs_loss), params, batch


def _run(step_fn, params, batch, devices=FOUR, **option):
    """(parallel step, executable, outputs); the outputs are checked against the serial step."""
    method = autopar.ShardParallel(
        devices=devices, auto_sharding_option=autopar.AutoShardingOption(**option)
    )
    step = autopar.parallelize(step_fn, method=method)
    executable = step.get_executable(params, batch)
    out = step(params, batch)
    assert relative_error(out, jax.jit(step_fn)(params, batch)) <= 1e-5
    return step, executable, out


def _specs(out):
    """Each output's PartitionSpec as a tuple with one entry per dim."""
    return {
        k: tuple(v.sharding.spec) + (None,) * (v.ndim - len(v.sharding.spec))
        for k, v in out.items()
    }


def test_large_batch_small_hidden_is_data_parallel():
    _, executable, out = _run(*_mlp(4096, 64, 64))
    assert _specs(out) == {"w1": (None, None), "w2": (None, None)}  # replicated
    collectives = executable.collectives()
    assert collectives["all-reduce"] and not collectives["all-gather"]
    assert not collectives["all-to-all"]


def test_small_batch_large_hidden_is_megatron():
    _, executable, out = _run(*_mlp(8, 1024, 4096))
    assert _specs(out) == {"w1": (None, "x"), "w2": ("x", None)}
    collectives = executable.collectives()
    assert collectives["all-reduce"] == [8 * 1024 * 4]  # one activation all-reduce
    assert not collectives["all-gather"] and not collectives["reduce-scatter"]


def test_2d_mesh_uses_both_axes():
    mesh = Mesh(np.array(FOUR).reshape(2, 2), ("a", "b"))
    _, executable, out = _run(*_mlp(256, 1024, 2048), devices=mesh)
    used = {a for spec in executable.plan.stages[0].input_specs for e in spec if e for a in e}
    assert used == {"a", "b"}


def test_attention_heads_split_on_model_axis():
    mesh = Mesh(np.array(FOUR).reshape(2, 2), ("data", "model"))
    _, _, out = _run(*_attention(2, 128, 1024, 16), devices=mesh)
    for name in ("wq", "wk", "wv"):
        assert "model" in (_specs(out)[name][1] or ()), _specs(out)


def test_moe_experts_split_with_all_to_all():
    """The backward pass reshards the dispatched tokens again for the experts' gradients: the
    loss runs under jax.checkpoint, and XLA does not CSE a reshard inside that region with the
    forward's. The prediction counts every all-to-all the HLO has."""
    _, executable, out = _run(*_moe())
    assert _specs(out)["w1"][0] == "x" and _specs(out)["w2"][0] == "x"
    collectives = executable.collectives()
    assert collectives["all-to-all"]
    hlo_bytes = sum(sum(sizes) for sizes in collectives.values())
    assert executable.plan.predicted.communication_bytes == pytest.approx(hlo_bytes, rel=1e-4)


def test_conv_partial_sums_are_reduce_scattered_as_planned():
    """A convolution's partial sums that the plan reduce-scatters are summed explicitly, as a
    dot's are: left to GSPMD, the CPU backend all-reduces them whole and then slices (n times
    the bytes). The HLO moves the bytes the plan predicts, and the step matches the serial one."""
    _, executable, _ = _run(*_convs())
    collectives = executable.collectives()
    assert collectives["reduce-scatter"]
    hlo_bytes = sum(sum(sizes) for sizes in collectives.values())
    assert executable.plan.predicted.communication_bytes == pytest.approx(hlo_bytes, rel=1e-4)


def test_tight_memory_budget_gets_a_plan_that_fits():
    """Under 3/4 of the free plan's memory the ILP stores or computes more of the step split:
    the plan fits the budget by its prediction and by XLA's memory analysis (within the memory
    model's 15%)."""
    step_fn, params, batch = _mlp(1024, 1024, 512)
    free = autopar.plan(step_fn, params, batch, method=autopar.ShardParallel(devices=FOUR))
    budget = 0.75 * free.predicted.memory_per_device_bytes
    _, executable, _ = _run(step_fn, params, batch, memory_budget_per_device=budget)
    assert executable.plan.stages[0].input_specs != free.stages[0].input_specs
    assert executable.plan.predicted.memory_per_device_bytes <= budget
    assert executable.memory_stats().peak_bytes <= 1.15 * budget


def test_budget_below_anything_feasible_names_the_least_memory():
    step_fn, params, batch = _mlp(8, 1024, 2048)
    method = autopar.ShardParallel(
        devices=FOUR, auto_sharding_option=autopar.AutoShardingOption(memory_budget_per_device=1e5)
    )
    with pytest.raises(autopar.PlanningError, match=r"least memory per device .* about [\d.]+ MiB"):
        autopar.plan(step_fn, params, batch, method=method)


def test_force_options_restrict_storage():
    step_fn, params, batch = _mlp(64, 256, 512)
    _, _, dp = _run(step_fn, params, batch, force_data_parallel=True)
    assert _specs(dp) == {"w1": (None, None), "w2": (None, None)}
    _, executable, z3 = _run(step_fn, params, batch, force_zero_stage_3=True)
    assert all(any(spec) for spec in _specs(z3).values())
    assert executable.plan.stages[0].input_specs[2] == (("x",), None)  # batch x split


def test_forced_batch_dim_splits_every_batch_value_over_that_axis():
    """Alpa's force_batch_dim_to_mesh_dim: data parallel over axis "a", the ILP choosing the
    model parallelism over "b" (free, it splits this small-batch MLP over both axes instead)."""
    mesh = Mesh(np.array(FOUR).reshape(2, 2), ("a", "b"))
    step_fn, params, batch = _mlp(8, 1024, 4096)
    _, free, _ = _run(step_fn, params, batch, devices=mesh)
    _, forced, out = _run(step_fn, params, batch, devices=mesh, force_batch_dim_to_mesh_dim=0)
    assert free.plan.stages[0].input_specs[2] == (None, None)
    stage = forced.plan.stages[0]
    assert [spec[0] for spec in stage.input_specs[2:]] == [("a",), ("a",)]  # batch x and y
    args = (params, batch)
    argnums = resolve_argnums(args, (), (1,), "auto")
    traced = trace_for_method(step_fn, args, autopar.ShardParallel(), argnums)
    grouping = group_graph(traced.program.graph)
    values = batch_dims(grouping, traced.program.signature.batch_inputs, _mesh_2x2(), 0)
    assert len(values) >= 10  # forward and backward activations, not only the inputs
    for (node, o), dim in values.items():
        spec = stage.input_specs[o] if node is None else stage.node_output_specs[node][o]
        assert spec[dim] == ("a",), (node, spec)
    assert "b" in _specs(out)["w1"][1]  # model parallel over the other axis
    with pytest.raises(autopar.InvalidArgumentError, match=r"mesh_dim=1 needs .* shape \(4,\)"):
        _run(step_fn, params, batch, force_batch_dim_to_mesh_dim=1)


def _blocks_program(names, width=16):
    """The program of an SGD step over blocks applied in the order of `names`."""

    def loss(params, x):
        for name in names:
            x = jnp.tanh(x @ params[name])
        return jnp.sum(x)

    params = {name: jnp.ones((width, width)) for name in names}
    args = (params, jnp.ones((8, width)))
    argnums = resolve_argnums(args, (), (1,), "auto")
    return trace_for_method(_sgd_step(loss), args, autopar.ShardParallel(), argnums).program


def test_layers_equal_up_to_the_order_of_their_parameters_share_a_structure():
    """Parameters sort by name, so blocks 9, 10, 11 arrive as 10, 11, 9: a different program
    text, the same layer (LayerCosts plans it once)."""
    in_order = _blocks_program(["b6", "b7", "b8"])
    permuted = _blocks_program(["b9", "b10", "b11"])
    assert in_order.fingerprint != permuted.fingerprint
    assert program_structure(in_order) == program_structure(permuted)
    assert program_structure(in_order) != program_structure(_blocks_program(["b6", "b7"]))
    assert program_structure(in_order) != program_structure(
        _blocks_program(["b6", "b7", "b8"], width=32)
    )


def _mesh_2x2():
    return logical_mesh(autopar.ClusterSpec.preset("8xV100-p3"), (2, 2), ("a", "b"))


def _adam_mlp(batch_size, din, hidden):
    _, params, batch = _mlp(batch_size, din, hidden)
    optimizer = optax.adam(1e-2)

    def train_step(state, batch):
        params, opt_state = state
        grads = autopar.grad(_mlp_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return train_step, (params, optimizer.init(params)), batch


def test_adam_update_is_sharded_and_prefer_reduce_scatter_shards_all_of_it():
    """A replicated Adam update streams every weight, gradient and both moments on each device
    (memory-bound): the default plan already stores the moments split and reduce-scatters
    gradients into them (ZeRO-2's update); with prefer_reduce_scatter nothing is all-reduced."""
    step_fn, state, batch = _adam_mlp(4096, 64, 64)
    _, executable, (_, (adam, _)) = _run(step_fn, state, batch)
    assert all(any(s) for m in (adam.mu, adam.nu) for s in _specs(m).values())
    assert executable.collectives()["reduce-scatter"]
    _, executable, (_, (adam, _)) = _run(step_fn, state, batch, prefer_reduce_scatter=True)
    assert all(any(s) for m in (adam.mu, adam.nu) for s in _specs(m).values())
    collectives = executable.collectives()
    # Each device receives its quarter of both 64x64 fp32 gradients.
    assert sum(collectives["reduce-scatter"]) == 2 * 64 * 64 * 4 // 4
    assert not collectives["all-reduce"]


def test_gpt_numerics_and_repeated_layers_share_a_class():
    config = GPTConfig(num_layers=2)
    state = gpt.create_train_state(config, batch_size=2)
    batch = gpt.make_batch(config, 16)
    train_step = gpt.make_train_step(autopar.value_and_grad)
    step = autopar.parallelize(train_step)
    new_state, _ = step(state, batch)
    ref_state, _ = jax.jit(train_step)(state, batch)
    assert relative_error(new_state.params, ref_state.params) <= 1e-5
    note = step.get_plan(state, batch).notes[0]
    groups, classes = (int(w) for w in note.replace("(", " ").split() if w.isdigit())
    assert classes < groups


# XLA:CPU from jax 0.12 splits GELU's backward into more fusions, each writing its own copy of
# the MLP activations (the 2-layer GPT's buffer assignment: 17 values of f32[2,32,256], 64 KiB
# each, in 11 allocations, against 8 in 5 on 0.10): about 0.5 MB that the memory model, which
# prices the fusions of a GPU compiler, does not count.
GPT_MEMORY_TOLERANCE = 0.30 if jax.__version_info__ >= (0, 12) else 0.15


def test_cost_model_against_xla():
    """Predicted collective bytes and peak memory against the compiled HLO and XLA's analysis:
    within 15% (the 2-layer GPT on jax 0.12: `GPT_MEMORY_TOLERANCE`)."""
    cases = {
        "mlp-dp": _mlp(4096, 64, 64),
        "mlp-megatron": _mlp(8, 1024, 4096),
        "attention": _attention(2, 128, 1024, 16),
        "gpt-2-layer": None,
    }
    rows = []
    for name, case in cases.items():
        if case is None:
            config = GPTConfig(num_layers=2)
            state = gpt.create_train_state(config, batch_size=2)
            case = (gpt.make_train_step(autopar.value_and_grad), state, gpt.make_batch(config, 16))
            devices = None
        else:
            devices = FOUR
        step = autopar.parallelize(case[0], method=autopar.ShardParallel(devices=devices))
        executable = step.get_executable(*case[1:])
        predicted = executable.plan.predicted
        hlo_bytes = sum(sum(sizes) for sizes in executable.collectives().values())
        peak = executable.memory_stats().peak_bytes
        rows.append(
            (
                name,
                predicted.communication_bytes,
                hlo_bytes,
                predicted.memory_per_device_bytes,
                peak,
            )
        )
    print(f"\n{'plan':<14}{'comm pred':>12}{'comm HLO':>12}{'mem pred':>12}{'mem XLA':>12}")
    for name, cp, ch, mp, mx in rows:
        print(f"{name:<14}{cp:>12.0f}{ch:>12.0f}{mp:>12.0f}{mx:>12.0f}")
    for name, cp, ch, mp, mx in rows:
        tolerance = GPT_MEMORY_TOLERANCE if name == "gpt-2-layer" else 0.15
        assert abs(mp - mx) <= tolerance * mx, (name, mp, mx)
        assert abs(cp - ch) <= 0.10 * max(ch, 1), (name, cp, ch)


@pytest.mark.parametrize(
    ("equation", "lhs", "rhs", "transpose"),
    [
        ("bqhk,hkd->bqd", (2, 128, 16, 64), (16, 64, 1024), None),  # both in matmul order
        ("bqd,hkd->bqhk", (2, 128, 1024), (16, 64, 1024), None),  # a weight read transposed
        ("bqhk,bqd->hkd", (2, 128, 16, 64), (2, 128, 1024), None),  # lhs contracted on dims 0, 1
        ("qd,nd->qn", (256, 1024), (1024, 1024), None),  # 2-D: a transposed GEMM, no copy
        ("dbq,dn->bqn", (1024, 2, 128), (1024, 1024), None),  # [k, rows...]: copied
        ("ikb,kjb->bij", (256, 512, 4), (512, 256, 4), None),  # batch dims last: both copied
        ("bqd,dhk->bqhk", (2, 128, 1024), (16, 64, 1024), (2, 0, 1)),  # matmul order, not stored so
        ("bqd,dhk->bqhk", (2, 128, 1024), (1024, 64, 16), (0, 2, 1)),
        ("bqd,dn->bqn", (2, 128, 1024), (1024, 1024), (1, 0)),  # 2-D transposed: no copy
    ],
)
def test_cpu_dot_operand_copies_are_those_xla_makes(equation, lhs, rhs, transpose):
    """XLA's CPU dot reads [batch, rows, k] x [batch, k, columns] buffers (a 2-D matrix either
    way round) and copies other operands first. A transpose folds into the dot, so what counts is
    the order of the buffer under it. On one device the predicted peak is XLA's to the byte; a
    GPU cluster's plan counts no copies."""

    def fn(x, w):
        return jnp.einsum(equation, x, w if transpose is None else jnp.transpose(w, transpose))

    args = (jnp.ones(lhs), jnp.ones(rhs))
    method = autopar.ShardParallel(devices=jax.devices()[:1])
    executable = autopar.parallelize(fn, donate_argnums=(), method=method).get_executable(*args)
    stats = executable.memory_stats()
    assert executable.plan.predicted.memory_per_device_bytes == stats.peak_bytes
    cpu = autopar.ClusterSpec.local(1)
    predicted = [
        autopar.plan(fn, *args, method=method, cluster_spec=spec).predicted
        for spec in (cpu, dataclasses.replace(cpu, platform="gpu"))
    ]
    assert predicted[0].memory_per_device_bytes - predicted[1].memory_per_device_bytes == (
        stats.temp_bytes
    )


def test_cpu_max_pool_gradient_buffers_are_counted():
    """XLA:CPU expands max pooling's gradient into a selection (a padded copy of the pooled
    image and an int32 iota per dimension, giving each window's value and indices) that it
    schedules in the forward pass: a Wide-ResNet's predicted peak on one device is within 15% of
    XLA's memory analysis with those buffers and well under it without (a GPU spec's model)."""
    from autopar.models import wresnet

    config = wresnet.WResNetConfig(
        image_size=64, channels=64, stage_sizes=(1, 1, 1), num_classes=100
    )
    state = wresnet.create_train_state(config, batch_size=8)
    batch = wresnet.make_batch(config, 8)
    step = wresnet.make_train_step(autopar.value_and_grad)
    method = autopar.ShardParallel(devices=jax.devices()[:1])
    executable = autopar.parallelize(step, method=method).get_executable(state, batch)
    xla_peak = executable.memory_stats().peak_bytes
    assert 0.85 <= executable.plan.predicted.memory_per_device_bytes / xla_peak <= 1.15
    gpu = dataclasses.replace(autopar.ClusterSpec.local(1), platform="gpu")
    without = autopar.plan(step, state, batch, method=method, cluster_spec=gpu).predicted
    assert without.memory_per_device_bytes / xla_peak < 0.85


def _deep_mlp_loss(p, batch):
    h = batch["x"]
    for w in p:
        h = jax.nn.relu(h @ w)
    return jnp.mean((h - batch["y"]) ** 2)


def test_cpu_schedule_runs_weight_gradients_after_the_backward_pass(monkeypatch):
    """XLA:CPU's DFS scheduler (what `simulate_cpu_devices` selects) reaches the first layer's
    update first, whose subtree is the forward pass and every input gradient: the other layers'
    weight gradients follow the whole backward pass. Program order interleaves them. The specs
    of the devices here say so (the tests simulate devices); without the flag they do not."""
    assert autopar.ClusterSpec.local(8).dfs_schedule
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert not autopar.ClusterSpec.local(8).dfs_schedule
    from autopar.planner.groups import group_graph
    from autopar.planner.memory import liveness
    from autopar.tracing import trace_step

    params = [jnp.ones((64, 64)) for _ in range(4)]
    batch = {"x": jnp.ones((256, 64)), "y": jnp.ones((256, 64))}
    traced = trace_step(
        _sgd_step(_deep_mlp_loss),
        (params, batch),
        static_argnums=(),
        batch_argnums=(1,),
        donate_argnums=(),
        regather_params=False,
    )
    grouping = group_graph(traced.program.graph)
    dots = [n for n in grouping.planned_nodes() if n.primitive == "dot_general"]
    weight_grads = [n.id for n in dots if n.out_avals[0].shape == (64, 64)]
    input_grads = [n.id for n in dots[4:] if n.id not in weight_grads]  # after the forward
    assert len(weight_grads) == 4 and len(input_grads) == 3
    for dfs, early in ((True, 1), (False, 3)):
        step = liveness(grouping, traced.program.signature, cpu=True, dfs=dfs).step_of_node
        last_input_grad = max(step[n] for n in input_grads)
        assert sum(step[n] < last_input_grad for n in weight_grads) == early, dfs


def _reduced_wide_resnet(spec: autopar.ClusterSpec):
    """(train step, state, batch, its ShardParallel executable planned for `spec`) of the
    suite's reduced Wide-ResNet: 64 images of 64x64, three stages of one block."""
    from autopar.models import wresnet

    config = wresnet.WResNetConfig(
        image_size=64, channels=64, stage_sizes=(1, 1, 1), num_classes=100
    )
    state = wresnet.create_train_state(config, batch_size=64)
    batch = wresnet.make_batch(config, 64)
    step = wresnet.make_train_step(autopar.value_and_grad)
    autopar.init("local", cluster_spec=spec)
    try:
        executable = autopar.parallelize(step).get_executable(state, batch)
    finally:
        autopar.shutdown()
    return step, state, batch, executable


def test_cpu_memory_follows_xla_schedule_on_a_wide_resnet(monkeypatch):
    """The suite's reduced Wide-ResNet (64 images of 64x64) planned for 8 V100s with XLA:CPU's
    memory rules: XLA keeps each layer's input and output gradient live until its weight
    gradient runs, after the whole backward pass. In `cpu_schedule` order the predicted peak is
    within 15% of XLA's memory analysis; in program order it was under 0.85 of it."""
    from autopar.planner import memory

    v100 = autopar.ClusterSpec.preset("8xV100-p3")
    spec = dataclasses.replace(v100, platform="cpu", dfs_schedule=True)
    step, state, batch, executable = _reduced_wide_resnet(spec)
    method = autopar.ShardParallel()
    xla_peak = executable.memory_stats().peak_bytes
    assert 0.85 <= executable.plan.predicted.memory_per_device_bytes / xla_peak <= 1.15
    monkeypatch.setattr(memory, "cpu_schedule", lambda grouping, nodes, fused, updates: nodes)
    in_program_order = autopar.plan(step, state, batch, method=method, cluster_spec=spec)
    assert in_program_order.stages == executable.plan.stages
    assert in_program_order.predicted.memory_per_device_bytes / xla_peak < 0.85


def test_checkpointed_readers_of_a_resharded_value_keep_their_planned_layout():
    """The suite's reduced Wide-ResNet planned for 8 H100s with XLA:CPU's rules: inside the
    checkpointed backward pass the plan reshards two images by the batch for the weight
    gradients that read them so, and computes the other weight gradients reading the same
    images whole. The body's operands are pinned as planned, so XLA does not hand those the
    batch-split copy and all-reduce them: the HLO's collective bytes are the predicted ones
    (0.84 of the HLO's before)."""
    h100 = autopar.ClusterSpec.preset("8xH100-80G")
    *_, executable = _reduced_wide_resnet(dataclasses.replace(h100, platform="cpu"))
    collectives = executable.collectives()
    assert collectives["all-reduce"] and not collectives["all-gather"]
    hlo_bytes = sum(sum(sizes) for sizes in collectives.values())
    predicted = executable.plan.predicted.communication_bytes
    assert abs(predicted - hlo_bytes) <= 0.01 * hlo_bytes


def test_same_inputs_give_the_same_plan():
    step_fn, params, batch = _mlp(64, 256, 1024)
    method = autopar.ShardParallel(devices=FOUR)
    first = autopar.plan(step_fn, params, batch, method=method)
    second = autopar.plan(step_fn, params, batch, method=method)
    # The notes say how long planning took; everything else is the plan.
    assert dataclasses.replace(second, notes=()) == dataclasses.replace(first, notes=())
    assert autopar.Plan.from_json(first.to_json()) == first


def test_highs_solver_finds_the_same_optimum():
    pytest.importorskip("highspy")
    step_fn, params, batch = _mlp(8, 1024, 4096)
    plans = [
        autopar.plan(
            step_fn,
            params,
            batch,
            method=autopar.ShardParallel(
                devices=FOUR, auto_sharding_option=autopar.AutoShardingOption(solver=solver)
            ),
        )
        for solver in ("cbc", "highs")
    ]
    assert plans[0].predicted.step_time_s == pytest.approx(plans[1].predicted.step_time_s)


def test_unknown_primitive_falls_back_to_replicated(caplog):
    def loss(p, batch):
        m = batch["x"].T @ batch["x"] + 64.0 * jnp.eye(64)
        return jnp.sum(jnp.linalg.cholesky(m) @ p["w"])

    params = {"w": jnp.ones((64, 8))}
    batch = {"x": jax.random.normal(jax.random.PRNGKey(3), (32, 64))}
    with caplog.at_level(logging.WARNING, logger="autopar.planner.menus"):
        _run(_sgd_step(loss), params, batch)
    assert "no sharding rules for primitive 'cholesky'" in caplog.text


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"memory_budget_per_device": -1}, "memory_budget_per_device"),
        ({"solver": "gurobi"}, "solver must be one of"),
        ({"time_limit_s": 0}, "time_limit_s"),
        ({"force_data_parallel": True, "force_zero_stage_3": True}, "exclude each other"),
        ({"force_batch_dim_to_mesh_dim": 2}, "force_batch_dim_to_mesh_dim must be 0, 1"),
    ],
)
def test_bad_options_are_rejected(option, message):
    with pytest.raises(autopar.InvalidArgumentError, match=message):
        autopar.AutoShardingOption(**option)


def test_bad_method_arguments_are_rejected():
    with pytest.raises(autopar.InvalidArgumentError, match="AutoShardingOption"):
        autopar.ShardParallel(auto_sharding_option={"force_data_parallel": True})
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("a", "b", "c"))
    with pytest.raises(autopar.InvalidArgumentError, match="1D or 2D"):
        autopar.ShardParallel(devices=mesh)


def test_one_device_plans_move_no_bytes():
    """Splits over a mesh of one device are no splits: no collective, no bytes, no time."""
    step_fn, params, batch = _mlp(8, 1024, 4096)
    plan = autopar.plan(step_fn, params, batch, cluster_spec=autopar.ClusterSpec.local(1))
    assert plan.predicted.communication_bytes == 0
    assert plan.predicted.communication_s == 0


def _adam_mlp_problem(*shape: int) -> ShardingProblem:
    """The ILP of `_adam_mlp(*shape)`'s ShardParallel step on a (4,) mesh, one micro-batch."""
    step_fn, params, batch = _adam_mlp(*shape)
    args = (params, batch)
    method = autopar.ShardParallel(devices=FOUR)
    traced = trace_for_method(step_fn, args, method, resolve_argnums(args, (), (1,), "auto"))
    mesh = MeshPlan((4,), ("x",), tuple(range(4)))
    return ShardingProblem(traced.program, mesh, autopar.ClusterSpec.local(4), IntraOpConfig(), 1)


def test_the_ilps_memory_counts_the_resharded_copies_the_plan_makes():
    """The ILP's memory of a choice is the emitted plan's, resharded copies included (a copy's
    buffer depends on both ends of an edge: the edge's variables carry it), on 300 random
    choices; without the copies it would miss them on most."""
    problem = _adam_mlp_problem(8, 512, 2048)
    memory, rng = problem.memory, np.random.default_rng(0)
    missed = 0
    for _ in range(300):
        choice = np.array([rng.integers(n) for n in problem.ilp.num_choices])
        _, predicted = intra._emit(
            problem.program, problem.problem, problem.mesh_plan, memory, choice[memory.cls]
        )
        peak = memory.evaluate(choice).max()
        assert peak == pytest.approx(predicted.memory_per_device_bytes, rel=1e-12)
        missed += memory.evaluate_groups(choice[memory.cls], copies=False).max() < peak
    assert missed > 200


def test_no_plan_only_where_the_least_memory_plan_does_not_fit():
    """Where the emitted plan holds more than the ILP counted (gradients reduced once after
    it), solve falls back to the least-memory plan, as emitted. It returns None exactly where
    that plan does not fit, so the error's least memory is above the budget (before, it named
    the ILP's own least, below a budget nothing was found for)."""
    problem = _adam_mlp_problem(8, 512, 2048)
    least = problem.least_memory()
    fitted = problem.solve(least)
    assert fitted is not None and fitted.predicted.memory_per_device_bytes <= least
    # The ILP's own least is where its memory model and the emitted plans part.
    for budget in [problem.ilp.least_memory(), *np.linspace(0.5 * least, 1.5 * least, 9)]:
        plan = problem.solve(budget)
        if plan is None:
            assert problem.over_budget(budget).least > budget
        else:
            assert plan.predicted.memory_per_device_bytes <= budget


def test_only_a_plan_a_user_gets_warns_of_the_time_limit(monkeypatch, caplog):
    """Candidate ILPs (pipeline layers priced for the stage search) stop at their time limit by
    design, dozens of times a search: only a plan a user gets warns that it hit the limit. A
    plan rounded from the LP relaxation by choice (a pipeline's chosen stages) is not proved
    optimal either, but did not run out of time: no warning, and its note says how it was
    found."""
    problem = _adam_mlp_problem(8, 64, 128)
    solve = type(problem.ilp).solve
    timed_out = [True]

    def not_optimal(self, *args, **kwargs):
        solution = solve(self, *args, **kwargs)
        return solution and dataclasses.replace(solution, optimal=False, timed_out=timed_out[0])

    monkeypatch.setattr(type(problem.ilp), "solve", not_optimal)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        assert problem.candidate(1e12) is not None
        assert not [r for r in caplog.records if "time limit" in r.getMessage()]
        assert "time limit hit" in problem.solve(1e12).notes[0]
    warned = [r for r in caplog.records if "time limit" in r.getMessage()]
    assert len(warned) == 1 and "AutoShardingOption.time_limit_s" in warned[0].getMessage()
    caplog.clear()
    timed_out[0] = False
    with caplog.at_level(logging.WARNING, logger="autopar"):
        assert "rounded from its LP relaxation" in problem.solve(1e12).notes[0]
    assert not [r for r in caplog.records if "time limit" in r.getMessage()]


def _gpt_problem(num_layers: int = 4, cache: MeshCache | None = None) -> ShardingProblem:
    """The ILP of a GPT's ShardParallel step on a (2, 2) mesh over 2 micro-batches."""
    step_fn = gpt.make_train_step(autopar.value_and_grad)
    config = GPTConfig(num_layers=num_layers, seq_len=16, hidden=32)
    state = gpt.create_train_state(config, batch_size=2)
    args = (state, gpt.make_batch(config, 8))
    method = autopar.ShardParallel(devices=FOUR, num_micro_batches=2)
    traced = trace_for_method(step_fn, args, method, resolve_argnums(args, (), (1,), "auto"))
    mesh = MeshPlan((2, 2), ("x", "y"), tuple(range(4)))
    cluster = autopar.ClusterSpec.local(4)
    return ShardingProblem(traced.program, mesh, cluster, IntraOpConfig(), 2, cache=cache)


def test_programs_on_one_mesh_share_the_menus_and_costs_of_their_common_groups():
    """Two programs planned on one mesh with one `MeshCache` (a pipeline's layers of different
    structures): the second finds most of its group costs and edges in the cache, and its ILP
    inputs and plan are those it gets with a cache of its own."""
    cache = MeshCache()
    _gpt_problem(4, cache)
    priced, edges = len(cache.costs), len(cache.edges)
    shared = _gpt_problem(3, cache)
    alone = _gpt_problem(3)
    own = alone.problem.builder.cache
    assert len(cache.costs) - priced < 0.2 * len(own.costs)
    assert len(cache.edges) - edges < 0.2 * len(own.edges)
    for mine, theirs in zip(shared.problem.group_costs, alone.problem.group_costs, strict=True):
        for name in ("compute", "blocking", "overlap", "comm_bytes"):
            np.testing.assert_array_equal(getattr(mine, name), getattr(theirs, name))
    assert [(e.producer, e.consumer, e.value) for e in shared.problem.edges] == [
        (e.producer, e.consumer, e.value) for e in alone.problem.edges
    ]
    for mine, theirs in zip(shared.problem.edges, alone.problem.edges, strict=True):
        np.testing.assert_array_equal(mine.costs.blocking, theirs.costs.blocking)
        np.testing.assert_array_equal(mine.producer_choice, theirs.producer_choice)
        np.testing.assert_array_equal(mine.consumer_choice, theirs.consumer_choice)
    budget = 2.0**30
    assert shared.solve(budget).stages == alone.solve(budget).stages


def _assert_shared_costs_are_each_groups_own(problem: ShardingProblem) -> None:
    builder, groups = problem.problem.builder, problem.problem.grouping.groups
    priced = [g for g in groups if not g.is_input]
    assert len(builder.cache.costs) < len(priced)  # shared
    for group, shared in zip(groups, problem.problem.group_costs, strict=True):
        if group.is_input:
            continue
        own = builder._priced(group, builder.menu(group))
        for name in ("compute", "blocking", "overlap", "comm_bytes"):
            np.testing.assert_array_equal(getattr(shared, name), getattr(own, name))


def test_repeated_groups_share_their_costs_only_where_priced_alike():
    """Groups of one class (the same layer repeated) are priced once, where their members'
    weights (micro-batches), overlap, FLOPs and memory traffic agree: each group's shared costs
    equal its own pricing, on a 4-layer GPT over 2 micro-batches."""
    _assert_shared_costs_are_each_groups_own(_gpt_problem())


def test_repeated_groups_on_a_gpu_are_priced_apart_where_their_reductions_fuse_apart():
    """On a GPU preset XLA fuses element-wise outputs into column reductions
    (`Roofline.kernel_leader`), over the whole program: groups of one class (equal within 3
    hops) whose reductions fuse different arrays cost differently, and are priced apart. A
    6-layer MoE on 8 H100s had 2 groups priced with another's costs when the key held only
    their traffic (Alpa's MoE 2.4B: 85)."""
    config = MoEConfig.alpa("2.4B", num_layers=6, hidden=256, dtype=jnp.float16)
    step, state, batch = abstract_train_inputs(moe, config, 8)
    args = (state, batch)
    devices = jax.devices()[:8]
    method = autopar.ShardParallel(devices=devices)
    traced = trace_for_method(step, args, method, resolve_argnums(args, (), (1,), "auto"))
    mesh = MeshPlan((8,), ("x",), tuple(range(8)))
    cluster = autopar.ClusterSpec.preset("8xH100-80G")
    problem = ShardingProblem(traced.program, mesh, cluster, IntraOpConfig(), 1)
    _assert_shared_costs_are_each_groups_own(problem)


def test_edges_between_repeated_groups_share_their_costs_and_price_their_own_reads():
    """Edges between groups of the same classes read alike share one cost matrix (525 of
    966 are distinct on a 4-layer GPT), and every edge's rows, columns and costs are those of
    its own producer's specs and its own consumer's reads."""
    problem = _gpt_problem().problem
    builder, grouping = problem.builder, problem.grouping
    assert len({id(edge.costs) for edge in problem.edges}) < 0.6 * len(problem.edges)
    for edge in problem.edges:
        producer, consumer = grouping.groups[edge.producer], grouping.groups[edge.consumer]
        lv = builder.local_value(producer, edge.value)
        haves = [specs[lv] for specs in builder.menu(producer).value_specs]
        menu = builder.menu(consumer)
        if edge.readers:  # reads by members, in (member, operand) order
            reads = [
                (j, pos, builder.weights.get(member, 1.0))
                for j, member in enumerate(consumer.members)
                for pos, ref in enumerate(grouping.graph.node(member).inputs)
                if grouping.value_of(ref) == edge.value
            ]
            needs = [tuple(s[j].in_specs[pos] for j, pos, _ in reads) for s in menu.strategies]
        else:  # the new value of a stored input
            reads = [(None, None, 1.0)]
            needs = [(specs[(-1, 0)],) for specs in menu.value_specs]
        aval = value_aval(grouping, edge.value)
        for k, have in enumerate(haves):
            assert edge.haves[edge.producer_choice[k]] == have
        for k, need in enumerate(needs):
            assert edge.needs[edge.consumer_choice[k]] == need
        for a, have in enumerate(edge.haves):
            for b, need in enumerate(edge.needs):
                seconds = sum(
                    weight * builder.reshard(aval.shape, aval.dtype.itemsize, have, n)[0]
                    for n, (*_, weight) in zip(need, reads, strict=True)
                    if n is not None and n != have
                )
                cost = edge.costs.blocking[a, b] + edge.costs.overlap[a, b]
                assert cost == pytest.approx(seconds, rel=1e-12)
