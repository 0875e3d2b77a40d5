"""Compiled steering, the host side: which steering-table slot each flat token row reads.

shared/steering.py holds the tables the compiled graph reads and their slot algebra
(SlotPlanner: a slot per distinct composed write, shared, freed when its last user
ends): decoder layers' tables, and the heads' and neurons' (UnitTables), one planner
each; a write goes to the planner whose tables hold its module. This module decides,
before each forward pass, which of the pass's rows write what: it reads the requests'
Sequences, the pass's Spans and write conditions, all worker-only types, so it lives in
the worker package rather than beside the tables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..shared import plan as P
from ..shared import steering
from . import recompute
from .conditions import holds_before_forward
from .dictionaries import Dictionaries
from .module_hooks import Span
from .patch_store import PatchStore
from .runner import RunnerView
from .sequences import UNPLANNED, Sequence, Sequences

# One planner's fill for a forward pass: flat token rows, their tables, their slots.
Fill = tuple[list[int], list[int], list[int]]


class Placed(NamedTuple):
    """A write at one flat token row of this pass: the step making it and the row's token
    position (what a patch's operand row is looked up by)."""

    write: P.WriteModule
    step: int
    position: int


# Under vLLM's logger: vLLM configures its handlers (with the process prefix) in the
# worker processes; a logger of our own would have none there.
log = logging.getLogger(f"vllm.{__name__}")


def _check_clamps(edits: list[P.WriteModule]) -> None:
    """A compiled table clamps a row once, after its other writes (the graph adds the clamp's
    change to the stream those left): anything else fails this request (RuntimeError)."""
    clamps = [k for k, edit in enumerate(edits) if edit.edit == "clamp"]
    if len(clamps) > 1 or (clamps and clamps[0] != len(edits) - 1):
        raise RuntimeError("on a compiled engine a row takes one dictionary clamp, after its other writes "
                           "(--enforce-eager serves the rest)")


def _mean_groups(seq: Sequence, by_row: dict[tuple[int, int, int], list[Placed]]
                 ) -> dict[tuple[int, int, int], tuple[int, int]] | None:
    """The mean groups of one request's rows in this pass: (planner, table, row) -> the
    group's first and last flat row, for each row of a mean write over two rows or more
    (the mean of one row is the row). The graph takes a group's mean over its members
    between its ends (steering.pack), which holds when a request has one mean group at a
    table in a pass and the writes at its rows are the same; anything else fails this
    request (None), naming the write."""
    members: dict[tuple[int, int, int, int], list[int]] = {}  # (planner, table, write, step) -> rows
    for (p, table, row), placed in by_row.items():
        means = [w for w in placed if w.write.edit == "mean"]
        if not means:
            continue
        if len(means) > 1 or any(w.write.ref is not None for w in placed):
            seq.error = seq.error or (
                f"mean of {means[0].write.module}: on a compiled engine a row takes one mean ablation and no "
                "patch in a forward pass (--enforce-eager serves the rest)")
            return None
        members.setdefault((p, table, id(means[0].write), means[0].step), []).append(row)
    found: dict[tuple[int, int, int], tuple[int, int]] = {}
    tables_grouped: set[tuple[int, int]] = set()
    for (p, table, _, _), rows in members.items():
        if len(rows) < 2:
            continue
        first_writes = [id(w.write) for w in by_row[(p, table, rows[0])]]
        module = by_row[(p, table, rows[0])][0].write.module
        if (p, table) in tables_grouped or any(
                [id(w.write) for w in by_row[(p, table, row)]] != first_writes for row in rows):
            seq.error = seq.error or (
                f"mean of {module}: on a compiled engine a request's mean ablations at one module in a forward pass "
                "are one write, and its other writes there cover all of the mean's positions or none "
                "(--enforce-eager serves the rest)")
            return None
        tables_grouped.add((p, table))
        found.update({(p, table, row): (min(rows), max(rows)) for row in rows})
    return found


class SteeringSlots:
    """Fills the compiled graph's steering tables before each forward pass."""

    def __init__(self, runner: RunnerView, sequences: Sequences,
                 tables: list[steering.SteeringTables | steering.UnitTables], drain: Callable[[], None],
                 dictionaries: Dictionaries | None = None, store: PatchStore | None = None) -> None:
        self.runner = runner
        self.sequences = sequences
        self.dictionaries = dictionaries if dictionaries is not None else Dictionaries()  # (steer writes' directions)
        self.store = store if store is not None else PatchStore()  # (patch / add_read operands)
        self.planners = [steering.SlotPlanner(t) for t in tables]
        self.drain = drain  # (write conditions on the text: every finished step first)
        # The requests of the last forward pass, when it decoded them one token each and
        # the next pass may keep its steering slots should it decode the same ones.
        self._steered_batch: list[str] | None = None
        sequences.writer_ended = self._release

    def _release(self, owner: str) -> None:
        for planner in self.planners:
            planner.release(owner)

    def _table(self, module: str) -> tuple[int, int] | None:
        """(planner, table) holding `module`'s writes; None: none here (another pipeline
        stage's layer: the compiler refuses the rest)."""
        for p, planner in enumerate(self.planners):
            table = planner.table_of.get(module)
            if table is not None:
                return p, table
        return None

    def install(self) -> None:
        """Before each forward pass (on the host, before the graph is replayed)."""
        self.runner.before_model_forward(self._steer_safely)

    def _steer_safely(self) -> None:
        req_ids = self.runner.req_ids
        if req_ids == self._steered_batch and self.runner.query_starts(len(req_ids))[-1] == len(req_ids):
            return  # the same requests decoding as in the last pass: the tables already hold their slots
        self._steered_batch = None
        # per planner: (flat token rows, their tables, their slots)
        fills: list[Fill] = [([], [], []) for _ in self.planners]
        for planner in self.planners:
            planner.begin_pass()
        try:
            if self._writes_modules() and self._plan(fills):
                self._steered_batch = list(req_ids)
            for planner, (rows, tables, slots) in zip(self.planners, fills, strict=True):
                planner.fill(rows, tables, slots)
        except Exception as e:  # noqa: BLE001 - never break vLLM's forward pass
            self._steered_batch = None
            log.exception("filling the steering tables failed; failing the batch's steering traces")
            for req_id in self.sequences.module_writers:
                seq = self.sequences.by_id.get(req_id)
                if seq is not None:
                    seq.error = seq.error or f"{type(e).__name__} filling the steering tables: {e}"
            for planner in self.planners:
                planner.fill([], [], [])  # nobody steered this pass, rather than stale slots

    def _writes_modules(self) -> bool:
        """Whether a request in this batch has module writes: requests without cost a
        set difference per forward pass. Ended requests give back their slots."""
        for req_id in set(self.runner.req_ids).difference(self.sequences.by_id):
            self.sequences.get(req_id)  # a request's first pass: its plan is read here
        self.sequences.forget_ended_writers()
        return bool(self.sequences.module_writers)

    def _plan(self, fills: list[Fill]) -> bool:
        """This pass's writes as (flat token row, table, slot) triples, per planner. True
        when the next pass may keep them, should it decode the same requests one token
        each: every writer here decodes one new token and writes the same at every new token."""
        repeatable = True
        req_ids = self.runner.req_ids
        starts = self.runner.query_starts(len(req_ids)).tolist()
        computed = self.runner.computed_tokens(len(req_ids)).tolist()
        writers = self.sequences.module_writers
        by_id = self.sequences.by_id
        output_count = self.runner.output_count
        for i, req_id in enumerate(req_ids):
            if req_id not in writers:
                continue
            seq = by_id.get(req_id)
            if seq is None or seq.error is not None:
                continue
            first, last, pos0 = starts[i], starts[i + 1], computed[i]
            drawn = output_count(req_id)
            if seq.steady is UNPLANNED:
                seq.steady = self._steady_slots(req_id, seq)
            if seq.steady is not None:  # the same writes at every new token (inlined: per row)
                if pos0 + last - first >= len(seq.prompt_ids) + drawn:
                    # (and, recomputing a preempted request, at each new token it had processed)
                    redo = recompute.recomputed(pos0, last - first, len(seq.prompt_ids), drawn)
                    steered = [first + p - pos0 for p in redo if p >= len(seq.prompt_ids) - 1] + [last - 1]
                    for p, table, slot in seq.steady:
                        rows, tables, slots = fills[p]
                        rows.extend(steered)
                        tables.extend([table] * len(steered))
                        slots.extend([slot] * len(steered))
                    repeatable = repeatable and last - first == 1
                else:
                    repeatable = False  # a prompt chunk: its next pass may reach the new token
                continue
            repeatable = False
            span = Span.of(len(seq.prompt_ids), drawn, first, last, pos0)
            # (planner, table, row) -> its writes, in plan order
            by_row: dict[tuple[int, int, int], list[Placed]] = {}
            for replay in span.replays(seq):  # a recomputed request: its writes there again
                assert isinstance(replay.op.action, P.WriteModule)
                where = self._table(replay.op.action.module)
                for row, position in zip(replay.rows, replay.positions, strict=True) if where is not None else ():
                    by_row.setdefault((*where, row), []).append(Placed(replay.op.action, replay.step, position))
            for k, op in enumerate(seq.plan.ops):
                if not isinstance(op.action, P.WriteModule) or not op.selects(seq.step):
                    continue
                op_rows, positions = span.rows(op.action.positions, seq.step)
                where = self._table(op.action.module)
                if where is not None and op_rows and holds_before_forward(op.condition, seq, self.drain):
                    seq.applied.add((seq.step, k))
                    for row, position in zip(op_rows, positions, strict=True):
                        by_row.setdefault((*where, row), []).append(Placed(op.action, seq.step, position))
            groups = _mean_groups(seq, by_row)
            for (p, table, row), placed in by_row.items() if groups is not None else ():
                if any(w.write.ref is not None for w in placed):
                    slot = self._patch_slot(seq, p, table, placed)
                else:
                    slot = self._slot(req_id, seq, p, table, [w.write for w in placed])
                if slot is None:
                    break
                rows, tables, slots = fills[p]
                rows.append(row)
                tables.append(table)
                group = groups.get((p, table, row))  # type: ignore[union-attr]
                slots.append(slot if group is None else steering.pack(slot, *group))
        return repeatable

    def _steady_slots(self, req_id: str, seq: Sequence) -> list[tuple[int, int, int]] | None:
        """(planner, table, slot) of each module this request writes, when it writes the
        same way at every new token and nowhere else (steering); None otherwise."""
        writes = [op.action for op in seq.plan.ops if isinstance(op.action, P.WriteModule)]
        steady = seq.constant is not None and all(
            op.condition is None and op.action.positions.kind == "new_token"  # type: ignore[union-attr]
            and op.action.ref is None  # type: ignore[union-attr] - (a patch's rows differ step by step)
            for op in seq.plan.ops if isinstance(op.action, P.WriteModule)
        )
        if not steady:
            return None
        by_table: dict[tuple[int, int], list[P.WriteModule]] = {}
        for write in writes:
            where = self._table(write.module)
            if where is not None:  # else another pipeline stage holds that layer
                by_table.setdefault(where, []).append(write)
        found = []
        for (p, table), edits in by_table.items():
            slot = self._slot(req_id, seq, p, table, edits)
            if slot is None:
                return []
            found.append((p, table, slot))
        return found

    def _slot(self, req_id: str, seq: Sequence, p: int, table: int, edits: list[P.WriteModule]) -> int | None:
        planner = self.planners[p]
        like = planner.tables.operand_like()  # (the operands' device and dtype: the tables')
        try:  # before the planner takes a slot: a dictionary replaced since fails this request only
            named = {id(e): self.dictionaries.get(e.dictionary.dictionary) for e in edits if e.dictionary is not None}
            _check_clamps(edits)
            slot = planner.slot(table, req_id, edits, lambda edit: seq.write_vector(edit, like, named.get(id(edit))),
                                lambda edit: named[id(edit)].clamp_rows(edit.dictionary, like.device))
        except RuntimeError as e:
            seq.error = seq.error or f"{edits[0].edit} of {edits[0].module}: {e}"
            return None
        if slot is None:
            seq.error = seq.error or (
                f"more than {planner.tables.num_slots - planner.tables.patch_slots - 1} different writes at "
                f"{planner.tables.names[table]} at once: too many distinct steering vectors in flight"
            )
        return slot

    def _patch_slot(self, seq: Sequence, p: int, table: int, placed: list[Placed]) -> int | None:
        """A slot of this pass for one row whose writes take a patch source's row."""
        planner = self.planners[p]
        like = planner.tables.operand_like()
        prompt_len = len(seq.prompt_ids)

        def vector(edit: P.WriteModule) -> torch.Tensor:
            if edit.ref is None:
                named = self.dictionaries.get(edit.dictionary.dictionary) if edit.dictionary is not None else None
                return seq.write_vector(edit, like, named)
            w = next(w for w in placed if w.write is edit)
            row = self.store.operand(edit, prompt_len, w.step, [w.position])[0]
            row = row.to(device=like.device, dtype=like.dtype)
            return row * edit.scale if edit.edit == "add_read" else row

        try:  # a source's row missing fails this request only
            slot = planner.patch_slot(table, [w.write for w in placed], vector)
        except RuntimeError as e:
            seq.error = seq.error or f"{placed[0].write.edit} of {placed[0].write.module}: {e}"
            return None
        if slot is None:
            seq.error = seq.error or (
                f"more than {planner.tables.patch_slots} patched rows at {planner.tables.names[table]} in one "
                f"forward pass ({steering.PATCH_ROWS_PER_SEQ} per sequence the engine holds, --max-num-seqs): "
                "patch fewer positions at once, or in more traces"
            )
        return slot
