"""GetEngineStats through the SDK: `Client.engine_stats()` and `AsyncClient.engine_stats()`
(the TypeScript client's `engineStats()`), counting a request while it runs."""

from __future__ import annotations

import asyncio

import tracewire as tw
from conftest import engine_stats

PROMPT = "Once upon a time"


def test_engine_stats_counts_a_running_trace(server, client):
    """While a trace streams, the engine holds its request; after it, none of ours."""
    idle = client.engine_stats()
    assert isinstance(idle, tw.EngineStats)
    assert idle.num_unfinished_requests == engine_stats(server.target).num_unfinished_requests
    seen = []
    for step in client.stream_trace(PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True):
        if step.step == 2:
            seen.append(client.engine_stats())
    (during,) = seen
    assert during.num_unfinished_requests >= 1
    assert during.num_running_requests >= 0 and during.num_waiting_requests >= 0


def test_async_engine_stats_matches_the_stub(server):
    async def main() -> tw.EngineStats:
        async with tw.AsyncClient(server.target, timeout=60) as client:
            return await client.engine_stats()

    stats = asyncio.run(main())
    raw = engine_stats(server.target)
    assert (stats.num_unfinished_requests, stats.num_waiting_requests) == (
        raw.num_unfinished_requests, raw.num_waiting_requests)
