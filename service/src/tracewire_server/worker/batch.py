"""One engine step's traced rows, as the hooks carry them from the sampler to the collector.

A row of a request that only reads (batched reads, the drawn token, or whole modules and
the logit lens at the new token: column reads) joins a Block of such rows (arrays: a few
list entries per row); every other traced row is a Row of its own. The Step holds both,
and a StepWork hands the step to the collector.
Separate from the per-request state (sequences.py), which outlives the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ..shared import plan as P
from .host import ColumnRows, Launched
from .ops import StepOps

if TYPE_CHECKING:
    from .sequences import Sequence


@dataclass(slots=True)
class Captured:
    """One row of a step's captured logits batch."""

    batch: torch.Tensor  # [rows, vocab] float32
    position: int

    @property
    def row(self) -> torch.Tensor:
        return self.batch[self.position]


@dataclass(slots=True)
class Row:
    index: int  # row in the logits
    seq: Sequence
    selected: StepOps  # the ops selected at this step (none: only count the step)
    step: int = -1
    processed: Captured | None = None  # for conditions on the sampler's row
    token: int = -1
    reads: dict[str, Launched] = field(default_factory=dict)  # conditions not yet decided
    kept: dict[str, Launched] = field(default_factory=dict)  # the reads whose conditions held
    stopped: bool = False
    error: str | None = None


@dataclass(slots=True)
class Block:
    """Traced rows of one step with the same block key and frontend (they only read:
    batched reads, the drawn token, column reads): arrays, a few list entries per row.
    Their steps are counted when the block is formed (the forward pass, which their
    column reads need the step for, has run by then)."""

    ops: StepOps
    route: int
    index: list[int] = field(default_factory=list)  # rows in the logits, ascending
    seqs: list[Sequence] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    # read name -> its batch, and the batch row of each of this block's rows
    reads: dict[str, ColumnRows] = field(default_factory=dict)
    error: str | None = None


# A batched read's consumer: a row or a block (its rows in order), and the read's name.
Target = tuple[Row | Block, str]


class PendingLogprobs(NamedTuple):
    """A logprobs read waiting for the draw (the drawn token's logprob comes first): its
    log_softmax over the rows reading it, and where those rows are."""

    read: P.ReadLogprobs
    logprobs: torch.Tensor  # [rows, vocab]
    rows: list[int]  # the logits rows, ascending
    first: int  # rows[0]
    where: dict[int, int] | None  # logits row -> row of `logprobs` (None: the rows are one run)
    targets: list[Target]


@dataclass(slots=True)
class Step:
    """One engine step's traced rows: rows one by one, blocks as arrays."""

    rows: list[Row]
    blocks: list[Block]
    logprobs: list[PendingLogprobs] = field(default_factory=list)
    # Seconds the hooks spent on this step on the engine's thread, up to handing it to
    # the collector; sent with its records (the frontends' hook-time metric).
    engine_s: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.rows or self.blocks)

    def size(self) -> int:
        return len(self.rows) + sum(len(b.index) for b in self.blocks)

    def fail(self, message: str) -> None:
        for row in self.rows:
            row.error = row.error or message
        for block in self.blocks:
            block.error = block.error or message


@dataclass
class StepWork:
    """One engine step's traced rows, handed to the collector to finish."""

    step: Step
    tokens: np.ndarray  # host copy of the drawn ids, one per logits row (filled once done)
    done: torch.cuda.Event | None  # recorded after the step's copies (None: CPU, already done)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()
