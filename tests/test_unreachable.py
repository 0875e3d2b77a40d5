"""A client pointed where no server is: one line naming the target and how to give another,
from the CLI (nothing else printed, exit status 1) and from the SDK (`tracewire.Unreachable`,
an `Unavailable`, raised `from None`). Against real closed ports: a port picked free, with
nothing listening on it, and a name that does not resolve. No server is started."""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
import textwrap

import grpc
import pytest
import tracewire as tw
from conftest import free_port
from tracewire import cli
from tracewire.errors import unreachable_reason


@pytest.fixture
def closed() -> str:
    return f"127.0.0.1:{free_port()}"


CLI_COMMANDS = [
    ["generate", "The capital of France is"],
    ["trace", "The capital of France is", "--max-tokens", "2"],
    ["lens", "The capital of France is"],
    ["tokenize", " Berlin"],
]


@pytest.mark.parametrize("command", CLI_COMMANDS, ids=lambda c: c[0])
def test_cli_says_one_line_naming_the_target_and_the_flag(closed, command, capsys):
    assert cli.main(["--target", closed, *command]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # no table header (trace) before the error
    assert err == (f"tracewire: cannot reach a tracewire server at {closed} (connection refused: nothing listens "
                   "there): start one (make serve), or give its address: --target HOST:PORT or $TRACEWIRE_TARGET\n")


def test_cli_collect_writes_nothing_and_says_one_line(closed, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n")
    assert cli.main(["--target", closed, "collect", str(prompts), str(tmp_path / "out"), "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"tracewire: cannot reach a tracewire server at {closed} ("), err
    assert not (tmp_path / "out").exists()


def test_cli_takes_the_target_from_the_environment(closed):
    """As a user runs it: the installed `tracewire` script, $TRACEWIRE_TARGET, exit status 1."""
    import os
    import shutil

    exe = shutil.which("tracewire", path=os.path.dirname(sys.executable))
    assert exe, "the tracewire console script is not installed next to this python"
    result = subprocess.run([exe, "trace", "The capital of France is"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "TRACEWIRE_TARGET": closed})
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"tracewire: cannot reach a tracewire server at {closed} (connection refused: nothing listens there): "
        "start one (make serve), or give its address: --target HOST:PORT or $TRACEWIRE_TARGET"]


def test_cli_names_a_target_that_does_not_resolve(capsys):
    assert cli.main(["--target", "no-such-host.invalid:50051", "tokenize", "x"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("tracewire: cannot reach a tracewire server at no-such-host.invalid:50051 "
                          "(the name does not resolve): "), err


def _check(error: BaseException, target: str, call: str = "") -> None:
    assert isinstance(error, tw.Unreachable), call
    assert isinstance(error, tw.Unavailable) and isinstance(error, tw.TracewireError)  # map() retries it as before
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.target == target
    assert str(error) == (f"cannot reach a tracewire server at {target} (connection refused: nothing listens there): "
                          'start one (make serve), or pass its address: tracewire.Client("HOST:PORT")')
    assert error.__cause__ is None and error.__suppress_context__  # raised from None: no grpc dump chained
    copied = pickle.loads(pickle.dumps(error))  # (a worker process's error, sent back)
    assert (type(copied), str(copied), copied.target, copied.reason) == (type(error), str(error), target, error.reason)


def test_sdk_raises_unreachable_from_every_kind_of_call(closed):
    client = tw.Client(closed, timeout=30)
    calls = {
        "generate": lambda: client.generate("hi", max_tokens=1),
        "model_info": client.model_info,
        "tokenize": lambda: client.tokenizer.encode("hi"),
        "stream_trace": lambda: list(client.stream_trace("hi", max_tokens=1)),
        "generate_stream": lambda: list(client.generate_stream("hi", max_tokens=1)),
    }
    for name, call in calls.items():
        with pytest.raises(tw.Unreachable, match=f"at {closed} ") as info:
            call()
        _check(info.value, closed, name)
    with pytest.raises(tw.Unreachable) as info:
        with client.trace("hi", max_tokens=1) as tracer:
            tracer.all().logprobs(top_k=1).save()
    _check(info.value, closed)
    client.close()


def test_async_sdk_raises_unreachable(closed):
    async def go() -> None:
        async with tw.AsyncClient(closed, timeout=30) as client:
            with pytest.raises(tw.Unreachable) as info:
                await client.generate("hi", max_tokens=1)
            _check(info.value, closed)
            with pytest.raises(tw.Unreachable) as info:
                async for _ in client.stream_trace("hi", max_tokens=1):
                    pass
            _check(info.value, closed)

    asyncio.run(go())


def test_a_script_ends_on_the_one_line(closed):
    """Run as a script: the traceback's last line is the message, with no gRPC error chained
    ("During handling of the above exception") and nothing of gRPC's own wording."""
    script = textwrap.dedent(f"""
        import tracewire
        client = tracewire.Client({closed!r})
        print(client.generate("The capital of France is", max_tokens=4))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (f"tracewire.errors.Unreachable: cannot reach a tracewire server at {closed} (connection "
                         'refused: nothing listens there): start one (make serve), or pass its address: '
                         'tracewire.Client("HOST:PORT")')
    assert "During handling" not in result.stderr and "direct cause" not in result.stderr
    assert "failed to connect to all addresses" not in result.stderr
    assert result.stderr.count("Traceback") == 1


def test_a_servers_own_unavailable_is_not_unreachable():
    """Only gRPC's own no-connection errors: a server that answered UNAVAILABLE was reached."""
    refused = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to "
               "remote host: Connection refused")
    assert unreachable_reason(grpc.StatusCode.UNAVAILABLE, refused) == "connection refused: nothing listens there"
    assert unreachable_reason(grpc.StatusCode.UNAVAILABLE, "the server is shutting down") is None
    assert unreachable_reason(grpc.StatusCode.INTERNAL, refused) is None
    # a TLS handshake that failed met a server: gRPC's own words stay
    handshake = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Ssl handshake failed: "
                 "SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED")
    assert unreachable_reason(grpc.StatusCode.UNAVAILABLE, handshake) is None
