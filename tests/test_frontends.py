"""`--frontends 2`: two server processes on one port sharing one engine core.

Each frontend must get exactly its own requests' records from the worker hooks:
a trace served by the wrong frontend would never see its values (it would time
out), and one frontend's records must not leak into the other's traces. The
test pins one connection to each frontend (by the process holding it) and runs
traces on both at once, checked against transformers.
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import psutil
import pytest
import torch
from conftest import NO_COMPILE, ServerProcess, free_port, take
from server_pool import ServerSpec, servers
from trace_requests import invoke, iv, logits, run, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2, service_pb2_grpc

PROMPTS = ["The capital of France is", "Once upon a time", "One, two, three,"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


METRICS_PORT = free_port()  # frontend i serves its metrics on METRICS_PORT + i


FRONTENDS = ServerSpec("frontends", (*NO_COMPILE, "--frontends", "2", "--metrics-port", str(METRICS_PORT)))
pytestmark = servers(FRONTENDS)


@pytest.fixture(scope="module")
def frontends() -> Iterator[ServerProcess]:
    server = take(FRONTENDS)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def _connections(server: ServerProcess) -> set[tuple[int, int]]:
    """(pid, client port) of every established connection to the gRPC port."""
    port = int(server.target.rsplit(":", 1)[1])
    found = set()
    for child in psutil.Process(server.process.pid).children():
        try:
            conns = child.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        found |= {(child.pid, c.raddr.port) for c in conns
                  if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port and c.raddr}
    return found


def _channel_per_frontend(server: ServerProcess) -> dict[int, grpc.Channel]:
    """One channel (its own TCP connection) to each frontend process, keyed by pid."""
    pinned: dict[int, grpc.Channel] = {}
    spare = []
    for _ in range(64):  # the kernel picks the frontend per connection
        before = _connections(server)
        channel = grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
        service_pb2_grpc.TraceServiceStub(channel).GetModelInfo(service_pb2.GetModelInfoRequest(), timeout=10)
        (pid, _port), = _connections(server) - before
        if pid in pinned:
            spare.append(channel)
        else:
            pinned[pid] = channel
        if len(pinned) == 2:
            break
    for channel in spare:
        channel.close()
    assert len(pinned) == 2, "64 connections all went to one frontend"
    return pinned


def test_both_frontends_serve_traces_with_their_own_values(frontends, hf):
    channels = _channel_per_frontend(frontends)
    berlin = hf.encode(" Berlin")[0]

    def top_k(stub, prompt):
        return prompt, run(stub, trace(invoke(prompt, iv("top", read_logits=logits(k=5, raw=True))),
                                       max_tokens=6, **GREEDY))

    def forced(stub):
        return run(stub, trace(invoke(PROMPTS[0], iv(sel=steps(at=[0]),
                                                     force_sample=I.ForceSample(token_id=berlin))),
                               max_tokens=6, **GREEDY))

    stubs = [service_pb2_grpc.TraceServiceStub(c) for c in channels.values()]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        reads = [pool.submit(top_k, stub, prompt) for stub in stubs for prompt in PROMPTS]
        forces = [pool.submit(forced, stub) for stub in stubs]
        for future in reads:
            prompt, result = future.result()
            ids = hf.encode(prompt)
            assert len(result.values("top")) == 6, prompt
            for step in range(6):
                ref = torch.topk(hf.next_logits(ids), 5)
                np.testing.assert_array_equal(result.ids("top")[step], ref.indices.numpy())
                np.testing.assert_allclose(result.values("top")[step], ref.values.numpy(), atol=2e-3)
                ids.append(result.seq()[step].token_id)
            assert result.tokens() == hf.greedy(hf.encode(prompt), 6)
        expected = [berlin] + hf.greedy(hf.encode(PROMPTS[0]) + [berlin], 5)
        for future in forces:
            assert future.result().tokens() == expected
    for channel in channels.values():
        channel.close()


def test_each_frontend_serves_its_own_metrics(frontends):
    def model_info_calls() -> list[float]:
        key = ('tracewire_rpcs_total{code="OK",method="tracewire.v1.TraceService/GetModelInfo",'
               'tenant="",transport="grpc"} ')
        counts = []
        for port in (METRICS_PORT, METRICS_PORT + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            counts.append(sum(float(line[len(key):]) for line in text.splitlines() if line.startswith(key)))
        return counts

    channels = _channel_per_frontend(frontends)  # one GetModelInfo on each frontend
    before = model_info_calls()
    for channel in channels.values():
        service_pb2_grpc.TraceServiceStub(channel).GetModelInfo(service_pb2.GetModelInfoRequest(), timeout=10)
    after = model_info_calls()
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]
    for channel in channels.values():
        channel.close()


def test_http_port_is_shared_too(frontends):
    """Every frontend listens on the HTTP port as well (new connection per call here)."""
    models = set()
    for _ in range(6):
        request = urllib.request.Request(
            frontends.http_url + "/tracewire.v1.TraceService/GetModelInfo", data=b"{}",
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            models.add(json.loads(response.read())["vocabSize"])
    assert len(models) == 1 and models.pop() > 0


def test_frontends_need_a_fixed_port(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tracewire_server", "--port", "0", "--frontends", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--frontends > 1 needs a fixed --port" in out.stderr
