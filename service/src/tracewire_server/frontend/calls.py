"""One served call, on either port: its request id, and what is counted and logged when
it ends (metrics.py, access_log.py).

Each port's observer (grpc_calls.py, http_calls.py) starts a `Call` when a request
arrives and finishes it with the status the client got. While the call runs it is
`current_call()` (a context variable: the handler's tasks see it too), which is where
authentication will name the tenant (`call.tenant`); traces read it to label their metrics.
"""

from __future__ import annotations

import contextvars
import re
import time
import uuid
from dataclasses import dataclass, field

from . import access_log, metrics

# Returned to the client in the initial metadata / response headers of every call;
# taken from the request when it is well-formed, so that a caller's id follows the call.
REQUEST_ID_HEADER = "x-request-id"
_WELL_FORMED_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

_CURRENT: contextvars.ContextVar[Call | None] = contextvars.ContextVar("tracewire_call", default=None)


def request_id(offered: str | bytes | None) -> str:
    """The caller's id when it is short and plain (no spaces, quotes or control characters
    to forge log lines with), else a new one."""
    if isinstance(offered, bytes):
        offered = offered.decode("latin-1")
    if offered and _WELL_FORMED_ID.fullmatch(offered):
        return offered
    return uuid.uuid4().hex


@dataclass
class Call:
    transport: str  # grpc | connect | grpc-web
    method: str  # tracewire.v1.TraceService/Generate, or what the HTTP path asked for
    request_id: str
    peer: str
    known_method: bool = True  # False: a path nobody serves (its metrics label is "unknown")
    tenant: str = ""  # set by authentication; "" when it is off
    code: str = ""  # the gRPC status name the client got; "" until known
    http_status: int | None = None  # the HTTP port's response status
    bytes_sent: int = 0  # response bytes: serialized messages (gRPC), the body (HTTP)
    started: float = field(default_factory=time.monotonic)

    def enter(self) -> None:
        """This call is the current one in this task (and the tasks it starts)."""
        _CURRENT.set(self)

    def finish(self) -> None:
        duration = time.monotonic() - self.started
        code = self.code or "UNKNOWN"
        method = self.method if self.known_method else "unknown"
        metrics.RPCS.labels(self.transport, method, code, self.tenant).inc()
        metrics.RPC_SECONDS.labels(self.transport, method).observe(duration)
        access_log.write(
            method=self.method,
            transport=self.transport,
            code=code,
            http_status=self.http_status,
            duration_ms=round(duration * 1e3, 3),
            request_id=self.request_id,
            peer=self.peer,
            bytes_sent=self.bytes_sent,
            tenant=self.tenant,
        )


def current_call() -> Call | None:
    return _CURRENT.get()


def current_tenant() -> str:
    call = _CURRENT.get()
    return call.tenant if call is not None else ""
