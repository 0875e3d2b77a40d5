"""One engine step's traced rows, as the hooks carry them from the sampler to the collector.

A row of a request that only reads (batched reads or the drawn token) joins a Block
of such rows (arrays: a few list entries per row); every other traced row is a Row
of its own. The Step holds both, and a StepWork hands the step to the collector.
Separate from the per-request state (sequences.py), which outlives the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .host import HostBatch, Launched
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
    """Traced rows of one step with the same block key and frontend (they only read,
    and only batched reads or the drawn token): arrays, a few list entries per row.
    Their steps are counted when the block is formed (no module reads need them)."""

    ops: StepOps
    route: int
    index: list[int] = field(default_factory=list)  # rows in the logits, ascending
    seqs: list[Sequence] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    # read name -> (its batch, the batch row of each of this block's rows)
    reads: dict[str, tuple[HostBatch, list[int]]] = field(default_factory=dict)
    error: str | None = None


@dataclass(slots=True)
class Step:
    """One engine step's traced rows: rows one by one, blocks as arrays."""

    rows: list[Row]
    blocks: list[Block]
    # Logprobs reads waiting for the draw: (key, logprobs [G, vocab], and where their
    # rows are, as _assign takes it: logits rows, first row, row map, targets).
    logprobs: list[tuple[Any, ...]] = field(default_factory=list)
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


# A batched read's consumer: a row or a block (its rows in order), and the read's name.
Target = tuple[Row | Block, str]


@dataclass
class StepWork:
    """One engine step's traced rows, handed to the collector to finish."""

    step: Step
    tokens: np.ndarray  # host copy of the drawn ids, one per logits row (filled once done)
    done: torch.cuda.Event | None  # recorded after the step's copies (None: CPU, already done)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

