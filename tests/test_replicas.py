"""Several replicas behind one target (docs/deployment.md: Replicas): the SDK's channel spreads calls
round-robin over a target's addresses and retries a call refused UNAVAILABLE before any
response on the next replica, so a replica draining after SIGTERM sheds its traffic without
failing a call.

Two servers on the tiny model; one client whose target lists both. Under a steady stream of
traces, one replica gets SIGTERM: it finishes the traces it had (the drain's grace), refuses
new ones with UNAVAILABLE, and every one of those is retried on the other replica. No call
fails, and both replicas served traces.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tracewire
from conftest import NO_COMPILE, ServerProcess, stop_soon, take
from server_pool import Prepared, ServerSpec, servers

PROMPT = "Once upon a time"
# Long enough that the replica being stopped still has traces in flight for a while.
SAMPLING = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}


def _access_log(directory: Path) -> Prepared:
    return Prepared(("--access-log", str(directory / "access.log")), access_log=directory / "access.log")


# (eager: what the replicas check does not depend on the engine kind)
REPLICAS = [ServerSpec(f"replica-{name}", (*NO_COMPILE, "--grace-period", "60"), prepare=_access_log)
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


def traces_by_code(server: ServerProcess) -> dict[str, int]:
    """The server's Trace calls by status code, from its access log."""
    counts: dict[str, int] = {}
    path: Path = server.access_log  # type: ignore[attr-defined]
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry["method"].endswith("/Trace"):
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

    with ThreadPoolExecutor(4) as pool:
        workers = [pool.submit(keep_tracing) for _ in range(4)]
        deadline = time.monotonic() + 180
        while not (traces_by_code(a).get("OK") and traces_by_code(b).get("OK")):  # both serve
            assert time.monotonic() < deadline, (traces_by_code(a), traces_by_code(b))
            time.sleep(0.2)
        stopped_at = len(outcomes)
        b.process.send_signal(15)  # SIGTERM: b drains
        while b.process.poll() is None:  # new traces meet the draining b, then a alone
            assert time.monotonic() < deadline, "b did not stop"
            time.sleep(0.2)
        after_stop = len(outcomes)
        time.sleep(2)  # and a little more load on a alone
        stop_load.set()
        for worker in workers:
            worker.result()
    client.close()

    failures = [o for o in outcomes if isinstance(o, Exception)]
    assert not failures, failures[:3]
    assert all(o == expected for o in outcomes)
    assert len(outcomes) > after_stop > stopped_at, (stopped_at, after_stop, len(outcomes))
    on_b = traces_by_code(b)
    # b refused the traces it met while draining, and each of them was retried on a
    assert on_b.get("UNAVAILABLE", 0) >= 1, on_b
    assert b.process.returncode == 0
    assert traces_by_code(a).get("OK", 0) + on_b.get("OK", 0) == len(outcomes) + 1


def test_which_targets_name_replicas() -> None:
    """Address lists and dns: names get the round-robin / retry policy; a plain host:port
    (one server) does not, so its own UNAVAILABLE comes back at once."""
    from tracewire.channel import names_replicas

    assert names_replicas("ipv4:10.0.0.1:50051,10.0.0.2:50051")
    assert names_replicas("ipv6:[::1]:50051,[::1]:50052")
    assert names_replicas("dns:///tracewire.default.svc:50051")
    for one in ("127.0.0.1:50051", "localhost:50051", "ipv4:10.0.0.1:50051", "unix:/tmp/tw.sock"):
        assert not names_replicas(one), one
