"""How values move between the workers of two stage meshes on Ray, without the driver.

Every mesh worker listens on a TCP socket of its host (`SocketTransport.listen`); the driver
hands each worker the addresses of all the others when it builds the stages. A producing worker
sends the distinct shards it holds straight to every worker of the consuming mesh over one
connection per pair (opened on first use, authenticated with a key the driver drew for the
executable): a small JSON header, then each shard's raw bytes, read by the receiver straight into
a buffer of the right dtype and shape. After the handshake both ends use the bare socket:
`multiprocessing`'s `recv_bytes_into` reads a large message in pieces and copies it once more.
A consuming worker waits until the shards from every producing worker have arrived, assembles
the whole value on its host and places it in the sharding its own stage reads it with
(`runtime.stage.place`), which reshards between any two mesh shapes. The driver only learns
that a step finished.

Measured on the 2-core development machine between two processes (`make bench-ray` writes the
step-level figures): receiving 256 KiB costs 31 µs of CPU with `socket.recv_into` against
300–380 µs with `recv_bytes_into`; a 256 KiB activation in 4 shards takes 0.14–0.28 ms from
send to assembled value (0.38 ms before the bare socket, 1.9 ms as a Ray actor call whose
argument goes through the object store).

Values are tagged (step number, variable id, micro-batch): a send may arrive before the receiver
has started that step. Sends run on a thread of their own, in order, so that copying a value to
the host and writing it overlaps the worker's next task instead of delaying it. A GPU transport
(NCCL send/recv) would sit behind the same `send`/`receive`; it is not built: no GPU has been
available to verify it (README, "Ray").
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

Shards = list[tuple[tuple[slice, ...], np.ndarray]]
Part = tuple[str | None, Shards]  # (typed PRNG key implementation or None, shards)
Delivery = tuple[Part, float]  # a sender's part and its device clock when it sent it
Tag = tuple[int, int, int | None]  # (step, variable id, micro-batch)
Address = tuple[str, int]


class TransferTimeoutError(RuntimeError):
    """A value another stage should have sent did not arrive in time (raised on the worker)."""


class Mailbox:
    """Shard lists delivered to this worker, by tag; `take` waits for all of a value's parts."""

    def __init__(self) -> None:
        self._arrived = threading.Condition()
        self._parts: dict[Tag, list[Delivery]] = {}
        self._broken: BaseException | None = None

    def put(self, tag: Tag, delivery: Delivery) -> None:
        with self._arrived:
            self._parts.setdefault(tag, []).append(delivery)
            self._arrived.notify_all()

    def fail(self, error: BaseException) -> None:
        """A delivery broke (a message could not be read): waiting `take`s raise it."""
        with self._arrived:
            self._broken = error
            self._arrived.notify_all()

    def arrived(self, tag: Tag, count: int) -> bool:
        """Whether `count` deliveries of `tag` are here (`take` would not wait)."""
        with self._arrived:
            return len(self._parts.get(tag, ())) >= count

    def take(self, tag: Tag, count: int, timeout_s: float) -> list[Delivery] | None:
        """The `count` deliveries of `tag`, or None when they have not all arrived in `timeout_s`;
        raises a delivery's failure (`fail`)."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while len(self._parts.get(tag, ())) < count:
                if self._broken is not None:
                    raise RuntimeError(
                        f"receiving values from another stage failed: {self._broken!r}"
                    ) from self._broken
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._arrived.wait(left)
            return self._parts.pop(tag)

    def drop_before(self, step: int) -> None:
        """Forget parts of earlier steps (a step that failed half way leaves some behind)."""
        with self._arrived:
            for tag in [t for t in self._parts if t[0] < step]:
                del self._parts[tag]


class SocketTransport:
    """Send and receive stage values worker to worker (module docstring).

    `listen` opens the socket; `connect` gives the addresses of every stage's workers
    (`peers[s]`); `timeout_s` bounds a receive."""

    def __init__(self, host: str, authkey: bytes, timeout_s: float) -> None:
        self._listener = Listener((host, 0), authkey=authkey)
        self._authkey = authkey
        self.timeout_s = timeout_s
        self.mailbox = Mailbox()
        self.bytes_sent = 0
        self.peers: Sequence[Sequence[Address]] = ()
        self._connections: dict[Address, socket.socket] = {}
        self._outbox: queue.Queue = queue.Queue()
        self._failure: BaseException | None = None
        threading.Thread(target=self._accept_loop, name="autopar-accept", daemon=True).start()
        threading.Thread(target=self._send_loop, name="autopar-sender", daemon=True).start()

    @property
    def address(self) -> Address:
        return tuple(self._listener.address)

    def connect(self, peers: Sequence[Sequence[Address]]) -> None:
        self.peers = [[tuple(a) for a in stage] for stage in peers]

    # ------------------------------------------------------------------ sending

    def send(self, tag: Tag, value: Any, target: int, clock: float = 0.0) -> None:
        """Send this worker's shards of `value` to every worker of stage `target`, stamped
        with the sender's device clock (queued: the sender thread waits for the value)."""
        self._outbox.put((tag, value, target, clock))

    def flush(self) -> None:
        """Wait until every queued send is written; a send that failed raises here."""
        self._outbox.join()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError(f"sending a value to another stage failed: {failure!r}") from failure

    def _send_loop(self) -> None:
        while True:
            tag, value, target, clock = self._outbox.get()
            try:
                impl, shards = key_impl(value), local_shards(value)
                for address in self.peers[target]:
                    _write(self._connection(address), tag, (impl, shards), clock)
                    self.bytes_sent += sum(data.nbytes for _, data in shards)
            except BaseException as e:  # handed to the step's thread by `flush`
                self._failure = e
            finally:
                self._outbox.task_done()

    def _connection(self, address: Address) -> socket.socket:
        if address not in self._connections:
            self._connections[address] = _bare(Client(address, authkey=self._authkey))
        return self._connections[address]

    # ------------------------------------------------------------------ receiving

    def _accept_loop(self) -> None:
        while True:
            try:
                connection = self._listener.accept()
            except Exception as e:  # a peer that failed authentication, or the listener closed
                logger.warning("refused a connection to the stage transport: %r", e)
                continue
            reader = threading.Thread(
                target=self._read_loop, args=(_bare(connection),), name="autopar-reader"
            )
            reader.daemon = True
            reader.start()

    def _read_loop(self, connection: socket.socket) -> None:
        try:
            while True:
                tag, delivery = _read(connection)
                self.mailbox.put(tag, delivery)
        except (EOFError, OSError):  # the sending worker is gone; its receivers time out
            connection.close()
        except Exception as e:  # a message this worker cannot read: fail the waiting step
            self.mailbox.fail(e)
            connection.close()

    def arrived(self, tag: Tag, source: int) -> bool:
        """Whether every part of `tag` from stage `source` is here (`receive` would not wait)."""
        return self.mailbox.arrived(tag, len(self.peers[source]))

    def receive(self, tag: Tag, source: int, aval: Any, what: str) -> tuple[Any, float]:
        """The whole host value of `tag` sent by stage `source`'s workers (waits for it), and
        the latest device clock they sent it at."""
        deliveries = self.mailbox.take(tag, len(self.peers[source]), self.timeout_s)
        if deliveries is None:
            raise TransferTimeoutError(
                f"{what} from stage {source} did not arrive within {self.timeout_s:g} s "
                f"(step {tag[0]}); the sending worker is slow, stuck or gone"
            )
        parts = [part for part, _ in deliveries]
        return from_parts(parts, aval), max(clock for _, clock in deliveries)


