"""Several frontend processes sharing one engine core (`--frontends N`).

One Python process can only send so many gRPC messages a second: a trace streams
a message per step per sequence, and at a few hundred concurrent traces the
frontend, not the engine, sets the pace. As vLLM's `--api-server-count` does,
this process starts the engine core and N frontend processes; each runs the
whole gRPC (and HTTP) server of server.py on the same port (SO_REUSEPORT: the
kernel spreads connections over them) with its own vLLM client of the shared
engine core. The worker hooks send each frontend the records of its own
requests (SequencePlan.route).

This process supervises: it forwards SIGTERM/SIGINT to the frontends (which
drain), stops everything when a frontend or the engine core dies, and stops
the engine core last.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

from . import vllm_compat
from .engine import use_worker_hooks
from .server import ServerConfig, serve

log = logging.getLogger(__name__)


def run(config: ServerConfig) -> int:
    if config.port == 0:
        raise SystemExit("tracewire: --frontends > 1 needs a fixed --port (every frontend binds it)")
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
    group = vllm_compat.launch_frontends(config.engine_args, config.frontends, _frontend, config)
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


def _frontend(listen_address: Any, sock: Any, config: ServerConfig, client: dict[str, Any]) -> None:
    """A frontend process (spawned): the whole server, on the shared engine core."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s %(name)s[{client['client_index']}]: %(message)s",
    )
    sys.exit(asyncio.run(serve(config, client=client)))
