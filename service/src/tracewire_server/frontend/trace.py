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
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tracewire.v1 import output_pb2, service_pb2, trace_pb2

from ..shared.detokenize import DecodeStreamTracker, TextTracker
from ..shared.sidechannel import StepRecord
from . import outputs, tensors
from .calls import current_tenant
from .compiler import CompiledInvoke, CompiledTrace, EngineSequence
from .errors import FailedPrecondition, Internal, TracewireError
from .invoke_gates import InvokeGates
from .metrics import TraceMetrics
from .outbox import Outbox, Write
from .patch_room import PatchRoom
from .prompts import EnginePrompt
from .receiver import Receiver

# How long a sequence waits for the worker's record of a step the engine
# already reported. Records normally arrive before the token itself.
RECORD_TIMEOUT_S = 60.0


class TraceEngine(Protocol):
    """What a trace needs of the engine (engine.Engine, which starts the runs:
    Engine.trace)."""

    def generate(
        self, prompt: EnginePrompt, sampling: dict[str, Any], *, stream: bool, cache_salt: str | None = None
    ) -> AsyncGenerator[Any, None]: ...

    def text_tracker(
        self, prompt_ids: Sequence[int], skip_special_tokens: bool
    ) -> TextTracker | DecodeStreamTracker: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    # Room in the worker's patch store (a patching trace takes it before it starts)...
    patch_room: PatchRoom

    # ...given back, with the worker's values, when the trace ends.
    def release_trace(self, trace_key: str) -> None: ...


@dataclass
class _SequenceResult:
    completion: output_pb2.CompletionOutput
    steps: int
    prompt: Any = None  # the first vLLM output (prompt fields)


