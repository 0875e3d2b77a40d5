"""The side channel's wire format: a step's batched reads travel once, as columns,
and each record gets back exactly its own row."""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import zmq
from tracewire_server.shared import sidechannel
from tracewire_server.shared.sidechannel import ReadResult, RowBlock, StepBatch, StepRecord, resolve
from tracewire_server.shared.tensors import RawTensor
from tracewire_server.worker import sender as worker_sender


def _array(raw: RawTensor) -> np.ndarray:
    return np.frombuffer(raw.data, dtype=raw.dtype).reshape(raw.shape)


def test_records_get_their_own_rows_of_the_columns():
    rng = np.random.default_rng(0)
    top_values = rng.standard_normal((3, 4)).astype(np.float32)
    top_ids = rng.integers(0, 1000, (3, 4)).astype(np.int32)
    logprobs = rng.standard_normal((2, 6)).astype(np.float32)
    columns = [
        ReadResult(RawTensor.from_numpy(top_values), RawTensor.from_numpy(top_ids)),
        ReadResult(RawTensor.from_numpy(logprobs)),
    ]
    sample = ReadResult(RawTensor.from_numpy(np.asarray(7, np.int32)))
    records = [
        StepRecord("a", 0, 7, {"s": sample}, rows={"top": (0, 2), "lp": (1, 0)}),
        StepRecord("b", 3, 9, {}, rows={"top": (0, 0)}),
        StepRecord("c", 1, 4, {}, stopped=True),
    ]
    wire = sidechannel.encode(StepBatch(records, columns))
    batch = sidechannel.decode(wire)

    a, b, c = (resolve(r, batch.columns) for r in batch.records)
    np.testing.assert_array_equal(_array(a.values["top"].values), top_values[2])
    np.testing.assert_array_equal(_array(a.values["top"].token_ids), top_ids[2])
    np.testing.assert_array_equal(_array(a.values["lp"].values), logprobs[0])
    assert a.values["lp"].token_ids is None
    assert int(_array(a.values["s"].values)) == 7
    np.testing.assert_array_equal(_array(b.values["top"].values), top_values[0])
    assert (b.key, b.step, b.token_id, b.rows) == ("b", 3, 9, {})
    assert c.values == {} and c.stopped


def test_block_records_are_the_records_of_their_rows():
    rng = np.random.default_rng(1)
    top_values = rng.standard_normal((5, 3)).astype(np.float32)
    top_ids = rng.integers(0, 1000, (5, 3)).astype(np.int32)
    columns = [ReadResult(RawTensor.from_numpy(top_values), RawTensor.from_numpy(top_ids))]
    # Two sequences whose rows are 3 and 1 of the column (the others belong to others).
    block = RowBlock(["a", "b"], [5, 0], [11, 12], [("top", 0, [3, 1])], ["drawn"])
    wire = sidechannel.encode(StepBatch([], columns, [block]))
    batch = sidechannel.decode(wire)

    (decoded,) = batch.blocks
    a, b = (decoded.record(j, batch.columns) for j in range(2))
    assert (a.key, a.step, a.token_id, b.key, b.step, b.token_id) == ("a", 5, 11, "b", 0, 12)
    np.testing.assert_array_equal(_array(a.values["top"].values), top_values[3])
    np.testing.assert_array_equal(_array(b.values["top"].token_ids), top_ids[1])
    # A read of the drawn token is the token, as an int32 scalar.
    assert _array(b.values["drawn"].values).shape == () and int(_array(b.values["drawn"].values)) == 12
    assert a.error is None and not a.stopped and a.rows == {}


def test_rows_cut_from_the_bytes_equal_numpy_indexing():
    rng = np.random.default_rng(1)
    arrays = [
        rng.standard_normal((7, 5)).astype(np.float32),
        rng.integers(0, 1 << 40, (6, 2)),  # int64
        np.arange(6, dtype=np.int32),
        np.ones((1, 3), np.float32),
        rng.standard_normal((4, 3, 2)).astype(np.float32),
        rng.standard_normal((5, 4)).astype(np.float32)[:, ::2],  # not contiguous
        # a strided view of other bits
        rng.standard_normal((4, 2, 1, 6)).astype(np.float32)[..., 3:].view(np.int32),
        rng.standard_normal((4, 3)).astype(">f4"),  # big-endian
        np.zeros((0, 3), np.float32),
    ]
    for array in arrays:
        n = array.shape[0]
        # (a run of rows in order is sent as a view of the array: `n // 2..n`, all of them)
        for rows in ([], [0], [n - 1, 0, n // 2], list(range(n // 2, n)), list(range(n))) if n else ([],):
            cut = RawTensor.rows_of(array, rows)
            assert cut == RawTensor.from_numpy(array[rows]), (array.shape, array.dtype, rows)
            assert _array(cut).shape == (len(rows), *array.shape[1:])
            sent = msgspec.msgpack.decode(msgspec.msgpack.encode(cut), type=RawTensor)
            assert sent == RawTensor.from_numpy(array[rows]) and type(sent.data) is bytes


def _batch(key: str) -> StepBatch:
    return StepBatch([StepRecord(key, 0, 1, {})], [])


def test_sender_delivers_without_letting_go_of_the_gil_and_waits_when_it_cannot(tmp_path):
    # The fast path is in use here (pyzmq's own libzmq, through ctypes).
    assert worker_sender._send_keeping_gil() is not None
    address = f"ipc://{tmp_path}/side"
    sender = worker_sender.Sender(address, high_water_mark=1)
    sender.send(_batch("first"))  # queued for the reader to come
    # The pipe is full: the non-blocking send cannot go, so the send falls back to
    # pyzmq's, which waits for the reader instead of dropping the step.
    sent = threading.Event()
    worker = threading.Thread(target=lambda: (sender.send(_batch("second")), sent.set()))
    worker.start()
    assert not sent.wait(0.3)
    context = zmq.Context()
    reader = context.socket(zmq.PULL)
    reader.bind(address)
    try:
        assert reader.poll(10_000)
        worker.join(10)
        assert sent.is_set()
        sender.send(_batch("third"))  # a reader now: the GIL-keeping send
        keys = [sidechannel.decode(reader.recv()).records[0].key for _ in range(3)]
        assert keys == ["first", "second", "third"]
    finally:
        sender.close()
        reader.close(linger=0)
        context.term()


_PINNED_SENDER = """
import os, sys, time
usable = os.sched_getaffinity(0)
os.sched_setaffinity(0, {min(usable)})  # as vLLM's CPU backend pins its worker
from tracewire_server.worker.sender import Sender
sender = Sender("ipc://" + sys.argv[1])
tasks = f"/proc/{os.getpid()}/task"
for _ in range(100):  # the I/O thread names itself once it runs
    io = [int(t) for t in os.listdir(tasks) if open(f"{tasks}/{t}/comm").read().startswith("ZMQbg/IO")]
    if io:
        break
    time.sleep(0.05)
print(sorted(usable - {min(usable)}) or [min(usable)], sorted(os.sched_getaffinity(io[0])) if len(io) == 1 else io)
"""


def test_a_pinned_worker_sends_through_an_io_thread_off_its_cores(tmp_path):
    """Each send wakes the ZMQ I/O thread: on a pinned worker's own core it would preempt
    the engine step that sent it. It runs on the cores the worker leaves free (with one
    CPU there are none, and it shares the worker's)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PINNED_SENDER, str(tmp_path / "pull")],
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    expected, io_thread = out.split("] ")
    assert f"{expected}]" == io_thread
