"""uvicorn's httptools protocol with what it lacks against slow or idle peers.

uvicorn (0.55) arms its keep-alive timer only after a response: a connection that never
sends a request, or sends its head a byte at a time (slowloris), stays open for as long
as the peer likes, and it has no limit on connections (limit_concurrency answers
requests 503, but keeps the sockets) nor, with httptools, on a request head's size
(h11_max_incomplete_event_size is for its h11 protocol). This subclass adds, per
connection (connection_limits.py):

- a head deadline: `header_timeout_s` from the connection, or from the first byte of a
  request after a keep-alive wait (uvicorn's keep-alive timer covers the wait itself);
  408 and closed past it;
- a body deadline: `body_timeout_s` from the end of the head to the end of the body;
- `max_header_bytes` of request head (431 past it);
- `max_connections`: a connection beyond it is answered 503 and closed at once.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .connection_limits import ConnectionLimits


def _response(status: str, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


_TOO_MANY = _response("503 Service Unavailable", b"tracewire: too many connections\n")
_HEAD_TIMEOUT = _response("408 Request Timeout", b"tracewire: the request head took too long\n")
_HEAD_TOO_LARGE = _response("431 Request Header Fields Too Large", b"tracewire: the request head is too large\n")


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting_head = True
        self._head_bytes = 0
        self._refused = False

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
        """The protocol class for uvicorn.Config(http=...), bound to `limits`."""
        return type(cls.__name__, (cls,), {"limits": limits})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.server_state.connections) >= self.limits.max_connections:
            self._refused = True
            self.transport = transport
            transport.write(_TOO_MANY)
            transport.close()
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, head=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._awaiting_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._awaiting_head and self._head_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
            self._refuse(_HEAD_TOO_LARGE)

    # httptools callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a request after a keep-alive wait: its head starts now
            self._arm(self.limits.header_timeout_s, head=True)

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._head_bytes = 0
        self._arm(self.limits.body_timeout_s, head=False)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._awaiting_head = True
        self._head_bytes = 0
        super().on_response_complete()

    # deadlines

    def _arm(self, seconds: float, *, head: bool) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, head)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, head: bool) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        # A 408 only where no response is under way (a pipelined request's slow head
        # must not land in the middle of the previous response); a late body just closes:
        # its handler sees the client gone.
        if head and (self.cycle is None or self.cycle.response_complete):
            self._refuse(_HEAD_TIMEOUT)
        else:
            self.transport.close()

    def _refuse(self, response: bytes) -> None:
        self._disarm()
        self.transport.write(response)
        self.transport.close()
