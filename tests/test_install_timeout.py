"""Installing the worker hooks fails the start with a clear error when the engine
core never answers (engine._install_worker_hooks), instead of hanging it. vLLM's
AsyncLLM is replaced here by the one method the install uses."""

from __future__ import annotations

import asyncio

import pytest
from tracewire_server.frontend import engine


class _EngineCore:
    """collective_rpc that answers, or never does."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.calls: list[tuple[str, tuple]] = []
        self.pending: list[asyncio.Future] = []

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[int]:
        self.calls.append((method, args))
        if self.answers:
            return [0]
        future = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        return await future


def test_install_sends_the_frontends_route():
    core = _EngineCore(answers=True)
    asyncio.run(engine._install_worker_hooks(core, "ipc://x", False, 1))
    assert core.calls == [("tracewire_install", ("ipc://x", False, 1))]


def test_an_unanswered_install_fails_the_start_clearly(monkeypatch):
    monkeypatch.setattr(engine, "INSTALL_TIMEOUT_S", 0.05)
    core = _EngineCore(answers=False)

    async def install() -> None:
        with pytest.raises(RuntimeError, match=r"did not answer tracewire_install \(frontend 2\) in 0 s"):
            await engine._install_worker_hooks(core, "ipc://x", False, 2)
        # Shielded, not cancelled: vLLM's output handler may still resolve it.
        assert not core.pending[0].cancelled()

    asyncio.run(install())
