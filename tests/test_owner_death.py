"""A server killed outright (SIGKILL, the OOM killer) takes its engine with it (watchdog.py)."""

from __future__ import annotations

import glob
import os
import tempfile

import psutil
from conftest import start_server


def test_sigkill_of_the_server_ends_its_engine_and_removes_its_socket(tmp_path):
    server = start_server(tmp_path)
    children = psutil.Process(server.process.pid).children(recursive=True)
    assert any("EngineCore" in " ".join(_name(p)) for p in children), [_name(p) for p in children]
    sockets = glob.glob(os.path.join(tempfile.gettempdir(), f"tracewire-{server.process.pid}-*"))
    assert sockets  # the side channel's ipc socket

    server.process.kill()
    server.process.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [_name(p) for p in alive]  # no engine left holding its memory
    assert not [path for path in sockets if os.path.exists(path)]


def _name(process: psutil.Process) -> list[str]:
    try:
        return [process.name(), *process.cmdline()[:3]]
    except psutil.Error:
        return ["<gone>"]
