"""The side channel: per-step records from the worker to the server process.

One ZMQ PUSH socket per worker (rank 0 only) and frontend connects to the PULL
socket that frontend binds. Each engine step that touched a traced request of
that frontend sends one message: a msgpack StepBatch, tensors as raw bytes. A
read batched across rows (top-k logits, logprobs, ...) travels once for the
whole step, as a column the records point into. Sequences that only read (the
common case under load: top-k every step) travel as a RowBlock, their records as
arrays, so the worker spends a few list entries per sequence and step on them.
The server hands each record its own rows and routes records by plan key to the
trace waiting for them.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import glob
import logging
import os
import tempfile
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from ..frontend.metrics import observe_hook_times
from .tensors import RawTensor

log = logging.getLogger(__name__)


class ReadResult(msgspec.Struct, array_like=True, frozen=True):
    values: RawTensor
    token_ids: RawTensor | None = None
    positions: RawTensor | None = None  # prompt positions of the rows


class StepRecord(msgspec.Struct, array_like=True, frozen=True):
    """What the worker saw and did for one sequence at one step."""

    key: str
    step: int
    token_id: int
    values: dict[str, ReadResult]
    stopped: bool = False
    error: str | None = None
    # Reads whose value is a row of one of the step's columns: name -> (column, row).
    # The server resolves them into `values` before a trace sees the record.
    rows: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


class RowBlock(msgspec.Struct, array_like=True, frozen=True):
    """The records of several sequences at one step, as arrays: record j is sequence
    keys[j] at steps[j], which drew tokens[j]; its read `name` is row rows[j] of
    `column` for each (name, column, rows) in `reads`, and the drawn token for each
    name in `samples`. No stops or errors (those travel as StepRecords)."""

    keys: list[str]
    steps: list[int]
    tokens: list[int]
    reads: list[tuple[str, int, list[int]]]
    samples: list[str] = msgspec.field(default_factory=list)

    def record(self, j: int, columns: list[ReadResult]) -> StepRecord:
        token = self.tokens[j]
        values = {name: token_read(token) for name in self.samples}
        for name, c, rows in self.reads:
            values[name] = _column_row(columns[c], rows[j])
        return StepRecord(self.keys[j], self.steps[j], token, values)


class StepBatch(msgspec.Struct, array_like=True, frozen=True):
    """One step's records for one frontend, and the columns they point into."""

    records: list[StepRecord]
    columns: list[ReadResult]
    blocks: list[RowBlock] = msgspec.field(default_factory=list)
    # The worker hooks' time on this step: on the engine's thread, and finishing it (the
    # collector thread; inline on CPUs). For the frontend's metrics.
    engine_s: float = 0.0
    collector_s: float = 0.0


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepBatch)


def _row(column: RawTensor, row: int) -> RawTensor:
    size = len(column.data) // column.shape[0]
    return RawTensor(column.dtype, column.shape[1:], column.data[row * size:(row + 1) * size])


def _column_row(column: ReadResult, j: int) -> ReadResult:
    return ReadResult(_row(column.values, j), _row(column.token_ids, j) if column.token_ids is not None else None)


def token_read(token: int) -> ReadResult:
    """The value of a read of the drawn token: an int32 scalar."""
    return ReadResult(RawTensor("int32", (), token.to_bytes(4, "little", signed=True)))


def resolve(record: StepRecord, columns: list[ReadResult]) -> StepRecord:
    """The record with its column rows as values of its own."""
    if not record.rows:
        return record
    values = dict(record.values)
    for name, (c, j) in record.rows.items():
        values[name] = _column_row(columns[c], j)
    return msgspec.structs.replace(record, values=values, rows={})


ZERO_COPY_FROM = 1 << 16


@functools.cache
def _send_keeping_gil() -> Callable[[int, bytes, int, int], int] | None:
    """libzmq's own zmq_send, called through ctypes.PyDLL, which keeps the GIL (None
    where pyzmq's libzmq is not found). pyzmq lets go of the GIL for every send. The
    collector thread then waits to get it back from vLLM's busy engine thread, once per
    frontend per step: ~1 ms a step of 8 sends beside a busy thread (bench/hooks.py).
    A send that would block cannot hold the GIL: it is tried with ZMQ_DONTWAIT only."""
    try:
        with open("/proc/self/maps") as maps:  # pyzmq's wheels load their own libzmq
            paths = {line.split()[-1] for line in maps if "libzmq" in line.rsplit("/", 1)[-1]}
        if len(paths) != 1:
            return None
        send = ctypes.PyDLL(paths.pop()).zmq_send
    except (OSError, AttributeError):
        return None
    send.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    send.restype = ctypes.c_int
    return send  # type: ignore[no-any-return]