@dataclass
class TraceRun:
    engine: TraceEngine
    receiver: Receiver  # this frontend's side channel: the worker hooks' records of the trace's steps
    trace: CompiledTrace
    buffer_cap_bytes: int
    # Whether a dictionary name still holds a generation (the registry's `unchanged`): a
    # trace whose dictionary was deleted or replaced while it ran fails with
    # FAILED_PRECONDITION, not INTERNAL. (None: not known here, never claimed.)
    dictionary_unchanged: Callable[[str, int], bool] | None = None
    _outbox: Outbox = field(init=False)
    _metrics: TraceMetrics = field(init=False)
    _warnings: list[trace_pb2.TraceWarning] = field(default_factory=list)
    _generated: int = 0
    _read_bytes: int = 0
    _gates: InvokeGates = field(init=False)

    async def send(self, write: Write) -> None:
        """Run the trace, handing each event to `write` (the call's context.write: one
        await per message, no async generators stacked between the steps and gRPC)."""
        self._metrics = TraceMetrics.start(self.trace, current_tenant())
        try:
            await self._run(write)
        finally:
            self._metrics.finish()

    async def _run(self, write: Write) -> None:
        started = time.monotonic()
        if self.trace.keeps_values:  # before anything runs: room for its patch sources' values
            self.engine.patch_room.admit(self.trace.key, self.trace.patch_bytes, self.trace.patch_source)
        if self.trace.clamp_columns:  # ... and for its dictionary clamps (compiled engines)
            try:
                self.engine.clamp_room.admit(self.trace.key, self.trace.clamp_columns)
            except BaseException:
                if self.trace.keeps_values:
                    self.engine.release_trace(self.trace.key)
                raise
        self._outbox = Outbox(write, len(self.trace.invokes), self.buffer_cap_bytes, self.trace.stream_interval_s)
        self._gates = InvokeGates(self.trace.waits)
        tasks = [asyncio.create_task(self._invoke(inv)) for inv in self.trace.invokes]
        try:
            await self._outbox.finished  # every invoke's result written, or the error that ended the trace
        finally:
            self._outbox.close()
            for t in tasks:
                t.cancel()
            if self.trace.keeps_values:  # however the trace ended: free its patch sources' values
                self.engine.release_trace(self.trace.key)
            self.engine.clamp_room.free(self.trace.key)
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
            # Activation patching: not before the sources it patches from have the values.
            await self._gates.wait(inv.index)
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._sequence(inv, s)) for s in inv.sequences]
            results = [t.result() for t in tasks]
            self._warn_unreached(inv, results)
            self._outbox.put_invoke_result(self._invoke_result(inv, results))
        except* TracewireError as group_error:
            self._outbox.fail(group_error.exceptions[0])
        except* Exception as group_error:  # noqa: BLE001 - reported to the client as INTERNAL
            e = group_error.exceptions[0]
            self._outbox.fail(Internal(f"trace failed: {type(e).__name__}: {e}"))

    async def _sequence(self, inv: CompiledInvoke, seq: EngineSequence) -> _SequenceResult:
        records: asyncio.Queue[StepRecord] | None = None
        if seq.plan is not None:
            records = asyncio.Queue()
            self.receiver.register(seq.plan.key, records.put_nowait)
        skip_special = inv.skip_special_tokens
        text = self.engine.text_tracker(inv.prompt.token_ids, skip_special)
        completion = output_pb2.CompletionOutput(index=seq.sequence_index)
        token_ids: list[int] = []  # into the completion at the end: this loop runs per token
        vllm_text: list[str] = []
        first: Any = None
        stopped_at: int | None = None
        plan = seq.plan
        early: dict[int, list[StepRecord]] = {}  # pipeline stages' parts of later steps
        try:
            stream = self.engine.generate(inv.prompt, seq.sampling, stream=True, cache_salt=inv.cache_salt)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    now_ns = time.time_ns()
                    first = first or out
                    c = out.outputs[0]
                    for k, token in enumerate(c.token_ids):
                        step = len(token_ids)
                        # The worker records a step only when an op is selected at it.
                        record = (await self._record(records, seq, step, token, early)
                                  if records is not None and plan is not None and plan.active_at(step) else None)
                        if record is not None:
                            self._gates.reached(seq.invoke_index, step)  # (its worker kept the values first)
                        token_ids.append(token)
                        if c.logprobs is not None:
                            completion.logprobs.extend(outputs.positions([c.logprobs[k]]))
                        self._generated += 1
                        self._step_result(seq, step, token, text.add(token), record, now_ns)
                        if record is not None and record.stopped:
                            stopped_at = step
                            break
                    self._outbox.flush()  # this output's steps go to the client now
                    self._metrics.maybe_publish()
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
            self._gates.ended(seq.invoke_index)
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
        self, records: asyncio.Queue[StepRecord], seq: EngineSequence, step: int, token: int,
        early: dict[int, list[StepRecord]],
    ) -> StepRecord:
        """The worker's record of `step`; under pipeline parallelism the parts the stages
        with ops at the step sent, joined (a part of a later step, sent by an earlier
        stage before the last stage's record of this one, waits in `early`)."""
        assert seq.plan is not None
        if not seq.plan.stages:
            return self._checked(await self._next_record(records, seq, step), seq, step, token)
        parts = early.pop(step, [])
        while len(parts) < seq.plan.parts_at(step):
            record = await self._next_record(records, seq, step)
            if record.step == step:
                parts.append(record)
            else:
                early.setdefault(record.step, []).append(record)
        values = {name: value for part in parts for name, value in part.values.items()}
        drawn = max(part.token_id for part in parts)  # (earlier stages do not know it: -1)
        joined = StepRecord(parts[0].key, step, drawn if drawn >= 0 else token, values,
                            any(part.stopped for part in parts))
        return self._checked(joined, seq, step, token)

    async def _next_record(self, records: asyncio.Queue[StepRecord], seq: EngineSequence, step: int) -> StepRecord:
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
            failed = (f"invoke {seq.invoke_index} sequence {seq.sequence_index}: an intervention failed "
                      f"in the engine at step {record.step}: {record.error}")
            if (gone := self._changed_dictionary()) is not None:
                raise FailedPrecondition(f"dictionary {gone!r} was deleted or registered again while the trace "
                                         f"ran; {failed}")
            raise Internal(failed)
        return record

    def _changed_dictionary(self) -> str | None:
        """A dictionary the trace uses that no longer holds the generation it was compiled
        against (another call deleted or replaced it)."""
        unchanged = self.dictionary_unchanged
        for ref in self.trace.dictionaries if unchanged is not None else ():
            if not unchanged(ref.name, ref.generation):
                return ref.name
        return None

    @staticmethod
    def _checked(record: StepRecord, seq: EngineSequence, step: int, token: int) -> StepRecord:
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
        result = self._outbox.new_step(size_hint, now_ns)
        result.invoke_index = seq.invoke_index
        result.sequence_index = seq.sequence_index
        result.step = step
        result.token_id = token
        result.text_delta = text_delta
        result.stopped = stopped
        # (the fields directly: protobuf's FromNanoseconds is Python, and this runs per token)
        result.engine_time.seconds, result.engine_time.nanos = divmod(now_ns, 1_000_000_000)
        self._metrics.step_count += 1
        reads = self._metrics.reads[seq.invoke_index]
        for name, value in values.items():
            counts = reads.get(name)
            if counts is not None:
                counts.count += 1
                counts.size += len(value.values.data)
            target = result.values[name]
            tensors.fill(target.values, value.values)
            if value.token_ids is not None:
                tensors.fill(target.token_ids, value.token_ids)
            if value.positions is not None:
                tensors.fill(target.positions, value.positions)
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
