"""StepOps: a plan's ops selected at one step, sorted by what the hooks do with them.

Sorted once per plan and step pattern, not per row: the per-row code only looks at
the sorted tuples. Separate from the per-request state because requests with the
same reads share one StepOps (a block of rows is keyed by its identity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, cast

from ..shared import plan as P


class LogitsReadOp(NamedTuple):
    """A logits read selected at a step: its name, and what it reads (the rows reading
    equal reads are one device computation: logits_reads.py)."""

    name: str
    read: P.LogitsRead


# A block's module read: its name, and a module's whole value (or its chosen heads or
# neurons), the logit lens, a dictionary (probe, SAE) on a module or an attention
# pattern's top k, at the new token.
ColumnReadAction = P.ReadModule | P.ReadLogitLens | P.ReadDictionary | P.ReadAttentionPattern
ColumnRead = tuple[str, ColumnReadAction]


class BlockKey(NamedTuple):
    """What a block's rows read: logits reads, the drawn token and column reads of
    modules (nothing else)."""

    logits_reads: tuple[LogitsReadOp, ...]
    samples: tuple[str, ...]
    column_reads: tuple[ColumnRead, ...]


def _column_read(op: P.Op) -> bool:
    """A read each row takes as one row of a column over the batch: a module's whole
    value or its chosen units, the logit lens, a dictionary's values (not a
    condition's), or an attention pattern's top k, at the new token (module_hooks.py
    gathers the modules' rows for all such rows at once, attention_patterns.py computes
    their patterns' top k at once; module_reads.py launches the column). A pattern's
    full rows are not: each row's length is its own position's."""
    a = op.action
    if type(a) is P.ReadModule:  # (heads and neurons too: their module input's column, units cut once)
        return not a.mean and a.positions.kind == "new_token"
    if type(a) is P.ReadDictionary:
        return a.positions.kind == "new_token" and not a.internal
    if type(a) is P.ReadAttentionPattern:
        return a.positions.kind == "new_token" and a.top_k > 0
    return type(a) is P.ReadLogitLens and a.positions.kind == "new_token"


@dataclass(frozen=True)
class StepOps:
    """The ops selected at one step, sorted by what the hooks do with them (once per
    plan and step pattern, not per row)."""

    ops: tuple[P.Op, ...]
    logits_writes: tuple[P.Op, ...]
    # A condition looks at the sampler's row: keep a copy of it for after the draw.
    needs_processed: bool
    # Reads computed for all rows at once (source "logits").
    logits_reads: tuple[LogitsReadOp, ...]
    # Reads computed per row from module outputs (source "modules").
    module_reads: tuple[P.Op, ...]
    # Names of the reads of the drawn token (source "sample").
    samples: tuple[str, ...]
    # Reads launched per row after the draw: module reads or the drawn token.
    reads_per_row: bool
    # Only reads, none with a condition: every read launched is kept.
    plain: bool
    # Names of the reads computing dictionary conditions' values (never returned).
    condition_reads: frozenset[str]
    # Only logits reads, reads of the drawn token and column reads, none with a
    # condition: rows with equal keys (and frontend) form one Block. None: each row is a Row.
    block_key: BlockKey | None
    # A block's module reads, and the distinct module paths whose rows they read.
    column_reads: tuple[ColumnRead, ...] = ()
    column_paths: tuple[str, ...] = ()

    @classmethod
    def of(cls, ops: tuple[P.Op, ...]) -> StepOps:
        reads = [(op, op.action) for op in ops if isinstance(op.action, P.READS)]
        logits_reads = tuple(LogitsReadOp(op.name, cast(P.LogitsRead, read)) for op, read in reads
                             if read.source == "logits")
        module_reads = tuple(op for op, read in reads if read.source == "modules")
        samples = tuple(op.name for op, read in reads if read.source == "sample")
        # Module writes are done before the draw (in the forward pass): at the sampler
        # they are nothing to decide.
        drawn = tuple(op for op in ops if not isinstance(op.action, P.WriteModule))
        internal = frozenset(op.name for op, read in reads if isinstance(read, P.ReadDictionary) and read.internal)
        plain = len(reads) == len(drawn) and all(op.condition is None for op in drawn) and not internal
        blockable = bool(ops) and plain and all(_column_read(op) for op in module_reads)
        column_reads = (tuple((op.name, cast(ColumnReadAction, op.action))
                              for op in module_reads)
                        if blockable else ())
        found = cls(
            ops,
            tuple(op for op in ops if isinstance(op.action, P.LOGITS_WRITES)),
            P.conditions_use_logits(ops),
            logits_reads,
            module_reads,
            samples,
            bool(module_reads or samples),
            plain,
            internal,
            BlockKey(logits_reads, samples, column_reads) if blockable else None,
            column_reads,
            # (modules whose rows are gathered: a pattern's keys and queries are the
            # attention hooks', planned per sequence, not a column)
            tuple(dict.fromkeys(path for name, read in column_reads if type(read) is not P.ReadAttentionPattern
                                for _, path in read.module_reads(name))),
        )
        if found.block_key is None:
            return found
        # One object per block key, shared by every request with these reads: a step
        # groups its rows into blocks by object identity, not by hashing the key per row.
        if len(_BLOCK_OPS) > 4096:
            _BLOCK_OPS.clear()
        return _BLOCK_OPS.setdefault(found.block_key, found)


_BLOCK_OPS: dict[BlockKey, StepOps] = {}


NO_OPS = StepOps.of(())
ERROR_OPS = StepOps.of((P.Op("error", P.StepSet(), None, P.Stop()),))
