"""Installing the worker hooks asks the engine core again when a call goes unanswered
(engine._install_worker_hooks), and fails the start with a clear error instead of
hanging. vLLM's AsyncLLM is replaced here by the one method the install uses."""

from __future__ import annotations

import asyncio

import pytest
from tracewire_server import engine


class _EngineCore:
    """collective_rpc that leaves the first `lost` calls unanswered."""

    def __init__(self, lost: int) -> None:
        self.lost = lost
        self.calls: list[tuple[str, tuple]] = []
        self.unanswered: list[asyncio.Future] = []

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[int]:
        self.calls.append((method, args))
        if len(self.calls) <= self.lost:
            future = asyncio.get_running_loop().create_future()
            self.unanswered.append(future)
            return await future
        return [0]


def test_an_unanswered_install_is_asked_again(monkeypatch):
    monkeypatch.setattr(engine, "INSTALL_TIMEOUT_S", 0.05)
    core = _EngineCore(lost=1)

    async def install() -> None:
        await engine._install_worker_hooks(core, "ipc://x", False, 1)
        # The unanswered call was shielded, not cancelled: a late answer still has a taker.
        assert not core.unanswered[0].cancelled()

    asyncio.run(install())
    assert core.calls == [("tracewire_install", ("ipc://x", False, 1))] * 2


def test_install_gives_up_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(engine, "INSTALL_TIMEOUT_S", 0.05)
    core = _EngineCore(lost=10)
    with pytest.raises(RuntimeError, match=r"did not answer tracewire_install \(frontend 2\) in 3 attempts"):
        asyncio.run(engine._install_worker_hooks(core, "ipc://x", False, 2))
    assert len(core.calls) == engine.INSTALL_ATTEMPTS
