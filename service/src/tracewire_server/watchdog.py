"""The engine dies with the server that owns it (worker side).

vLLM's engine core runs in a child process of the server (of the launcher with
`--frontends N`), and its workers die with it, but nothing ends the engine core when the
server itself is killed outright (SIGKILL, the OOM killer): it went on holding its memory
(~3 GB here, a GPU's worth on a GPU) and the server's socket file stayed behind.

So each worker's rank 0 watches the owner: a thread blocks on a pidfd of the owner's
process (readable when it exits: no polling, no pid reuse), then removes the owner's
side-channel socket files, which the owner can no longer remove itself, and kills the
engine core process. The workers in other processes follow it through vLLM's own death
pipe.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Collection

log = logging.getLogger(__name__)

# owner pid -> the socket files to remove once it is gone (every frontend adds its own)
_watched: dict[int, list[str]] = {}
_lock = threading.Lock()


def watch_owner(owner_pid: int, socket_paths: Collection[str]) -> None:
    """When `owner_pid` exits, unlink `socket_paths` and kill the engine core (this
    process, or its parent when this is a worker process of its own). One thread per
    owner; later calls for it only add their socket files."""
    if owner_pid <= 1:
        return
    with _lock:
        paths = _watched.get(owner_pid)
        if paths is not None:
            paths.extend(socket_paths)
            return
        paths = _watched[owner_pid] = list(socket_paths)
    engine_core = os.getpid() if os.getppid() == owner_pid else os.getppid()
    thread = threading.Thread(target=_watch, args=(owner_pid, paths, engine_core),
                              name="tracewire-owner-watchdog", daemon=True)
    thread.start()


def _watch(owner_pid: int, socket_paths: list[str], engine_core: int) -> None:
    _wait_for_exit(owner_pid)
    log.error("tracewire: the server process %d is gone; stopping the engine core %d", owner_pid, engine_core)
    with _lock:
        paths = list(socket_paths)
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
    os.kill(engine_core, signal.SIGKILL)


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds (Linux < 5.3): look once a second
        while _alive(pid):
            time.sleep(1.0)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
