"""One real tracewire server (real vLLM engine, CPU build) per test session.

The server runs as `python -m tracewire_server` in a subprocess, exactly as a
user starts it, with its HTTP port (Connect / gRPC-Web) on too: `http_url`. Its
health is polled from the moment it is spawned, so the NOT_SERVING -> SERVING
transition is observed, not assumed.

The HTTP port is served when this environment has what it needs (connectrpc, uvicorn,
starlette, httptools: an environment with vLLM alone may lack some); without them
the servers run gRPC only, the gRPC tests run as ever, and a test that uses the HTTP
port fails saying what is missing.

TRACEWIRE_TEST_ENGINE_ARGS adds engine flags to every test server (shell words, after
the defaults below, before a test's own), e.g. "--attention-backend FLEX_ATTENTION"
on a GPU, where vLLM's default float32 Triton attention puts some per-step logits
outside the tests' tolerances against transformers.
"""

from __future__ import annotations

import functools
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_pool import Prepared, ServerPool, ServerSpec, plan_of

# wall time per file and the servers each started, in the terminal summary
pytest_plugins = ["suite_timing"]

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path(os.environ.get("TRACEWIRE_TEST_MODEL", ROOT / "models" / "tracewire-tiny"))
# float32 so values can be compared with transformers at tight tolerances.
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "32",
               # small enough that a stalled reader hits it; tests only
               "--trace-buffer-bytes", str(2 << 20), "--enable-fault-injection",
               *shlex.split(os.environ.get("TRACEWIRE_TEST_ENGINE_ARGS", ""))]
START_TIMEOUT = 600.0
# vLLM's CPU build pins each engine's worker to core 0 ("auto" binding keeps the other
# core for the server's own processes), so every test server, and every server the pool
# starts in the background, would share one core while the other idled. Unpinned, the OS
# spreads them over both; one OpenMP thread each, as the pinning gives (the same sums in
# the same order: values as `make serve` computes them). Tests that bind cores themselves
# (test_parallel's rank per core) pass their own; the environment's own setting wins.
ONE_THREAD_UNPINNED = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (the sockets stay bound until all are picked)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


@functools.cache
def http_unavailable() -> str | None:
    """Why this environment cannot serve the HTTP port, or None when it can: the server
    imports the HTTP stack only with --http-port, and the test servers run from this
    same environment."""
    try:
        import tracewire_server.frontend.http_gateway  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


