"""TLS for both ports (--tls-cert, --tls-key) and mutual TLS (--tls-client-ca).

The files are checked once, at startup, with Python's own TLS stack (the key matches the
certificate, the CA file holds certificates), so that a bad file is a clear error naming
it, not a handshake failure on the first connection. They are read once: replacing them
takes a restart.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """The TLS files cannot be used; the message names the flag and the file."""


@dataclass(frozen=True)
class ServerTls:
    cert_file: Path
    key_file: Path
    # Clients must present a certificate signed by one of these (mutual TLS); None: any
    # client may connect (and authenticates, if at all, with a token).
    client_ca_file: Path | None = None

    @classmethod
    def load(cls, cert: str | None, key: str | None, client_ca: str | None) -> ServerTls | None:
        """The TLS settings of the flags, checked; None without any."""
        if cert is None and key is None:
            if client_ca is not None:
                raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
            return None
        if cert is None or key is None:
            given, missing = ("--tls-key", "--tls-cert") if cert is None else ("--tls-cert", "--tls-key")
            raise TlsConfigError(f"{given} needs {missing} too")
        tls = cls(Path(cert), Path(key), Path(client_ca) if client_ca is not None else None)
        tls._check()
        return tls

    def _check(self) -> None:
        for flag, path in (("--tls-cert", self.cert_file), ("--tls-key", self.key_file),
                           ("--tls-client-ca", self.client_ca_file)):
            if path is not None:
                _readable(flag, path)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as e:
            raise TlsConfigError(
                f"--tls-cert {self.cert_file} / --tls-key {self.key_file}: not a PEM certificate "
                f"and its private key ({e.reason or e})"
            ) from e
        if self.client_ca_file is not None:
            try:
                context.load_verify_locations(cafile=self.client_ca_file)
            except ssl.SSLError as e:
                raise TlsConfigError(
                    f"--tls-client-ca {self.client_ca_file}: no PEM CA certificates ({e.reason or e})"
                ) from e

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_file.read_bytes(), self.cert_file.read_bytes())],
            root_certificates=self.client_ca_file.read_bytes() if self.client_ca_file else None,
            require_client_auth=self.mutual,
        )


def _readable(flag: str, path: Path) -> None:
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as e:
        raise TlsConfigError(f"{flag} {path}: cannot read it: {e.strerror or e}") from e
