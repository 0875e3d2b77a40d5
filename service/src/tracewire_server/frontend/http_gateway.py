"""The HTTP port: the same servicers over the Connect protocol and gRPC-Web, for browsers.

Browsers cannot speak gRPC (it needs HTTP/2 trailers that fetch() does not expose), so
`--http-port` serves the very servicer instances of the gRPC port (same engine, same
errors -> status mapping, same drain accounting) through connectrpc's ASGI application,
run by uvicorn in the grpc.aio server's event loop. One port speaks:

- the Connect protocol, unary and server streaming, with JSON (`application/json`,
  `application/connect+json`) or binary protobuf (`application/proto`,
  `application/connect+proto`): what Connect-ES's createConnectTransport sends, and
  curl-able;
- gRPC-Web (`application/grpc-web+proto`, `+json`): createGrpcWebTransport.

Why connectrpc (connectrpc.com's Python implementation, 0.13): it is maintained, passes
the Connect conformance suite, speaks Connect and gRPC-Web from one ASGI app, turns
Connect-Timeout-Ms / grpc-timeout into a deadline and a client disconnect into a
cancellation of the handler (which aborts its engine requests exactly as on the gRPC
port), and ships a codec for google.protobuf messages, so the classes generated for
grpc are used as they are. sonora (gRPC-Web only, last release 2023) was the other
candidate. No Connect code is generated: endpoints are built from the service
descriptors, so this port follows proto/ without a second codegen step.

The servicers are written against grpc.aio.ServicerContext; `_GrpcContext` gives them
the part of it they use, and turns their aborts (built by the servicer, the one place
errors become status codes) into ConnectErrors carrying the same code, message and
google.rpc.Status details (a BadRequest naming the field for INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Generator, Mapping, Sequence
from typing import Any, NoReturn, cast

import grpc
import uvicorn
from connectrpc.code import Code
from connectrpc.compat import google_protobuf_binary_codec, google_protobuf_json_codec
from connectrpc.errors import ConnectError, ErrorDetail
from connectrpc.method import IdempotencyLevel, MethodInfo, StreamType
from connectrpc.request import RequestContext
from connectrpc.server import ConnectASGIApplication, Endpoint
from google.protobuf import descriptor, descriptor_pb2, message_factory
from google.rpc import status_pb2
from protobuf.wkt import Any as ConnectAny
from starlette.middleware.cors import CORSMiddleware

from .connection_limits import ConnectionLimits
from .http_calls import CallStatus
from .http_protocol import GuardedHttpToolsProtocol
from .tls import ServerTls

log = logging.getLogger(__name__)

# Browser origins allowed when no --cors-origin is given: pages served from this machine
# (any port, http or https). Anything wider is an explicit choice of the operator.
LOCALHOST_ORIGINS = r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?$"

# What Connect-ES and gRPC-Web clients send and must read (connect-es's `cors` constants):
# without these in the preflight / response, the browser blocks the call or hides its status.
CORS_ALLOWED_METHODS = ("POST", "GET")
CORS_ALLOWED_HEADERS = (
    "Authorization",  # the bearer token (--auth-tokens)
    "Content-Type",
    "Connect-Protocol-Version",
    "Connect-Timeout-Ms",
    "Connect-Content-Encoding",
    "Connect-Accept-Encoding",
    "Content-Encoding",
    "Accept-Encoding",
    "Grpc-Timeout",
    "Grpc-Message-Type",
    "X-Grpc-Web",
    "X-User-Agent",
    "X-Request-Id",
)
CORS_EXPOSED_HEADERS = (
    "Grpc-Status",
    "Grpc-Message",
    "Grpc-Status-Details-Bin",
    "Content-Encoding",
    "Connect-Content-Encoding",
    "X-Request-Id",
)
CORS_MAX_AGE_SECONDS = 7200

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


class _GrpcContext:
    """The part of grpc.aio.ServicerContext the servicers use, over one Connect request.

    Aborts raise ConnectError: connectrpc writes it as the Connect / gRPC-Web error.
    """

    def __init__(self, ctx: RequestContext[Any, Any],
                 write: Callable[[Any], Awaitable[None]] | None = None) -> None:
        self._ctx = ctx
        self._write = write

    async def write(self, message: Any) -> None:
        assert self._write is not None, "write() is for server-streaming methods"
        await self._write(message)

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> NoReturn:
        raise connect_error(code, details, trailing_metadata)

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        raise connect_error(status.code, status.details, status.trailing_metadata)

    def time_remaining(self) -> float | None:
        remaining_ms = self._ctx.timeout_ms
        return None if remaining_ms is None else max(remaining_ms / 1000.0, 0.0)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._ctx.request_headers.allitems())


def connect_error(
    code: grpc.StatusCode, message: str, trailing_metadata: Sequence[tuple[str, str | bytes]]
) -> ConnectError:
    """The ConnectError for a gRPC status: same code, message and rich-status details."""
    details: list[ErrorDetail] = []
    for key, value in trailing_metadata or ():
        if key == _STATUS_DETAILS_KEY and isinstance(value, bytes):
            for detail in status_pb2.Status.FromString(value).details:
                # connectrpc's details are protobuf-py messages; an Any carries the packed
                # google.protobuf bytes across unchanged.
                details.append(ErrorDetail(ConnectAny(type_url=detail.type_url, value=detail.value)))
    return ConnectError(_connect_code(code), message, details)


def _connect_code(code: grpc.StatusCode) -> Code:
    if code == grpc.StatusCode.CANCELLED:  # the one name the two protocols spell apart
        return Code.CANCELED
    try:
        return Code[code.name]
    except KeyError:  # OK is not an error; nothing else is missing
        return Code.UNKNOWN


Handler = Callable[[Any, Any], Any]


def _unary(handler: Handler) -> Callable[[Any, RequestContext[Any, Any]], Awaitable[Any]]:
    async def call(request: Any, ctx: RequestContext[Any, Any]) -> Any:
        return await handler(request, _GrpcContext(ctx))

    return call


def _server_stream(handler: Handler) -> Callable[[Any, RequestContext[Any, Any]], AsyncIterator[Any]]:
    if inspect.isasyncgenfunction(handler):
        def call(request: Any, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
            # The servicer's own generator: connectrpc closes it when the client goes away
            # or the deadline passes, and its cleanup aborts the engine requests.
            return cast(AsyncIterator[Any], handler(request, _GrpcContext(ctx)))

        return call

    async def written(request: Any, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
        # A servicer that streams through context.write runs as a task whose writes this
        # generator yields; connectrpc closing the generator cancels the task, and with
        # it the engine requests. One message in hand at a time: a slow client holds the
        # servicer's writes back exactly as grpc.aio does.
        messages: asyncio.Queue[Any] = asyncio.Queue(1)
        task = asyncio.ensure_future(handler(request, _GrpcContext(ctx, messages.put)))
        try:
            while True:
                get = asyncio.ensure_future(messages.get())
                await asyncio.wait((get, task), return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield get.result()
                    continue
                get.cancel()
                if not messages.empty():  # its last write, put just before it returned
                    yield messages.get_nowait()
                task.result()  # the servicer's error, if any (its abort's ConnectError)
                return
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    return written


_IDEMPOTENCY = {
    descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS: IdempotencyLevel.NO_SIDE_EFFECTS,
    descriptor_pb2.MethodOptions.IDEMPOTENT: IdempotencyLevel.IDEMPOTENT,
}


def service_endpoints(
    service: descriptor.ServiceDescriptor, servicer: object, methods: Collection[str] | None = None
) -> dict[str, Endpoint[Any, Any]]:
    """`/package.Service/Method` -> endpoint calling the grpc servicer's method of that name.

    `methods` limits which are served (None: all). Client streaming (RegisterDictionary) is
    served over the Connect protocol, whose request body carries the whole stream (HTTP/1.1
    needs nothing more); gRPC-Web has no client streaming, and connectrpc refuses it there.
    Bidi streaming needs HTTP/2 full duplex, which browsers lack; no served service has such
    methods, so they are refused.
    """
    endpoints: dict[str, Endpoint[Any, Any]] = {}
    for method in service.methods:
        if methods is not None and method.name not in methods:
            continue
        if method.client_streaming and method.server_streaming:
            raise ValueError(f"{service.full_name}.{method.name}: bidi streaming is not served over HTTP")
        info: MethodInfo[Any, Any] = MethodInfo(
            name=method.name,
            service_name=service.full_name,
            input=message_factory.GetMessageClass(method.input_type),
            output=message_factory.GetMessageClass(method.output_type),
            idempotency_level=_IDEMPOTENCY.get(
                method.GetOptions().idempotency_level, IdempotencyLevel.UNKNOWN
            ),
            stream_type=(StreamType.SERVER_STREAM if method.server_streaming
                         else StreamType.CLIENT_STREAM if method.client_streaming else StreamType.UNARY),
        )
        handler = getattr(servicer, method.name)
        endpoint: Endpoint[Any, Any]
        if method.server_streaming:
            endpoint = Endpoint.server_stream(info, _server_stream(handler))
        elif method.client_streaming:
            # (same call shape as unary: the servicer takes the request iterator)
            endpoint = Endpoint.client_stream(info, _unary(handler))
        else:
            endpoint = Endpoint.unary(info, _unary(handler))
        endpoints[f"/{service.full_name}/{method.name}"] = endpoint
    return endpoints


class _ConnectApp(ConnectASGIApplication[Mapping[str, Endpoint[Any, Any]]]):
    """Several services' endpoints on one ASGI app (connectrpc routes by full path)."""

    @property
    def path(self) -> str:
        return "/"


