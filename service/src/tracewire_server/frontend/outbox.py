"""A trace's outgoing stream: its events in order, steps coalesced, each message
written the moment it is ready."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from tracewire.v1 import service_pb2, trace_pb2

from . import metrics
from .errors import ResourceExhausted, TracewireError

# Steps ready together go out in one message up to this size (a step larger than
# this goes alone): fewer gRPC messages when the stream is busy.
BATCH_BYTES = 1 << 20

Write = Callable[[service_pb2.TraceResponse], Awaitable[None]]

_observe_latency = metrics.ENGINE_TO_CLIENT.observe


class Outbox:
    """The events of one trace on their way to the client, and the one task that writes them.

    Steps go into one open StepResults message. `flush()`, which the trace calls after each
    engine output, starts the writer when none is running, and starts it *now*: the message
    reaches gRPC inside the caller's own turn of the event loop. A frontend gets a whole
    engine step's tokens in one burst (32 streams at a time on the H200 at c=256); a writer
    that waited for its own turn wrote only after every stream of the burst had been
    processed, which was most of the 1.4-1.6 ms p50 step latency there. While a write is in
    flight, new steps join the open message and go in the next one, so a busy stream
    coalesces and an idle one sends each step at once.

    Bytes queued and not yet handed to gRPC are capped: over the cap the trace fails (a
    client reading too slowly). `finished` resolves once the last invoke result is written,
    or with the error that ended the trace.
    """

    def __init__(self, write: Write, invokes: int, cap: int, interval_s: float = 0.0) -> None:
        self._write = write
        self._invokes_left = invokes
        self.cap = cap
        self.interval_s = interval_s
        self.queued = 0
        self._last_steps = -math.inf  # loop time the last steps message was taken
        # messages ready to write, the bytes each counted against the cap, whether it ends
        # an invoke, and its steps' engine times (time.time_ns(), for the latency metric)
        self._ready: deque[tuple[service_pb2.TraceResponse, int, bool, list[int]]] = deque()
        self._open: service_pb2.TraceResponse | None = None
        self._open_bytes = 0
        self._open_times: list[int] = []
        self._writer: asyncio.Task[None] | None = None
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        metrics.OUTBOXES.add(self)

    def new_step(self, size_hint: int, engine_ns: int = 0) -> trace_pb2.StepResult:
        """A StepResult to fill in place, already queued; `count` it once filled.
        `engine_ns`: its engine_time, as time.time_ns()."""
        if self._open is not None and self._open_bytes + size_hint > BATCH_BYTES:
            self._close_open()
        if self._open is None:
            self._open = service_pb2.TraceResponse()
            self._open_bytes = 0
        if engine_ns:
            self._open_times.append(engine_ns)
        return self._open.steps.results.add()

    def count(self, size: int) -> None:
        self._open_bytes += size
        self.queued += size
        if self.queued > self.cap:
            raise ResourceExhausted(
                f"the client is reading too slowly: {self.queued} bytes of step results "
                f"are waiting, over the per-trace buffer of {self.cap} bytes"
            )

    def put_invoke_result(self, result: trace_pb2.InvokeResult) -> None:
        """After all the invoke's steps; written at once."""
        self._close_open()
        self._ready.append((service_pb2.TraceResponse(invoke_result=result), 0, True, []))
        self.flush()

    def flush(self) -> None:
        """Start writing what is queued, unless a write is already under way."""
        if self._writer is None and not self.finished.done() and (self._ready or self._open is not None):
            self._writer = _start_now(self._drain())

    def fail(self, error: TracewireError) -> None:
        """End the trace with `error`; the backlog is not written."""
        if not self.finished.done():
            self.finished.set_exception(error)

    def waiting_messages(self) -> int:
        """Messages queued and not yet handed to the transport (metrics)."""
        return len(self._ready) + (self._open is not None)

    def close(self) -> None:
        """The trace is over: stop writing."""
        metrics.OUTBOXES.discard(self)
        if self._writer is not None:
            self._writer.cancel()
        if not self.finished.done():
            self.finished.cancel()
        elif not self.finished.cancelled():
            self.finished.exception()  # retrieved: no "never retrieved" log when nobody awaited it

    async def _drain(self) -> None:
        try:
            while not self.finished.done() and (item := await self._next()) is not None:
                message, ends_invoke, engine_times = item
                if engine_times:
                    now = time.time_ns()
                    for engine_ns in engine_times:
                        _observe_latency((now - engine_ns) * 1e-9)
                await self._write(message)
                if ends_invoke:
                    self._invokes_left -= 1
                    if self._invokes_left == 0 and not self.finished.done():
                        self.finished.set_result(None)
        except Exception as e:  # noqa: BLE001 - the stream broke: the trace ends with it
            if not self.finished.done():
                self.finished.set_exception(e)
        finally:
            self._writer = None

    async def _next(self) -> tuple[service_pb2.TraceResponse, bool, list[int]] | None:
        loop = asyncio.get_running_loop()
        if self.interval_s and not self._ready:  # only open steps: let more join them
            delay = self._last_steps + self.interval_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
        self._close_open()
        if not self._ready or self.finished.done():  # (it may have failed while we slept)
            return None
        message, size, ends_invoke, engine_times = self._ready.popleft()
        self.queued -= size
        if not ends_invoke:
            self._last_steps = loop.time()
        return message, ends_invoke, engine_times

    def _close_open(self) -> None:
        if self._open is not None:
            self._ready.append((self._open, self._open_bytes, False, self._open_times))
            self._open = None
            self._open_times = []


if sys.version_info >= (3, 12):

    def _start_now(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """`coro` run up to its first suspension right here, then on as a task; None when
        it finished without suspending."""
        task = asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)
        return None if task.done() else task

else:  # Python 3.11 has no eager tasks. Delete this branch with 3.11.

    def _start_now(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """`coro` run up to its first suspension right here, then on as a task; None when
        it finished without suspending."""
        try:
            waiting = coro.send(None)
        except StopIteration:
            return None
        return asyncio.get_running_loop().create_task(_resume(coro, waiting))

    async def _resume(coro: Coroutine[Any, Any, None], waiting: Any) -> None:
        """Drive `coro` on from a suspension on `waiting` (a future, or None for a bare
        yield) as asyncio's Task would: resume it once `waiting` is done, and pass it a
        cancellation of this task."""
        while True:
            try:
                if waiting is None:
                    await asyncio.sleep(0)
                else:
                    waiting._asyncio_future_blocking = False  # was set by coro's own await
                    await waiting
                error: BaseException | None = None
            except BaseException as e:  # noqa: BLE001 - handed to coro below
                error = e
                if waiting is not None and waiting.done() and (waiting.cancelled() or waiting.exception() is e):
                    error = None  # coro reads `waiting`'s outcome itself when resumed
            try:
                waiting = coro.send(None) if error is None else coro.throw(error)
            except StopIteration:
                return
