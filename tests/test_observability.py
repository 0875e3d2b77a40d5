"""Metrics (--metrics-port), the JSON access log with request ids (--access-log), and the
HTTP port's Host allow-list (--allowed-host), on the session's eager server (conftest's
`eager`, which has all three).

Counters are compared before and after each call (deltas), so the checks hold whatever
ran earlier on this server.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import trace_requests as T
from conftest import ALLOWED_HOST, ServerProcess
from tracewire.v1 import service_pb2, service_pb2_grpc

SERVICE = "tracewire.v1.TraceService/"
ALLOWED_NAME = ALLOWED_HOST


class Observed:
    def __init__(self, server: ServerProcess, metrics_url: str, access_log: Path) -> None:
        self.server = server
        self.metrics_url = metrics_url
        self.access_log = access_log
        self.channel = grpc.insecure_channel(server.target)
        self.stub = service_pb2_grpc.TraceServiceStub(self.channel)

    def scrape(self) -> dict[str, float]:
        """Every sample of the tracewire_ metrics: 'name{labels}' -> value."""
        text = httpx.get(self.metrics_url, timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line.startswith("tracewire_"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def log_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.access_log.read_text().splitlines() if line.strip()]

    def log_line(self, request_id: str, timeout: float = 10.0) -> dict:
        """The access log line of the call with this request id (it is written as the call ends)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.log_lines() if line["request_id"] == request_id]
            if found:
                assert len(found) == 1, found
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no access log line for request id {request_id}")


@pytest.fixture(scope="module")
def observed(eager: ServerProcess) -> Iterator[Observed]:
    assert eager.access_log is not None
    obs = Observed(eager, eager.metrics_url, eager.access_log)
    yield obs
    obs.channel.close()


