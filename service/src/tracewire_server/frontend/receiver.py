"""The frontend's end of the side channel: the PULL socket its workers' records arrive on.

Separate from the wire format (shared/sidechannel.py): only the frontend receives,
on its asyncio loop, and routes each record to the trace waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from ..shared.sidechannel import StepRecord, decode, resolve, socket_path
from .metrics import observe_hook_times

log = logging.getLogger(__name__)


class Receiver:
    """Server side: routes each record to the callback registered for its key."""

    def __init__(self) -> None:
        self.address = "ipc://" + socket_path(os.getpid(), uuid.uuid4().hex[:8])
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
                batch = decode(frame.buffer)
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
