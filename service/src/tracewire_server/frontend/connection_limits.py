"""Connection hygiene on both ports: timeouts and limits, and the flags that set them.

Without them a slowloris (a request head sent a byte at a time) or a crowd of idle
connections held sockets and file descriptors for as long as the peers liked. Per port
(per frontend with --frontends N):

- idle: a connection with no call in flight is closed after `idle_timeout_s` (gRPC:
  max_connection_idle, a GOAWAY the client's channel reconnects from; HTTP: keep-alive);
- header: an HTTP request's head must arrive within `header_timeout_s` of the
  connection or of its first byte (a connection that never sends one is closed then);
  a gRPC connection must finish its HTTP/2 handshake in that time;
- body: an HTTP request's body must arrive within `body_timeout_s` of its head;
- age: a gRPC connection is sent GOAWAY after `max_connection_age_s` (new calls go to a
  new connection, which with --frontends may land on another frontend); the calls in
  flight on it are never cut: a Trace may stream for as long as it needs;
- limits: at most `max_connections` connections (more are closed at once; HTTP answers
  them 503), `max_concurrent_calls` calls in flight (gRPC answers RESOURCE_EXHAUSTED,
  HTTP 503: uvicorn counts open connections against this limit too) and
  `max_streams_per_connection` HTTP/2 streams on one gRPC connection (the client queues
  more); an HTTP request head is at most `max_header_bytes` (431).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

# grpc's "no limit" for durations in ms (INT_MAX): GOAWAY'd connections keep their
# calls in flight until they end.
_FOREVER_MS = 2**31 - 1
# The server pings a connection quiet for this long, and drops it when the ping is not
# answered in KEEPALIVE_TIMEOUT_S: half-open connections (a peer that vanished) go.
KEEPALIVE_TIME_S = 60.0
KEEPALIVE_TIMEOUT_S = 20.0
# Clients may ping this often without data (keepalive through NATs); more often counts as
# a strike, and grpc closes a connection after two strikes: no ping floods.
MIN_CLIENT_PING_INTERVAL_S = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    idle_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connection_age_s: float = 3600.0  # 0: no age limit
    max_connections: int = 1024
    max_concurrent_calls: int = 1024
    max_streams_per_connection: int = 1024
    max_header_bytes: int = 16 << 10

    def grpc_options(self) -> list[tuple[str, int]]:
        options = [
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_connection_idle_ms", _ms(self.idle_timeout_s)),
            ("grpc.server_handshake_timeout_ms", _ms(self.header_timeout_s)),
            ("grpc.keepalive_time_ms", _ms(KEEPALIVE_TIME_S)),
            ("grpc.keepalive_timeout_ms", _ms(KEEPALIVE_TIMEOUT_S)),
            ("grpc.http2.min_ping_interval_without_data_ms", _ms(MIN_CLIENT_PING_INTERVAL_S)),
            ("grpc.http2.max_ping_strikes", 2),
        ]
        if self.max_connection_age_s > 0:
            options += [
                ("grpc.max_connection_age_ms", _ms(self.max_connection_age_s)),
                ("grpc.max_connection_age_grace_ms", _FOREVER_MS),
            ]
        return options


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def add_flags(parser: Any) -> None:
    defaults = ConnectionLimits()
    group = parser.add_argument_group("connections (each port, each frontend)")
    group.add_argument("--idle-timeout", type=float, default=defaults.idle_timeout_s, metavar="S",
                       help="close a connection with no call in flight after S seconds")
    group.add_argument("--header-timeout", type=float, default=defaults.header_timeout_s, metavar="S",
                       help="an HTTP request head (and a gRPC connection's handshake) must arrive "
                       "within S seconds, else the connection is closed")
    group.add_argument("--body-timeout", type=float, default=defaults.body_timeout_s, metavar="S",
                       help="an HTTP request body must arrive within S seconds of its head")
    group.add_argument("--max-connection-age", type=float, default=defaults.max_connection_age_s, metavar="S",
                       help="send a gRPC connection GOAWAY after S seconds (its calls in flight "
                       "finish; 0: never)")
    group.add_argument("--max-connections", type=int, default=defaults.max_connections, metavar="N",
                       help="connections per port; more are closed at once")
    group.add_argument("--max-concurrent-calls", type=int, default=defaults.max_concurrent_calls, metavar="N",
                       help="calls in flight per port; more are refused (RESOURCE_EXHAUSTED, HTTP 503)")
    group.add_argument("--max-streams-per-connection", type=int, default=defaults.max_streams_per_connection,
                       metavar="N", help="concurrent calls on one gRPC (HTTP/2) connection; the client queues more")
    group.add_argument("--max-header-bytes", type=int, default=defaults.max_header_bytes, metavar="B",
                       help="largest HTTP request head (431 beyond)")


def from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ConnectionLimits:
    limits = ConnectionLimits(
        idle_timeout_s=args.idle_timeout,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connection_age_s=args.max_connection_age,
        max_connections=args.max_connections,
        max_concurrent_calls=args.max_concurrent_calls,
        max_streams_per_connection=args.max_streams_per_connection,
        max_header_bytes=args.max_header_bytes,
    )
    for name in ("idle_timeout_s", "header_timeout_s", "body_timeout_s"):
        if getattr(limits, name) <= 0:
            parser.error(f"--{name.removesuffix('_s').replace('_', '-')} must be > 0")
    for name in ("max_connections", "max_concurrent_calls", "max_streams_per_connection", "max_header_bytes"):
        if getattr(limits, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return limits
