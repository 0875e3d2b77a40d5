"""Starting the server as a user does (`python -m tracewire_server`, as `make serve` runs it):
a start-up mistake ends in one line that names it and a non-zero exit, never a traceback or
pages of usage; a good start says what is served where."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, ServerProcess
from tracewire_server.frontend import server as server_module
from tracewire_server.frontend.model_path import looks_like_path


def _env() -> dict[str, str]:
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))


def start(*args: str) -> subprocess.CompletedProcess[str]:
    """The server with `args`, from the checkout's root as `make serve` runs it; it is
    expected to exit on its own."""
    return subprocess.run([sys.executable, "-m", "tracewire_server", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=_env())


def start_forked(starts: dict[str, tuple[str, ...]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """The same starts, each in a fork of one process that imported vLLM once
    (tests/start_forks.py): what each printed and its exit status."""
    runner = subprocess.run([sys.executable, str(Path(__file__).with_name("start_forks.py"))],
                            input=json.dumps({name: list(args) for name, args in starts.items()}),
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())
    assert runner.returncode == 0, runner.stderr[-3000:]
    return {name: subprocess.CompletedProcess(["python", "-m", "tracewire_server", *starts[name]],
                                              r["returncode"], r["stdout"], r["stderr"])
            for name, r in json.loads(runner.stdout).items()}


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    assert "usage:" not in result.stderr, result.stderr[:2000]
    lines = result.stderr.strip().splitlines()
    # Besides the one line: at most the noise of the libraries below (Triton's notice,
    # grpc's or uvicorn's own bind error), never pages.
    assert 1 <= len(lines) <= 4, result.stderr
    return lines[-1]


FLAGS = [("--port", "gRPC"), ("--http-port", "HTTP"), ("--metrics-port", "metrics")]
MISSING_MODELS = ["/no/such/model", "models/no-such-model", "./no-such-model"]
GRAPH_FLAGS = ["--compiled-steering", "--compiled-reads"]


class Starts:
    """Every start this file's tests make. Each would be a process of its own that spends
    ~7 s of a core importing vLLM (its argument parser is vLLM's) and exits: one, the
    unknown flag, is; the others run in forks of one process that imported it once
    (start_forks.py), beside it. A test takes its own start's result by name; none depends
    on another's. `taken`: a port another socket listens on for as long as the starts run."""

    REAL = "unknown flag"  # the start made as a user makes it, `python -m tracewire_server`

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor, taken: int, not_a_model: Path) -> None:
        self.taken = taken
        self.not_a_model = not_a_model
        self._args: dict[str, tuple[str, ...]] = {}
        for flag, _ in FLAGS:
            ports = {"--port": "0", "--http-port": "0", "--metrics-port": "0", flag: str(taken)}
            self._add(f"port {flag}", *[word for item in ports.items() for word in item])
            # --frontends N: the second frontend's metrics port is the flag's + 1.
            free = {f: _free_port() for f, _ in FLAGS}
            free[flag] = taken - 1 if flag == "--metrics-port" else taken
            self._add(f"frontends {flag}", "--frontends", "2",
                         *[word for f, port in free.items() for word in (f, str(port))])
        for model in MISSING_MODELS:
            self._add(f"model {model}", "--port", "0", "--model", model)
        self._add("not a model", "--port", "0", "--model", str(not_a_model))
        self._add("unknown flag", "--port", "0", "--max-num-seqz", "3")
        self._add("frontends 0", "--frontends", "0")
        for flag in GRAPH_FLAGS:
            self._add(f"pp {flag}", "--pipeline-parallel-size", "2", flag)
        self._real = pool.submit(start, *self._args.pop(self.REAL))
        self._forked = pool.submit(start_forked, self._args)

    def _add(self, name: str, *args: str) -> None:
        self._args[name] = args

    def __getitem__(self, name: str) -> subprocess.CompletedProcess[str]:
        return self._real.result() if name == self.REAL else self._forked.result()[name]


@pytest.fixture(scope="module")
def starts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Starts]:
    with socket.socket() as other, concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        other.bind(("127.0.0.1", 0))
        other.listen()
        runs = Starts(pool, int(other.getsockname()[1]), tmp_path_factory.mktemp("not-a-model"))
        yield runs
        runs[Starts.REAL], runs[next(iter(runs._args))]  # every start has ended before the socket closes


@pytest.mark.parametrize(("flag", "what"), FLAGS)
def test_port_in_use_is_one_line(starts: Starts, flag: str, what: str) -> None:
    result = starts[f"port {flag}"]
    assert result.returncode == 1
    assert last_line(result) == (
        f"tracewire: cannot listen on 127.0.0.1:{starts.taken} for {what}: address already in use "
        f"(another server is listening there); stop what uses it or choose another {flag}"
    )
    assert "Event loop is closed" not in result.stderr


