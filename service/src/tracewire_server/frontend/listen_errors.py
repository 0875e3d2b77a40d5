"""Why a port could not be listened on, as one line a user can act on.

grpcio raises a bare "RuntimeError: Failed to bind" and uvicorn exits with code 3 after
logging its own line: neither says which flag chose the port. After such a failure a
plain socket bind to the same address finds the reason (address in use, permission).
"""

from __future__ import annotations

import errno
import os
import socket


def bind_problem(host: str, port: int) -> str:
    """Why host:port cannot be bound right now, in words ('address already in use')."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve {host!r} ({e.strerror})"
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            # As grpcio and uvicorn do: a port with only TIME_WAIT connections is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return "address already in use (another server is listening there)"
        return os.strerror(e.errno).lower() if e.errno else str(e)
    return "the port could not be bound"


def cannot_listen(what: str, host: str, port: int, flag: str) -> SystemExit:
    """The exit for a port `what` ('gRPC', 'HTTP', 'metrics') chosen by `flag` failed to bind."""
    return SystemExit(
        f"tracewire: cannot listen on {host}:{port} for {what}: {bind_problem(host, port)}; "
        f"stop what uses it or choose another {flag}"
    )
