"""The trace stream's outbox: a step reaches the stream inside the flush that follows it,
steps coalesce while a write is in flight, order is kept around invoke results, and a
client that stops reading hits the byte cap."""

import asyncio

import pytest
from tracewire.v1 import service_pb2, trace_pb2
from tracewire_server.frontend.errors import ResourceExhausted
from tracewire_server.frontend.outbox import BATCH_BYTES, Outbox


class Client:
    """A stream's write: records each message as gRPC gets it, then holds the write
    while `reading` is clear (a client not reading yet)."""

    def __init__(self) -> None:
        self.messages: list[service_pb2.TraceResponse] = []
        self.reading = asyncio.Event()
        self.reading.set()
        self.cancelled = False

    async def write(self, message: service_pb2.TraceResponse) -> None:
        self.messages.append(message)
        try:
            await self.reading.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    def received(self) -> list:
        """Each message as its step numbers, or ("invoke", index)."""
        return [("invoke", m.invoke_result.invoke_index) if m.HasField("invoke_result")
                else [r.step for r in m.steps.results] for m in self.messages]


def _step(box: Outbox, step: int, size: int = 10) -> None:
    result = box.new_step(size)
    result.step = step
    box.count(size)


def _flushed(box: Outbox, step: int, size: int = 10) -> None:
    """A step as the trace adds it: filled, then flushed after its engine output."""
    _step(box, step, size)
    box.flush()


def _in_flight(invokes: int = 1, cap: int = 1 << 20) -> tuple[Client, Outbox]:
    """An outbox whose client is not reading yet, with step 0 already handed to its write.
    Needs a running event loop."""
    client = Client()
    client.reading.clear()
    box = Outbox(client.write, invokes=invokes, cap=cap)
    _flushed(box, 0)
    return client, box


def _run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))


def test_a_step_reaches_the_stream_inside_the_flush_that_follows_it():
    async def go():
        client = Client()
        box = Outbox(client.write, invokes=1, cap=1 << 20)
        _step(box, 0)
        assert client.received() == []  # nothing goes before the flush: the step is filled in place first
        box.flush()
        assert client.received() == [[0]]  # no turn of the event loop in between
        box.put_invoke_result(trace_pb2.InvokeResult(invoke_index=0))
        await box.finished
        assert client.received() == [[0], ("invoke", 0)]
        assert box.queued == 0

    _run(go)


def test_steps_coalesce_while_a_write_is_in_flight_and_order_is_kept():
    async def go():
        client, box = _in_flight(invokes=2)
        for i in (1, 2):
            _flushed(box, i)
        box.put_invoke_result(trace_pb2.InvokeResult(invoke_index=0))
        _flushed(box, 3)
        await asyncio.sleep(0.01)
        assert client.received() == [[0]]  # the first write is still in flight
        client.reading.set()
        box.put_invoke_result(trace_pb2.InvokeResult(invoke_index=1))
        await box.finished
        assert client.received() == [[0], [1, 2], ("invoke", 0), [3], ("invoke", 1)]
        assert box.queued == 0

    _run(go)


def test_large_steps_start_a_new_message():
    async def go():
        client, box = _in_flight(cap=8 * BATCH_BYTES)
        _step(box, 1, BATCH_BYTES // 2 + 1)
        _step(box, 2, BATCH_BYTES // 2 + 1)
        box.put_invoke_result(trace_pb2.InvokeResult(invoke_index=0))
        client.reading.set()
        await box.finished
        assert client.received() == [[0], [1], [2], ("invoke", 0)]

    _run(go)


def test_a_client_that_does_not_read_hits_the_cap():
    async def go():
        _, box = _in_flight(cap=100)  # step 0 in flight: no longer counted as waiting
        for i in range(1, 11):
            _flushed(box, i)
        with pytest.raises(ResourceExhausted, match="reading too slowly"):
            _step(box, 11)
        box.close()

    _run(go)


def test_a_failed_trace_does_not_write_its_backlog():
    async def go():
        client, box = _in_flight()
        _flushed(box, 1)
        box.fail(ResourceExhausted("too slow"))
        client.reading.set()
        with pytest.raises(ResourceExhausted, match="too slow"):
            await box.finished
        await asyncio.sleep(0.01)
        assert client.received() == [[0]]
        box.close()

    _run(go)


@pytest.mark.parametrize("how", ["raises at once", "raises after a turn", "its future fails"])
def test_a_write_that_fails_ends_the_trace_with_its_error(how):
    async def go():
        async def write(message):
            if how == "raises after a turn":
                await asyncio.sleep(0)
            elif how == "its future fails":
                broken = asyncio.get_running_loop().create_future()
                asyncio.get_running_loop().call_soon(broken.set_exception, ConnectionError("reset"))
                await broken
            raise ConnectionError("reset")

        box = Outbox(write, invokes=1, cap=1 << 20)
        _flushed(box, 0)
        with pytest.raises(ConnectionError, match="reset"):
            await box.finished

    _run(go)


def test_closing_cancels_a_write_in_flight_and_stops_writing():
    async def go():
        client, box = _in_flight()
        await asyncio.sleep(0)
        box.close()
        await asyncio.sleep(0.01)
        assert client.cancelled  # the write in flight saw the cancellation
        assert box.finished.cancelled()
        _flushed(box, 1)
        await asyncio.sleep(0.01)
        assert client.received() == [[0]]

    _run(go)


def test_a_stream_interval_holds_steps_back_to_join_the_next_ones():
    async def go():
        client = Client()
        box = Outbox(client.write, invokes=1, cap=1 << 20, interval_s=0.05)
        _flushed(box, 0)
        assert client.received() == [[0]]  # nothing sent yet: no reason to wait
        _flushed(box, 1)
        _flushed(box, 2)
        assert client.received() == [[0]]
        await asyncio.sleep(0.2)
        assert client.received() == [[0], [1, 2]]
        box.put_invoke_result(trace_pb2.InvokeResult(invoke_index=0))
        await box.finished

    _run(go)


def test_a_trace_that_fails_while_steps_wait_out_the_interval_sends_none_of_them():
    async def go():
        client = Client()
        box = Outbox(client.write, invokes=1, cap=1 << 20, interval_s=0.05)
        _flushed(box, 0)
        _flushed(box, 1)  # waits out the interval
        box.fail(ResourceExhausted("too slow"))
        with pytest.raises(ResourceExhausted):
            await box.finished
        await asyncio.sleep(0.1)
        assert client.received() == [[0]]
        box.close()

    _run(go)
