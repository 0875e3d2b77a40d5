"""A second server process, to watch it drain (both ports) and exit on SIGTERM."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import httpx
import pytest
import tracewire
from conftest import start_server, wait_for_unfinished
from grpc_health.v1 import health_pb2, health_pb2_grpc


def test_sigterm_drains_in_flight_calls_and_exits_zero(tmp_path):
    server = start_server(tmp_path, "--grace-period", "60")
    client = tracewire.Client(server.target, timeout=120)
    result: dict[str, object] = {}

    def long_call():
        try:  # ~400 tokens: a few seconds on 2 CPU cores
            result["out"] = client.generate("The capital of France is", max_tokens=400,
                                            ignore_eos=True, temperature=0.0)
        except tracewire.TracewireError as e:  # asserted below
            result["error"] = e

    def long_http_call():  # the same, in flight on the HTTP port (Connect JSON)
        result["http"] = httpx.post(
            server.http_url + "/tracewire.v1.TraceService/Generate", timeout=120,
            json={"prompts": [{"text": "The capital of France is"}],
                  "samplingParams": {"maxTokens": 400, "ignoreEos": True, "temperature": 0.0}})

    worker = threading.Thread(target=long_call)
    worker.start()
    http_worker = threading.Thread(target=long_http_call)
    http_worker.start()
    assert wait_for_unfinished(server.target, lambda n: n == 2)
    # Connections opened before the signal (a load balancer's, say) watch the drain;
    # new connections are refused once the listener closes.
    watcher = grpc.insecure_channel(server.target)
    health = health_pb2_grpc.HealthStub(watcher)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    other = tracewire.Client(server.target, timeout=5)
    other.tokenizer.encode("warm the connection")
    server.process.send_signal(signal.SIGTERM)
    seen, refused, http_refused = set(), None, None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and worker.is_alive() and (
            refused is None or http_refused is None or len(seen) == 0):
        try:
            seen.add(health.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
        except grpc.RpcError:
            pass
        try:
            other.generate("a", max_tokens=1)
        except tracewire.Unavailable as e:
            refused = e
        if http_refused is None:  # the HTTP listener stays open while draining, refusing calls
            r = httpx.post(server.http_url + "/tracewire.v1.TraceService/Tokenize", json={"text": "a"}, timeout=5)
            http_refused = r if r.status_code != 200 else None
        time.sleep(0.05)
    assert seen == {health_pb2.HealthCheckResponse.NOT_SERVING}, seen
    assert refused is not None and "shutting down" in refused.message, refused
    assert http_refused is not None and http_refused.status_code == 503, http_refused
    assert http_refused.json()["code"] == "unavailable" and "shutting down" in http_refused.json()["message"]
    assert worker.is_alive()  # all of this happened while the in-flight call was draining
    code = server.process.wait(timeout=180)
    worker.join(timeout=60)
    http_worker.join(timeout=60)
    assert code == 0, server.log()
    assert "error" not in result, result.get("error")
    out = result["out"]
    assert len(out[0].outputs[0].token_ids) == 400  # the in-flight call was let finish
    http_out = result["http"]
    assert http_out.status_code == 200, http_out.text  # and so was the HTTP one
    assert len(http_out.json()["outputs"][0]["outputs"][0]["tokenIds"]) == 400
    assert "draining" in server.log()
    with pytest.raises((tracewire.Unavailable, tracewire.DeadlineExceeded)):
        tracewire.Client(server.target, timeout=5).generate("a", max_tokens=1)
    with pytest.raises(httpx.ConnectError):
        httpx.post(server.http_url + "/tracewire.v1.TraceService/Tokenize", json={"text": "a"}, timeout=5)


def test_a_dead_engine_stops_the_server_with_exit_1(tmp_path):
    import psutil

    server = start_server(tmp_path)
    children = psutil.Process(server.process.pid).children(recursive=True)
    engine_core = [p for p in children if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
    assert engine_core, [(p.name(), p.cmdline()) for p in children]
    for p in engine_core:
        p.kill()
    code = server.process.wait(timeout=120)
    assert code == 1, server.log()[-3000:]
    assert "engine has died" in server.log()
