"""Several replicas behind one target (docs/deployment.md: Replicas): the SDK's channel spreads calls
round-robin over a target's addresses and retries a call refused UNAVAILABLE before any
response on the next replica, so a replica draining after SIGTERM sheds its traffic without
failing a call.

Two servers on the tiny model; one client whose target lists both. Under a steady stream of
traces, one replica gets SIGTERM: it finishes the traces it had (the drain's grace), refuses
new ones with UNAVAILABLE, and every one of those is retried on the other replica. No call
fails, and both replicas served traces. A held trace (held_trace.py) keeps the stopped
replica draining while the other serves DRAINED_ON_A traces alone: a drain as long as a
user's long trace makes it, where the client's health checks must keep calls off the
draining replica (round-robin and retries alone failed calls there).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import tracewire
from conftest import NO_COMPILE, ServerProcess, stop_soon, take
from held_trace import SERVER_ARGS as HELD_TRACE_ARGS
from held_trace import HeldTrace
from server_pool import Prepared, ServerSpec, servers

PROMPT = "Once upon a time"
# Long enough that the replica being stopped still has traces in flight for a while.
SAMPLING = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
WORKERS = 4
# Traces a serves alone, begun after b got SIGTERM, while b is held draining: enough calls
# that, without health checking, some would meet b on every one of their five attempts.
DRAINED_ON_A = 24


def _access_log(directory: Path) -> Prepared:
    return Prepared(("--access-log", str(directory / "access.log")), access_log=directory / "access.log")


# (eager: what the replicas check does not depend on the engine kind)
REPLICAS = [ServerSpec(f"replica-{name}", (*NO_COMPILE, "--grace-period", "60", *HELD_TRACE_ARGS), prepare=_access_log)
            for name in ("a", "b")]
pytestmark = servers(*REPLICAS)


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProcess]]:
    started = []
    try:
        for spec in REPLICAS:
            started.append(take(spec))
        yield started
    finally:
        for server in started:
            stop_soon(server)


def traces_by_code(server: ServerProcess, started_after: datetime | None = None) -> dict[str, int]:
    """The server's Trace calls by status code, from its access log; with `started_after`,
    only the calls that began after that moment (the log's time is the call's end)."""
    counts: dict[str, int] = {}
    path: Path = server.access_log  # type: ignore[attr-defined]
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        began = datetime.fromisoformat(entry["time"]) - timedelta(milliseconds=entry["duration_ms"])
        if entry["method"].endswith("/Trace") and (started_after is None or began > started_after):
            counts[entry["code"]] = counts.get(entry["code"], 0) + 1
    return counts


def one_trace(client: tracewire.Client) -> list[int]:
    with client.trace(PROMPT, **SAMPLING) as tracer:
        samples = tracer.all().samples.save()
    return [int(s) for s in samples]


def test_a_draining_replica_sheds_its_traffic_without_failing_a_call(replicas: list[ServerProcess]) -> None:
    a, b = replicas
    client = tracewire.Client(f"ipv4:{a.target},{b.target}", timeout=300)
    expected = one_trace(client)  # greedy: every trace, on either replica, draws the same
    outcomes: list[list[int] | Exception] = []
    stop_load = threading.Event()

    def keep_tracing() -> None:
        while not stop_load.is_set():
            try:
                outcomes.append(one_trace(client))
            except Exception as e:  # noqa: BLE001 - counted below: there must be none
                outcomes.append(e)

    held: HeldTrace | None = None
    with ThreadPoolExecutor(WORKERS) as pool:
        workers = [pool.submit(keep_tracing) for _ in range(WORKERS)]
        try:
            deadline = time.monotonic() + 180
            while not (traces_by_code(a).get("OK") and traces_by_code(b).get("OK")):  # both serve
                assert time.monotonic() < deadline, (traces_by_code(a), traces_by_code(b))
                time.sleep(0.2)
            held = HeldTrace(b)  # in flight on b, unread: b drains until it is released
            assert held.started.wait(60), held.error
            stopped_at, signalled = len(outcomes), datetime.now(UTC)
            b.process.send_signal(15)  # SIGTERM: b drains
            while traces_by_code(a, started_after=signalled).get("OK", 0) < DRAINED_ON_A:  # a alone serves
                assert time.monotonic() < deadline and held.is_alive(), traces_by_code(a, started_after=signalled)
                time.sleep(0.05)
            assert b.process.poll() is None  # b was draining all that time
            held.release.set()
            while b.process.poll() is None:
                assert time.monotonic() < deadline, "b did not stop"
                time.sleep(0.2)
            after_stop = len(outcomes)
            time.sleep(2)  # and a little more load on a alone
        finally:
            stop_load.set()
            if held is not None:
                held.release.set()
        for worker in workers:
            worker.result()
    client.close()
    held.join(timeout=60)

    held.check_complete()
    failures = [o for o in outcomes if isinstance(o, Exception)]
    assert not failures, failures[:3]
    assert all(o == expected for o in outcomes)
    assert len(outcomes) > after_stop > stopped_at, (stopped_at, after_stop, len(outcomes))
    assert b.process.returncode == 0
    # Nothing b began after the signal was served there; the health check took b out of the
    # rotation, so only the calls racing the health change met it (a call or two per worker,
    # each retried on a; without health checks, b refused 71 here while a served its 24)
    refused = traces_by_code(b, started_after=signalled)
    assert refused.keys() <= {"UNAVAILABLE"} and refused.get("UNAVAILABLE", 0) <= 2 * WORKERS, refused
    # every trace served once: the first, the held one, and the load's
    assert traces_by_code(a).get("OK", 0) + traces_by_code(b).get("OK", 0) == len(outcomes) + 2


def test_which_targets_name_replicas() -> None:
    """Address lists and dns: names get the round-robin / retry policy; a plain host:port
    (one server) does not, so its own UNAVAILABLE comes back at once."""
    from tracewire.channel import names_replicas

    assert names_replicas("ipv4:10.0.0.1:50051,10.0.0.2:50051")
    assert names_replicas("ipv6:[::1]:50051,[::1]:50052")
    assert names_replicas("dns:///tracewire.default.svc:50051")
    for one in ("127.0.0.1:50051", "localhost:50051", "ipv4:10.0.0.1:50051", "unix:/tmp/tw.sock"):
        assert not names_replicas(one), one
