"""A connection to the server, opened the same way by both clients: a grpc or grpc.aio
channel (the two modules have the same factory functions), TLS when asked for, the
TraceService stub on it and the metadata every call carries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc

from .tls import Tls, bearer_metadata, channel_credentials
from .v1 import service_pb2_grpc

# Full-vocabulary reads make large messages.
_MAX_RECEIVE_BYTES = 256 * 1024 * 1024


class Connection(NamedTuple):
    channel: Any  # grpc.Channel or grpc.aio.Channel
    stub: Any  # TraceServiceStub: its calls block, or are awaited, as the channel's do
    metadata: tuple[tuple[str, str], ...]


def connect(
    api: Any,
    target: str,
    *,
    token: str | None,
    tls: Tls | bool,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
) -> Connection:
    """A channel from `api` (grpc or grpc.aio) to `target`, TLS when `tls` / `credentials`
    select it, and `token` as bearer metadata."""
    metadata = bearer_metadata(token)
    opts = [("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES), *options]
    chosen = channel_credentials(tls, credentials)
    if chosen is None:
        channel = api.insecure_channel(target, options=opts)
    else:
        channel = api.secure_channel(target, chosen, options=opts)
    stub = service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
    return Connection(channel, stub, metadata)
