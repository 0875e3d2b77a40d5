"""The engine's processes in a process group of their own, tied to the server's life.

Ctrl-C in a terminal, or `kill -- -PGID` from a supervisor, signals every process in
the server's process group. vLLM's engine core and its workers answer SIGINT/SIGTERM
by stopping at once (a worker leaves mid-step, the engine core dies with it), so a
group signal used to kill the engine under the calls the server was draining. The
engine core therefore starts a process group of its own, which its workers inherit:
only the server stops it, once it has drained, exactly as after a SIGTERM to the
server's PID alone.

A group, not a session (setsid): where the kernel's autogroup is on, each session is
a CPU scheduling group of its own, and an engine in a session of its own would get
its own share of a busy machine's CPU instead of competing with the server's threads
as before. In the server's terminal session the engine's group is a background one:
SIGTTOU is ignored so that it still writes its log there under `stty tostop`.

Outside the server's group, nothing would stop the engine when the server dies
without stopping it (SIGKILL, a crash): a watchdog thread in the engine core stops it
when its parent goes, and removes the side-channel socket files the server can no longer
remove itself.

`leave_server_group` runs first thing in the engine core process (vllm_compat wraps
vLLM's entry point with it), before vLLM installs its signal handlers.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time

from ..shared import sidechannel

log = logging.getLogger(__name__)

# How often the engine core checks that the server is still its parent.
PARENT_POLL_S = 1.0
# What an orphaned engine core gets to stop cleanly (its workers too) before its
# whole group is killed.
ORPHAN_GRACE_S = 10.0


def leave_server_group() -> None:
    """Leave the server's process group (this process and every process it starts from
    now on), and stop when the server goes."""
    parent = _parent_pid()
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # inherited by the workers
    try:
        os.setpgid(0, 0)
    except OSError as e:  # signals to the server's group still reach the engine
        log.warning("tracewire: the engine core stays in the server's process group: %s", e)
    threading.Thread(
        target=_stop_when_orphaned, args=(parent,), name="tracewire-orphan-watch", daemon=True
    ).start()


def _parent_pid() -> int:
    """The process that started this one: multiprocessing records it at start, so a
    parent that died before this line is still noticed (getppid would already name
    the reaper that adopted this process)."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getppid()


def _stop_when_orphaned(parent: int) -> None:
    """Once `parent` is gone (this process was adopted by another), stop through vLLM's
    own SIGTERM handling, which stops the workers too; kill the whole group if that
    has not ended it in ORPHAN_GRACE_S."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    log.warning("tracewire: the server (pid %d) is gone; stopping the engine", parent)
    for path in sidechannel.socket_paths(parent):
        with contextlib.suppress(OSError):
            os.unlink(path)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    os.killpg(0, signal.SIGKILL)
