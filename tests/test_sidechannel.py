"""The side channel's wire format: a step's batched reads travel once, as columns,
and each record gets back exactly its own row."""

from __future__ import annotations

import numpy as np
from tracewire_server import sidechannel
from tracewire_server.sidechannel import ReadResult, StepBatch, StepRecord, resolve
from tracewire_server.tensors import RawTensor


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
    wire = sidechannel._ENCODER.encode(StepBatch(records, columns))
    batch = sidechannel._DECODER.decode(wire)

    a, b, c = (resolve(r, batch.columns) for r in batch.records)
    np.testing.assert_array_equal(_array(a.values["top"].values), top_values[2])
    np.testing.assert_array_equal(_array(a.values["top"].token_ids), top_ids[2])
    np.testing.assert_array_equal(_array(a.values["lp"].values), logprobs[0])
    assert a.values["lp"].token_ids is None
    assert int(_array(a.values["s"].values)) == 7
    np.testing.assert_array_equal(_array(b.values["top"].values), top_values[0])
    assert (b.key, b.step, b.token_id, b.rows) == ("b", 3, 9, {})
    assert c.values == {} and c.stopped
