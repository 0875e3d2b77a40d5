"""A second server process, to watch it drain and exit on SIGTERM."""

from __future__ import annotations

import threading

import pytest
import tracewire
from conftest import start_server, wait_for_unfinished


def test_sigterm_drains_in_flight_calls_and_exits_zero(tmp_path):
    server = start_server(tmp_path, "--grace-period", "60")
    client = tracewire.Client(server.target, timeout=120)
    result: dict[str, object] = {}

    def long_call():
        try:
            result["out"] = client.generate("The capital of France is", max_tokens=64,
                                            ignore_eos=True, temperature=0.0)
        except tracewire.TracewireError as e:  # asserted below
            result["error"] = e

    worker = threading.Thread(target=long_call)
    worker.start()
    assert wait_for_unfinished(server.target, lambda n: n > 0)
    code = server.stop(timeout=180)
    worker.join(timeout=60)
    assert code == 0, server.log()
    assert "error" not in result, result.get("error")
    out = result["out"]
    assert len(out[0].outputs[0].token_ids) == 64  # the in-flight call was let finish
    assert "draining" in server.log()
    with pytest.raises((tracewire.Unavailable, tracewire.DeadlineExceeded)):
        tracewire.Client(server.target, timeout=5).generate("a", max_tokens=1)