class _RefuseGrpc:
    """Answer plain gRPC (content-type application/grpc) with 415 instead of a traceback:
    it needs HTTP/2 trailers, which uvicorn's HTTP/1.1 cannot send; the gRPC port serves it."""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and _is_plain_grpc(dict(scope.get("headers", ())).get(b"content-type", b"")):
            body = b"plain gRPC is served on the gRPC port; this port speaks Connect and gRPC-Web\n"
            await send({"type": "http.response.start", "status": 415,
                        "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self._app(scope, receive, send)


def _is_plain_grpc(content_type: bytes) -> bool:
    return content_type == b"application/grpc" or content_type.startswith(b"application/grpc+")


def build_app(
    endpoints: Mapping[str, Endpoint[Any, Any]], cors_origins: Sequence[str], read_max_bytes: int
) -> Any:
    """The ASGI app: Connect + gRPC-Web for `endpoints`, behind CORS.

    `cors_origins`: exact origins, or "*" for any; empty means this machine's pages only.
    """
    app = _ConnectApp(
        service=endpoints,
        # connectrpc types this with its private union of Endpoint subclasses, which
        # service_endpoints builds (unary and server-stream ones).
        endpoints=lambda eps: cast(Any, eps),
        read_max_bytes=read_max_bytes,
        # JSON is what people type (curl): a misspelt field is an INVALID_ARGUMENT naming it,
        # not silently ignored, as binary protobuf cannot misspell one.
        codecs=[google_protobuf_binary_codec(), google_protobuf_json_codec(ignore_unknown_fields=False)],
        interceptors=[CallStatus()],  # the status each call ended with, for metrics and the access log
    )
    return CORSMiddleware(
        _RefuseGrpc(app),
        allow_origins=list(cors_origins),
        allow_origin_regex=None if cors_origins else LOCALHOST_ORIGINS,
        allow_methods=CORS_ALLOWED_METHODS,
        allow_headers=CORS_ALLOWED_HEADERS,
        expose_headers=CORS_EXPOSED_HEADERS,
        max_age=CORS_MAX_AGE_SECONDS,
    )


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the tracewire process owns SIGTERM/SIGINT and
    drains both ports itself (uvicorn's would also re-raise the signal on exit)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def _serve(server: _Server, sockets: list[socket.socket] | None) -> None:
    try:
        await server.serve(sockets=sockets)
    except SystemExit as e:
        # uvicorn exits the process when it cannot start; a SystemExit out of a task would
        # tear down the event loop, the gRPC server's too, so it becomes an error here.
        raise RuntimeError(f"uvicorn could not start (exit code {e.code})") from e


class HttpGateway:
    """The HTTP server, running as a task in the current event loop."""

    def __init__(self, server: _Server, task: asyncio.Task[None], address: str) -> None:
        self._server = server
        self._task = task
        self.address = address

    @classmethod
    async def start(
        cls, app: Any, host: str, port: int, *, shared: bool = False, tls: ServerTls | None = None,
        limits: ConnectionLimits | None = None,
    ) -> HttpGateway:
        """Serve `app` on host:port; `shared`: with SO_REUSEPORT, so that every frontend
        process of `--frontends N` listens on the same port and the kernel spreads the
        connections over them. `tls`: HTTPS, requiring client certificates when mutual.
        `limits`: timeouts and limits (connection_limits.py)."""
        limits = limits or ConnectionLimits()
        sockets = [_reuse_port_socket(host, port)] if shared else None
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="off",
            log_config=None,  # keep the process's logging as __main__ set it up
            log_level="warning",
            access_log=False,  # tracewire's own (access_log.py)
            http=GuardedHttpToolsProtocol.with_limits(limits),
            timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]  # (a float works)
            limit_concurrency=limits.max_concurrent_calls,
            ws="none",  # nothing here speaks WebSocket: no upgrades
            # TLS is uvicorn's (the ssl module); with a client CA, no certificate, no connection.
            ssl_certfile=str(tls.cert_file) if tls else None,
            ssl_keyfile=str(tls.key_file) if tls else None,
            ssl_ca_certs=str(tls.client_ca_file) if tls and tls.client_ca_file else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.mutual else ssl.CERT_NONE,
        )
        server = _Server(config)
        task = asyncio.create_task(_serve(server, sockets))
        while not server.started:
            if task.done():  # uvicorn has logged why (address in use, ...)
                raise SystemExit(f"tracewire: cannot listen on {host}:{port} (HTTP): {task.exception()}")
            await asyncio.sleep(0.02)
        return cls(server, task, f"{host}:{port}")

    async def stop(self, cancel_timeout: float = 5.0) -> None:
        """Cancel the calls still running (their engine requests are aborted; clients get
        CANCELED where the connection still stands), then close the listener."""
        running = list(self._server.server_state.tasks)
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=cancel_timeout)
        self._server.should_exit = True
        await self._task


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family, reuse_port=True)
    except OSError as e:
        raise SystemExit(f"tracewire: cannot listen on {host}:{port} (HTTP): {e}") from e
