"""Host allow-list for the HTTP ports (Connect / gRPC-Web, metrics): DNS rebinding defence.

A page on rebind.evil.example whose name is made to resolve to 127.0.0.1 is, to the
browser, same-origin with this server, so CORS does not stop it: only the Host header
gives it away (`Host: rebind.evil.example`). Requests are answered only for the names
the server is reached by: the listening address; on a loopback address also `localhost`
and any loopback IP; on a wildcard address (0.0.0.0, ::) any IP literal (a rebinding page
always sends a name); and every `--allowed-host NAME` ('*': any Host, the check off).
Others get 421 before any handler runs.

The port is not compared: a port forward (ssh -L 9000:127.0.0.1:8080, a container's -p)
legitimately changes it, and a rebinding page cannot choose the name it is served under.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

LOOPBACK_NAMES = ("localhost",)
ANY = "*"


@dataclass(frozen=True)
class AllowedHosts:
    names: frozenset[str]
    loopback_ips: bool  # any loopback IP literal (a loopback listener)
    any_ip: bool  # any IP literal (a wildcard listener)
    any_host: bool  # the check is off

    @classmethod
    def for_listener(cls, host: str, extra: Iterable[str] = ()) -> AllowedHosts:
        names = {_normal(name) for name in extra}
        listen = _normal(host)
        address = _ip(listen)
        wildcard = listen in ("", "0.0.0.0", "::")
        loopback = listen in LOOPBACK_NAMES or (address is not None and address.is_loopback)
        names.add(listen)
        if loopback or wildcard:
            names.update(LOOPBACK_NAMES)
        return cls(frozenset(names - {ANY}), loopback, wildcard, ANY in names)

    def admits(self, host_header: str) -> bool:
        if self.any_host:
            return True
        name = _normal(_strip_port(host_header))
        if not name:
            return False
        if name in self.names:
            return True
        address = _ip(name)
        if address is None:
            return False
        return self.any_ip or (self.loopback_ips and address.is_loopback)


def _strip_port(host: str) -> str:
    if host.startswith("["):  # [v6]:port
        return host[1:host.find("]")] if "]" in host else ""
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host


def _normal(name: str) -> str:
    return name.strip().strip("[]").rstrip(".").lower()


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


class HostCheck:
    """ASGI middleware: refuse requests whose Host is not allowed (421, plain text)."""

    def __init__(self, app: Any, allowed: AllowedHosts) -> None:
        self._app = app
        self._allowed = allowed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = next((v for k, v in scope.get("headers", ()) if k == b"host"), b"").decode("latin-1")
            if not self._allowed.admits(host):
                shown = host[:100].encode("ascii", "replace").decode()
                body = (
                    f"tracewire: this server does not answer for Host {shown!r} (DNS rebinding "
                    f"protection); start it with --allowed-host NAME to serve that name\n"
                ).encode()
                await send({"type": "http.response.start", "status": 421, "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", str(len(body)).encode()),
                ]})
                await send({"type": "http.response.body", "body": body})
                return
        await self._app(scope, receive, send)