@dataclass
class ServerProcess:
    target: str
    process: subprocess.Popen[bytes]
    log_path: Path
    # base URL of the HTTP port: http://127.0.0.1:N (https:// with TLS); "" when served without it
    http_base: str = ""
    health_seen: list[str] = field(default_factory=list)
    # TLS servers (--tls-cert): how the health checks connect.
    credentials: grpc.ChannelCredentials | None = None
    # the Prometheus endpoint of a server started with --metrics-port; "" without one
    metrics_base: str = ""
    # the JSON access log of a server started with --access-log
    access_log: Path | None = None

    @property
    def http_url(self) -> str:
        """The HTTP port's base URL. A test that needs it fails, not skips, on a server
        started without it: the HTTP tests are part of the suite wherever it runs."""
        if not self.http_base:
            pytest.fail("this test uses the HTTP port (--http-port), which this environment cannot serve "
                        f"({http_unavailable()}); install the server's HTTP dependencies (pyproject.toml: "
                        "connectrpc, uvicorn, starlette, httptools)", pytrace=False)
        return self.http_base

    @property
    def metrics_url(self) -> str:
        """The Prometheus endpoint. The metrics port is served by the HTTP stack, so a
        server in an environment without it runs without one; a test that reads it
        fails there, as http_url's do."""
        if not self.metrics_base:
            pytest.fail("this test reads the metrics port (--metrics-port), which this environment cannot "
                        f"serve ({http_unavailable()}); install the server's HTTP dependencies", pytrace=False)
        return self.metrics_base

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def channel(self) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(self.target, self.credentials)

    def health(self, timeout: float = 2.0) -> str:
        with self.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    def wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                status = self.health()
            except grpc.RpcError:
                time.sleep(0.2)
                continue
            if not self.health_seen or self.health_seen[-1] != status:
                self.health_seen.append(status)
            if status == "SERVING":
                return
            time.sleep(0.2)
        raise TimeoutError(f"server not SERVING after {START_TIMEOUT} s:\n{self.log()}")

    def stop(self, timeout: float = 120.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def signal_group(self, sig: int) -> None:
        """Signal the server's whole process group, as Ctrl-C in a terminal or
        `kill -- -PGID` does (a server started with `own_session=True` leads its group,
        which holds neither pytest nor any other test's server)."""
        assert os.getpgid(self.process.pid) == self.process.pid, "started without own_session"
        os.killpg(self.process.pid, sig)


class PortTaken(RuntimeError):
    """A port picked as free was taken before the server bound it."""


def start_server(
    tmp_dir: Path, *extra: str, credentials: grpc.ChannelCredentials | None = None, own_session: bool = False,
    env: dict[str, str] | None = None, owner: str | None = None,
) -> ServerProcess:
    """A server on fresh ports. Ports are free when picked but can be taken before the
    server binds them (vLLM's engines pick random free ports too): then again, on others.
    `credentials`: the server serves TLS (`extra` has --tls-cert), connect with these.
    `own_session`: the server leads a session and process group of its own, for
    `ServerProcess.signal_group`. `env`: set in the server's environment (over this one's).
    `owner`: the test file the start is timed for (by default the one running now)."""
    for attempt in range(3):
        try:
            return _start_server_once(tmp_dir, *extra, credentials=credentials, own_session=own_session, env=env,
                                      owner=owner)
        except PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start_server_once(
    tmp_dir: Path, *extra: str, credentials: grpc.ChannelCredentials | None, own_session: bool,
    env: dict[str, str] | None = None, owner: str | None = None,
) -> ServerProcess:
    port, http_port = free_ports(2)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    log_path = tmp_dir / f"server-{port}.log"
    server_env = {**os.environ, **ONE_THREAD_UNPINNED,
                  "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
    http = http_unavailable() is None
    cmd = [sys.executable, "-m", "tracewire_server", "--model", str(MODEL), "--port", str(port),
           *(["--http-port", str(http_port)] if http else []), *ENGINE_ARGS, *extra]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=server_env,
                                   start_new_session=own_session)
    spawned = time.monotonic()
    scheme = "https" if credentials is not None else "http"
    server = ServerProcess(f"127.0.0.1:{port}", process, log_path,
                           f"{scheme}://127.0.0.1:{http_port}" if http else "", credentials=credentials)
    try:
        server.wait_serving()
    except RuntimeError as e:
        process.kill()
        if "tracewire: cannot listen on" in server.log():
            raise PortTaken(str(e)) from e
        raise
    except BaseException:
        process.kill()
        raise
    import suite_timing  # (the plugin pytest_plugins loaded: imported here, after it was)

    suite_timing.record_start(list(extra), time.monotonic() - spawned, owner)
    return server


# The shared server serves the dictionaries shipped with the default model, and takes
# uploads up to SHARED_MAX_DICTIONARY_BYTES (small, so a test can go over it cheaply).
DICTIONARIES = Path(os.environ.get("TRACEWIRE_TEST_DICTIONARIES", MODEL / "dictionaries"))
SHARED_MAX_DICTIONARY_BYTES = 8 << 20


# Servers told to stop whose exit status no test checks: reaped at the session's end.
_stopping: list[ServerProcess] = []


def stop_soon(server: ServerProcess) -> None:
    """SIGTERM `server` and go on: its drain and engine shutdown (4-5 s of mostly waiting)
    overlap the next tests instead of holding them up. For fixtures that do not check the
    exit status (those that do call `stop()`); the session's end waits for it."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    _stopping.append(server)


@pytest.fixture(scope="session", autouse=True)
def _reap_stopped_servers() -> Iterator[None]:
    """Set up before, so torn down after, every other session fixture: waits for the
    servers `stop_soon` left stopping; one still running after 120 s (where `stop()` times
    out) is killed and reported, as `stop()` would report it."""
    yield
    hung = []
    for server in _stopping:
        try:
            server.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
            hung.append(server.log_path)
    assert not hung, f"servers still running 120 s after SIGTERM: {hung}"


# -- servers started ahead (server_pool.py) ------------------------------------------------

# servers started and not yet taken, at most (1 measured quicker than 2 on 2 cores: the
# starts compete for them with the tests that run meanwhile)
AHEAD = int(os.environ.get("TRACEWIRE_TEST_SERVERS_AHEAD", "1"))
_pool: ServerPool | None = None


def start_spec(spec: ServerSpec, directory: Path, owner: str | None = None) -> ServerProcess:
    """start_server for a spec, in `directory` (its prepare's files and the log)."""
    directory.mkdir(parents=True, exist_ok=True)
    prepared = spec.prepare(directory) if spec.prepare is not None else Prepared()
    proc = start_server(directory, *spec.args, *prepared.args, credentials=prepared.credentials,
                        own_session=spec.own_session, env=dict(spec.env), owner=owner)
    if prepared.metrics_port is not None:
        proc.metrics_base = f"http://127.0.0.1:{prepared.metrics_port}/metrics"
    proc.access_log = prepared.access_log
    return proc


def take(spec: ServerSpec) -> ServerProcess:
    """A fresh server of `spec` for the test running now: prestarted by the pool when a
    `servers` mark (or a session fixture) planned it, started here otherwise."""
    import suite_timing

    owner = suite_timing.current_file()
    if _pool is None:  # (outside a pytest session's fixtures)
        raise RuntimeError("take() needs the session's server pool (conftest's _server_pool fixture)")
    try:
        return _pool.take(spec, owner)
    finally:  # (a start that fails, as one test expects, was waited for too)
        suite_timing.record_wait(owner, _pool.waited.get(spec.name, 0.0))


def _session_specs(item: pytest.Item) -> list[ServerSpec]:
    """The session servers an item's fixtures take (conftest's own fixtures, not a module's
    fixture of the same name, as test_connection_limits' `server`)."""
    defs = getattr(item, "_fixtureinfo", None)
    if defs is None:
        return []
    specs = []
    for name, spec in SESSION_SPECS.items():
        chain = defs.name2fixturedefs.get(name)
        if chain and getattr(chain[-1].func, "__module__", "") == __name__:
            specs.append(spec)
    return specs


@pytest.fixture(scope="session", autouse=True)
def _server_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 _reap_stopped_servers: None) -> Iterator[ServerPool]:
    """The pool, planned from every collected test (torn down before the reaper, which
    waits for the untaken servers it stops)."""
    global _pool
    plan = plan_of(request.session.items, _session_specs)
    _pool = ServerPool(plan, start_spec, tmp_path_factory.mktemp("servers"), AHEAD)
    _pool.fill()
    yield _pool
    for proc in _pool.close():
        stop_soon(proc)
    _pool = None


# For servers whose tests check what does not depend on the engine kind (TLS and tokens,
# connection limits, replicas, frontends, an engine dying): an eager engine starts without
# torch.compile, 28 s of a core instead of 40 here. (`make serve`'s compiled default is the
# session's `server`, and test_lifecycle's servers stop and clean up compiled engines.)
NO_COMPILE = ("--enforce-eager",)


def _shipped() -> tuple[str, ...]:
    return ("--dictionaries", str(DICTIONARIES)) if DICTIONARIES.is_dir() else ()  # (another model's: none)


DEFAULT = ServerSpec("default", (*_shipped(), "--max-dictionary-bytes", str(SHARED_MAX_DICTIONARY_BYTES)))


@pytest.fixture(scope="session")
def server(_server_pool: ServerPool) -> Iterator[ServerProcess]:
    proc = take(DEFAULT)
    yield proc
    stop_soon(proc)


# The eager server's flags: the union of what the files that need module hooks (module
# reads and writes, heads and neurons, attention patterns, patching, the CLI's lens, the
# README's snippets) and test_observability asked of a server each of their own: a small
# --max-num-batched-tokens sends long prompts through chunked prefill (test_hidden_states,
# test_attention_patterns); the metrics port shows the worker's patch store (test_patching)
# and the call counters, the access log the request ids, one more allowed Host the
# allow-list (test_observability). None of them changes the engine's state for the others,
# and their counter checks are deltas, so one engine start serves them all. One limit is
# small: a patch store of 768 KiB, which one long patching trace fills (test_patching: a
# second is refused, the first loses nothing); every other trace here keeps far less. It
# serves the dictionaries shipped with the default model, as `make serve` does (the README's
# snippets and the dictionary tests read them; tests that upload delete what they upload).
EAGER_ARGS = ("--enforce-eager", "--max-num-batched-tokens", "64", "--patch-store-bytes", str(768 << 10))
ALLOWED_HOST = "dash.example.test"


# The compiled server with graph hooks: steering tables and read buffers (residual streams,
# heads and neurons: both; attention queries and keys; the other modules' outputs) on layers
# 0-2 (layers.3 has none: what it refuses is tested), the
# shipped dictionaries (on layers.2), and 64-token passes, so long prompts are read through
# chunked prefill.
GRAPH_ARGS = ("--compiled-steering", "0,1,2", "--compiled-reads", "0,1,2", "--compiled-unit-reads", "0,1,2",
              "--compiled-unit-steering", "0,1,2", "--compiled-pattern-reads", "0,1,2",
              "--compiled-module-reads", "0,1,2", "--compiled-module-steering", "0,1,2", "--compiled-mean-ablation",
              "--compiled-dictionary-clamps", "0,1,2",
              "--max-num-batched-tokens", "64")


GRAPH = ServerSpec("graph", (*GRAPH_ARGS, *_shipped()))


@pytest.fixture(scope="session")
def graph(_server_pool: ServerPool) -> Iterator[ServerProcess]:
    """One compiled server with steering tables and read buffers (test_compiled_steering,
    test_compiled_reads)."""
    proc = take(GRAPH)
    yield proc
    stop_soon(proc)


def _eager_files(directory: Path) -> Prepared:
    # (the metrics port needs the HTTP stack: without it, the tests reading it fail and the rest run)
    metrics_port = None if http_unavailable() else free_port()
    metrics = () if metrics_port is None else ("--metrics-port", str(metrics_port))
    return Prepared((*metrics, "--access-log", str(directory / "access.log")), metrics_port=metrics_port,
                    access_log=directory / "access.log")


EAGER = ServerSpec("eager", (*EAGER_ARGS, "--allowed-host", ALLOWED_HOST, *_shipped()), prepare=_eager_files)


@pytest.fixture(scope="session")
def eager(_server_pool: ServerPool) -> Iterator[ServerProcess]:
    """One eager server (module hooks fire only in eager steps) for the whole session."""
    proc = take(EAGER)
    yield proc
    stop_soon(proc)


# A compiled server without graph hooks (--graph-hook-bytes 0: what a model too large for
# the default hooks gets, and `make serve` before them): what it refuses, and the ways out it
# names (test_dashboard_compiled, test_workflow, test_compiled_reads).
BARE = ServerSpec("bare", ("--graph-hook-bytes", "0", *_shipped()))


@pytest.fixture(scope="session")
def bare(_server_pool: ServerPool) -> Iterator[ServerProcess]:
    proc = take(BARE)
    yield proc
    stop_soon(proc)


# fixture name -> the session server it takes (planned from the tests using the fixture)
SESSION_SPECS = {"server": DEFAULT, "graph": GRAPH, "eager": EAGER, "bare": BARE}


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> Iterator[object]:
    import tracewire

    with tracewire.Client(server.target, timeout=300) as c:
        yield c


@pytest.fixture(scope="session")
def stub(server: ServerProcess) -> Iterator[object]:
    """The generated gRPC stub, as any gRPC client would use it."""
    from tracewire.v1 import service_pb2_grpc

    with grpc.insecure_channel(server.target) as channel:
        yield service_pb2_grpc.TraceServiceStub(channel)


@pytest.fixture(scope="session")
def hf() -> object:
    """The independent reference: transformers on the same weights, float32."""
    from reference import HFReference

    return HFReference(MODEL)


def engine_stats(target: str) -> object:
    """The server's GetEngineStats, through a bare generated stub."""
    from tracewire.v1 import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        return service_pb2_grpc.TraceServiceStub(channel).GetEngineStats(
            service_pb2.GetEngineStatsRequest(), timeout=10
        )


def eventually(check, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Whether `check()` comes true within `timeout` seconds (asked every `interval`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return bool(check())


def wait_for_unfinished(target: str, predicate, timeout: float = 30.0) -> bool:
    """Poll until predicate(num_unfinished_requests) holds; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate(engine_stats(target).num_unfinished_requests):
            return True
        time.sleep(0.05)
    return False
