"""The engine dying under in-flight calls: each gets UNAVAILABLE (Generate answered INTERNAL
with an ExceptionGroup), and the server stops with exit code 1, saying why. (One engine start
checks both: the server's exit after a dead engine was test_lifecycle's own start before.)"""

from __future__ import annotations

import concurrent.futures
import signal

import psutil
import pytest
import tracewire
from conftest import NO_COMPILE, take, wait_for_unfinished
from server_pool import ServerSpec, servers

DYING = ServerSpec("engine-death", NO_COMPILE)


@servers(DYING)
def test_in_flight_calls_get_unavailable_when_the_engine_dies():
    server = take(DYING)
    client = tracewire.Client(server.target, timeout=120)
    long = dict(max_tokens=480, ignore_eos=True, temperature=0.0)

    def generate():
        return client.generate(["The capital of France is", "Once upon a time"], **long)

    def trace():
        with client.trace("The capital of France is", **long) as tracer:
            tracer.all().logits.top_k(3).save()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(generate), pool.submit(trace)]
        assert wait_for_unfinished(server.target, lambda n: n == 3)
        (core,) = [p for p in psutil.Process(server.process.pid).children(recursive=True)
                   if "EngineCore" in " ".join([p.name(), *p.cmdline()[:2]])]
        core.send_signal(signal.SIGKILL)
        for call in calls:
            with pytest.raises(tracewire.Unavailable):
                call.result(timeout=120)
    assert server.process.wait(timeout=120) == 1, server.log()[-3000:]
    assert "engine has died" in server.log()
