"""Starting the server: one process with its engine, or (`--frontends N`) one engine
core shared by N frontend processes, and when such a group is ready.

One Python process can only send so many gRPC messages a second: a trace streams
a message per step per sequence, and at a few hundred concurrent traces the
frontend, not the engine, sets the pace. As vLLM's `--api-server-count` does,
with `--frontends N` this process starts the engine core and N frontend
processes; each runs the whole gRPC (and HTTP) server of server.py on the same
port (SO_REUSEPORT: the kernel spreads connections over them) with its own vLLM
client of the shared engine core. The worker hooks send each frontend the records
of its own requests (SequencePlan.route).

A frontend reports SERVING only once every frontend has its engine client up and
the worker hooks installed (GroupReadiness, owned here and handed to each
frontend's server): the kernel may hand any new connection to any of them, so one
SERVING answer must mean that every connection will be served.

This process supervises: it forwards SIGTERM/SIGINT to the frontends (which
drain), stops everything when a frontend or the engine core dies, and stops
the engine core last. A signal to the whole process group (Ctrl-C) reaches the
frontends directly too, but not the engine core, which runs in a process group
of its own (engine_group.py).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import sys
from dataclasses import dataclass
from typing import Any

from . import listen_errors, vllm_compat
from .engine import use_worker_hooks
from .server import ServerConfig, serve

log = logging.getLogger(__name__)


def run(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; the process's exit status."""
    if config.frontends == 1:
        return asyncio.run(serve(config))  # the engine core starts under this process's AsyncLLM
    return _run_group(config)


def _run_group(config: ServerConfig) -> int:
    if config.port == 0:
        raise SystemExit("tracewire: --frontends > 1 needs a fixed --port (every frontend binds it)")
    _check_ports(config)
    use_worker_hooks(config.engine_args)
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("tracewire: starting the engine core and %d frontends on port %d", config.frontends, config.port)
    readiness = GroupReadiness(config.frontends)
    group = vllm_compat.launch_frontends(
        config.engine_args, config.frontends, _frontend, _FrontendArgs(config, readiness)
    )
    try:
        group.wait()
    except SystemExit:
        pass  # a signal: drain below
    except RuntimeError as e:  # a frontend or the engine core died
        log.error("tracewire: %s; stopping", e)
        return 1
    finally:
        # The frontends get the grace period to drain, then are killed.
        group.shutdown(timeout=config.grace_seconds + 5)
    return 0


def _check_ports(config: ServerConfig) -> None:
    """Every port the group will listen on, before the engine core starts: a port in use
    is one line now, not a frontend dying a minute later. (The frontends share the gRPC
    and HTTP ports through SO_REUSEPORT; each has a metrics port of its own.)"""
    listen_errors.check_free("gRPC", config.host, config.port, "--port")
    listen_errors.check_free("HTTP", config.host, config.http_port, "--http-port")
    if config.metrics_port:
        for i in range(config.frontends):
            listen_errors.check_free("metrics", config.host, config.metrics_port + i, "--metrics-port")


class GroupReadiness:
    """How many of the frontends have their engine client up and the worker hooks
    installed, shared between the processes (a counter in shared memory, handed over
    at spawn). Each frontend's server sees it as a server.Readiness."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._ready = multiprocessing.get_context("spawn").Value("i", 0)

    def arrive(self) -> None:
        with self._ready.get_lock():
            self._ready.value += 1

    async def all_ready(self, stop: asyncio.Event) -> bool:
        """Wait until every frontend has arrived (True) or `stop` is set (False). A
        frontend that dies on the way stops the whole group (_run_group), so this ends."""
        while self._ready.value < self.count:
            if stop.is_set():
                return False
            await asyncio.sleep(0.05)
        return True


@dataclass(frozen=True)
class _FrontendArgs:
    config: ServerConfig
    readiness: GroupReadiness


def _frontend(args: _FrontendArgs, client: vllm_compat.SharedEngineClient) -> None:
    """A frontend process (spawned): the whole server, on the shared engine core."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s %(name)s[{client.index}]: %(message)s",
    )
    sys.exit(asyncio.run(serve(args.config, client=client, readiness=args.readiness)))
