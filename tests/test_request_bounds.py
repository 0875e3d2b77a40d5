"""Request sizes: bounded before any work is done on them (bounds.py, --max-request-bytes),
and large work kept off the event loop, where it would hold up every other call."""

from __future__ import annotations

import concurrent.futures
import gzip

import grpc
import httpx
import pytest
import tracewire
from test_http import SERVICE
from trace_requests import invoke, iv, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import prompt_pb2, service_pb2


def expect_invalid(call, field: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert tracewire.errors.from_rpc_error(info.value).field == field


def nested_not(depth: int) -> I.Condition:
    condition = I.Condition(text_contains="x")
    for _ in range(depth):
        condition = I.Condition(**{"not": condition})
    return condition


TRACE_CASES = {
    "stop strings": (trace(invoke("a"), stop=["x"] * 65), "sampling_params.stop"),
    "a step list longer than the context": (
        trace(invoke("a", iv(sel=steps(at=range(513)), stop=I.Stop()))),
        "invokes[0].interventions[0].steps.list.steps"),
    "a token set larger than the vocabulary": (
        trace(invoke("a", iv(when=I.Condition(sampled_in=I.TokenSet(token_ids=[1] * 2049)), stop=I.Stop()))),
        "invokes[0].interventions[0].condition.sampled_in.token_ids"),
    "an intervention name": (trace(invoke("a", iv("n" * 1025, stop=I.Stop()))), "invokes[0].interventions[0].name"),
    "conditions nested too deep": (
        trace(invoke("a", iv(when=nested_not(40), stop=I.Stop()))),
        "invokes[0].interventions[0].condition" + ".not" * 30),  # 33 messages deep
}


@pytest.mark.parametrize("case", sorted(TRACE_CASES))
def test_repeated_fields_and_strings_are_bounded(stub, client, case):
    request, field = TRACE_CASES[case]
    expect_invalid(lambda: list(stub.Trace(request, timeout=30)), field)
    (out,) = client.generate("The capital of France is", temperature=0.0, max_tokens=2)
    assert len(out.outputs[0].token_ids) == 2


def test_detokenize_ids_are_bounded(stub):
    expect_invalid(lambda: stub.Detokenize(service_pb2.DetokenizeRequest(token_ids=[1] * ((1 << 20) + 1)),
                                           timeout=30), "token_ids")


def test_requests_over_the_byte_cap_are_refused(stub):
    big = service_pb2.GenerateRequest(prompts=[prompt_pb2.Prompt(text="a " * (5 << 20))])
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(big, timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_gzip_bomb_on_the_http_port_is_refused_by_what_it_inflates_to(server):
    body = service_pb2.TokenizeRequest(text="a" * (64 << 20)).SerializeToString()
    packed = gzip.compress(body, 9)
    assert len(packed) < 1 << 20
    r = httpx.post(server.http_url + SERVICE + "Tokenize", content=packed, timeout=60,
                   headers={"content-type": "application/proto", "content-encoding": "gzip",
                            "connect-protocol-version": "1"})
    assert r.json()["code"] == "resource_exhausted", r.text


def test_large_tokenizing_runs_off_the_event_loop(server):
    """Tokenizing ~7 MB takes seconds: other calls are answered meanwhile."""
    from tracewire.v1 import service_pb2_grpc

    text = "The capital of France is Paris. " * 220_000
    with grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        stub = service_pb2_grpc.TraceServiceStub(channel)
        big = pool.submit(stub.Tokenize, service_pb2.TokenizeRequest(text=text), timeout=300)
        answered_during = 0
        while not big.done():
            assert server.health(timeout=10) == "SERVING"
            answered_during += 1
        assert len(big.result().token_ids) > 1_000_000
    assert answered_during >= 2


@pytest.mark.parametrize("body", [b"\xff\xff\xff\xff", "nested 150 deep"])
def test_undecodable_bodies_are_invalid_argument(server, body):
    """Corrupt bytes, or conditions nested past protobuf's recursion limit: grpc answered
    UNKNOWN and logged a traceback each time."""
    from fuzz_requests import nested_conditions

    data = nested_conditions(150) if body == "nested 150 deep" else body
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(channel.unary_stream("/tracewire.v1.TraceService/Trace")(data, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "not a valid tracewire.v1.TraceRequest" in info.value.details()


def test_unknown_enum_values_are_refused(stub):
    """protobuf keeps enum values it does not know; they read as some default."""
    mean_of_99 = I.ReadModule(module="layers.1", reduction=99)
    expect_invalid(lambda: list(stub.Trace(trace(invoke("a", iv("m", read_module=mean_of_99))), timeout=30)),
                   "invokes[0].interventions[0].read_module.reduction")
    odd = I.Condition(entropy=I.Threshold(comparison=42, value=1.0))
    expect_invalid(lambda: list(stub.Trace(trace(invoke("a", iv(when=odd, stop=I.Stop()))), timeout=30)),
                   "invokes[0].interventions[0].condition.entropy.comparison")
