"""Every error path of the SDK raises the same typed error from Client and AsyncClient.

Each case runs one SDK entry point (generate, generate_stream, trace, stream_trace,
tokenizer.encode / decode) through both clients against the session server and
compares what they raise: class, message, `.field` and code. The session server
runs its engine compiled (no --enforce-eager), so a clamp wider than its graph computes
is a FAILED_PRECONDITION there, and with --enable-fault-injection, so an intervention
named "__fault__:..." fails a trace in the engine, after steps have streamed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import tracewire as tw
from conftest import ServerProcess

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, ignore_eos=True)
VOCAB = 2048
TIMEOUT = 120.0
TINY_TIMEOUT = 1e-3  # expires before any generation can; a short Tokenize beats it


def _nothing(tracer: tw.Tracer) -> None:
    return None


@dataclass(frozen=True)
class Case:
    """One error path: an SDK call and the error it must raise."""

    call: str  # generate | generate_stream | trace | stream_trace | encode | decode
    expect: type[tw.TracewireError]
    field: str | None = None  # the InvalidArgument's .field
    prompt: Any = PROMPT
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    build: Callable[[tw.Tracer], None] = _nothing  # the trace's reads and writes
    timeout: float = TIMEOUT
    mid_stream: bool = False  # the error must come after the stream yielded something
    # When gRPC itself words the error two ways, each client may get either: the messages
    # must be among these, and all else identical.
    wordings: frozenset[str] = frozenset()


def _force_outside_vocab(tracer: tw.Tracer) -> None:
    tracer.iter[0].samples = VOCAB


def _top_k_zero(tracer: tw.Tracer) -> None:
    tracer.all().logits.top_k(0).save()


def _wide_clamp(tracer: tw.Tracer) -> None:
    # (a compiled graph clamps at most 8 features a write)
    tracer.all().model.layers[2].output.clamp_feature("res-l2-sae", list(range(9)), 1.0)


def _full_rows_over_budget(tracer: tw.Tracer) -> None:
    tracer.all().logits.save()
    tracer.options(max_read_bytes=1)


def _fault_at_step_8(tracer: tw.Tracer) -> None:
    # The session server raises in the engine hook at step 8: INTERNAL, mid-stream.
    tracer.iter[8].samples.save(name="__fault__:boom at step 8")


def _invalid(call: str, field: str, **kw: Any) -> Case:
    return Case(call, tw.InvalidArgument, field, **kw)


# Whether the client's timer or the server's reset of the stream ends a call first decides
# grpc's wording (on a loaded machine either can win, on any kind of call).
DEADLINE_WORDINGS = frozenset({"Deadline Exceeded", "Stream removed (Deadline Exceeded)"})


def _deadline(call: str, **kw: Any) -> Case:
    return Case(call, tw.DeadlineExceeded, timeout=TINY_TIMEOUT, wordings=DEADLINE_WORDINGS, **kw)


LONG = dict(max_tokens=16, **GREEDY)
CASES: dict[str, Case] = {
    # INVALID_ARGUMENT naming the field, through each kind of call.
    "generate bad top_p": _invalid("generate", "sampling_params.top_p", sampling=dict(top_p=3.0)),
    "generate no prompts": _invalid("generate", "prompts", prompt=[]),
    "generate id outside vocab": _invalid("generate", "prompts[0].token_ids.ids[2]",
                                          prompt=[1, 2, VOCAB]),
    "generate misspelled keyword (SDK-side)": _invalid("generate", "temprature",
                                                       sampling=dict(temprature=0.0)),
    "generate_stream bad top_p": _invalid("generate_stream", "sampling_params.top_p",
                                          sampling=dict(top_p=2.0)),
    "generate_stream empty text": _invalid("generate_stream", "prompts[0].text", prompt=""),
    "trace forced id outside vocab": _invalid(
        "trace", "invokes[0].interventions[0].force_sample.token_id", build=_force_outside_vocab),
    "trace empty prompt": _invalid("trace", "invokes[0].prompt.text", prompt=""),
    "stream_trace top-k zero": _invalid(
        "stream_trace", "invokes[0].interventions[0].read_logits.top_k.k", build=_top_k_zero),
    "stream_trace bad temperature": _invalid("stream_trace", "sampling_params.temperature",
                                             sampling=dict(temperature=-1.0)),
    "decode id outside vocab": _invalid("decode", "token_ids[1]", prompt=[1, VOCAB]),
    # FAILED_PRECONDITION: what the compiled graph does not compute.
    "trace wide clamp": Case("trace", tw.FailedPrecondition, build=_wide_clamp),
    "stream_trace wide clamp": Case("stream_trace", tw.FailedPrecondition, build=_wide_clamp),
    # RESOURCE_EXHAUSTED: reads over the trace's own byte budget, refused up front.
    "trace over max_read_bytes": Case("trace", tw.ResourceExhausted, build=_full_rows_over_budget),
    "stream_trace over max_read_bytes": Case("stream_trace", tw.ResourceExhausted,
                                             build=_full_rows_over_budget),
    # INTERNAL raised in the engine, after steps have gone by.
    "trace engine fault": Case("trace", tw.Internal, sampling=LONG, build=_fault_at_step_8),
    "stream_trace engine fault": Case("stream_trace", tw.Internal, sampling=LONG,
                                      build=_fault_at_step_8, mid_stream=True),
    # DEADLINE_EXCEEDED on every kind of call.
    "generate deadline": _deadline("generate"),
    "generate_stream deadline": _deadline("generate_stream"),
    "trace deadline": _deadline("trace"),
    "stream_trace deadline": _deadline("stream_trace"),
    # Inputs that take the tokenizer tens of milliseconds, far past the deadline.
    "encode deadline": _deadline("encode", prompt=PROMPT * 3000),
    "decode deadline": _deadline("decode", prompt=[5] * 200_000),
    # 32 prompts x 480 steps take far longer than the deadline; the first deltas do not.
    "generate_stream deadline mid-stream": Case(
        "generate_stream", tw.DeadlineExceeded, prompt=[PROMPT] * 32,
        sampling=dict(max_tokens=480, **GREEDY), timeout=2.0, mid_stream=True,
        wordings=DEADLINE_WORDINGS),
}


@dataclass(frozen=True)
class Raised:
    """What a client raised, in the terms sync and async must agree on."""

    kind: type[BaseException]
    message: str
    field: str | None
    code: grpc.StatusCode

    @staticmethod
    def of(error: tw.TracewireError) -> Raised:
        return Raised(type(error), str(error), error.field, error.code)

    def worded(self, message: str) -> Raised:
        return dataclasses.replace(self, message=message)


# -- the calls, once per client: each yields what the call returns, item by item -----


def _sync_calls(client: tw.Client, case: Case) -> Iterator[object]:
    if case.call == "generate":
        yield client.generate(case.prompt, **case.sampling)
    elif case.call == "generate_stream":
        yield from client.generate_stream(case.prompt, **case.sampling)
    elif case.call == "trace":
        with client.trace(case.prompt, **case.sampling) as tracer:
            case.build(tracer)
        yield tracer
    elif case.call == "stream_trace":
        tracer = client.trace(case.prompt, **case.sampling)
        case.build(tracer)
        yield from client.stream_trace(tracer)
    elif case.call == "encode":
        yield client.tokenizer.encode(case.prompt)
    elif case.call == "decode":
        yield client.tokenizer.decode(case.prompt)
    else:
        raise AssertionError(f"unknown call {case.call!r}")


async def _async_calls(client: tw.AsyncClient, case: Case) -> AsyncIterator[object]:
    if case.call == "generate":
        yield await client.generate(case.prompt, **case.sampling)
    elif case.call == "generate_stream":
        async for update in client.generate_stream(case.prompt, **case.sampling):
            yield update
    elif case.call == "trace":
        async with client.trace(case.prompt, **case.sampling) as tracer:
            case.build(tracer)
        yield tracer
    elif case.call == "stream_trace":
        tracer = client.trace(case.prompt, **case.sampling)
        case.build(tracer)
        async for step in client.stream_trace(tracer):
            yield step
    elif case.call == "encode":
        yield await client.tokenizer.encode(case.prompt)
    elif case.call == "decode":
        yield await client.tokenizer.decode(case.prompt)
    else:
        raise AssertionError(f"unknown call {case.call!r}")


def _sync_raised(target: str, case: Case) -> tuple[Raised, int]:
    """The error the sync client raises, and how many items came before it."""
    received = 0
    with tw.Client(target, timeout=case.timeout) as client:
        with pytest.raises(tw.TracewireError) as info:
            for _ in _sync_calls(client, case):
                received += 1
    return Raised.of(info.value), received


async def _async_raised(target: str, case: Case) -> tuple[Raised, int]:
    received = 0
    async with tw.AsyncClient(target, timeout=case.timeout) as client:
        with pytest.raises(tw.TracewireError) as info:
            async for _ in _async_calls(client, case):
                received += 1
    return Raised.of(info.value), received


@pytest.mark.parametrize("name", list(CASES))
def test_sync_and_async_raise_the_same_error(server: ServerProcess, name: str) -> None:
    case = CASES[name]
    sync, sync_received = _sync_raised(server.target, case)
    aio, aio_received = asyncio.run(_async_raised(server.target, case))
    assert sync.kind is case.expect, sync
    assert sync.field == case.field, sync
    if case.wordings:
        assert {sync.message, aio.message} <= case.wordings, (sync, aio)
        sync, aio = sync.worded(""), aio.worded("")
    assert aio == sync
    if case.mid_stream:
        # How many steps got out before the failure can differ; that some did, not.
        assert sync_received > 0 and aio_received > 0, (sync_received, aio_received)
