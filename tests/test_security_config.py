"""The boundary's configuration on its own, no server: the token file, the TLS files and
the flags that refuse to start with them."""

from __future__ import annotations

import pytest
from certs import make_pki
from tracewire_server.frontend.auth import TokenFileError, TokenTable
from tracewire_server.frontend.errors import Unauthenticated
from tracewire_server.frontend.tls import ServerTls, TlsConfigError

ALICE = "alice-token-0123456789"
ALICE2 = "alice-token-rotated-0000"
BOB = "bob-token-abcdefghijklmn"


def table() -> TokenTable:
    return TokenTable.parse(f"# tenant token\n\nalice {ALICE}\n  alice\t{ALICE2}  \nbob {BOB}\n", "tokens")


def bearer(token: str) -> list[tuple[str, str]]:
    return [("user-agent", "x"), ("authorization", f"Bearer {token}")]


def test_tokens_name_their_tenant():
    tokens = table()
    assert tokens.tenants == {"alice", "bob"}
    assert tokens.tenant_for(bearer(ALICE)) == "alice"
    assert tokens.tenant_for(bearer(ALICE2)) == "alice"
    assert tokens.tenant_for(bearer(BOB)) == "bob"
    assert tokens.tenant_for([("authorization", f"bearer {BOB}".encode())]) == "bob"  # scheme is case-blind


@pytest.mark.parametrize(("metadata", "message"), [
    ([], "missing credentials"),
    ([("authorization", ALICE)], "must be 'Bearer TOKEN'"),
    ([("authorization", f"Basic {ALICE}")], "must be 'Bearer TOKEN'"),
    (bearer(ALICE + "x"), "invalid token"),
    (bearer(ALICE[:-1]), "invalid token"),
    (bearer(""), "invalid token"),
])
def test_anything_but_a_known_bearer_token_is_unauthenticated(metadata, message):
    with pytest.raises(Unauthenticated, match=message) as error:
        table().tenant_for(metadata)
    assert ALICE not in str(error.value)  # the presented secret is not echoed back


@pytest.mark.parametrize(("text", "message"), [
    (f"alice {ALICE}\nbob {ALICE}\n", r"line 2: the same token as line 1"),
    (f"alice {ALICE}\nbob\n", r"line 2: expected 'TENANT TOKEN', got 1 words"),
    (f"alice {ALICE} extra\n", r"line 1: expected 'TENANT TOKEN', got 3 words"),
    ("alice short\n", r"line 1: token shorter than 16 characters"),
    (f"al/ice {ALICE}\n", r"line 1: tenant name 'al/ice'"),
    ("# only comments\n\n", r"no tokens"),
])
def test_a_bad_token_file_is_refused_naming_the_line(text, message):
    with pytest.raises(TokenFileError, match=message):
        TokenTable.parse(text, "tokens.txt")


def test_an_unreadable_token_file_is_refused(tmp_path):
    with pytest.raises(TokenFileError, match=r"cannot read it"):
        TokenTable.load(tmp_path / "missing")


def test_tls_files_are_checked_at_startup(tmp_path):
    pki = make_pki(tmp_path / "pki")
    tls = ServerTls.load(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    assert tls is not None and tls.mutual
    assert ServerTls.load(None, None, None) is None
    with pytest.raises(TlsConfigError, match=r"--tls-key needs --tls-cert"):
        ServerTls.load(None, str(pki.server_key), None)
    with pytest.raises(TlsConfigError, match=r"--tls-cert needs --tls-key"):
        ServerTls.load(str(pki.server_cert), None, None)
    with pytest.raises(TlsConfigError, match=r"--tls-client-ca needs --tls-cert"):
        ServerTls.load(None, None, str(pki.ca))
    with pytest.raises(TlsConfigError, match=r"--tls-cert .*missing.pem: cannot read it"):
        ServerTls.load(str(tmp_path / "missing.pem"), str(pki.server_key), None)
    with pytest.raises(TlsConfigError, match=r"--tls-key .*: not a PEM certificate and its private key"):
        ServerTls.load(str(pki.server_cert), str(pki.client_key), None)  # another certificate's key
    with pytest.raises(TlsConfigError, match=r"--tls-client-ca .*server.key: no PEM CA certificates"):
        ServerTls.load(str(pki.server_cert), str(pki.server_key), str(pki.server_key))


def test_the_flags_refuse_to_start_with_a_bad_boundary(tmp_path, capsys):
    from tracewire_server.__main__ import parse_args

    pki = make_pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {ALICE}\n")
    for argv, message in (
        (["--tls-key", str(pki.server_key)], "--tls-key needs --tls-cert too"),
        (["--auth-tokens", str(tokens)], "line 2: the same token as line 1"),
        (["--tenant-max-calls", "2"], "--tenant-max-calls needs --auth-tokens"),
        (["--tenant-patch-store-bytes", "2"], "--tenant-patch-store-bytes needs --auth-tokens"),
        (["--patch-store-bytes", "-1"], "--patch-store-bytes must be >= 0"),
    ):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    tokens.write_text(f"alice {ALICE}\n")
    config = parse_args(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                         "--auth-tokens", str(tokens), "--tenant-max-calls", "0", "--no-reflection",
                         "--tenant-patch-store-bytes", "4096"])
    assert config.tls is not None and not config.tls.mutual
    assert config.tokens is not None and config.tokens.tenants == {"alice"}
    assert config.tenant_quotas.max_calls == 0 and config.tenant_quotas.max_sequences == 256
    assert config.tenant_quotas.patch_store_bytes == 4096
    assert not config.reflection
