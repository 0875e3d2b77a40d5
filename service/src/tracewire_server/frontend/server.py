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
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tracewire.v1 import service_pb2

from . import access_log, listen_errors, vllm_compat
from .auth import ReflectionAuth, TokenTable
from .connection_limits import ConnectionLimits
from .dictionaries import DEFAULT_MAX_BYTES, DictionaryRegistry, EngineDictionaries
from .dictionary_directory import DirectoryError, OperatorDictionary, check_against_model
from .engine import Engine
from .errors import InvalidArgument
from .grpc_calls import CallObserver
from .servicer import SERVICE_NAME, TraceOptions, TraceServicer, add_to_server
from .tenants import TenantQuotas
from .tls import ServerTls

if TYPE_CHECKING:
    from .http_gateway import HttpGateway

log = logging.getLogger(__name__)



class Readiness(Protocol):
    """Whether every frontend sharing the engine core is up (launcher.GroupReadiness):
    one frontend's SERVING must mean that every connection the kernel hands any of
    them will be served."""

    def arrive(self) -> None:
        """This frontend is up: its engine client connected, the worker hooks installed."""

    async def all_ready(self, stop: asyncio.Event) -> bool:
        """Until every frontend has arrived (True) or `stop` is set (False)."""


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int
    grace_seconds: float
    max_message_bytes: int  # largest message sent (a step of full-row reads can be large)
    engine_args: Any  # vllm AsyncEngineArgs
    trace: TraceOptions
    # Connect / gRPC-Web for browsers on this port; 0: off.
    http_port: int = 0
    # Browser origins allowed on the HTTP port ("*": any); empty: localhost pages only.
    cors_origins: tuple[str, ...] = ()
    # Frontend processes sharing one engine core (launcher.py); 1: this process only.
    frontends: int = 1
    # Largest request received on either port, after decompression: requests are small
    # (prompts, plans); a larger one is refused before it is decoded.
    max_request_bytes: int = 8 << 20
    # The boundary (README "Security"): TLS / mutual TLS on both ports; bearer tokens for
    # every call but health's, each tenant's calls held to `tenant_quotas`; reflection.
    tls: ServerTls | None = None
    tokens: TokenTable | None = None
    tenant_quotas: TenantQuotas = TenantQuotas()
    reflection: bool = True
    # Timeouts and limits of both ports' connections.
    connections: ConnectionLimits = ConnectionLimits()
    # Prometheus metrics on this port (frontend i of --frontends N: this port + i); 0: off.
    metrics_port: int = 0
    # Access log: "" the normal log, a file path, or "off" (access_log.py).
    access_log: str = ""
    # Names the HTTP ports answer for besides the listening address (host_check.py).
    allowed_hosts: tuple[str, ...] = ()
    # The operator's dictionaries (--dictionaries DIR, read when the flags were parsed),
    # loaded once the engine is up; and the device bytes uploads may take in all.
    dictionaries: tuple[OperatorDictionary, ...] = ()
    max_dictionary_bytes: int = DEFAULT_MAX_BYTES


