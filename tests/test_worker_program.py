"""Per-worker step programs (`runtime.worker_program`) and the socket transport between workers
(`runtime.transport`), without Ray: the programs of every stage, run together, never deadlock,
read only what they hold, free each value after its last reader; values cross between two
transports whole, in every dtype, and a missing or unreadable one is a clear error in bounded
time."""

import struct
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.models import MLPConfig, mlp
from autopar.runtime.layout import PipelineLayout, PlaceInput, RunTask
from autopar.runtime.transport import SocketTransport, TransferTimeoutError
from autopar.runtime.worker_program import Copy, Free, Receive, Send, worker_programs


def _layout(stages: int, micro_batches: int, schedule: str, layers: int = 4) -> PipelineLayout:
    """An MLP of `layers` layers in `stages` uniform stages (meshes, for interleaved 1F1B)."""
    config = MLPConfig(in_dim=32, hidden=32, out_dim=32, num_layers=layers)
    method = autopar.PipeshardParallel(
        num_micro_batches=micro_batches,
        layer_option=autopar.AutoLayerOption(layer_num=layers),
        stage_option=autopar.UniformStageOption(stages),
        pipeline_schedule=schedule,
    )
    step = autopar.parallelize(mlp.make_train_step(autopar.value_and_grad), method=method)
    state, batch = mlp.create_train_state(config, batch_size=2), mlp.make_batch(config, 16)
    return step.get_executable(state, batch).layout


def _run_symbolically(layout: PipelineLayout) -> dict[int, list]:
    """Every mesh's program run in lockstep, a `Receive` waiting for its `Send`: per stage, the
    tasks in the order they ran. Fails on a deadlock, a read of a value the stage does not hold,
    or a value freed while a later task of the stage still reads it."""
    programs = worker_programs(layout)
    position = [0] * len(programs)
    sent: set[tuple] = set()
    held: dict[int, set] = {s: set() for s in range(layout.num_stages)}
    ran: dict[int, list] = {s: [] for s in range(layout.num_stages)}
    while any(p < len(program) for p, program in zip(position, programs, strict=True)):
        progressed = False
        for m, program in enumerate(programs):
            while position[m] < len(program):
                instruction = program[position[m]]
                if isinstance(instruction, Receive):
                    if (instruction.key, instruction.source, instruction.stage) not in sent:
                        break  # waits for the other mesh
                    held[instruction.stage].add(instruction.key)
                elif isinstance(instruction, PlaceInput):
                    held[instruction.stage].add(instruction.key)
                elif isinstance(instruction, (Send, Copy)):
                    source = instruction.source
                    assert instruction.key in held[source], f"stage {source} sends early"
                    assert layout.schedule.mesh_of(source) == m
                    if isinstance(instruction, Copy):
                        held[instruction.target].add(instruction.key)
                    else:
                        sent.add((instruction.key, source, instruction.target))
                elif isinstance(instruction, Free):
                    s = instruction.stage
                    for key in instruction.keys:
                        later = _reads_later(program[position[m] + 1 :], key, s)
                        assert not later, f"stage {s} frees {key} before {later[0]} reads it"
                        held[s].discard(key)
                else:
                    s = instruction.segment.stage
                    missing = _reads(held[s], instruction) - held[s]
                    assert not missing, f"{instruction} on stage {s} reads unheld {missing}"
                    held[s].update(layout.writes_of(instruction.segment, instruction.micro_batch))
                    ran[s].append((instruction.segment.kind.value, instruction.micro_batch))
                position[m] += 1
                progressed = True
        assert progressed, f"the programs deadlock at positions {position}"
    return ran


def _reads(held: set, run: RunTask) -> set:
    """The keys a task reads, as `StageRunner.run` looks them up."""
    j = run.micro_batch
    return {(v, j) if (v, j) in held else (v, None) for v in run.segment.reads}


