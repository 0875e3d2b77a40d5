"""A step's message to one frontend, assembled from its rows and blocks (the wire format is
shared/sidechannel.py; worker/sender.py sends it).

Separate from the sender: this is the per-step, per-row work on the collector thread
(which rows each frontend gets, which columns travel whole or cut), the sender only
moves bytes.
"""

from __future__ import annotations

from typing import Any

from ..shared.sidechannel import ReadResult, RowBlock, StepBatch, StepRecord
from .batch import Block, Row
from .host import HostBatch


class Outgoing:
    """One step's message to one frontend: a record per traced row, a RowBlock per
    block, and each batched read once (a column), which the records and blocks point
    into. Per row this costs a few references, not a tensor conversion; per block row,
    a list entry. A column computed over several frontends' rows goes whole to each one
    reading it when it is small (WHOLE_COLUMN_BYTES), else with only the rows that
    frontend reads (a full-vocabulary read is not sent whole to every frontend)."""

    __slots__ = ("_blocks", "_records", "_used")

    def __init__(self) -> None:
        # StepRecord fields, with the column rows still as (batch, batch row)
        self._records: list[tuple[Any, ...]] = []
        self._blocks: list[tuple[Block, list[int]]] = []
        self._used: dict[int, tuple[HostBatch, list[int]]] = {}  # id(batch) -> (batch, rows read)

    def _use(self, batch: HostBatch, rows: list[int] | tuple[int]) -> None:
        found = self._used.get(id(batch))
        if found is None:
            self._used[id(batch)] = (batch, list(rows))
        else:
            found[1].extend(rows)

    def add(self, key: str, row: Row) -> None:
        values: dict[str, ReadResult] = {}
        refs: dict[str, tuple[HostBatch, int]] = {}
        if row.error is None:
            for name, read in row.kept.items():
                if type(read) is tuple:
                    refs[name] = read
                    self._use(read[0], (read[1],))
                else:
                    values[name] = read.result(row.token)  # type: ignore[union-attr]
        self._records.append((key, row.step, row.token, values, row.stopped, row.error, refs))

    def add_failed(self, key: str, step: int, token: int, error: str) -> None:
        self._records.append((key, step, token, {}, False, error, {}))

    def add_block(self, block: Block, tokens: list[int]) -> None:
        for batch, rows in block.reads.values():
            self._use(batch, rows)
        self._blocks.append((block, tokens))

    def message(self, engine_s: float, collector_s: float) -> StepBatch:
        columns: list[ReadResult] = []
        # id(batch) -> (its column, batch row -> column row; None: the same)
        place: dict[int, tuple[int, dict[int, int] | None]] = {}
        for ident, (batch, used) in self._used.items():
            rows = sorted(set(used)) if not batch.small else None
            if rows is None or len(rows) == batch.rows:
                place[ident] = (len(columns), None)
                columns.append(batch.column())
            else:
                place[ident] = (len(columns), {r: p for p, r in enumerate(rows)})
                columns.append(batch.column(rows))
        records = []
        for key, step, token, values, stopped, error, refs in self._records:
            rows = {}
            for name, (batch, j) in refs.items():
                c, where = place[id(batch)]
                rows[name] = (c, j if where is None else where[j])
            records.append(StepRecord(key, step, token, values, stopped, error, rows))
        blocks = []
        for block, tokens in self._blocks:
            reads = []
            for name, (batch, batch_rows) in block.reads.items():
                c, where = place[id(batch)]
                reads.append((name, c, batch_rows if where is None else [where[r] for r in batch_rows]))
            keys = [seq.plan.key for seq in block.seqs]
            blocks.append(RowBlock(keys, block.steps, tokens, reads, list(block.ops.samples)))
        return StepBatch(records, columns, blocks, engine_s, collector_s)

