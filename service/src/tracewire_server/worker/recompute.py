"""Module writes made again on the positions vLLM recomputes.

Under KV-cache pressure vLLM preempts a running request and later recomputes it: one
prefill over its prompt and the tokens it has drawn, whose keys and values replace the
ones it dropped. A module write changed those keys and values the first time (prompt
positions at step 0, each step's new token after): the recomputation must make the same
writes at the same positions, or every later token comes from a model that was never
written to there, an answer silently different from the run that was not preempted.

So each write a sequence makes is remembered as (step, op index) once it applied (its
condition held then: text conditions are not decided again, since the text now is not
the text then), and a pass that computes positions an earlier step computed gets those
writes again here, at those positions.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from ..shared import plan as P

# Under vLLM's logger: vLLM configures its handlers (with the process prefix) in the
# worker processes; a logger of our own would have none there.
log = logging.getLogger(f"vllm.{__name__}")


class Replay(NamedTuple):
    """A write to make again in this pass: at these flat rows, the positions its
    step `step` wrote."""

    op: P.Op
    step: int
    rows: list[int]
    positions: list[int]


def written_positions(positions: P.Positions, step: int, prompt_len: int) -> list[int]:
    """The token positions a write at `positions` changed at `step`: prompt positions at
    step 0, and the token each step processes (the last prompt position at step 0, the
    token drawn at step s - 1 at step s)."""
    found = positions.prompt_positions(prompt_len) if step == 0 else []
    if positions.kind in ("new_token", "all"):
        new_token = prompt_len - 1 + step
        if new_token not in found:
            found.append(new_token)
    return found


def recomputed(pos0: int, count: int, prompt_len: int, drawn: int) -> range:
    """The positions of a pass (`count` rows from position `pos0`) that an earlier step
    computed already: all of the pass before the token this step processes, once the
    request has drawn a token (before that, a pass before the last prompt position is a
    chunk of the first prefill)."""
    if drawn == 0:
        return range(0)
    redo = range(pos0, min(pos0 + count, prompt_len - 1 + drawn))
    if redo:
        log.info("a preempted request is recomputed: positions %d-%d again", redo.start, redo.stop - 1)
    return redo


def replays(plan: P.SequencePlan, applied: set[tuple[int, int]], first: int, pos0: int,
            positions: range, prompt_len: int) -> list[Replay]:
    """The writes `applied` made at `positions` (recomputed, in a pass whose rows start
    at `first`, at position `pos0`), in the order they were first made."""
    found = []
    for step, index in sorted(applied):
        op = plan.ops[index]
        assert isinstance(op.action, P.WriteModule)
        wanted = [p for p in written_positions(op.action.positions, step, prompt_len) if p in positions]
        if wanted:
            found.append(Replay(op, step, [first + p - pos0 for p in wanted], wanted))
    return found