def _reads_later(program, key, stage: int) -> list:
    var, j = key
    return [
        i
        for i in program
        if isinstance(i, RunTask)
        and i.segment.stage == stage
        and var in i.segment.reads
        and j in (None, i.micro_batch)
    ]


@pytest.mark.parametrize(
    ("stages", "micro_batches", "schedule"),
    [
        (2, 4, "1f1b"),
        (4, 8, "1f1b"),
        (2, 4, "gpipe"),
        (4, 2, "gpipe"),
        (2, 4, "zero_bubble"),
        (4, 4, "zero_bubble"),
        (2, 4, "interleaved_1f1b"),
    ],
)
def test_mesh_programs_run_together_in_the_schedule_order(stages, micro_batches, schedule):
    layout = _layout(stages, micro_batches, schedule)
    meshes = layout.schedule.num_meshes
    assert meshes == stages and layout.num_stages == layout.schedule.stages_per_mesh * stages
    ran = _run_symbolically(layout)
    for s in range(layout.num_stages):
        expected = [
            (t.kind.value, t.micro_batch)
            for t in layout.schedule.tasks_of_mesh(layout.schedule.mesh_of(s))
            if t.micro_batch is not None and t.stage == s
        ]
        assert [r for r in ran[s] if r[0] != "apply"] == expected
        assert any(kind == "apply" for kind, _ in ran[s])
    programs = worker_programs(layout)
    assert len(programs) == meshes
    sends = sum(isinstance(i, Send) for p in programs for i in p)
    receives = sum(isinstance(i, Receive) for p in programs for i in p)
    assert sends == receives > 0
    # Frees are merged: no two in a row for one stage.
    for program in programs:
        for a, b in zip(program, program[1:], strict=False):
            assert not (isinstance(a, Free) and isinstance(b, Free) and a.stage == b.stage)


def _clipped_step(params, batch):
    """Four layers, an update clipped by the global gradient norm: every stage's apply reads
    the squared norms of every other stage's gradients."""

    def loss(p):
        h0 = jnp.tanh(batch["x"] @ p["w0"])
        autopar.mark_pipeline_boundary()
        h1 = jnp.tanh(h0 @ p["w1"])
        autopar.mark_pipeline_boundary()
        h2 = jnp.tanh(h1 @ p["w2"])
        autopar.mark_pipeline_boundary()
        return jnp.mean((h2 @ p["w3"] - batch["y"]) ** 2)

    value, grads = autopar.value_and_grad(loss)(params)
    norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    scale = 0.1 / jnp.maximum(1.0, norm)
    return jax.tree.map(lambda w, g: w - scale * g, params, grads), value


def _clipped_inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    params = {f"w{i}": jax.random.normal(keys[i], (16, 16)) / 4 for i in range(4)}
    batch = {"x": jax.random.normal(keys[4], (16, 16)), "y": jax.random.normal(keys[5], (16, 16))}
    return params, batch


