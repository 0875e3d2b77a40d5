"""TLS settings for a client: which CA to trust and, for mutual TLS, the client's own
certificate (the server's --tls-cert / --tls-client-ca)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class Tls:
    """PEM bytes. No root certificates: the system's trust store (grpc's bundled roots)."""

    root_certificates: bytes | None = None
    #: The client certificate and its key, for a server that requires one (mutual TLS).
    certificate_chain: bytes | None = None
    private_key: bytes | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its private key, and a key its certificate")

    @classmethod
    def from_files(
        cls,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
    ) -> Tls:
        """Read the PEM files: `ca` to trust, `cert` and `key` to present."""

        def read(path: str | Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return cls(read(ca), read(cert), read(key))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def channel_credentials(
    tls: Tls | bool, credentials: grpc.ChannelCredentials | None
) -> grpc.ChannelCredentials | None:
    """What a client's `tls` / `credentials` arguments select: None for plaintext."""
    if credentials is not None:
        if tls:
            raise ValueError("pass tls= or credentials=, not both")
        return credentials
    if tls is True:
        return Tls().credentials()
    return tls.credentials() if isinstance(tls, Tls) else None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying `token` (the server's --auth-tokens); none without one."""
    if token is None:
        return ()
    token = token.strip()
    if not token:
        raise ValueError("token is empty")
    return (("authorization", f"Bearer {token}"),)