def rpcs(method: str, code: str, transport: str = "grpc") -> str:
    return f'tracewire_rpcs_total{{code="{code}",method="{SERVICE}{method}",tenant="",transport="{transport}"}}'


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def generate_request(max_tokens: int = 4) -> service_pb2.GenerateRequest:
    return service_pb2.GenerateRequest(
        prompts=[{"text": "The capital of France is"}],
        sampling_params={"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )


# ---- metrics ---------------------------------------------------------------------------

def test_generate_is_counted(observed: Observed) -> None:
    before = observed.scrape()
    observed.stub.Generate(generate_request(), timeout=60)
    after = observed.scrape()
    assert delta(before, after, rpcs("Generate", "OK")) == 1
    key = f'tracewire_rpc_duration_seconds_count{{method="{SERVICE}Generate",transport="grpc"}}'
    assert delta(before, after, key) == 1


def test_trace_with_reads_counts_steps_bytes_and_latency(observed: Observed) -> None:
    steps = 5
    request = T.trace(
        T.invoke("The capital of France is",
                 T.iv("top", T.steps(), read_logits=T.logits(k=3)),
                 T.iv("drawn", T.steps(), read_sample={})),
        max_tokens=steps, temperature=0, ignore_eos=True,
    )
    before = observed.scrape()
    result = T.run(observed.stub, request)
    assert len(result.seq()) == steps
    after = observed.scrape()
    assert delta(before, after, rpcs("Trace", "OK")) == 1
    assert delta(before, after, 'tracewire_trace_steps_total{tenant=""}') == steps
    # top-3 logits: 3 float32 a step; the drawn token: one int32 a step
    assert delta(before, after, 'tracewire_trace_read_values_total{kind="logits",tenant=""}') == steps
    assert delta(before, after, 'tracewire_trace_read_bytes_total{kind="logits",tenant=""}') == steps * 3 * 4
    assert delta(before, after, 'tracewire_trace_read_values_total{kind="sample",tenant=""}') == steps
    assert delta(before, after, 'tracewire_trace_read_bytes_total{kind="sample",tenant=""}') == steps * 4
    # every StepResult's engine_time to its handing to gRPC, each a small positive time
    latency = "tracewire_step_engine_to_transport_seconds"
    assert delta(before, after, f"{latency}_count") == steps
    assert 0 < delta(before, after, f"{latency}_sum") < steps * 1.0
    # the worker's hook time: one observation per traced engine step, on each thread
    for thread in ("engine", "collector"):
        assert delta(before, after, f'tracewire_hook_seconds_count{{thread="{thread}"}}') == steps
        assert delta(before, after, f'tracewire_hook_seconds_sum{{thread="{thread}"}}') > 0
    assert after['tracewire_traces_in_flight{tenant=""}'] == 0
    assert after["tracewire_outbox_bytes"] == 0 and after["tracewire_outbox_messages"] == 0


def test_trace_error_is_counted_with_its_code(observed: Observed) -> None:
    before = observed.scrape()
    with pytest.raises(grpc.RpcError) as failed:
        T.run(observed.stub, service_pb2.TraceRequest())  # no invokes
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = observed.scrape()
    assert delta(before, after, rpcs("Trace", "INVALID_ARGUMENT")) == 1
    assert delta(before, after, rpcs("Trace", "OK")) == 0
    assert delta(before, after, 'tracewire_trace_steps_total{tenant=""}') == 0


def test_http_calls_are_counted_by_transport(observed: Observed) -> None:
    url = observed.server.http_url + "/" + SERVICE + "GetModelInfo"
    before = observed.scrape()
    ok = httpx.post(url, json={}, headers={"connect-protocol-version": "1"}, timeout=30)
    bad = httpx.post(url, json={"no_such_field": 1}, headers={"connect-protocol-version": "1"}, timeout=30)
    assert ok.status_code == 200 and bad.status_code == 400
    after = observed.scrape()
    assert delta(before, after, rpcs("GetModelInfo", "OK", "connect")) == 1
    assert delta(before, after, rpcs("GetModelInfo", "INVALID_ARGUMENT", "connect")) == 1
    assert delta(before, after, rpcs("GetModelInfo", "OK", "grpc")) == 0


# ---- access log and request ids ---------------------------------------------------------

def test_grpc_call_logged_with_the_request_id_the_client_received(observed: Observed) -> None:
    response, call = observed.stub.Generate.with_call(generate_request(), timeout=60)
    request_id = dict(call.initial_metadata())["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    line = observed.log_line(request_id)
    assert line["method"] == SERVICE + "Generate"
    assert line["transport"] == "grpc" and line["code"] == "OK"
    assert line["bytes_sent"] == response.ByteSize() > 0
    assert line["peer"].startswith("127.0.0.1:") and line["duration_ms"] > 0
    assert "tenant" not in line  # no authentication: no tenant


def test_grpc_request_id_is_taken_from_the_client_when_well_formed(observed: Observed) -> None:
    _, call = observed.stub.GetModelInfo.with_call(
        service_pb2.GetModelInfoRequest(), metadata=[("x-request-id", "client-chosen.id:42")], timeout=30)
    assert dict(call.initial_metadata())["x-request-id"] == "client-chosen.id:42"
    assert observed.log_line("client-chosen.id:42")["method"] == SERVICE + "GetModelInfo"
    # a forged log line or an overlong id is not taken
    for offered in ('x", "code": "OK', "a" * 65):
        _, call = observed.stub.GetModelInfo.with_call(
            service_pb2.GetModelInfoRequest(), metadata=[("x-request-id", offered)], timeout=30)
        assert dict(call.initial_metadata())["x-request-id"] != offered


def test_failed_grpc_stream_logged_with_its_code(observed: Observed) -> None:
    calls = observed.stub.Trace(service_pb2.TraceRequest(), timeout=30)
    with pytest.raises(grpc.RpcError) as failed:
        list(calls)
    request_id = dict(failed.value.initial_metadata())["x-request-id"]
    line = observed.log_line(request_id)
    assert line["method"] == SERVICE + "Trace" and line["code"] == "INVALID_ARGUMENT"


def test_http_calls_logged_with_the_request_id_of_the_response(observed: Observed) -> None:
    url = observed.server.http_url + "/" + SERVICE + "Tokenize"
    r = httpx.post(url, json={"text": "hello"}, headers={"connect-protocol-version": "1"}, timeout=30)
    assert r.status_code == 200
    line = observed.log_line(r.headers["x-request-id"])
    assert line["transport"] == "connect" and line["code"] == "OK" and line["http_status"] == 200
    # the body as sent (compressed, when the client accepts gzip)
    assert line["method"] == SERVICE + "Tokenize" and line["bytes_sent"] == r.num_bytes_downloaded > 0
    r = httpx.post(url, json={"text": "hello"}, timeout=30,
                   headers={"connect-protocol-version": "1", "x-request-id": "from-the-browser"})
    assert r.headers["x-request-id"] == "from-the-browser"
    assert observed.log_line("from-the-browser")["code"] == "OK"


# ---- Host allow-list --------------------------------------------------------------------

def test_dns_rebinding_host_is_refused(observed: Observed) -> None:
    url = observed.server.http_url + "/" + SERVICE + "GetModelInfo"
    headers = {"connect-protocol-version": "1"}
    before = observed.scrape()
    r = httpx.post(url, json={}, headers={**headers, "host": "rebind.evil.example"}, timeout=30)
    assert r.status_code == 421
    assert "rebind.evil.example" in r.text and "--allowed-host" in r.text
    assert "vocabSize" not in r.text
    assert observed.log_line(r.headers["x-request-id"])["code"] == "PERMISSION_DENIED"
    after = observed.scrape()
    assert delta(before, after, rpcs("GetModelInfo", "OK", "connect")) == 0
    # also on the metrics port
    assert httpx.get(observed.metrics_url, headers={"host": "rebind.evil.example:80"}, timeout=10).status_code == 421


def test_served_hosts_are_answered(observed: Observed) -> None:
    url = observed.server.http_url + "/" + SERVICE + "GetModelInfo"
    port = url.split(":")[2].split("/")[0]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", ALLOWED_NAME, f"{ALLOWED_NAME}:443"):
        r = httpx.post(url, json={}, headers={"connect-protocol-version": "1", "host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)
        assert r.json()["vocabSize"] > 0
