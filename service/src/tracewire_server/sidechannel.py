"""The side channel: per-step records from the worker to the server process.

One ZMQ PUSH socket per worker (rank 0 only) connects to one PULL socket bound
by the server. Each engine step that touched a traced request sends one
message: a msgpack list of StepRecords, tensors as raw bytes. The server
routes records by plan key to the trace waiting for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

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


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[StepRecord])


class Sender:
    """Worker side. send() never drops: a full pipe blocks the step (HWM is large)."""

    def __init__(self, address: str) -> None:
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(address)

    def send(self, records: list[StepRecord]) -> None:
        self._socket.send(_ENCODER.encode(records), copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)


class Receiver:
    """Server side: routes each record to the callback registered for its key."""

    def __init__(self) -> None:
        self.address = f"ipc://{tempfile.gettempdir()}/tracewire-{os.getpid()}-{uuid.uuid4().hex[:8]}"
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
                records = _DECODER.decode(frame.buffer)
            except msgspec.DecodeError:
                log.exception("dropping an undecodable side-channel message")
                continue
            for record in records:
                deliver = self._routes.get(record.key)
                if deliver is not None:  # else: the trace is gone (stopped, cancelled)
                    deliver(record)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._socket.close(linger=0)
        self._context.term()
        path = self.address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)
