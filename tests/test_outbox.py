"""The trace stream's outbox: steps ready together share one message, order is kept
around invoke results, and a client that stops reading hits the byte cap."""

import asyncio

import pytest
from tracewire.v1 import service_pb2, trace_pb2
from tracewire_server.errors import ResourceExhausted
from tracewire_server.trace import BATCH_BYTES, _Outbox


def _step(box: _Outbox, step: int, size: int = 10) -> None:
    result = box.new_step(size)
    result.step = step
    box.count(size)


def test_steps_ready_together_go_in_one_message_and_order_is_kept():
    async def go():
        box = _Outbox(cap=1 << 20)
        for i in range(3):
            _step(box, i)
        box.put(trace_pb2.InvokeResult(invoke_index=0))
        _step(box, 3)
        first, second, third = await box.get(), await box.get(), await box.get()
        assert isinstance(first, service_pb2.TraceResponse)
        assert [r.step for r in first.steps.results] == [0, 1, 2]
        assert isinstance(second, trace_pb2.InvokeResult)
        assert [r.step for r in third.steps.results] == [3]
        assert box.queued == 0

    asyncio.run(go())


def test_a_waiting_consumer_gets_a_single_step_at_once():
    async def go():
        box = _Outbox(cap=1 << 20)
        getter = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        _step(box, 0)
        item = await asyncio.wait_for(getter, 1)
        assert [r.step for r in item.steps.results] == [0]

    asyncio.run(go())


def test_large_steps_start_a_new_message():
    async def go():
        box = _Outbox(cap=8 * BATCH_BYTES)
        _step(box, 0, BATCH_BYTES // 2 + 1)
        _step(box, 1, BATCH_BYTES // 2 + 1)
        first, second = await box.get(), await box.get()
        assert [r.step for r in first.steps.results] == [0]
        assert [r.step for r in second.steps.results] == [1]

    asyncio.run(go())


def test_a_client_that_does_not_read_hits_the_cap():
    box = _Outbox(cap=100)
    for i in range(10):
        _step(box, i)
    with pytest.raises(ResourceExhausted, match="reading too slowly"):
        _step(box, 10)
