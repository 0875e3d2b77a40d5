"""Trace bad input, limits, runtime failures and cancellation: each stays in its own trace."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import tracewire
from conftest import engine_stats, wait_for_unfinished
from trace_requests import TraceResult, f32, invoke, iv, logits, run, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc, trace_pb2

PROMPT = "The capital of France is"
VOCAB = 2048
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _status(stub, request):
    with pytest.raises(grpc.RpcError) as info:
        run(stub, request)
    return info.value, tracewire.errors.from_rpc_error(info.value)


BAD = {
    "no invokes": (trace(max_tokens=2), "invokes"),
    "stop before start": (trace(invoke(PROMPT, iv("a", sel=steps(start=4, stop=2),
                                                 read_sample=I.ReadSample()))),
                          "invokes[0].interventions[0].steps.range.stop"),
    "negative start": (trace(invoke(PROMPT, iv("a", sel=steps(start=-1),
                                               read_sample=I.ReadSample()))),
                       "invokes[0].interventions[0].steps.range.start"),
    "negative listed step": (trace(invoke(PROMPT, iv("a", sel=steps(at=[1, -2]),
                                                     read_sample=I.ReadSample()))),
                             "invokes[0].interventions[0].steps.list.steps[1]"),
    "forced id outside vocab": (trace(invoke(PROMPT, iv(force_sample=I.ForceSample(
        token_id=VOCAB)))), "invokes[0].interventions[0].force_sample.token_id"),
    "read ids outside vocab": (trace(invoke(PROMPT, iv("a", read_logits=logits(ids=[1, -5])))),
                               "invokes[0].interventions[0].read_logits.token_ids.token_ids[1]"),
    "bias vector wrong length": (trace(invoke(PROMPT, iv(write_logits=I.WriteLogits(
        add=f32(np.zeros(VOCAB - 1)))))), "invokes[0].interventions[0].write_logits.add.shape"),
    "bias vector with nan": (trace(invoke(PROMPT, iv(write_logits=I.WriteLogits(
        add=f32(np.full(VOCAB, np.nan)))))), "invokes[0].interventions[0].write_logits.add.data"),
    "replace with inf": (trace(invoke(PROMPT, iv(write_logits=I.WriteLogits(
        replace=f32(np.full(VOCAB, np.inf)))))),
        "invokes[0].interventions[0].write_logits.replace.data"),
    "invalid regex": (trace(invoke(PROMPT, iv(when=I.Condition(text_matches="(unclosed"),
                                              stop=I.Stop()))),
                      "invokes[0].interventions[0].condition.text_matches"),
    "top-k zero": (trace(invoke(PROMPT, iv("a", read_logits=logits(k=0)))),
                   "invokes[0].interventions[0].read_logits.top_k.k"),
    "top-k above vocab": (trace(invoke(PROMPT, iv("a", read_logits=logits(k=VOCAB + 1)))),
                          "invokes[0].interventions[0].read_logits.top_k.k"),
    "no action": (trace(invoke(PROMPT, iv("a"))), "invokes[0].interventions[0].action"),
    "read without a name": (trace(invoke(PROMPT, iv(read_sample=I.ReadSample()))),
                            "invokes[0].interventions[0].name"),
    "duplicate names": (trace(invoke(PROMPT, iv("x", read_sample=I.ReadSample()),
                                     iv("x", read_logits=logits(k=2)))),
                        "invokes[0].interventions[1].name"),
    "write conditioned on the draw": (trace(invoke(PROMPT, iv(
        when=I.Condition(sampled_in=I.TokenSet(token_ids=[1])),
        force_sample=I.ForceSample(token_id=2)))), "invokes[0].interventions[0].condition"),
    "empty prompt": (trace(invoke("")), "invokes[0].prompt.text"),
    "bad invoke sampling": (trace(invoke(PROMPT, top_p=0.0)),
                            "invokes[0].sampling_params.top_p"),
    "bad trace sampling": (trace(invoke(PROMPT), temperature=-1.0), "sampling_params.temperature"),
    "unknown logits stage": (trace(invoke(PROMPT, iv("a", read_logits=I.ReadLogits(stage=99, full=I.FullRow())))),
                             "invokes[0].interventions[0].read_logits.stage"),
    "trace max_tokens past max_model_len": (trace(invoke(PROMPT), max_tokens=600), "sampling_params.max_tokens"),
    "invoke max_tokens past max_model_len": (trace(invoke(PROMPT, max_tokens=600), max_tokens=4),
                                             "invokes[0].sampling_params.max_tokens"),
    "long invoke prompt past max_model_len": (trace(invoke(PROMPT), invoke([5] * 500), max_tokens=16),
                                              "sampling_params.max_tokens"),
    "stream interval too long": (trace(invoke(PROMPT), options=trace_pb2.TraceOptions(stream_interval_ms=5000)),
                                 "options.stream_interval_ms"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_trace_names_the_field(stub, case):
    request, field = BAD[case]
    error, typed = _status(stub, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert typed.field == field, (typed.field, error.details())


def test_module_interventions_are_refused_until_served(stub):
    # (the default compiled graph clamps at most 8 features a write)
    error, _ = _status(stub, trace(invoke(PROMPT, iv(write_dictionary=I.WriteDictionary(
        dictionary="res-l2-sae", features=list(range(9)), clamp=1.0)))))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "interventions[0].write_dictionary.features" in error.details()


def test_reads_over_the_byte_budget_are_refused_up_front(stub, server):
    request = trace(invoke(PROMPT, iv("all", read_logits=logits())), max_tokens=100, **GREEDY,
                    options=trace_pb2.TraceOptions(max_read_bytes=100 * VOCAB * 4 - 1))
    error, _ = _status(stub, request)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_read_bytes" in error.details()
    assert engine_stats(server.target).num_unfinished_requests == 0
    request.options.max_read_bytes = 100 * VOCAB * 4
    assert len(run(stub, request).values("all")) == 100


def test_runtime_failure_fails_only_its_own_trace(stub, hf):
    """An intervention that raises inside the engine (fault injection) -> INTERNAL for
    that trace; a concurrent trace and the engine carry on unaffected."""
    good = trace(invoke("The capital of Japan is", iv("r", read_logits=logits(k=3))),
                 max_tokens=40, **GREEDY)
    bad = trace(invoke(PROMPT, iv("__fault__:boom at step 3", sel=steps(at=[3]),
                                  force_sample=I.ForceSample(token_id=1))),
                max_tokens=40, **GREEDY)
    results: dict[str, object] = {}

    def go(name, req):
        try:
            results[name] = run(stub, req)
        except grpc.RpcError as e:
            results[name] = e

    threads = [threading.Thread(target=go, args=(n, r)) for n, r in (("good", good), ("bad", bad))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    error = results["bad"]
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INTERNAL
    assert "boom at step 3" in error.details() and "step 3" in error.details()
    ok = results["good"]
    assert ok.tokens() == hf.greedy(hf.encode("The capital of Japan is"), 40)
    assert len(ok.values("r")) == 40
    again = run(stub, trace(invoke(PROMPT), max_tokens=3, **GREEDY))
    assert again.tokens() == hf.greedy(hf.encode(PROMPT), 3)


def test_cancelling_the_stream_aborts_the_engine_request(stub, server):
    call = stub.Trace(trace(invoke(PROMPT, iv("r", read_logits=logits(k=2))), max_tokens=480,
                            **GREEDY), timeout=120)
    first = next(call)
    assert first.steps.results[0].step == 0
    assert engine_stats(server.target).num_unfinished_requests == 1
    call.cancel()
    assert wait_for_unfinished(server.target, lambda n: n == 0, timeout=10)


def test_stop_aborts_the_engine_request_within_steps(stub, server):
    request = trace(invoke(PROMPT, iv(sel=steps(at=[1]), stop=I.Stop())), max_tokens=480,
                    **GREEDY)
    started = time.monotonic()
    result = run(stub, request)
    assert len(result.tokens()) == 2
    # 480 steps take over a second here; the stop ends it far sooner
    assert wait_for_unfinished(server.target, lambda n: n == 0, timeout=10)
    assert time.monotonic() - started < 5


def test_slow_reader_gets_resource_exhausted_and_others_do_not(stub, hf, server):
    """The session server runs with --trace-buffer-bytes 2 MiB. A client that stops reading
    a full-logits trace (4 sequences x 480 steps x 8 KiB = 16 MiB, more than HTTP/2 flow
    control lets the transport absorb) fails alone; a concurrent trace finishes."""
    slow = stub.Trace(trace(invoke(PROMPT, iv("all", read_logits=logits())), max_tokens=480,
                            n=4, **GREEDY), timeout=120)
    next(slow)  # the stream is open; now stall
    (out,) = [run(stub, trace(invoke("The capital of Japan is"), max_tokens=20, **GREEDY))]
    assert out.tokens() == hf.greedy(hf.encode("The capital of Japan is"), 20)
    time.sleep(3)  # the engine finishes 480 steps meanwhile; the backlog passes 2 MiB
    with pytest.raises(grpc.RpcError) as info:
        for _ in slow:
            pass
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "reading too slowly" in info.value.details()
    assert wait_for_unfinished(server.target, lambda n: n == 0, timeout=10)


UNREAD_STREAMS = 20
UNREAD_STEPS = 200  # x 8 KiB of full logits: 1.6 MiB a stream, under the 2 MiB buffer, so none fails


def test_twenty_unread_streams_do_not_delay_another_clients_generate(stub, client, hf, server):
    """Isolation: 20 Trace streams reading full logits every step that their client never
    reads (each holding 1.6 MiB of results on the server) leave a small greedy Generate on
    another connection within 1 s of its idle latency, while they decode and after, as
    they sit; then each still delivers every step, nothing lost."""
    prompt, tokens = "The capital of Japan is", 8
    expected = hf.greedy(hf.encode(prompt), tokens)

    def latency() -> float:
        started = time.monotonic()
        out = client.generate(prompt, max_tokens=tokens, **GREEDY)
        assert list(out[0].outputs[0].token_ids) == expected
        return time.monotonic() - started

    idle = sorted(latency() for _ in range(3))[1]
    channels = [grpc.insecure_channel(server.target) for _ in range(UNREAD_STREAMS)]  # (one client each)
    try:
        request = trace(invoke(PROMPT, iv("all", read_logits=logits())), max_tokens=UNREAD_STEPS, **GREEDY)
        streams = [service_pb2_grpc.TraceServiceStub(ch).Trace(request, timeout=300) for ch in channels]
        firsts = [next(stream) for stream in streams]  # open and running; not read again until the end
        while_decoding = max(latency() for _ in range(3))
        assert wait_for_unfinished(server.target, lambda n: n == 0, timeout=120)  # all decoded, unread
        while_held = max(latency() for _ in range(3))
        assert while_decoding <= idle + 1.0, (idle, while_decoding)
        assert while_held <= idle + 1.0, (idle, while_held)
        results = [TraceResult([first, *stream]) for first, stream in zip(firsts, streams, strict=True)]
        greedy = hf.greedy(hf.encode(PROMPT), UNREAD_STEPS)
        for result in results:  # every step still there, the run as if alone
            assert result.tokens() == greedy
            assert len(result.values("all")) == UNREAD_STEPS
            assert np.allclose(result.values("all")[-1], results[0].values("all")[-1], atol=1e-4)
    finally:
        for ch in channels:
            ch.close()
