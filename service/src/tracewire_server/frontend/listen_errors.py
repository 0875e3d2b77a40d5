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
    return _problem(host, port) or "the port could not be bound"


def _problem(host: str, port: int) -> str | None:
    """Why host:port cannot be bound right now; None when it can."""
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
    return None


def check_free(what: str, host: str, port: int, flag: str) -> None:
    """Exit now, in one line, when host:port cannot be bound (a fixed port only). For a
    group of frontends: each binds in a process of its own, after the engine core has
    started, where a failure could only say that a frontend died."""
    if port and _problem(host, port) is not None:
        raise cannot_listen(what, host, port, flag)


def cannot_listen(what: str, host: str, port: int, flag: str) -> SystemExit:
    """The exit for a port `what` ('gRPC', 'HTTP', 'metrics') chosen by `flag` failed to bind."""
    return SystemExit(
        f"tracewire: cannot listen on {host}:{port} for {what}: {bind_problem(host, port)}; "
        f"stop what uses it or choose another {flag}"
    )
