"""The boundary on real servers: TLS and mutual TLS on both ports, bearer tokens on every
RPC of both ports, per-tenant quotas, reflection and health (docs/security.md).

Two servers, one per configuration, each shared by its module-scoped tests:
- `tls_server`: TLS (server certificate only), --auth-tokens, small tenant quotas;
- `mtls_server`: mutual TLS, no tokens, --no-reflection.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import tracewire
from certs import Pki, make_pki
from conftest import NO_COMPILE, ROOT, ServerProcess, free_port, take
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_pool import Prepared, ServerSpec, servers
from snippets import blocks, claim_holds, print_claims, run_python
from tracewire.v1 import service_pb2, service_pb2_grpc

SERVICE = "tracewire.v1.TraceService"
TOKENS = {  # one tenant per test that spends quota, so that the tests leave each other alone
    "alice": "alice-0123456789abcdef",
    "bob": "bob-0123456789abcdefgh",
    "carol": "carol-0123456789abcdef",
    "dave": "dave-0123456789abcdefg",
    "erin": "erin-0123456789abcdefg",
}
MAX_CALLS, MAX_SEQUENCES, READ_BYTES_PER_MINUTE = 2, 4, 100_000
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}  # seconds of decoding on 2 cores


@dataclass(frozen=True)
class Rpc:
    name: str
    request: dict
    streaming: bool = False

    def message(self):
        request_class = "TraceRequest" if self.name == "Trace" else f"{self.name}Request"
        return json_format.ParseDict(self.request, getattr(service_pb2, request_class)())


RPCS = [
    Rpc("Generate", {"prompts": [{"text": "The capital of France is"}], "samplingParams": {"maxTokens": 2}}),
    Rpc("GenerateStream", {"prompts": [{"text": "The capital of France is"}], "samplingParams": {"maxTokens": 2}},
        streaming=True),
    Rpc("Trace", {"samplingParams": {"maxTokens": 2}, "invokes": [{"prompt": {"text": "The capital of France is"}}]},
        streaming=True),
    Rpc("Tokenize", {"text": " Berlin"}),
    Rpc("Detokenize", {"tokenIds": [794]}),
    Rpc("GetModelInfo", {}),
    Rpc("GetEngineStats", {}),
]


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


# ---- servers ---------------------------------------------------------------------------

_pki_lock = threading.Lock()
_pki: list[Pki] = []


def shared_pki() -> Pki:
    """One CA, server and client certificate for both servers and their clients (made by
    the first of the pool's threads or the tests that needs it)."""
    with _pki_lock:
        if not _pki:
            _pki.append(make_pki(Path(tempfile.mkdtemp(prefix="tracewire-pki-"))))
        return _pki[0]


def _tls_files(directory: Path) -> Prepared:
    pki = shared_pki()
    tokens = directory / "tokens"
    tokens.write_text("# tenant token\n" + "".join(f"{t} {tok}\n" for t, tok in TOKENS.items()))
    return Prepared(
        ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--auth-tokens", str(tokens),
         "--access-log", str(directory / "access.log"), "--metrics-port", str(free_port())),
        credentials=grpc.ssl_channel_credentials(pki.ca.read_bytes()), access_log=directory / "access.log")


def _mtls_files(directory: Path) -> Prepared:
    pki = shared_pki()
    return Prepared(
        ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)),
        credentials=grpc.ssl_channel_credentials(
            pki.ca.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()))


TLS = ServerSpec("tls", (*NO_COMPILE, "--tenant-max-calls", str(MAX_CALLS),
                         "--tenant-max-sequences", str(MAX_SEQUENCES),
                         "--tenant-read-bytes-per-minute", str(READ_BYTES_PER_MINUTE)), prepare=_tls_files)
MTLS = ServerSpec("mtls", (*NO_COMPILE, "--no-reflection"), prepare=_mtls_files)
pytestmark = servers(TLS, MTLS)


@pytest.fixture(scope="module")
def pki() -> Pki:
    return shared_pki()


@pytest.fixture(scope="module")
def tls_server() -> Iterator[ServerProcess]:
    server = take(TLS)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def mtls_server() -> Iterator[ServerProcess]:
    server = take(MTLS)
    yield server
    assert server.stop() == 0


def client(server: ServerProcess, pki: Pki, tenant: str = "alice", **kw) -> tracewire.Client:
    return tracewire.Client(server.target, token=TOKENS[tenant], tls=tracewire.Tls.from_files(pki.ca),
                            timeout=kw.pop("timeout", 120), **kw)