@pytest.mark.parametrize(("flag", "what"), FLAGS)
def test_port_in_use_is_one_line_with_several_frontends(starts: Starts, flag: str, what: str) -> None:
    """With --frontends N each frontend binds in a process of its own, once the engine core
    is up: the ports are checked first, so a taken one is the same line, at once. The second
    frontend's metrics port is the flag's + 1."""
    result = starts[f"frontends {flag}"]
    assert result.returncode == 1
    assert last_line(result) == (
        f"tracewire: cannot listen on 127.0.0.1:{starts.taken} for {what}: address already in use "
        f"(another server is listening there); stop what uses it or choose another {flag}"
    )
    assert "died" not in result.stderr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("model", MISSING_MODELS)
def test_missing_model_path_is_named(starts: Starts, model: str) -> None:
    result = starts[f"model {model}"]
    assert result.returncode == 1
    line = last_line(result)
    assert line.startswith(f"tracewire: --model {model}: no such directory ("), line
    assert str((ROOT / model).resolve()) in line, line  # where it looked


def test_directory_without_config_is_not_a_model(starts: Starts) -> None:
    result, path = starts["not a model"], starts.not_a_model
    assert result.returncode == 1
    assert last_line(result) == f"tracewire: --model {path}: {path} holds no config.json: not a model directory"


def test_paths_and_hub_ids_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # where models/ is a directory
    for path in ["/abs/model", "./model", "../model", "~/model", "model/", "a/b/c", "models/tracewire-tiny"]:
        assert looks_like_path(path), path
    # Hub ids go on to vLLM untouched.
    for hub_id in ["gpt2", "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B"]:
        assert not looks_like_path(hub_id), hub_id


def test_unknown_engine_flag_is_one_line(starts: Starts) -> None:
    result = starts["unknown flag"]
    assert result.returncode == 2
    assert last_line(result) == ("tracewire: unknown option --max-num-seqz (did you mean --max-num-seqs?); "
                                 "run 'python -m tracewire_server --help' for every option")
    assert result.stdout == ""


def test_other_argument_errors_are_one_line(starts: Starts) -> None:
    result = starts["frontends 0"]
    assert result.returncode == 2
    assert last_line(result) == ("tracewire: --frontends must be >= 1 "
                                 "(run 'python -m tracewire_server --help' for every option)")


@pytest.mark.parametrize("flag", GRAPH_FLAGS)
def test_graph_hooks_under_pipeline_parallel_are_refused_in_one_line(starts: Starts, flag: str) -> None:
    """Earlier stages' steering tables would stay empty and their read buffers unread:
    the hooks of a compiled engine run on the last stage."""
    result = starts[f"pp {flag}"]
    assert result.returncode == 2
    assert last_line(result).startswith(f"tracewire: {flag} needs --pipeline-parallel-size 1: ")


def test_start_says_what_is_served_where(server: ServerProcess) -> None:
    log = server.log()
    port = server.target.rsplit(":", 1)[1]
    assert re.search(r"starting the vLLM engine for \S+tracewire-tiny", log), log
    assert re.search(r"engine ready in \d+\.\d s", log), log
    # no --compiled-* flag: the default graph hooks, what they reserve
    assert re.search(r"compiled graph hooks on every layer: layer writes, layer reads, head and neuron writes, "
                     r"head and neuron reads, attention-pattern reads, module writes, module reads, dictionary clamps "
                     r"\(with mean ablation\) \(\d+ MiB of --graph-hook-bytes 2048 MiB\)$",
                     log, re.M), log
    served = [line for line in log.splitlines() if "tracewire SERVING" in line]
    assert len(served) == 1, log
    assert served[0].endswith(
        f"tracewire SERVING {ROOT / 'models' / 'tracewire-tiny'}: gRPC 127.0.0.1:{port}, "
        f"HTTP (Connect, gRPC-Web) {server.http_url}"
    ), served[0]


def test_engine_start_is_heard_from(caplog: pytest.LogCaptureFixture) -> None:
    """While the engine starts (a minute or more), a line every interval says it still is."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(server_module._still_starting(loop.time(), every_s=0.05))
        await asyncio.sleep(0.18)
        task.cancel()

    with caplog.at_level(logging.INFO, logger=server_module.__name__):
        asyncio.run(run())
    assert [r.getMessage().startswith("engine still starting (") for r in caplog.records] == [True] * 3
