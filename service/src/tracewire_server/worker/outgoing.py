"""A step's message to one frontend, assembled from its rows and blocks (the wire format is
shared/sidechannel.py; worker/sender.py sends it).

Separate from the sender: this is the per-step, per-row work on the collector thread
(which rows each frontend gets, which columns travel whole or cut), the sender only
moves bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from ..shared.sidechannel import ReadResult, RowBlock, StepBatch, StepRecord
from .batch import Block, Row
from .host import ColumnRow, ColumnRows, HostBatch


class _Record(msgspec.Struct, gc=False):
    """A StepRecord before the step's columns are placed: its reads of a column still
    as rows of their HostBatch. (A struct: one per traced row and frontend, as cheap to
    make as a tuple.)"""

    key: str
    step: int
    token: int
    values: dict[str, ReadResult]
    stopped: bool
    error: str | None
    refs: dict[str, ColumnRow]


class _BlockOut(NamedTuple):
    block: Block
    tokens: list[int]  # each block row's drawn token


class _Placed(NamedTuple):
    """Where a HostBatch went in the message: its column, and batch row -> column row
    (None: the same rows)."""

    column: int
    where: dict[int, int] | None


class Outgoing:
    """One step's message to one frontend: a record per traced row, a RowBlock per
    block, and each batched read once (a column), which the records and blocks point
    into. Per row this costs a few references, not a tensor conversion; per block row,
    a list entry. A column computed over several frontends' rows goes whole to each one
    reading it when it is small (WHOLE_COLUMN_BYTES), else with only the rows that
    frontend reads (a full-vocabulary read is not sent whole to every frontend)."""

    __slots__ = ("_blocks", "_records", "_used")

    def __init__(self) -> None:
        self._records: list[_Record] = []
        self._blocks: list[_BlockOut] = []
        self._used: dict[int, ColumnRows] = {}  # id(batch) -> the batch, and the rows read

    def _use(self, batch: HostBatch, rows: list[int]) -> None:
        found = self._used.get(id(batch))
        if found is None:
            self._used[id(batch)] = ColumnRows(batch, rows.copy())
        else:
            found.rows.extend(rows)

    def add(self, key: str, row: Row) -> None:
        values: dict[str, ReadResult] = {}
        refs: dict[str, ColumnRow] = {}
        if row.error is None:
            for name, read in row.kept.items():
                if type(read) is ColumnRow:
                    refs[name] = read
                    self._use(read.batch, [read.row])
                else:
                    values[name] = read.result(row.token)  # type: ignore[union-attr]
        self._records.append(_Record(key, row.step, row.token, values, row.stopped, row.error, refs))

    def add_failed(self, key: str, step: int, token: int, error: str) -> None:
        self._records.append(_Record(key, step, token, {}, False, error, {}))

    def add_block(self, block: Block, tokens: list[int]) -> None:
        for read in block.reads.values():
            self._use(read.batch, read.rows)
        self._blocks.append(_BlockOut(block, tokens))

    def message(self, engine_s: float, collector_s: float) -> StepBatch:
        columns: list[ReadResult] = []
        place: dict[int, _Placed] = {}  # by id(batch)
        for ident, used in self._used.items():
            batch = used.batch
            rows = sorted(set(used.rows)) if not batch.small else None
            if rows is None or len(rows) == batch.rows:
                place[ident] = _Placed(len(columns), None)
                columns.append(batch.column())
            else:
                place[ident] = _Placed(len(columns), {r: p for p, r in enumerate(rows)})
                columns.append(batch.column(rows))
        records = []
        for record in self._records:
            rows_of: dict[str, tuple[int, int]] = {}
            for name, ref in record.refs.items():
                c, where = place[id(ref.batch)]
                rows_of[name] = (c, ref.row if where is None else where[ref.row])
            records.append(StepRecord(record.key, record.step, record.token, record.values, record.stopped,
                                      record.error, rows_of))
        blocks = []
        for block, tokens in self._blocks:
            reads = []
            for name, read in block.reads.items():
                c, where = place[id(read.batch)]
                reads.append((name, c, read.rows if where is None else [where[r] for r in read.rows]))
            keys = [seq.plan.key for seq in block.seqs]
            blocks.append(RowBlock(keys, block.steps, tokens, reads, list(block.ops.samples)))
        return StepBatch(records, columns, blocks, engine_s, collector_s)
