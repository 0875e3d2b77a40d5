"""The HTTP port's calls observed: an ASGI middleware that gives each request its request id
(returned in the `x-request-id` response header), counts the body bytes it sends and
finishes it (metrics, access log); and a connectrpc interceptor that reports the Connect
status the call ended with (a stream's status travels in its body, not the HTTP status)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from .calls import REQUEST_ID_HEADER, Call, current_call, request_id

_REQUEST_ID = REQUEST_ID_HEADER.encode()
_LONGEST_LOGGED_PATH = 200

# For responses no endpoint made (unknown path, unsupported content type, a refused plain
# gRPC call, uvicorn's 503 over its limit): the Connect protocol's HTTP -> code mapping,
# and 421 for a Host refused (host_check.py).
_HTTP_CODES = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "UNIMPLEMENTED",
    408: "DEADLINE_EXCEEDED", 409: "ABORTED", 412: "FAILED_PRECONDITION", 413: "RESOURCE_EXHAUSTED",
    415: "INTERNAL", 421: "PERMISSION_DENIED", 429: "UNAVAILABLE", 431: "RESOURCE_EXHAUSTED", 501: "UNIMPLEMENTED",
    502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "UNAVAILABLE",
}


class CallObserver:
    """ASGI middleware around the Connect app. `routes`: the paths served
    (`/tracewire.v1.TraceService/Generate`, ...), the only method labels used in metrics.
    CORS preflights (OPTIONS) are not calls: passed through unobserved."""

    def __init__(self, app: Any, routes: Collection[str]) -> None:
        self._app = app
        self._routes = frozenset(routes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self._app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        path: str = scope["path"]
        content_type: bytes = headers.get(b"content-type", b"")
        client = scope.get("client")
        call = Call(
            transport="grpc-web" if content_type.startswith(b"application/grpc-web") else "connect",
            method=path.lstrip("/")[:_LONGEST_LOGGED_PATH],
            request_id=request_id(headers.get(_REQUEST_ID)),
            peer=_peer(client),
            known_method=path in self._routes,
        )
        call.enter()
        id_header = (_REQUEST_ID, call.request_id.encode())

        async def observed_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                call.http_status = message["status"]
                message = dict(message, headers=[*message.get("headers", ()), id_header])
            elif message["type"] == "http.response.body":
                call.bytes_sent += len(message.get("body", b""))
            await send(message)

        try:
            await self._app(scope, receive, observed_send)
        except BaseException:
            call.code = call.code or "UNKNOWN"
            raise
        finally:
            if not call.code:  # no endpoint ran: the HTTP status says what happened
                status = call.http_status or 500
                call.code = "OK" if status < 300 else _HTTP_CODES.get(status, "UNKNOWN")
            call.finish()


class CallStatus:
    """connectrpc metadata interceptor: the status of calls that reached an endpoint."""

    async def on_start(self, ctx: RequestContext[Any, Any]) -> None:
        return None

    async def on_end(self, token: None, ctx: RequestContext[Any, Any], error: Exception | None, /) -> None:
        call = current_call()
        if call is not None:
            call.code = _connect_code(error)


def _connect_code(error: Exception | None) -> str:
    if error is None:
        return "OK"
    if isinstance(error, ConnectError):
        return "CANCELLED" if error.code == Code.CANCELED else error.code.name
    return "UNKNOWN"


def _peer(client: Any) -> str:
    if not client:
        return ""
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