def https(pki: Pki, *, client_cert: bool = False) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if client_cert:
        context.load_cert_chain(pki.client_cert, pki.client_key)
    return httpx.Client(verify=context, timeout=120)


def grpc_code(server: ServerProcess, rpc: Rpc, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    with server.channel() as channel:
        method = getattr(service_pb2_grpc.TraceServiceStub(channel), rpc.name)
        try:
            if rpc.streaming:
                list(method(rpc.message(), metadata=metadata, timeout=60))
            else:
                method(rpc.message(), metadata=metadata, timeout=60)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def http_code(http: httpx.Client, server: ServerProcess, rpc: Rpc, headers: dict[str, str]) -> str:
    """A Connect (JSON) call's outcome: "ok" or the Connect error code."""
    url = f"{server.http_url}/{SERVICE}/{rpc.name}"
    if not rpc.streaming:
        r = http.post(url, json=rpc.request, headers={"connect-protocol-version": "1", **headers})
        return "ok" if r.status_code == 200 else str(r.json()["code"])
    payload = json.dumps(rpc.request).encode()
    r = http.post(url, content=struct.pack(">BI", 0, len(payload)) + payload,
                  headers={"content-type": "application/connect+json", "connect-protocol-version": "1", **headers})
    assert r.status_code == 200, r.text
    data, end = r.content, {}
    while data:  # the last envelope is the end-of-stream message
        size = struct.unpack(">I", data[1:5])[0]
        end, data = json.loads(data[5:5 + size]), data[5 + size:]
    return str(end["error"]["code"]) if "error" in end else "ok"


# ---- TLS -------------------------------------------------------------------------------

def test_tls_serves_both_ports_to_the_sdk_and_httpx(tls_server, pki):
    with client(tls_server, pki) as c:
        (out,) = c.generate("The capital of France is", temperature=0.0, max_tokens=4)
        assert out.outputs[0].text.startswith(" Paris")

    async def async_generate() -> str:
        async with tracewire.AsyncClient(tls_server.target, token=TOKENS["alice"],
                                         tls=tracewire.Tls.from_files(pki.ca), timeout=120) as c:
            (out,) = await c.generate("The capital of France is", temperature=0.0, max_tokens=4)
            return out.outputs[0].text

    assert asyncio.run(async_generate()).startswith(" Paris")
    assert tls_server.http_url.startswith("https://")
    with https(pki) as http:
        r = http.post(f"{tls_server.http_url}/{SERVICE}/Tokenize", json={"text": " Paris"},
                      headers={"authorization": f"Bearer {TOKENS['alice']}"})
        assert r.status_code == 200, r.text
        assert r.json()["tokenIds"] == [806]


def test_the_readme_security_snippet_runs_as_written(tls_server, pki, tmp_path):
    """docs/security.md's Python block, with its token and CA files beside it, against a TLS
    server with tokens: the call it makes is answered, and prints what the page says."""
    (block,) = [b for b in blocks(ROOT / "docs" / "security.md", "python") if "tracewire.Tls" in b.code]
    shutil.copy(pki.ca, tmp_path / "ca.pem")
    (tmp_path / "my.token").write_text(TOKENS["alice"] + "\n")
    run = run_python([block], tmp_path, {"host:50051": tls_server.target})
    assert run.returncode == 0, run.stderr
    claims = print_claims(block)
    assert claims, "the snippet prints nothing to check"
    for line, claim in claims:
        (printed,) = run.prints[(block.name, line)]
        assert claim_holds(claim, printed), (claim, printed)


def test_a_plaintext_client_gets_nothing_from_a_tls_server(tls_server):
    with tracewire.Client(tls_server.target, token=TOKENS["alice"], timeout=10) as c, \
            pytest.raises(tracewire.Unavailable):
        c.model_info()
    with pytest.raises(httpx.TransportError):
        httpx.post(tls_server.http_url.replace("https://", "http://") + f"/{SERVICE}/GetModelInfo", json={},
                   headers={"authorization": f"Bearer {TOKENS['alice']}"}, timeout=10)


def test_a_client_that_does_not_trust_the_server_certificate_is_refused(tls_server):
    with tracewire.Client(tls_server.target, token=TOKENS["alice"], tls=True, timeout=10) as c, \
            pytest.raises(tracewire.Unavailable):
        c.model_info()  # the system's CAs did not sign the test CA


def test_mutual_tls_serves_clients_with_a_certificate_on_both_ports(mtls_server, pki):
    tls = tracewire.Tls.from_files(pki.ca, pki.client_cert, pki.client_key)
    with tracewire.Client(mtls_server.target, tls=tls, timeout=120) as c:
        assert c.model_info().vocab_size == 2048
    with https(pki, client_cert=True) as http:
        r = http.post(f"{mtls_server.http_url}/{SERVICE}/GetModelInfo", json={})
        assert r.status_code == 200, r.text
        assert r.json()["vocabSize"] == 2048


def test_mutual_tls_refuses_clients_without_a_certificate_on_both_ports(mtls_server, pki):
    with tracewire.Client(mtls_server.target, tls=tracewire.Tls.from_files(pki.ca), timeout=10) as c, \
            pytest.raises(tracewire.Unavailable):
        c.model_info()
    with https(pki) as http, pytest.raises(httpx.TransportError):
        http.post(f"{mtls_server.http_url}/{SERVICE}/GetModelInfo", json={}, timeout=10)


def test_no_reflection_turns_reflection_off(mtls_server):
    with mtls_server.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                           timeout=10))
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


