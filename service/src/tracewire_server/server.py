"""Process lifecycle: the grpc.aio server, health, reflection, engine start and drain.

Order of events: listen at once (gRPC, and HTTP with --http-port) with health
NOT_SERVING (RPCs answer UNAVAILABLE) -> start the engine -> SERVING -> on
SIGTERM/SIGINT: NOT_SERVING, refuse new calls on both ports, give in-flight calls
a grace period, cancel the rest (which aborts their engine requests), stop the
engine, exit 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tracewire.v1 import service_pb2, service_pb2_grpc

from .engine import Engine
from .servicer import TraceOptions, TraceServicer

if TYPE_CHECKING:
    from .frontends import GroupReadiness
    from .http_gateway import HttpGateway

log = logging.getLogger(__name__)

SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int
    grace_seconds: float
    max_message_bytes: int
    engine_args: Any  # vllm AsyncEngineArgs
    trace: TraceOptions
    # Connect / gRPC-Web for browsers on this port; 0: off.
    http_port: int = 0
    # Browser origins allowed on the HTTP port ("*": any); empty: localhost pages only.
    cors_origins: tuple[str, ...] = ()
    # Frontend processes sharing one engine core (frontends.py); 1: this process only.
    frontends: int = 1


async def serve(
    config: ServerConfig,
    client: dict[str, Any] | None = None,
    readiness: GroupReadiness | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT. `client`: this process is one of `config.frontends`
    frontends, connecting to an engine core started by frontends.py; it reports
    SERVING only once `readiness` says that every frontend is up."""
    servicer = TraceServicer(config.trace)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # Only the frontends of one engine share a port (the kernel spreads the
            # connections over them); grpc's Linux default would let any second server
            # bind a port already in use without a word.
            ("grpc.so_reuseport", 1 if client else 0),
        ]
    )
    service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    address = f"{config.host}:{config.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"tracewire: cannot listen on {address}")

    async def set_health(status: int) -> None:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    gateway = await _start_http(config, servicer, health_servicer)
    log.info("tracewire listening on %s; starting the engine", address)

    started = time.monotonic()
    engine_task = asyncio.create_task(
        Engine.start(
            config.engine_args, fault_injection=config.trace.fault_injection, client=client, readiness=readiness
        )
    )
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait({engine_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    engine: Engine | None = None
    try:
        engine = await engine_task  # a stop during start still waits for the engine to exist
    except BaseException:
        if gateway is not None:
            await gateway.stop()
        await server.stop(0)
        raise
    engine_died = False
    if readiness is not None:
        log.info("engine client up; waiting for the other frontends")
        await readiness.all_ready(stop)
    if not stop.is_set():
        servicer.engine = engine
        frozen = _freeze_startup_heap()
        await set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "tracewire SERVING %s on %s (engine up in %.1f s; %d startup objects frozen out of the GC)",
            engine.description.model,
            address,
            time.monotonic() - started,
            frozen,
        )
        watcher = asyncio.create_task(_watch_engine(engine, stop))
        await stop_task
        engine_died = watcher.done() and watcher.result()
        watcher.cancel()

    log.info("draining: refusing new calls, %.0f s grace for in-flight ones", config.grace_seconds)
    # Keep the server up while in-flight calls finish, so that health checks on open
    # connections read NOT_SERVING and new calls get UNAVAILABLE saying why; then stop,
    # cancelling what is left (which aborts its engine requests).
    servicer.draining = True
    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = time.monotonic() + config.grace_seconds
    while servicer.in_flight and time.monotonic() < deadline:  # counts HTTP calls too
        await asyncio.sleep(0.05)
    if gateway is not None:
        await gateway.stop()
    await server.stop(0)
    engine.shutdown()
    # The interpreter never collects what _freeze_startup_heap froze, not even at exit,
    # and triton's bindings (nanobind) then report each of their objects still alive
    # as a leak, screens of them.
    gc.unfreeze()
    log.info("tracewire stopped")
    return 1 if engine_died else 0


def _freeze_startup_heap() -> int:
    """Take everything alive once the engine is up (vLLM, torch, the tokenizer: ~630k
    objects) out of the garbage collector's reach, as vLLM's own API server does. A full
    collection walks them all: ~310 ms on a 2-core VM, during which the event loop, and so
    every stream of every trace, stands still. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _start_http(
    config: ServerConfig, servicer: TraceServicer, health_servicer: health.aio.HealthServicer
) -> HttpGateway | None:
    """Serve the same servicer instances over Connect / gRPC-Web, or nothing without a port.

    Health's Check is served too, so a browser can read readiness; Watch (a stream that
    never ends) and reflection stay on the gRPC port.
    """
    if not config.http_port:
        return None
    # Imported only when serving HTTP: a gRPC-only server loads none of the HTTP stack.
    from .http_gateway import HttpGateway, build_app, service_endpoints

    endpoints = service_endpoints(service_pb2.DESCRIPTOR.services_by_name["TraceService"], servicer)
    endpoints |= service_endpoints(
        health_pb2.DESCRIPTOR.services_by_name["Health"], health_servicer, methods={"Check"}
    )
    app = build_app(endpoints, config.cors_origins, read_max_bytes=config.max_message_bytes)
    gateway = await HttpGateway.start(app, config.host, config.http_port, shared=config.frontends > 1)
    log.info(
        "tracewire HTTP (Connect, gRPC-Web) on http://%s; CORS origins: %s",
        gateway.address,
        ", ".join(config.cors_origins) or "localhost pages only",
    )
    return gateway


async def _watch_engine(engine: Engine, stop: asyncio.Event) -> bool:
    """A dead engine cannot come back: report it and stop the server (exit 1), so that
    health checks and orchestrators see it instead of a SERVING shell."""
    while not stop.is_set():
        if engine.errored:
            log.error("the vLLM engine has died; stopping the server")
            stop.set()
            return True
        await asyncio.sleep(1.0)
    return False