def test_interleaved_stages_on_one_mesh_hand_values_over_without_a_transfer():
    """2 meshes x 2 virtual stages: a value the apply of a stage reads from the other stage on
    its mesh (the global norm's parts) is handed over by a `Copy` on the worker; values between
    meshes are sent. The step matches jax.jit."""
    method = autopar.PipeshardParallel(
        num_micro_batches=4,
        stage_option=autopar.UniformStageOption(2),
        pipeline_schedule="interleaved_1f1b",
    )
    step = autopar.parallelize(_clipped_step, method=method)
    params, batch = _clipped_inputs()
    executable = step.get_executable(params, batch)
    layout = executable.layout
    assert layout.num_stages == 4 and layout.schedule.num_meshes == 2
    _run_symbolically(layout)
    programs = worker_programs(layout)
    mesh_of = layout.schedule.mesh_of
    copies = [i for p in programs for i in p if isinstance(i, Copy)]
    assert copies and all(mesh_of(i.source) == mesh_of(i.target) for i in copies)
    sends = [i for p in programs for i in p if isinstance(i, Send)]
    assert sends and all(mesh_of(i.source) != mesh_of(i.target) for i in sends)
    new, loss = executable(params, batch)
    want, want_loss = jax.jit(_clipped_step)(params, batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    for name in params:
        np.testing.assert_allclose(new[name], want[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- transport


@pytest.fixture
def two_transports():
    """Stage 0 and stage 1, one worker each, connected over the loopback interface."""
    key = b"test-key"
    first, second = SocketTransport("127.0.0.1", key, 5.0), SocketTransport("127.0.0.1", key, 5.0)
    for t in (first, second):
        t.connect([[first.address], [second.address]])
    return first, second


@pytest.mark.parametrize(
    "value",
    [
        np.arange(24, dtype=np.float32).reshape(4, 6),
        np.float32(3.5),
        np.arange(8, dtype=np.int32),
        jnp.arange(16, dtype=jnp.bfloat16).reshape(4, 4),
        np.array([True, False, True]),
        np.zeros((0, 3), np.float32),
        jax.random.split(jax.random.key(0), 4),
        np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024),  # more than a socket buffer
    ],
    ids=["f32", "scalar", "i32", "bf16", "bool", "empty", "typed-keys", "4MiB"],
)
def test_values_cross_whole_with_their_dtype(two_transports, value):
    first, second = two_transports
    devices = jax.devices()[:4]
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    split = P("x") if np.ndim(value) and np.shape(value)[0] % 4 == 0 else P()
    sharded = jax.device_put(value, NamedSharding(mesh, split))
    first.send((7, 3, 1), sharded, target=1, clock=0.25)
    first.flush()
    aval = jax.typeof(sharded)
    received, sent_at = second.receive((7, 3, 1), 0, aval, "x")
    assert sent_at == 0.25
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        np.testing.assert_array_equal(jax.random.key_data(received), jax.random.key_data(value))
    else:
        assert np.asarray(received).dtype == np.asarray(value).dtype
        np.testing.assert_array_equal(np.asarray(received), np.asarray(value))
    assert first.bytes_sent > 0 or np.size(value) == 0


def test_a_value_that_never_comes_is_an_error_naming_it():
    transport = SocketTransport("127.0.0.1", b"k", 0.2)
    transport.connect([[transport.address]])
    with pytest.raises(TransferTimeoutError, match=r"activation of micro-batch 2 from stage 0"):
        transport.receive(
            (0, 1, 2), 0, jax.ShapeDtypeStruct((2,), np.float32), "activation of micro-batch 2"
        )


def test_a_message_that_cannot_be_read_fails_the_waiting_receive_at_once(two_transports):
    first, second = two_transports
    connection = first._connection(second.address)
    connection.sendall(struct.pack("!Q", 8) + b"not json")  # a broken or foreign sender
    waited = threading.Event()

    def receive():
        with pytest.raises(RuntimeError, match="receiving values from another stage failed"):
            second.receive((0, 0, None), 0, jax.ShapeDtypeStruct((), np.float32), "x")
        waited.set()

    thread = threading.Thread(target=receive)
    thread.start()
    thread.join(timeout=3)
    assert waited.is_set()  # well before the 5 s timeout


def test_a_peer_without_the_key_is_refused(two_transports):
    from multiprocessing.connection import AuthenticationError, Client

    _, second = two_transports
    with pytest.raises(AuthenticationError):
        Client(second.address, authkey=b"wrong")


def test_a_step_runs_with_the_garbage_collector_paused_and_restored_after():
    """`MeshWorker.step` pauses Python's cyclic collector (a full collection in a built worker
    held a pipeline up for 0.2 s): off inside, back on after, even when the step raises, and
    left off where it was off before."""
    import gc

    from autopar.runtime.ray_worker import _collector_paused

    assert gc.isenabled()
    with _collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="step failed"), _collector_paused():
        raise RuntimeError("step failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
