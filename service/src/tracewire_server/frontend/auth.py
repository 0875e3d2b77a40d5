"""Who is calling: bearer tokens (--auth-tokens FILE) -> tenant names.

The token file holds one token a line, after the name of the tenant it belongs to:

    # tenant   token
    alice      3f9c0a1e6b2d47c8a5e1f0b9d8c7a6e5
    alice      a second token for alice (rotation: both work)
    bob        7d1e...

`#` starts a comment line, blank lines are ignored, a tenant may have several tokens, a
token belongs to one line only. Anything else (a missing token, extra words, a token
shorter than MIN_TOKEN_CHARS, a token seen twice) refuses the file at startup, naming
the line: a typo must not silently lock a tenant out or let one in.

Every TraceService call on both ports authenticates through `TokenTable.tenant_for`
(servicer.py's decorators, which serve the HTTP port's calls too), as does reflection on
the gRPC port (`ReflectionAuth`). Health stays open: orchestrators probe it without
credentials, and it tells nothing but SERVING / NOT_SERVING.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_status import rpc_status

from .errors import Unauthenticated, to_rpc_status

MIN_TOKEN_CHARS = 16
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_BEARER = "bearer "


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class _Entry:
    tenant: str
    token: bytes


@dataclass(frozen=True)
class TokenTable:
    """Tokens by the SHA-256 of the token: a lookup by the presented token's digest tells
    an observer nothing about the stored tokens, and the final comparison is constant-time."""

    _by_digest: dict[bytes, _Entry]

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenFileError(f"--auth-tokens {path}: cannot read it: {e}") from e
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str) -> TokenTable:
        by_digest: dict[bytes, _Entry] = {}
        first_line: dict[bytes, int] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            where = f"--auth-tokens {source}, line {number}"
            words = line.split()
            if len(words) != 2:
                raise TokenFileError(f"{where}: expected 'TENANT TOKEN', got {len(words)} words")
            tenant, token = words
            if not _TENANT.fullmatch(tenant):
                raise TokenFileError(
                    f"{where}: tenant name {tenant[:64]!r} must be letters, digits and _.@- "
                    "(at most 64 characters)"
                )
            if len(token) < MIN_TOKEN_CHARS:
                raise TokenFileError(f"{where}: token shorter than {MIN_TOKEN_CHARS} characters")
            secret = token.encode()
            digest = hashlib.sha256(secret).digest()
            if digest in by_digest:
                raise TokenFileError(f"{where}: the same token as line {first_line[digest]}")
            by_digest[digest] = _Entry(tenant, secret)
            first_line[digest] = number
        if not by_digest:
            raise TokenFileError(f"--auth-tokens {source}: no tokens (every call would be refused)")
        return cls(by_digest)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(entry.tenant for entry in self._by_digest.values())

    def tenant_for(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """The tenant whose token the call's `authorization: Bearer TOKEN` carries (gRPC
        metadata or HTTP headers: both arrive as lower-case keys); Unauthenticated otherwise."""
        header = next((value for key, value in metadata if key == "authorization"), None)
        if header is None:
            raise Unauthenticated("missing credentials: send the header 'authorization: Bearer TOKEN'")
        text = header.decode("latin-1") if isinstance(header, bytes) else header
        if not text[: len(_BEARER)].lower() == _BEARER:
            raise Unauthenticated("the authorization header must be 'Bearer TOKEN'")
        presented = text[len(_BEARER):].strip().encode()
        entry = self._by_digest.get(hashlib.sha256(presented).digest())
        if entry is None or not hmac.compare_digest(entry.token, presented):
            raise Unauthenticated("invalid token")
        return entry.tenant


class ReflectionAuth(grpc.aio.ServerInterceptor):
    """Server reflection describes the whole API: with --auth-tokens it needs a token too.
    (TraceService authenticates in servicer.py, for both ports; health stays open.)"""

    def __init__(self, tokens: TokenTable, service_prefixes: tuple[str, ...]) -> None:
        self._tokens = tokens
        self._prefixes = tuple(f"/{name}/" for name in service_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method  # type: ignore[attr-defined]
        if not method.startswith(self._prefixes):
            return await continuation(details)
        try:
            self._tokens.tenant_for(details.invocation_metadata)  # type: ignore[attr-defined]
        except Unauthenticated as e:
            status = rpc_status.to_status(to_rpc_status(e))

            async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
                await context.abort_with_status(status)

            # Reflection's one method is a bidi stream.
            return grpc.stream_stream_rpc_method_handler(refuse)
        return await continuation(details)