def _threads() -> set[int]:
    """This process's thread ids (Linux; empty elsewhere)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


@functools.cache
def _sender_context() -> zmq.Context:  # type: ignore[type-arg]
    """The senders' ZMQ context, one per process, made on the thread that will send.

    Every send wakes the context's I/O thread, which inherits the creating thread's CPU
    affinity. vLLM's CPU backend pins its worker to some cores and leaves the others for
    everything else: there the I/O thread would wake on the worker's own core and preempt
    the step that sent the message, once per step (~0.3 ms a step on the 2-core VM, most
    of what a one-request top-20 trace cost). It is moved to the other cores, where there
    are any; elsewhere (a GPU worker is not pinned) nothing changes."""
    context = zmq.Context(io_threads=1)
    before = _threads()
    # The first socket starts the context's threads (I/O and reaper). They name themselves
    # only once running, so they are told apart as the threads that were not there before.
    context.socket(zmq.PUSH).close(linger=0)
    try:
        others = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
    except (AttributeError, OSError):  # no affinities on this platform
        return context
    if not others:  # not pinned (a GPU worker), or no other CPU to go to
        return context
    for tid in _threads() - before:
        try:
            os.sched_setaffinity(tid, others)  # the kernel keeps those of this cgroup
        except OSError:
            pass  # none of the other CPUs is ours (or the thread is gone): it stays put
    return context


class Sender:
    """Worker side. send() never drops: a full pipe blocks the step (HWM is large)."""

    def __init__(self, address: str, high_water_mark: int = 100_000) -> None:
        self._context = _sender_context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)  # messages queued before send() waits
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(address)
        self._send_now = _send_keeping_gil()

    def send(self, batch: StepBatch) -> None:
        data = _ENCODER.encode(batch)
        if self._send_now is not None:
            if self._send_now(self._socket.underlying, data, len(data), zmq.DONTWAIT) == len(data):
                return
            # Else the pipe is full (or the send failed): pyzmq waits, or raises what failed.
        # Below ~64 KB pyzmq's zero-copy send costs more than copying (4 µs against 19 µs
        # for 9 KB, measured): it sets up a frame whose release another thread tracks.
        self._socket.send(data, copy=len(data) < ZERO_COPY_FROM)

    def close(self) -> None:
        self._socket.close(linger=0)


def _socket_path(pid: int, suffix: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"tracewire-{pid}-{suffix}")


def socket_paths(pid: int) -> list[str]:
    """The socket files server process `pid`'s Receivers bound: for whoever outlives a
    server killed outright (engine_group.py) to remove."""
    return glob.glob(_socket_path(pid, "*"))


class Receiver:
    """Server side: routes each record to the callback registered for its key."""

    def __init__(self) -> None:
        self.address = "ipc://" + _socket_path(os.getpid(), uuid.uuid4().hex[:8])
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, 100_000)
        self._socket.bind(self.address)
        self._routes: dict[str, Callable[[StepRecord], None]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tracewire-sidechannel")

    def register(self, key: str, deliver: Callable[[StepRecord], None]) -> None:
        self._routes[key] = deliver

    def unregister(self, key: str) -> None:
        self._routes.pop(key, None)

    async def _run(self) -> None:
        while True:
            frame = await self._socket.recv(copy=False)
            try:
                batch = _DECODER.decode(frame.buffer)
            except msgspec.DecodeError:
                log.exception("dropping an undecodable side-channel message")
                continue
            observe_hook_times(batch.engine_s, batch.collector_s)
            routes = self._routes
            for record in batch.records:
                deliver = routes.get(record.key)
                if deliver is not None:  # else: the trace is gone (stopped, cancelled)
                    deliver(resolve(record, batch.columns))
            for block in batch.blocks:
                for j, key in enumerate(block.keys):
                    deliver = routes.get(key)
                    if deliver is not None:
                        deliver(block.record(j, batch.columns))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._socket.close(linger=0)
        self._context.term()
        path = self.address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)