async def serve(
    config: ServerConfig,
    client: vllm_compat.SharedEngineClient | None = None,
    readiness: Readiness | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT. `client`: this process is one of `config.frontends`
    frontends, connecting to an engine core started by launcher.py; it arrives in
    `readiness` once its engine is up, and reports SERVING only once `readiness` says
    that every frontend is."""
    servicer = TraceServicer(config.trace, config.tokens, config.tenant_quotas)
    access_log.configure(config.access_log)
    # request ids, metrics, the access log; calls refused while not serving
    interceptors: list[grpc.aio.ServerInterceptor] = [CallObserver(servicer.unavailable)]
    if config.tokens is not None and config.reflection:
        interceptors.append(ReflectionAuth(config.tokens, (reflection.SERVICE_NAME,)))
    server = grpc.aio.server(
        interceptors=interceptors,
        maximum_concurrent_rpcs=config.connections.max_concurrent_calls,
        options=[
            *config.connections.grpc_options(),
            ("grpc.max_receive_message_length", config.max_request_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # Only the frontends of one engine share a port (the kernel spreads the
            # connections over them); grpc's Linux default would let any second server
            # bind a port already in use without a word.
            ("grpc.so_reuseport", 1 if client is not None else 0),
        ]
    )
    add_to_server(servicer, server)  # (request bodies that do not parse: INVALID_ARGUMENT)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
    address = f"{config.host}:{_bind_grpc(server, config)}"

    async def set_health(status: int) -> None:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    gateway: HttpGateway | None = None
    metrics_gateway: HttpGateway | None = None
    try:
        gateway = await _start_http(config, servicer, health_servicer)
        metrics_gateway = await _start_metrics(config, client.index if client is not None else 0)
    except BaseException:
        # Stopped here, on the running loop: left to the garbage collector, grpc's server
        # would try to stop itself on a closed loop ("Event loop is closed" traceback).
        if gateway is not None:
            await gateway.stop()
        await server.stop(0)
        raise
    model = config.engine_args.model
    log.info("tracewire listening on %s; starting the vLLM engine for %s (loads the model, sizes the KV "
             "cache, warms up: about a minute on 2 CPU cores)", address, model)

    started = time.monotonic()
    engine_task = asyncio.create_task(
        Engine.start(
            config.engine_args,
            fault_injection=config.trace.fault_injection,
            client=client,
        )
    )
    stop_task = asyncio.create_task(stop.wait())
    heartbeat = asyncio.create_task(_still_starting(started))
    await asyncio.wait({engine_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    engine: Engine | None = None
    try:
        engine = await engine_task  # a stop during start still waits for the engine to exist
    except BaseException:
        heartbeat.cancel()
        for http in (gateway, metrics_gateway):
            if http is not None:
                await http.stop()
        await server.stop(0)
        raise
    heartbeat.cancel()
    first = client is None or client.index == 0
    try:
        servicer.dictionaries = await _load_dictionaries(config, engine, first)
    except BaseException:
        for http in (gateway, metrics_gateway):
            if http is not None:
                await http.stop()
        await server.stop(0)
        engine.shutdown()
        raise
    engine_died = False
    if readiness is not None:
        # Only now: the first frontend has loaded the operator's dictionaries, so the
        # others, once every frontend has arrived, find them on the worker.
        readiness.arrive()
        log.info("engine client up; waiting for the other frontends")
        await readiness.all_ready(stop)
        if not first:
            await servicer.dictionaries.refresh()
    if not stop.is_set():
        servicer.engine = engine
        frozen = _freeze_startup_heap()
        await set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("engine ready in %.1f s (%d startup objects frozen out of the GC)",
                 time.monotonic() - started, frozen)
        scheme = "https" if config.tls else "http"
        log.info("tracewire SERVING %s",
                 _served_where(engine.description.model, address, scheme, gateway, metrics_gateway))
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
    for http in (gateway, metrics_gateway):
        if http is not None:
            await http.stop()
    await server.stop(0)
    engine.shutdown()
    # The interpreter never collects what _freeze_startup_heap froze, not even at exit,
    # and triton's bindings (nanobind) then report each of their objects still alive
    # as a leak, screens of them.
    gc.unfreeze()
    log.info("tracewire stopped")
    return 1 if engine_died else 0


async def _load_dictionaries(config: ServerConfig, engine: Engine, first: bool) -> DictionaryRegistry:
    """The registry of this frontend; the first (or only) frontend loads the operator's
    dictionaries onto the worker, checked against the model (a bad one: DirectoryError,
    one line, and the server does not start)."""
    registry = DictionaryRegistry(EngineDictionaries(engine.llm), max_upload_bytes=config.max_dictionary_bytes,
                                  shared=config.frontends > 1)
    if not first:
        return registry
    d = engine.description
    modules = {m.path: m.output_size for m in d.modules}
    for operator in config.dictionaries:
        info = check_against_model(operator, modules, d.hidden_size)
        try:
            loaded = await registry.load_operator(info, operator.weights)
        except InvalidArgument as e:  # the worker's refusal of the file
            raise DirectoryError(operator.weights, e.field, e.description) from None
        log.info("dictionary %s (%s, %d x %d, %s, %d bytes on the device) from %s", loaded.name, loaded.kind,
                 loaded.size, loaded.input_size, loaded.dtype, loaded.device_bytes, operator.weights)
    return registry


def _bind_grpc(server: grpc.aio.Server, config: ServerConfig) -> int:
    """Add the gRPC port; the port bound (--port 0: the one the kernel chose)."""
    address = f"{config.host}:{config.port}"
    try:
        bound = (
            server.add_secure_port(address, config.tls.grpc_credentials())
            if config.tls is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:  # grpcio's "Failed to bind", which says neither why nor which flag
        bound = 0
    if bound == 0:
        raise listen_errors.cannot_listen("gRPC", config.host, config.port, "--port")
    return bound


async def _still_starting(started: float, every_s: float = 15.0) -> None:
    """A line every `every_s` while the engine starts: vLLM's own are at WARNING by default
    (make serve), so without these a minute passes in silence."""
    while True:
        await asyncio.sleep(every_s)
        log.info("engine still starting (%.0f s)", time.monotonic() - started)


def _served_where(
    model: str, grpc_address: str, scheme: str, http: HttpGateway | None, metrics: HttpGateway | None
) -> str:
    """One line: the model and every port it is served on."""
    parts = [f"{model}: gRPC {grpc_address}"]
    if http is not None:
        parts.append(f"HTTP (Connect, gRPC-Web) {scheme}://{http.address}")
    if metrics is not None:
        parts.append(f"metrics http://{metrics.address}/metrics")
    return ", ".join(parts)


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
    from .host_check import AllowedHosts, HostCheck
    from .http_calls import CallObserver as HttpCallObserver
    from .http_gateway import HttpGateway, build_app, service_endpoints

    endpoints = service_endpoints(service_pb2.DESCRIPTOR.services_by_name["TraceService"], servicer)
    endpoints |= service_endpoints(
        health_pb2.DESCRIPTOR.services_by_name["Health"], health_servicer, methods={"Check"}
    )
    app = build_app(endpoints, config.cors_origins, read_max_bytes=config.max_request_bytes)
    # Outermost the observer (a refused Host is logged too), then the Host check, before
    # CORS or any handler.
    app = HttpCallObserver(HostCheck(app, AllowedHosts.for_listener(config.host, config.allowed_hosts)), endpoints)
    try:
        gateway = await HttpGateway.start(
            app, config.host, config.http_port, shared=config.frontends > 1, tls=config.tls,
            limits=config.connections,
        )
    except SystemExit:  # uvicorn could not start: say why, and which flag chose the port
        raise listen_errors.cannot_listen("HTTP", config.host, config.http_port, "--http-port") from None
    log.info(
        "tracewire HTTP (Connect, gRPC-Web) on %s://%s; CORS origins: %s",
        "https" if config.tls else "http",
        gateway.address,
        ", ".join(config.cors_origins) or "localhost pages only",
    )
    return gateway


async def _start_metrics(config: ServerConfig, frontend: int) -> HttpGateway | None:
    """Prometheus text on --metrics-port (+ this frontend's index), or nothing."""
    if not config.metrics_port:
        return None
    from . import metrics
    from .host_check import AllowedHosts, HostCheck
    from .http_gateway import HttpGateway

    port = config.metrics_port + frontend
    app = HostCheck(metrics.asgi_app(), AllowedHosts.for_listener(config.host, config.allowed_hosts))
    try:
        gateway = await HttpGateway.start(app, config.host, port, limits=config.connections)
    except SystemExit:
        raise listen_errors.cannot_listen("metrics", config.host, port, "--metrics-port") from None
    log.info("tracewire metrics on http://%s/metrics", gateway.address)
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