# ---- tokens ----------------------------------------------------------------------------

@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.name)
def test_every_rpc_needs_a_valid_token_on_both_ports(tls_server, pki, rpc):
    wrong = TOKENS["alice"][:-1] + "x"
    assert grpc_code(tls_server, rpc, ()) == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_code(tls_server, rpc, bearer(wrong)) == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_code(tls_server, rpc, (("authorization", TOKENS["alice"]),)) == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_code(tls_server, rpc, bearer(TOKENS["alice"])) == grpc.StatusCode.OK
    with https(pki) as http:
        assert http_code(http, tls_server, rpc, {}) == "unauthenticated"
        assert http_code(http, tls_server, rpc, {"authorization": f"Bearer {wrong}"}) == "unauthenticated"
        assert http_code(http, tls_server, rpc, {"authorization": f"Bearer {TOKENS['bob']}"}) == "ok"


def test_unauthenticated_is_a_401_naming_the_header(tls_server, pki):
    with https(pki) as http:
        r = http.post(f"{tls_server.http_url}/{SERVICE}/GetModelInfo", json={})
    assert r.status_code == 401
    assert "authorization: Bearer TOKEN" in r.json()["message"]
    with tracewire.Client(tls_server.target, tls=tracewire.Tls.from_files(pki.ca), timeout=10) as c, \
            pytest.raises(tracewire.TracewireError) as error:
        c.model_info()
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_health_stays_open_on_both_ports(tls_server, pki):
    with tls_server.channel() as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    with https(pki) as http:
        r = http.post(f"{tls_server.http_url}/grpc.health.v1.Health/Check", json={})
        assert r.status_code == 200 and r.json() == {"status": "SERVING"}


def test_browsers_may_send_the_token(tls_server, pki):
    """The CORS preflight allows the Authorization header, or no page could send its token."""
    origin = "http://localhost:5173"
    with https(pki) as http:
        r = http.options(f"{tls_server.http_url}/{SERVICE}/Trace", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type,connect-protocol-version"})
    assert r.status_code == 200, r.text
    assert "authorization" in {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}


def test_reflection_needs_a_token_when_tokens_are_on(tls_server):
    def services(metadata: tuple[tuple[str, str], ...]) -> list[str]:
        with tls_server.channel() as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            (response,) = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=10)
            return [s.name for s in response.list_services_response.service]

    with pytest.raises(grpc.RpcError) as error:
        services(())
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert SERVICE in services(bearer(TOKENS["alice"]))


