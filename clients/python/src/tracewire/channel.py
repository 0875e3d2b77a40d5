"""A connection to the server, opened the same way by both clients: a grpc or grpc.aio
channel (the two modules have the same factory functions), TLS when asked for, the
TraceService stub on it and the metadata every call carries.

One target may name several replicas: `ipv4:10.0.0.1:50051,10.0.0.2:50051` (gRPC's
address list), or a DNS name with several addresses (`dns:///tracewire.ns.svc:50051`, as
a Kubernetes headless Service gives). The channel then spreads calls over them
round-robin, and a call refused with UNAVAILABLE before any response (a replica that is
draining after SIGTERM, or still starting) is retried on the next one: gRPC's own
retries, which end once a response has begun, so a trace is never replayed after it
started streaming. A plain `host:port` names one server: no policy, and its own error
(e.g. "the server is shutting down") comes back at once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc

from .tls import Tls, bearer_metadata, channel_credentials
from .v1 import service_pb2_grpc

# Full-vocabulary reads make large messages.
_MAX_RECEIVE_BYTES = 256 * 1024 * 1024

# Round-robin over a target's addresses; UNAVAILABLE before a response: retried up to 4
# times, 50 ms to 1 s apart (with jitter: gRPC's), each attempt on the next address.
# Round-robin alone cannot tell a draining replica from a serving one (its connection stays
# up), and concurrent calls advance the rotation between one call's attempts, so during a
# long drain a call could meet the draining replica five times and fail. With client-side
# health checking (gRPC's A17) each connection watches the server's health, which reads
# NOT_SERVING while it starts or drains, and round-robin picks only SERVING replicas.
SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": "tracewire.v1.TraceService"},
    "methodConfig": [{
        "name": [{"service": "tracewire.v1.TraceService"}],
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.05s",
            "maxBackoff": "1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }],
}


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
    replicas = [("grpc.service_config", json.dumps(SERVICE_CONFIG)), ("grpc.enable_retries", 1)]
    opts = [
        ("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES),
        *(replicas if names_replicas(target) else []),
        *options,
    ]
    chosen = channel_credentials(tls, credentials)
    if chosen is None:
        channel = api.insecure_channel(target, options=opts)
    else:
        channel = api.secure_channel(target, chosen, options=opts)
    stub = service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
    return Connection(channel, stub, metadata)


def names_replicas(target: str) -> bool:
    """Whether `target` may name several servers: an address list (`ipv4:a,b`, `ipv6:...`)
    or a DNS name resolved by gRPC (`dns:///name:port`, as a headless Service gives)."""
    scheme, _, rest = target.partition(":")
    return scheme == "dns" or (scheme in ("ipv4", "ipv6") and "," in rest)
