"""Running a compiled trace: engine requests, worker records, one event stream.

For every sequence (one engine request each) a task consumes vLLM's token
stream and, step by step, the worker's record for that step (side channel),
checks they agree, and emits a StepResult. A record marked `stopped` ends the
sequence there: the task leaves the engine's stream, which aborts the request
in the engine, and the output is cut after the stop step. When every sequence
of an invoke has ended, its InvokeResult follows; a TraceEnd closes the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tracewire.v1 import output_pb2, service_pb2, trace_pb2

from . import outputs
from .compiler import CompiledInvoke, CompiledTrace, EngineSequence
from .engine import Engine
from .errors import Internal, ResourceExhausted, TracewireError
from .sidechannel import Receiver, StepRecord

# How long a sequence waits for the worker's record of a step the engine
# already reported. Records normally arrive before the token itself.
RECORD_TIMEOUT_S = 60.0


@dataclass
class _SequenceResult:
    completion: output_pb2.CompletionOutput
    steps: int
    prompt: Any = None  # the first vLLM output (prompt fields)


# Steps ready together go out in one message up to this size (a step larger than
# this goes alone): fewer gRPC messages when the stream is busy.
BATCH_BYTES = 1 << 20


class _Outbox:
    """Events waiting for the client, in order. Steps accumulate in one open
    StepResults message that the consumer takes whole when it wakes, so a busy
    stream coalesces steps and an idle one sends each step at once. Bytes queued
    and not yet taken are capped: over the cap the trace fails (slow client)."""

    def __init__(self, cap: int, interval_s: float = 0.0) -> None:
        self.cap = cap
        self.interval_s = interval_s
        self._last_steps = -float("inf")  # loop time the last steps message was taken
        self.queued = 0
        # (item, bytes it counted against the cap)
        self._closed: deque[tuple[service_pb2.TraceResponse | trace_pb2.InvokeResult | None, int]] = deque()
        self._open: service_pb2.TraceResponse | None = None
        self._open_bytes = 0
        self._wake = asyncio.Event()

    def new_step(self, size_hint: int) -> trace_pb2.StepResult:
        """A StepResult to fill in place, already queued for the client."""
        if self._open is not None and self._open_bytes + size_hint > BATCH_BYTES:
            self._close_open()
        if self._open is None:
            self._open = service_pb2.TraceResponse()
            self._open_bytes = 0
        self._wake.set()
        return self._open.steps.results.add()

    def count(self, size: int) -> None:
        self._open_bytes += size
        self.queued += size
        if self.queued > self.cap:
            raise ResourceExhausted(
                f"the client is reading too slowly: {self.queued} bytes of step results "
                f"are waiting, over the per-trace buffer of {self.cap} bytes"
            )

    def put(self, item: trace_pb2.InvokeResult | None) -> None:
        """An invoke result (after all steps before it), or None to wake the consumer."""
        self._close_open()
        self._closed.append((item, 0))
        self._wake.set()

    def _close_open(self) -> None:
        if self._open is not None:
            self._closed.append((self._open, self._open_bytes))
            self._open = None

    async def get(self) -> service_pb2.TraceResponse | trace_pb2.InvokeResult | None:
        while not self._closed and self._open is None:
            self._wake.clear()
            await self._wake.wait()
        if self.interval_s and not self._closed:  # only open steps: let more join them
            delay = self._last_steps + self.interval_s - asyncio.get_running_loop().time()
            if delay > 0:
                await asyncio.sleep(delay)
        self._close_open()
        item, size = self._closed.popleft()
        self.queued -= size
        if isinstance(item, service_pb2.TraceResponse):
            self._last_steps = asyncio.get_running_loop().time()
        return item


@dataclass
class TraceRun:
    engine: Engine
    receiver: Receiver
    trace: CompiledTrace
    buffer_cap_bytes: int
    _outbox: _Outbox = field(init=False)
    _warnings: list[trace_pb2.TraceWarning] = field(default_factory=list)
    _generated: int = 0
    _read_bytes: int = 0
    _failure: TracewireError | None = None

    def __post_init__(self) -> None:
        self._outbox = _Outbox(self.buffer_cap_bytes, self.trace.stream_interval_s)

    async def send(self, write: Callable[[service_pb2.TraceResponse], Awaitable[None]]) -> None:
        """Run the trace, handing each event to `write` (the call's context.write: one
        await per message, no async generators stacked between the steps and gRPC)."""
        started = time.monotonic()
        tasks = [asyncio.create_task(self._invoke(inv)) for inv in self.trace.invokes]
        done_invokes = 0
        try:
            while done_invokes < len(tasks):
                item = await self._outbox.get()
                if self._failure is not None:  # do not make the client read a backlog first
                    raise self._failure
                if isinstance(item, service_pb2.TraceResponse):
                    await write(item)
                elif isinstance(item, trace_pb2.InvokeResult):
                    done_invokes += 1
                    await write(service_pb2.TraceResponse(invoke_result=item))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        prompt_tokens = sum(len(inv.prompt.token_ids) for inv in self.trace.invokes)
        await write(service_pb2.TraceResponse(
            end=trace_pb2.TraceEnd(
                warnings=self._warnings,
                usage=trace_pb2.Usage(
                    prompt_tokens=prompt_tokens,
                    generated_tokens=self._generated,
                    elapsed_seconds=time.monotonic() - started,
                    read_bytes=self._read_bytes,
                ),
            )
        ))

    async def _invoke(self, inv: CompiledInvoke) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._sequence(inv, s)) for s in inv.sequences]
            results = [t.result() for t in tasks]
            self._warn_unreached(inv, results)
            self._outbox.put(self._invoke_result(inv, results))
        except* TracewireError as group_error:
            self._fail(group_error.exceptions[0])
        except* Exception as group_error:  # noqa: BLE001 - reported to the client as INTERNAL
            e = group_error.exceptions[0]
            self._fail(Internal(f"trace failed: {type(e).__name__}: {e}"))

    def _fail(self, error: BaseException) -> None:
        if self._failure is None:
            assert isinstance(error, TracewireError)
            self._failure = error
            self._outbox.put(None)  # wake the consumer

    async def _sequence(self, inv: CompiledInvoke, seq: EngineSequence) -> _SequenceResult:
        records: asyncio.Queue[StepRecord] | None = None
        if seq.plan is not None:
            records = asyncio.Queue()
            self.receiver.register(seq.plan.key, records.put_nowait)
        skip_special = seq.sampling.get("skip_special_tokens", True)
        text = self.engine.text_tracker(inv.prompt.token_ids, skip_special)
        completion = output_pb2.CompletionOutput(index=seq.sequence_index)
        token_ids: list[int] = []  # into the completion at the end: this loop runs per token
        vllm_text: list[str] = []
        first: Any = None
        stopped_at: int | None = None
        plan = seq.plan
        try:
            stream = self.engine.generate(inv.prompt, seq.sampling, stream=True)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    now_ns = time.time_ns()
                    first = first or out
                    c = out.outputs[0]
                    for k, token in enumerate(c.token_ids):
                        step = len(token_ids)
                        # The worker records a step only when an op is selected at it.
                        record = (await self._record(records, seq, step, token)
                                  if records is not None and plan is not None and plan.active_at(step) else None)
                        token_ids.append(token)
                        if c.logprobs is not None:
                            completion.logprobs.extend(outputs.positions([c.logprobs[k]]))
                        self._generated += 1
                        self._step_result(seq, step, token, text.add(token), record, now_ns)
                        if record is not None and record.stopped:
                            stopped_at = step
                            break
                    if stopped_at is not None:
                        break  # leaving the stream aborts the request in the engine
                    vllm_text.append(c.text)
                    if c.cumulative_logprob is not None:
                        completion.cumulative_logprob = c.cumulative_logprob
                    if c.finish_reason is not None:
                        completion.finish_reason = outputs.finish_reason(c.finish_reason)
                        outputs.set_stop_reason(completion, c.stop_reason)
        finally:
            if plan is not None:
                self.receiver.unregister(plan.key)
        completion.token_ids.extend(token_ids)
        if stopped_at is not None:
            completion.text = self.engine.decode(token_ids, skip_special_tokens=skip_special)
            completion.finish_reason = output_pb2.FINISH_REASON_STOP
            if len(completion.logprobs):
                completion.cumulative_logprob = sum(
                    next(e.logprob for e in pos.entries if e.token_id == t)
                    for t, pos in zip(token_ids, completion.logprobs, strict=True)
                )
        else:
            completion.text = "".join(vllm_text)
        return _SequenceResult(completion, len(completion.token_ids), first)

    async def _record(
        self, records: asyncio.Queue[StepRecord], seq: EngineSequence, step: int, token: int
    ) -> StepRecord:
        try:
            # The record usually arrived before vLLM's token: skip wait_for's timer then.
            record = records.get_nowait() if not records.empty() else await asyncio.wait_for(
                records.get(), RECORD_TIMEOUT_S
            )
        except TimeoutError:
            raise Internal(
                f"invoke {seq.invoke_index} sequence {seq.sequence_index}: no record from the "
                f"engine's hooks for step {step} within {RECORD_TIMEOUT_S:.0f} s"
            ) from None
        if record.error is not None:
            raise Internal(
                f"invoke {seq.invoke_index} sequence {seq.sequence_index}: an intervention failed "
                f"in the engine at step {record.step}: {record.error}"
            )
        if record.step != step or record.token_id != token:
            raise Internal(
                f"invoke {seq.invoke_index} sequence {seq.sequence_index}: the engine's hooks saw "
                f"step {record.step} token {record.token_id}, the engine reported step {step} "
                f"token {token}"
            )
        return record

    def _step_result(
        self, seq: EngineSequence, step: int, token: int, text_delta: str, record: StepRecord | None, now_ns: int
    ) -> None:
        """`record`: the worker's for this step, None at a step it did not record."""
        values = record.values if record is not None else {}
        stopped = record is not None and record.stopped
        if not (self.trace.stream_every_step or values or stopped):
            return
        size_hint = sum(len(v.values.data) for v in values.values())
        # Built in place inside the outgoing message: no intermediate copies.
        result = self._outbox.new_step(size_hint)
        result.invoke_index = seq.invoke_index
        result.sequence_index = seq.sequence_index
        result.step = step
        result.token_id = token
        result.text_delta = text_delta
        result.stopped = stopped
        # (the fields directly: protobuf's FromNanoseconds is Python, and this runs per token)
        result.engine_time.seconds, result.engine_time.nanos = divmod(now_ns, 1_000_000_000)
        for name, value in values.items():
            target = result.values[name]
            value.values.fill(target.values)
            if value.token_ids is not None:
                value.token_ids.fill(target.token_ids)
            if value.positions is not None:
                value.positions.fill(target.positions)
        self._read_bytes += size_hint
        self._outbox.count(result.ByteSize())

    def _invoke_result(
        self, inv: CompiledInvoke, results: list[_SequenceResult]
    ) -> trace_pb2.InvokeResult:
        first = results[0].prompt
        output = output_pb2.RequestOutput(request_id=inv.key, finished=True)
        if inv.prompt.text is not None:
            output.prompt = inv.prompt.text
        output.prompt_token_ids.extend(inv.prompt.token_ids)
        if first is not None:
            if first.prompt_logprobs is not None:
                output.prompt_logprobs.extend(outputs.positions(first.prompt_logprobs))
            output.num_cached_tokens = int(getattr(first, "num_cached_tokens", 0) or 0)
        output.outputs.extend(r.completion for r in results)
        return trace_pb2.InvokeResult(invoke_index=inv.index, output=output)

    def _warn_unreached(self, inv: CompiledInvoke, results: list[_SequenceResult]) -> None:
        reached = max(r.steps for r in results) - 1  # last step any sequence made
        for op in self.trace.ops_by_invoke[inv.index]:
            last = op.steps.last()
            if last is not None and last > reached:
                self._warnings.append(
                    trace_pb2.TraceWarning(
                        code="STEP_NOT_REACHED",
                        message=(
                            f"intervention {op.name!r} of invoke {inv.index} selected step {last}, "
                            f"but the generation ended at step {reached}"
                        ),
                        invoke_index=inv.index,
                        intervention=op.name,
                    )
                )