def test_the_cli_takes_a_token_file_and_a_ca(tls_server, pki, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKENS["alice"] + "\n")
    cli = [sys.executable, "-m", "tracewire.cli", "--target", tls_server.target, "--tls-ca", str(pki.ca)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEWIRE_")}
    ok = subprocess.run([*cli, "--token-file", str(token_file), "tokenize", " Paris", "--json"],
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["token_ids"] == [806]
    refused = subprocess.run([*cli, "tokenize", " Paris"], capture_output=True, text=True, timeout=120,
                             env={**env, "TRACEWIRE_TOKEN": "not-a-token-of-anyone"})
    assert refused.returncode == 1
    assert "UNAUTHENTICATED" in refused.stderr


# ---- quotas ----------------------------------------------------------------------------

def hold_stream(c: tracewire.Client, prompts="The capital of France is", **sampling) -> Iterator:
    """A GenerateStream call admitted and in flight (its first update has arrived)."""
    stream = c.generate_stream(prompts, **{**LONG, **sampling})
    next(stream)
    return stream


def eventually(call, timeout: float = 30.0):
    """`call()` once the server has finished releasing a call that just ended."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except tracewire.ResourceExhausted:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_calls_in_flight_per_tenant(tls_server, pki):
    with client(tls_server, pki, "carol") as carol, client(tls_server, pki, "bob") as bob:
        streams = [hold_stream(carol) for _ in range(MAX_CALLS)]
        with pytest.raises(tracewire.ResourceExhausted, match=r"--tenant-max-calls 2"):
            carol.tokenizer.encode(" Paris")
        assert bob.tokenizer.encode(" Paris") == [806]  # another tenant is not held back
        streams.pop().close()  # a cancelled call gives its slot back
        assert eventually(lambda: carol.tokenizer.encode(" Paris")) == [806]
        for _ in range(3):  # failed calls give theirs back too
            with pytest.raises(tracewire.InvalidArgument):
                carol.generate("x", max_tokens=-1)
        assert carol.tokenizer.encode(" Paris") == [806]
        streams.pop().close()
    with client(tls_server, pki, "carol", timeout=0.5) as hurried:
        for _ in range(MAX_CALLS + 1):  # and so do calls past their deadline
            with pytest.raises(tracewire.DeadlineExceeded):
                hurried.generate("The capital of France is", **LONG)
    with client(tls_server, pki, "carol") as carol:
        first = eventually(lambda: hold_stream(carol))
        second = eventually(lambda: hold_stream(carol))
        first.close()
        second.close()


def test_sequences_in_flight_per_tenant(tls_server, pki):
    with client(tls_server, pki, "dave") as dave:
        stream = hold_stream(dave, n=3, temperature=1.0, seed=0)
        with pytest.raises(tracewire.ResourceExhausted, match=r"--tenant-max-sequences 4"):
            dave.generate(["a", "b"], max_tokens=2)
        with pytest.raises(tracewire.ResourceExhausted, match=r"--tenant-max-sequences 4"):
            with dave.trace(max_tokens=2) as tracer:
                tracer.invoke("a")
                tracer.invoke("b")
        assert len(dave.generate(["a"], max_tokens=2)) == 1  # 3 + 1 fits
        stream.close()
        assert len(eventually(lambda: dave.generate(["a", "b", "c", "d"], max_tokens=2))) == 4


def test_read_bytes_per_minute_per_tenant(tls_server, pki):
    def full_logits(c: tracewire.Client, steps: int) -> None:
        with c.trace("The capital of France is", temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
            tracer.all().logits.save()

    with client(tls_server, pki, "erin") as erin:
        # A full row is 2048 float32 values, 8 KiB a step: 8 steps fit the 100 000 bytes once.
        with pytest.raises(tracewire.ResourceExhausted, match=r"more than tenant 'erin' may read in a minute"):
            full_logits(erin, 16)
        full_logits(erin, 8)
        with pytest.raises(tracewire.ResourceExhausted, match=r"--tenant-read-bytes-per-minute 100000"):
            full_logits(erin, 8)
        assert erin.tokenizer.encode(" Paris") == [806]  # calls without reads are not held back
    with client(tls_server, pki, "alice") as alice:
        full_logits(alice, 8)  # nor is another tenant


def test_the_tenant_is_in_the_access_log_and_the_metrics(tls_server, pki):
    """Authentication names the tenant of each call for the access log and the metrics."""
    with client(tls_server, pki, "bob") as c:
        c.tokenizer.encode("which tenant am I")
    lines = [json.loads(line) for line in tls_server.access_log.read_text().splitlines()]
    assert any(line["method"].endswith("Tokenize") and line.get("tenant") == "bob" for line in lines), lines[-3:]
    port = _flag(tls_server, "--metrics-port")
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    rpcs = [line for line in text.splitlines() if line.startswith("tracewire_rpcs_total{")]
    assert any('Tokenize"' in line and 'tenant="bob"' in line and not line.endswith(" 0.0")
               for line in rpcs), rpcs


def _flag(server: ServerProcess, name: str) -> str:
    args = psutil.Process(server.process.pid).cmdline()
    return args[args.index(name) + 1]
