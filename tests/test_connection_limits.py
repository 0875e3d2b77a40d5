"""Connection hygiene on both ports (connection_limits.py, http_protocol.py), with short
timeouts and small limits on a server of this module's own: slowloris heads and bodies,
idle and silent connections are closed in time; over the limits, connections and calls
are refused; a stream outlives the connection's maximum age. Raw sockets, 127.0.0.1 only.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack

import grpc
import pytest
from conftest import NO_COMPILE, ServerProcess, stop_soon, take
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_pool import ServerSpec, servers
from tracewire.v1 import service_pb2, service_pb2_grpc

IDLE_S = 2.0
HEADER_S = 2.0
BODY_S = 2.0
AGE_S = 2.0
MAX_CONNECTIONS = 4
MAX_CALLS = 3
SLACK_S = 1.5  # timers, scheduling on a busy 2-core machine
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS


LIMITED = ServerSpec("connection-limits", (
    *NO_COMPILE, "--idle-timeout", str(IDLE_S), "--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S),
    "--max-connection-age", str(AGE_S), "--max-connections", str(MAX_CONNECTIONS),
    "--max-concurrent-calls", str(MAX_CALLS)))
pytestmark = servers(LIMITED)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = take(LIMITED)
    yield proc
    stop_soon(proc)


def http_address(server: ServerProcess) -> tuple[str, int]:
    return "127.0.0.1", int(server.http_url.rsplit(":", 1)[1])


def grpc_address(server: ServerProcess) -> tuple[str, int]:
    return "127.0.0.1", int(server.target.rsplit(":", 1)[1])


def closed_after(sock: socket.socket, limit: float, drip: bytes = b"", every: float = 0.25) -> tuple[float, bytes]:
    """Seconds until the server closes `sock` (inf if it is still open after `limit`), and
    what it sent; `drip` is sent every `every` seconds meanwhile (a slowloris)."""
    started = time.monotonic()
    received = b""
    sock.settimeout(every)
    while time.monotonic() - started < limit:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            if drip:
                try:
                    sock.sendall(drip)
                except OSError:
                    return time.monotonic() - started, received
            continue
        except OSError:  # reset
            return time.monotonic() - started, received
        if not data:
            return time.monotonic() - started, received
        received += data
    return float("inf"), received


def wait_for_no_connections(server: ServerProcess) -> None:
    """Let connections of earlier tests (their channels, timed out sockets) go."""
    time.sleep(max(IDLE_S, HEADER_S) + SLACK_S)


# ---- slowloris and idle connections -----------------------------------------------------

def test_http_slowloris_head_is_dropped(server: ServerProcess) -> None:
    with socket.create_connection(http_address(server)) as sock:
        sock.sendall(b"POST /tracewire.v1.TraceService/GetModelInfo HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        took, received = closed_after(sock, limit=HEADER_S + 6, drip=b"X-Slow: 1\r\n")
    assert took <= HEADER_S + SLACK_S, "a head sent a line at a time kept its connection open"
    assert received.startswith(b"HTTP/1.1 408 ")


def test_http_slow_body_is_dropped(server: ServerProcess) -> None:
    with socket.create_connection(http_address(server)) as sock:
        sock.sendall(b"POST /tracewire.v1.TraceService/Tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"content-type: application/json\r\ncontent-length: 200\r\n\r\n{")
        took, _ = closed_after(sock, limit=BODY_S + 6, drip=b" ", every=0.5)
    assert took <= BODY_S + SLACK_S, "a body sent a byte at a time kept its connection open"


def test_silent_connections_are_closed_on_both_ports(server: ServerProcess) -> None:
    """Connections that never send a byte (the 1,000 idle sockets of the issue)."""
    for address in (http_address(server), grpc_address(server)):
        with ExitStack() as stack:
            socks = [stack.enter_context(socket.create_connection(address)) for _ in range(3)]
            started = time.monotonic()
            for sock in socks:
                took, _ = closed_after(sock, limit=HEADER_S + 6 - (time.monotonic() - started))
                assert took != float("inf"), f"a silent connection to {address} stayed open"
            assert time.monotonic() - started <= HEADER_S + SLACK_S


def test_grpc_slow_preface_is_dropped(server: ServerProcess) -> None:
    with socket.create_connection(grpc_address(server)) as sock:
        took, received = closed_after(sock, limit=HEADER_S + 6, drip=b"P", every=0.5)
    assert took <= HEADER_S + SLACK_S


def test_idle_http_keep_alive_connection_is_closed(server: ServerProcess) -> None:
    with socket.create_connection(http_address(server)) as sock:
        sock.sendall(b"POST /tracewire.v1.TraceService/GetModelInfo HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        sock.settimeout(30)
        response = sock.recv(65536)
        assert response.startswith(b"HTTP/1.1 200 ")
        took, _ = closed_after(sock, limit=IDLE_S + 6)
    assert IDLE_S - 0.5 <= took <= IDLE_S + SLACK_S


def test_idle_grpc_connection_is_closed(server: ServerProcess) -> None:
    with socket.create_connection(grpc_address(server)) as sock:
        sock.sendall(HTTP2_PREFACE)
        took, received = closed_after(sock, limit=IDLE_S + 6)
    assert took <= IDLE_S + SLACK_S
    assert b"connection idle" in received  # grpc's GOAWAY says why


# ---- limits ---------------------------------------------------------------------------

def test_connections_over_the_limit_are_refused(server: ServerProcess) -> None:
    wait_for_no_connections(server)
    for address, port in ((http_address(server), "HTTP"), (grpc_address(server), "gRPC")):
        with ExitStack() as stack:
            held = [stack.enter_context(socket.create_connection(address)) for _ in range(MAX_CONNECTIONS)]
            time.sleep(0.3)  # accepted
            extra = stack.enter_context(socket.create_connection(address))
            took, received = closed_after(extra, limit=HEADER_S / 2)
            assert took < HEADER_S / 2, f"{port}: connection {MAX_CONNECTIONS + 1} was kept"
            if port == "HTTP":
                assert received.startswith(b"HTTP/1.1 503 ")
            for sock in held:  # the first ones are still open (until their head timeout)
                assert is_open(sock), f"{port}: a connection under the limit was closed"


def is_open(sock: socket.socket) -> bool:
    """Not closed by the server (gRPC's opening SETTINGS may be waiting to be read)."""
    sock.settimeout(0.01)
    try:
        return sock.recv(65536) != b""
    except TimeoutError:
        return True


def until_accepted(health: health_pb2_grpc.HealthStub, within: float = 30.0) -> None:
    """Until the server takes this connection: the connections an earlier test held and
    closed count against --max-connections until the server has seen them close, which
    on a loaded machine can take a moment."""
    deadline = time.monotonic() + within
    while True:
        try:
            health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_grpc_calls_over_the_limit_are_refused(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        until_accepted(health)
        watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(MAX_CALLS)]
        try:
            for watch in watches:  # each one is running: it sent its first status
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            stub = service_pb2_grpc.TraceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetModelInfo(service_pb2.GetModelInfoRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for watch in watches:
                watch.cancel()
        time.sleep(0.5)
        stub.GetModelInfo(service_pb2.GetModelInfoRequest(), timeout=30)  # under the limit again


def test_http_requests_over_the_limit_are_refused(server: ServerProcess) -> None:
    """uvicorn's limit counts connections and calls in flight: with MAX_CALLS connections
    open, one more request is answered 503."""
    wait_for_no_connections(server)
    with ExitStack() as stack:
        for _ in range(MAX_CALLS):
            stack.enter_context(socket.create_connection(http_address(server)))
        sock = stack.enter_context(socket.create_connection(http_address(server)))
        sock.sendall(b"POST /tracewire.v1.TraceService/GetModelInfo HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        sock.settimeout(30)
        assert sock.recv(65536).startswith(b"HTTP/1.1 503 ")


# ---- a long stream and the connection's age -------------------------------------------------

def test_a_stream_outlives_the_connection_age(server: ServerProcess) -> None:
    """GOAWAY at the maximum age leaves the calls in flight alone (no grace deadline)."""
    with grpc.insecure_channel(server.target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        time.sleep(AGE_S * 2 + SLACK_S)
        assert watch.is_active(), f"the stream was cut: {watch.code()} {watch.details()}"
        watch.cancel()
        # the channel reconnects for new calls
        service_pb2_grpc.TraceServiceStub(channel).GetModelInfo(service_pb2.GetModelInfoRequest(), timeout=30)
