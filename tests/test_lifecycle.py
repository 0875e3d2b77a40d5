"""More server processes, to watch them drain (both ports) and exit on SIGTERM to the
server alone, or on a signal to its whole process group; and to watch one that dies
take its engine with it."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import threading
import time

import grpc
import httpx
import psutil
import pytest
import tracewire
from conftest import NO_COMPILE, ServerProcess, take, wait_for_unfinished
from grpc_health.v1 import health_pb2, health_pb2_grpc
from held_trace import SERVER_ARGS as HELD_TRACE_ARGS
from held_trace import HeldTrace
from server_pool import ServerSpec, servers
from tracewire.v1 import service_pb2, service_pb2_grpc

# (eager: the drain does not depend on the engine kind; the signals to the whole group and
# SIGKILL below stop compiled engines, as do the session servers' own stops)
SIGTERMED = ServerSpec("sigterm", (*NO_COMPILE, "--grace-period", "60"))


@servers(SIGTERMED)
def test_sigterm_drains_in_flight_calls_and_exits_zero():
    server = take(SIGTERMED)
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


# What a log must not show after a clean stop: the engine dying under the drain, and
# the noise of a dirty exit.
DIRTY_EXIT = ("Traceback", "EngineCore encountered a fatal error", "died unexpectedly",
              "nanobind: leaked", "resource_tracker")


def _group(name: str, *extra: str) -> ServerSpec:
    """A server leading a process group of its own, to signal the whole group; its per-trace
    buffer holds the whole held trace (the suite's 2 MiB would fail it as too slow a reader)."""
    args = ("--grace-period", "60", *HELD_TRACE_ARGS, *extra)
    return ServerSpec(name, args, own_session=True)


GROUP_SIGINT, GROUP_SIGTERM = _group("group-sigint"), _group("group-sigterm")
GROUP_SIGINT_FRONTENDS = _group("group-sigint-frontends", "--frontends", "2")


@pytest.mark.parametrize("sig, spec", [
    pytest.param(signal.SIGINT, GROUP_SIGINT, id="SIGINT", marks=servers(GROUP_SIGINT)),
    pytest.param(signal.SIGTERM, GROUP_SIGTERM, id="SIGTERM", marks=servers(GROUP_SIGTERM)),
    pytest.param(signal.SIGINT, GROUP_SIGINT_FRONTENDS, id="SIGINT-frontends",
                 marks=servers(GROUP_SIGINT_FRONTENDS)),
])
def test_a_signal_to_the_process_group_drains_like_sigterm_to_the_server(sig, spec):
    """Ctrl-C in a terminal (SIGINT) and `kill -- -PGID` from a supervisor (SIGTERM)
    signal every process of the server's group, vLLM's engine core and workers included.
    The server must still drain: the trace in flight finishes, new calls get
    UNAVAILABLE, the process exits 0 with a clean log and leaves no process behind."""
    server = take(spec)
    processes = psutil.Process(server.process.pid).children(recursive=True)
    traced: HeldTrace | None = None
    try:
        warm = grpc.insecure_channel(server.target, options=[("grpc.enable_retries", 0)])
        _tokenize(warm)  # a connection open before the signal
        traced = HeldTrace(server)
        assert traced.started.wait(60), traced.error
        server.signal_group(sig)
        refused = _refused_while(traced, warm, server.target)
        time.sleep(0.5)  # still refused: the held trace is what keeps the server draining
        refused_later = _refused_while(traced, warm, server.target)
        traced.release.set()
        warm.close()
        code = server.process.wait(timeout=180)
        traced.join(timeout=60)
        log = server.log()
        assert code == 0, log[-5000:]
        assert refused is not None, "no call was refused while the trace drained"
        assert refused_later is not None, "the server stopped draining before the trace was read"
        traced.check_complete()  # neither INTERNAL nor "the engine died"
        assert [line for line in log.splitlines() if any(s in line for s in DIRTY_EXIT)] == []
        assert "draining" in log
        _, alive = psutil.wait_procs(processes, timeout=30)
        assert alive == [], [(p.pid, p.name()) for p in alive]
    finally:
        if traced is not None:
            traced.release.set()
        _kill(server, processes)


KILLED = ServerSpec("sigkill")


@servers(KILLED)
def test_a_killed_server_takes_its_engine_with_it():
    """SIGKILL (or a crash) leaves the server no time to stop vLLM's engine processes;
    they must notice and stop on their own rather than hold the model's memory forever.
    (A SIGKILL to the server's whole group is the same case for the engine, which runs
    in a process group of its own.)"""
    server = take(KILLED)
    processes = psutil.Process(server.process.pid).children(recursive=True)
    assert any("EngineCore" in p.name() for p in processes), [p.name() for p in processes]
    sockets = glob.glob(os.path.join(tempfile.gettempdir(), f"tracewire-{server.process.pid}-*"))
    assert sockets  # the side channel's
    try:
        server.process.kill()
        server.process.wait(timeout=30)
        _, alive = psutil.wait_procs(processes, timeout=60)
        assert alive == [], [(p.pid, p.name()) for p in alive]
        assert [path for path in sockets if os.path.exists(path)] == []  # removed for it
    finally:
        _kill(server, processes)


def _tokenize(channel: grpc.Channel) -> None:
    service_pb2_grpc.TraceServiceStub(channel).Tokenize(service_pb2.TokenizeRequest(text="a"), timeout=5)


def _refused_while(traced: HeldTrace, warm: grpc.Channel, target: str) -> str | None:
    """What a new call is told while `traced` is still draining (None: no "shutting
    down" came while it ran). Each round tries the connection opened before the signal
    and a new one: with --frontends, a frontend with nothing in flight stops at once,
    its connections close, and only a new connection reaches the frontend still
    draining. No client retries: the SDK's would retry the refusal itself."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and traced.is_alive():
        fresh = grpc.insecure_channel(target, options=[("grpc.enable_retries", 0)])
        try:
            for channel in (warm, fresh):
                try:
                    _tokenize(channel)
                except grpc.RpcError as e:
                    said = e.details() or ""
                    if e.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in said:
                        return said if traced.is_alive() else None
        finally:
            fresh.close()
        time.sleep(0.01)
    return None


def _kill(server: ServerProcess, processes: list[psutil.Process]) -> None:
    """Whatever a failed test left running."""
    for process in [server.process, *processes]:
        try:
            process.kill()
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
