"""StepOps: a plan's ops selected at one step, sorted by what the hooks do with them.

Sorted once per plan and step pattern, not per row: the per-row code only looks at
the sorted tuples. Separate from the per-request state because requests with the
same reads share one StepOps (a block of rows is keyed by its identity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..shared import plan as P


@dataclass(frozen=True)
class StepOps:
    """The ops selected at one step, sorted by what the hooks do with them (once per
    plan and step pattern, not per row)."""

    ops: tuple[P.Op, ...]
    logits_writes: tuple[P.Op, ...]
    # A condition looks at the sampler's row: keep a copy of it for after the draw.
    needs_processed: bool
    # Reads computed for all rows at once, with the key of their batch.
    batched_reads: tuple[tuple[str, tuple[Any, ...]], ...]
    # Reads computed per row (module and logit-lens reads, the drawn sample).
    row_reads: tuple[P.Op, ...]
    # Only reads, none with a condition: every read launched is kept.
    plain: bool
    # Only batched reads and reads of the drawn token, none with a condition: rows
    # with equal keys (and frontend) form one Block. None: each row is a Row.
    block_key: tuple[Any, ...] | None

    @classmethod
    def of(cls, ops: tuple[P.Op, ...]) -> StepOps:
        reads = tuple(op for op in ops if isinstance(op.action, P.READS))
        keyed = [(op, _batch_key(op.action)) for op in reads]
        batched = tuple((op.name, key) for op, key in keyed if key is not None)
        row_reads = tuple(op for op, key in keyed if key is None)
        # Module writes are done before the draw (in the forward pass): at the sampler
        # they are nothing to decide.
        drawn = tuple(op for op in ops if not isinstance(op.action, P.WriteModule))
        plain = len(reads) == len(drawn) and all(op.condition is None for op in drawn)
        samples = tuple(op.name for op in row_reads if isinstance(op.action, P.ReadSample))
        blockable = bool(ops) and plain and len(samples) == len(row_reads)
        found = cls(
            ops,
            tuple(op for op in ops if isinstance(op.action, P.LOGITS_WRITES)),
            P.conditions_use_logits(ops),
            batched,
            row_reads,
            plain,
            (batched, samples) if blockable else None,
        )
        if found.block_key is None:
            return found
        # One object per block key, shared by every request with these reads: a step
        # groups its rows into blocks by object identity, not by hashing the key per row.
        if len(_BLOCK_OPS) > 4096:
            _BLOCK_OPS.clear()
        return _BLOCK_OPS.setdefault(found.block_key, found)

    @property
    def samples(self) -> tuple[str, ...]:
        """Names of the reads of the drawn token (of a block's ops)."""
        assert self.block_key is not None
        return self.block_key[1]


_BLOCK_OPS: dict[tuple[Any, ...], StepOps] = {}


def _batch_key(action: P.Action) -> tuple[Any, ...] | None:
    """Reads with the same key are one device computation for all their rows."""
    if isinstance(action, P.ReadLogprobs):
        return ("logprobs", action.top_k)
    if isinstance(action, P.ReadLogits):
        return ("logits", action.stage, action.top_k, action.token_ids)
    return None


NO_OPS = StepOps.of(())
ERROR_OPS = StepOps.of((P.Op("error", P.StepSet(), None, P.Stop()),))
