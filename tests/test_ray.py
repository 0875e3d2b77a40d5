"""vLLM's Ray executor (`--distributed-executor-backend ray`), what multi-node runs on.

Not run here: vLLM's CPU build has no Ray support (deploy/README.md: Multi-node with Ray
says what was tried and what stopped it). What is checked: that this start is refused in
one line naming the flag, before the engine's ~20 s start and ~50 lines of traceback; and
that a worker of rank 0 which cannot reach the server's side channel socket (a Ray worker
on another machine) fails the start with a message naming it, instead of every trace
waiting forever for records that ZMQ queues to a socket that is not there.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import zmq
from test_startup import last_line, start
from tracewire_server.frontend.ray_backend import ray_problem
from tracewire_server.worker.sender import unreachable


def test_ray_backend_on_the_cpu_build_is_refused_in_one_line() -> None:
    result = start("--port", "0", "--tensor-parallel-size", "2", "--enforce-eager",
                   "--distributed-executor-backend", "ray")
    assert result.returncode == 2
    assert last_line(result) == (
        "tracewire: --distributed-executor-backend ray: vLLM's cpu build has no Ray support (its "
        "platform names no Ray device, and vLLM refuses to start: 'current platform cpu does not "
        "support ray'); use --distributed-executor-backend mp on one machine, or vLLM's CUDA or "
        "ROCm build for a Ray cluster (deploy/README.md: Multi-node with Ray) "
        "(run 'python -m tracewire_server --help' for every option)"
    )


def test_ray_without_the_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # Python's own "cannot be imported"
    problem = ray_problem("ray", "cuda", "GPU")
    assert problem is not None
    assert problem.startswith("--distributed-executor-backend ray: the ray package is not installed here")
    assert ray_problem("mp", "cpu", "") is None
    assert ray_problem(None, "cpu", "") is None


def test_rank_zero_finds_the_side_channel_socket_it_is_given(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path / 'sidechannel'}"
    context = zmq.Context()
    receiver = context.socket(zmq.PULL)
    receiver.bind(address)  # as the frontend's Receiver binds it
    try:
        assert unreachable(address) is None
    finally:
        receiver.close(linger=0)
        context.term()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_rank_zero_on_another_machine_is_told_why(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "sidechannel"
    if kind == "file":
        path.write_bytes(b"")  # something else at that path: not the server's socket
    problem = unreachable(f"ipc://{path}")
    assert problem is not None
    assert problem.startswith(f"tracewire: the worker of rank 0 runs on {socket.gethostname()}, "
                              f"which has no side channel socket {path}")
    assert "--distributed-executor-backend ray" in problem
