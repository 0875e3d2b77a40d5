"""The HTTP port (--http-port): Connect protocol and gRPC-Web over plain HTTP/1.1, as a
browser's Connect-ES transport speaks them, against the session server's real engine.

Wire formats are built by hand here (no Connect client library), so these tests pin
the protocols themselves: Connect unary (JSON / binary body, errors as JSON), Connect
streaming (5-byte envelopes, end-of-stream JSON) and gRPC-Web (envelopes, trailers frame).
"""

from __future__ import annotations

import base64
import json
import re
import struct
import threading

import httpx
import numpy as np
import pytest
import trace_requests as T
from conftest import engine_stats, wait_for_unfinished
from google.protobuf import json_format
from google.rpc import error_details_pb2
from tracewire.v1 import service_pb2

SERVICE = "/tracewire.v1.TraceService/"
END_STREAM = 0x02  # Connect: the end-of-stream message flag
TRAILERS = 0x80  # gRPC-Web: the trailers frame flag


# ---- the wire, by hand -------------------------------------------------------------

def envelope(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def envelopes(data: bytes) -> list[tuple[int, bytes]]:
    frames, i = [], 0
    while i < len(data):
        flags, size = struct.unpack(">BI", data[i:i + 5])
        frames.append((flags, data[i + 5:i + 5 + size]))
        i += 5 + size
    assert i == len(data), "trailing bytes after the last envelope"
    return frames


def unary_json(server, method: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(server.http_url + SERVICE + method, json=body, timeout=120,
                      headers={"connect-protocol-version": "1", **headers})


def connect_stream(server, method: str, request, codec: str = "proto") -> tuple[list, dict]:
    """A Connect server-streaming call: (response messages, end-of-stream JSON)."""
    body = request.SerializeToString() if codec == "proto" else json_format.MessageToJson(request).encode()
    r = httpx.post(server.http_url + SERVICE + method, content=envelope(body), timeout=120,
                   headers={"content-type": f"application/connect+{codec}", "connect-protocol-version": "1"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == f"application/connect+{codec}"
    frames = envelopes(r.content)
    assert [f for f, _ in frames[:-1]] == [0] * (len(frames) - 1) and frames[-1][0] == END_STREAM
    out_type = service_pb2.TraceResponse if method == "Trace" else service_pb2.GenerateStreamResponse
    parse = (out_type.FromString if codec == "proto"
             else lambda b: json_format.Parse(b, out_type()))
    return [parse(payload) for _, payload in frames[:-1]], json.loads(frames[-1][1])


def grpc_web_stream(server, method: str, request) -> tuple[list, dict[str, str]]:
    """A gRPC-Web server-streaming call: (response messages, trailers)."""
    r = httpx.post(server.http_url + SERVICE + method, content=envelope(request.SerializeToString()),
                   timeout=120, headers={"content-type": "application/grpc-web+proto", "x-grpc-web": "1"})
    assert r.status_code == 200, r.text
    frames = envelopes(r.content)
    assert frames[-1][0] == TRAILERS
    trailers = dict(line.split(": ", 1) for line in frames[-1][1].decode().strip().split("\r\n"))
    return [service_pb2.TraceResponse.FromString(p) for _, p in frames[:-1]], trailers


def bad_request_field(error: dict) -> str:
    """The field path in a Connect error's google.rpc.BadRequest detail."""
    (detail,) = error["details"]
    assert detail["type"] == "google.rpc.BadRequest"
    value = base64.b64decode(detail["value"] + "=" * (-len(detail["value"]) % 4))
    (violation,) = error_details_pb2.BadRequest.FromString(value).field_violations
    return violation.field


# ---- unary ---------------------------------------------------------------------------

def test_tokenize_and_model_info_over_connect_json_equal_grpc(server, stub):
    r = unary_json(server, "Tokenize", {"text": "The capital of France is"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    grpc_tokens = stub.Tokenize(service_pb2.TokenizeRequest(text="The capital of France is"), timeout=30)
    assert r.json() == {"tokenIds": list(grpc_tokens.token_ids), "tokens": list(grpc_tokens.tokens)}

    r = unary_json(server, "GetModelInfo", {})
    assert r.status_code == 200, r.text
    info = json_format.Parse(r.text, service_pb2.GetModelInfoResponse())
    assert info == stub.GetModelInfo(service_pb2.GetModelInfoRequest(), timeout=30)
    assert info.architecture == "Qwen3ForCausalLM" and info.num_layers > 0


def test_generate_over_connect_binary_proto_equals_grpc(server, stub):
    request = service_pb2.GenerateRequest(
        prompts=[{"text": "The capital of France is"}, {"text": "The capital of Japan is"}],
        sampling_params={"temperature": 0.0, "max_tokens": 8})
    r = httpx.post(server.http_url + SERVICE + "Generate", content=request.SerializeToString(), timeout=120,
                   headers={"content-type": "application/proto", "connect-protocol-version": "1"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/proto", r.text
    over_http = service_pb2.GenerateResponse.FromString(r.content)
    over_grpc = stub.Generate(request, timeout=120)
    assert [o.outputs[0].text for o in over_http.outputs] == [" Paris.", " Tokyo."]
    for a, b in zip(over_http.outputs, over_grpc.outputs, strict=True):
        for o in (a, b):  # per call: the engine's request id and its prefix-cache hits
            o.ClearField("request_id")
            o.ClearField("num_cached_tokens")
        assert a == b


def test_health_check_over_http_reads_serving(server):
    r = httpx.post(server.http_url + "/grpc.health.v1.Health/Check", json={}, timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "SERVING"}, r.text


def test_unknown_method_is_404(server):
    assert httpx.post(server.http_url + SERVICE + "Nope", json={}, timeout=10).status_code == 404


# ---- server streaming ----------------------------------------------------------------

def step_results(events: list) -> list:
    """The StepResults of trace events, whether each event carries one (`step`) or a batch
    of those ready together (`steps`, on branches where the contract batches them)."""
    out = []
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "steps":
            out.extend(event.steps.results)
        elif kind == "step":
            out.append(event.step)
    return out


def _copy(message):
    return type(message).FromString(message.SerializeToString())


def _clear(message, *names: str) -> None:
    for name in names:
        if name in message.DESCRIPTOR.fields_by_name:
            message.ClearField(name)


def assert_same_trace(a: list, b: list) -> None:
    """Two runs of one trace agree: the same steps (tokens, text, read values within float32
    noise: kernels may differ in the last bits with prefix-cache hits), then the same final
    events, with what differs per run (request ids, cache hits, clocks) cleared."""
    steps_a, steps_b = [_copy(s) for s in step_results(a)], [_copy(s) for s in step_results(b)]
    assert len(steps_a) == len(steps_b)
    for x, y in zip(steps_a, steps_b, strict=True):
        assert set(x.values) == set(y.values)
        for name in x.values:
            vx, vy = x.values[name], y.values[name]
            assert vx.token_ids == vy.token_ids, (name, x.step)
            np.testing.assert_allclose(np.frombuffer(vx.values.data, "<f4"),
                                       np.frombuffer(vy.values.data, "<f4"), atol=1e-4)
            for v in (vx, vy):
                v.values.ClearField("data")
        for s in (x, y):
            _clear(s, "engine_time")
        assert x == y

    def rest(events: list) -> list:
        out = []
        for event in events:
            if event.WhichOneof("event") in ("step", "steps"):
                continue
            event = _copy(event)
            if event.WhichOneof("event") == "invoke_result":
                _clear(event.invoke_result.output, "request_id", "num_cached_tokens")
            else:
                _clear(event.end.usage, "elapsed_seconds")
            out.append(event)
        return out

    assert rest(a) == rest(b)


TRACE = T.trace(T.invoke("The capital of France is", T.iv("top", read_logits=T.logits(k=3)),
                         T.iv("drawn", read_sample={})),
                temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("protocol", ["connect+proto", "connect+json", "grpc-web+proto"])
def test_trace_stream_over_http_equals_grpc(server, stub, protocol):
    if protocol == "grpc-web+proto":
        events, trailers = grpc_web_stream(server, "Trace", TRACE)
        assert trailers == {"grpc-status": "0"}, trailers
    else:
        events, end = connect_stream(server, "Trace", TRACE, codec=protocol.split("+")[1])
        assert end == {}, end  # no error
    steps = step_results(events)
    assert [s.step for s in steps] == list(range(6))
    assert all(len(np.frombuffer(s.values["top"].values.data, "<f4")) == 3 for s in steps)
    assert events[-1].WhichOneof("event") == "end"
    assert_same_trace(events, list(stub.Trace(TRACE, timeout=120)))


def test_generate_stream_over_connect_streams_deltas(server):
    request = service_pb2.GenerateStreamRequest(prompts=[{"text": "The capital of France is"}],
                                                sampling_params={"temperature": 0.0, "max_tokens": 8})
    updates, end = connect_stream(server, "GenerateStream", request)
    assert end == {}
    # deltas (vLLM may merge some): together the whole output, the last one finished
    assert "".join(u.output.outputs[0].text for u in updates) == " Paris."
    assert updates[-1].output.finished and not any(u.output.finished for u in updates[:-1])


# ---- errors ---------------------------------------------------------------------------

def test_bad_input_is_invalid_argument_naming_the_field(server):
    r = unary_json(server, "Generate", {"prompts": []})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["code"] == "invalid_argument" and "prompts" in error["message"]
    assert bad_request_field(error) == "prompts"

    r = unary_json(server, "Generate", {"prompts": [{"text": "a"}, {"tokenIds": {"ids": [1, 2, 10**6]}}]})
    assert r.status_code == 400 and bad_request_field(r.json()) == "prompts[1].token_ids.ids[2]", r.text


def test_misspelt_json_field_is_invalid_argument(server):
    r = unary_json(server, "Generate", {"prompts": [{"text": "a"}], "samplingParams": {"temprature": 0}})
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_argument" and "temprature" in r.json()["message"]


def test_bad_trace_over_a_stream_ends_with_invalid_argument(server):
    bad = T.trace(T.invoke("a", T.iv("top", read_logits=T.logits(k=0))), max_tokens=2)
    events, end = connect_stream(server, "Trace", bad)
    assert events == []
    assert end["error"]["code"] == "invalid_argument", end
    field = bad_request_field(end["error"])
    assert field.startswith("invokes[0].interventions[0]"), field


# ---- CORS -----------------------------------------------------------------------------

def test_cors_preflight_allows_local_pages_with_connect_headers(server):
    origin = "http://localhost:5173"
    r = httpx.options(server.http_url + SERVICE + "Trace", timeout=10, headers={
        "origin": origin, "access-control-request-method": "POST",
        "access-control-request-headers": "content-type,connect-protocol-version,connect-timeout-ms"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == origin
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert allowed >= {"content-type", "connect-protocol-version", "connect-timeout-ms", "grpc-timeout",
                       "x-grpc-web", "x-user-agent"}

    r = unary_json(server, "Tokenize", {"text": "a"}, origin=origin)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
    assert exposed >= {"grpc-status", "grpc-message", "grpc-status-details-bin"}


def test_cors_refuses_other_origins_by_default(server):
    r = httpx.options(server.http_url + SERVICE + "Generate", timeout=10, headers={
        "origin": "https://elsewhere.example", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = unary_json(server, "Tokenize", {"text": "a"}, origin="https://elsewhere.example")
    assert "access-control-allow-origin" not in r.headers  # the browser hides the answer


# ---- deadlines and disconnects abort the engine request ----------------------------

def test_connect_timeout_aborts_the_engine_request(server):
    r = unary_json(server, "Generate", {"prompts": [{"text": "The capital of France is"}],
                                        "samplingParams": {"maxTokens": 500, "ignoreEos": True}},
                   **{"connect-timeout-ms": "300"})
    assert r.status_code == 504 and r.json()["code"] == "deadline_exceeded", r.text
    assert wait_for_unfinished(server.target, lambda n: n == 0), "the engine request outlived its deadline"


def test_client_disconnect_mid_stream_aborts_the_engine_request(server):
    request = T.trace(T.invoke("The capital of France is", T.iv("top", read_logits=T.logits(k=3))),
                      temperature=0.0, max_tokens=500, ignore_eos=True)
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", server.http_url + SERVICE + "Trace", content=envelope(request.SerializeToString()),
            headers={"content-type": "application/connect+proto", "connect-protocol-version": "1"}) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()  # held: dropping the iterator would already close the connection
        first = next(chunks)
        (flags, payload), *_ = envelopes(first[:5 + struct.unpack(">I", first[1:5])[0]])
        assert flags == 0 and step_results([service_pb2.TraceResponse.FromString(payload)])[0].step == 0
        assert engine_stats(server.target).num_unfinished_requests == 1  # still generating
    # leaving the block closed the connection mid-stream
    assert wait_for_unfinished(server.target, lambda n: n == 0), "the engine request outlived the client"


def test_http_and_grpc_calls_share_one_engine(server):
    """A long HTTP call is visible in the gRPC port's engine stats while it runs."""
    done = threading.Event()

    def long_call():
        unary_json(server, "Generate", {"prompts": [{"text": "a"}],
                                        "samplingParams": {"maxTokens": 300, "ignoreEos": True}})
        done.set()

    worker = threading.Thread(target=long_call)
    worker.start()
    assert wait_for_unfinished(server.target, lambda n: n == 1)
    worker.join(timeout=120)
    assert done.is_set()
    assert wait_for_unfinished(server.target, lambda n: n == 0)


def test_cors_origin_flag_replaces_the_localhost_default():
    """`--cors-origin` configuration, on the ASGI app alone (no engine needed for CORS)."""
    import asyncio

    from tracewire_server.frontend.http_gateway import build_app

    async def preflight(app, origin: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.options(SERVICE + "Generate", headers={
                "origin": origin, "access-control-request-method": "POST",
                "access-control-request-headers": "content-type,connect-protocol-version"})

    explicit = build_app({}, ["https://dash.example"], read_max_bytes=1 << 20)
    r = asyncio.run(preflight(explicit, "https://dash.example"))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://dash.example"
    r = asyncio.run(preflight(explicit, "http://localhost:5173"))  # the default no longer applies
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers

    anyone = build_app({}, ["*"], read_max_bytes=1 << 20)
    r = asyncio.run(preflight(anyone, "https://elsewhere.example"))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_plain_grpc_on_the_http_port_is_415():
    """gRPC needs HTTP/2 trailers; the HTTP port says where to go instead of failing inside."""
    import asyncio

    from tracewire_server.frontend.http_gateway import build_app

    async def post(content_type: str) -> httpx.Response:
        app = build_app({}, [], read_max_bytes=1 << 20)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(SERVICE + "Generate", content=envelope(b""), headers={"content-type": content_type})

    r = asyncio.run(post("application/grpc+proto"))
    assert r.status_code == 415 and "gRPC port" in r.text
    # gRPC-Web (trailers in the body) passes on to routing: this app has no endpoints
    assert asyncio.run(post("application/grpc-web+proto")).status_code == 404


def test_http_port_in_use_is_a_clear_startup_error():
    import asyncio
    import socket

    from tracewire_server.frontend.http_gateway import HttpGateway, build_app

    async def start(port: int) -> None:
        await HttpGateway.start(build_app({}, [], read_max_bytes=1 << 20), "127.0.0.1", port)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=re.escape(f"cannot listen on 127.0.0.1:{port} (HTTP)")):
            asyncio.run(start(port))
