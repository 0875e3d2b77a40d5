"""The side channel's wire format: per-step records from the worker to the server process.

One ZMQ PUSH socket per worker (rank 0 only) and frontend connects to the PULL
socket that frontend binds. Each engine step that touched a traced request of
that frontend sends one message: a msgpack StepBatch, tensors as raw bytes. A
read batched across rows (top-k logits, logprobs, ...) travels once for the
whole step, as a column the records point into. Sequences that only read (the
common case under load: top-k every step) travel as a RowBlock, their records as
arrays, so the worker spends a few list entries per sequence and step on them.
The server hands each record its own rows and routes records by plan key to the
trace waiting for them.

This module is what both ends must agree on (the messages, their encoding, where the
sockets live); the ends themselves are worker/sender.py (and worker/outgoing.py, which
assembles a step's message) and frontend/receiver.py.
"""

from __future__ import annotations

import glob
import os
import tempfile

import msgspec

from .tensors import RawTensor


class ReadResult(msgspec.Struct, array_like=True, frozen=True):
    values: RawTensor
    token_ids: RawTensor | None = None
    positions: RawTensor | None = None  # token positions of the rows (a column's: one row of them per row)


class StepRecord(msgspec.Struct, array_like=True, frozen=True):
    """What the worker saw and did for one sequence at one step."""

    key: str
    step: int
    token_id: int
    values: dict[str, ReadResult]
    stopped: bool = False
    error: str | None = None
    # Reads whose value is a row of one of the step's columns: name -> (column, row).
    # The server resolves them into `values` before a trace sees the record.
    rows: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


class RowBlock(msgspec.Struct, array_like=True, frozen=True):
    """The records of several sequences at one step, as arrays: record j is sequence
    keys[j] at steps[j], which drew tokens[j]; its read `name` is row rows[j] of
    `column` for each (name, column, rows) in `reads`, and the drawn token for each
    name in `samples`. No stops or errors (those travel as StepRecords)."""

    keys: list[str]
    steps: list[int]
    tokens: list[int]
    reads: list[tuple[str, int, list[int]]]
    samples: list[str] = msgspec.field(default_factory=list)

    def record(self, j: int, columns: list[ReadResult]) -> StepRecord:
        token = self.tokens[j]
        values = {name: token_read(token) for name in self.samples}
        for name, c, rows in self.reads:
            values[name] = _column_row(columns[c], rows[j])
        return StepRecord(self.keys[j], self.steps[j], token, values)


class StepBatch(msgspec.Struct, array_like=True, frozen=True):
    """One step's records for one frontend, and the columns they point into."""

    records: list[StepRecord]
    columns: list[ReadResult]
    blocks: list[RowBlock] = msgspec.field(default_factory=list)
    # The worker hooks' time on this step: on the engine's thread, and finishing it (the
    # collector thread; inline on CPUs). For the frontend's metrics.
    engine_s: float = 0.0
    collector_s: float = 0.0


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepBatch)
# A StepBatch as bytes and back (bound methods: the sender calls encode once per
# frontend per step).
encode = _ENCODER.encode
decode = _DECODER.decode


def _row(column: RawTensor, row: int) -> RawTensor:
    size = len(column.data) // column.shape[0]
    return RawTensor(column.dtype, column.shape[1:], column.data[row * size:(row + 1) * size])


def _column_row(column: ReadResult, j: int) -> ReadResult:
    """Row `j` of a column: its values, token ids and (a block's logit lens) positions."""
    return ReadResult(_row(column.values, j), _row(column.token_ids, j) if column.token_ids is not None else None,
                      _row(column.positions, j) if column.positions is not None else None)


def token_read(token: int) -> ReadResult:
    """The value of a read of the drawn token: an int32 scalar."""
    return ReadResult(RawTensor("int32", (), token.to_bytes(4, "little", signed=True)))


def resolve(record: StepRecord, columns: list[ReadResult]) -> StepRecord:
    """The record with its column rows as values of its own."""
    if not record.rows:
        return record
    values = dict(record.values)
    for name, (c, j) in record.rows.items():
        values[name] = _column_row(columns[c], j)
    return msgspec.structs.replace(record, values=values, rows={})


def socket_path(pid: int, suffix: str) -> str:
    """Where server process `pid` binds a Receiver's socket (`suffix` tells them apart)."""
    return os.path.join(tempfile.gettempdir(), f"tracewire-{pid}-{suffix}")


def socket_paths(pid: int) -> list[str]:
    """The socket files server process `pid`'s Receivers bound: for whoever outlives a
    server killed outright (engine_group.py) to remove."""
    return glob.glob(socket_path(pid, "*"))