_LENGTH = struct.Struct("!Q")


def _bare(connection: Connection) -> socket.socket:
    """The socket under an authenticated `multiprocessing` connection (which is closed)."""
    bare = socket.socket(fileno=os.dup(connection.fileno()))
    connection.close()
    return bare


def _write(connection: socket.socket, tag: Tag, part: Part, clock: float) -> None:
    """One message: the length of a JSON header (tag, sender's clock, key implementation, each
    shard's index, dtype and shape), the header, then each shard's bytes."""
    impl, shards = part
    header = json.dumps(
        {
            "tag": list(tag),
            "clock": clock,
            "impl": impl,
            "shards": [
                ([[s.start, s.stop] for s in index], data.dtype.name, list(data.shape))
                for index, data in shards
            ],
        }
    ).encode()
    connection.sendall(_LENGTH.pack(len(header)) + header)
    for _, data in shards:
        if data.nbytes:
            connection.sendall(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)


def _read(connection: socket.socket) -> tuple[Tag, Delivery]:
    (length,) = _LENGTH.unpack(_receive_into(connection, bytearray(_LENGTH.size)))
    header = json.loads(_receive_into(connection, bytearray(length)))
    shards = []
    for index, dtype, shape in header["shards"]:
        data = np.empty(shape, jnp.dtype(dtype))
        _receive_into(connection, data.reshape(-1).view(np.uint8).data)
        shards.append((tuple(slice(start, stop) for start, stop in index), data))
    step, vid, micro_batch = header["tag"]
    return (step, vid, micro_batch), ((header["impl"], shards), header["clock"])


def _receive_into(connection: socket.socket, buffer: Any) -> Any:
    """Fill `buffer` from the socket; raises EOFError when the sender closed it first."""
    view = memoryview(buffer).cast("B")
    while view.nbytes:
        received = connection.recv_into(view)
        if not received:
            raise EOFError("the sending worker closed its connection")
        view = view[received:]
    return buffer


def key_impl(x: Any) -> str | None:
    """The implementation of a typed PRNG key array (None for any other value): keys travel as
    their raw data and are wrapped again on arrival."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(x))
    return None


def local_shards(x: Any) -> Shards:
    """The distinct shards of `x` this process holds (replica 0 of each), as host arrays (a
    typed key's raw data)."""
    if not isinstance(x, jax.Array):
        return [((), np.asarray(x))]
    if key_impl(x) is not None:
        x = jax.random.key_data(x)
    return [
        (shard.index, np.asarray(shard.data))
        for shard in x.addressable_shards
        if shard.replica_id == 0
    ]


def from_parts(parts: Sequence[Part], aval: Any) -> Any:
    """The whole host value (a typed key array for keys) from every sender's part."""
    impl = parts[0][0]
    if impl is None:
        return assemble([shards for _, shards in parts], aval)
    shards = [piece for _, part in parts for piece in part]
    key_shape = shards[0][1].shape[len(aval.shape) :]
    data = jax.ShapeDtypeStruct((*aval.shape, *key_shape), shards[0][1].dtype)
    return jax.random.wrap_key_data(assemble([shards], data), impl=impl)


def assemble(parts: Sequence[Any], aval: Any) -> Any:
    """One host value from a whole one or from shard lists that together cover it."""
    if len(parts) == 1 and not isinstance(parts[0], list):
        return parts[0]  # a whole host array, or a Python scalar
    shards = [piece for part in parts for piece in part]
    if len(shards) == 1 and shards[0][0] == ():
        return shards[0][1]
    whole = np.empty(aval.shape, aval.dtype)
    for index, data in shards:
        whole[index] = data
    return whole
