"""Conditions: whether an op's condition holds for one row at one step.

What a condition can look at (the drawn token, the sampler's row, the text so far) is
a Context over the row; the plan's condition types (shared/plan.py) say what each one
asks, this evaluates them: in the worker, a new condition kind touches only `holds`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..shared import plan as P
from .batch import Row
from .ops import NO_OPS
from .sequences import Sequence


class Context:
    """What a condition can look at for one row at one step."""

    def __init__(self, row: Row) -> None:
        self.row = row
        self._logprobs: torch.Tensor | None = None

    @property
    def processed(self) -> torch.Tensor:
        assert self.row.processed is not None
        return self.row.processed.row

    @property
    def logprobs(self) -> torch.Tensor:
        if self._logprobs is None:
            self._logprobs = torch.log_softmax(self.processed, dim=-1)
        return self._logprobs


def _compare(value: float, comparison: str, threshold: float) -> bool:
    if comparison == ">":
        return value > threshold
    if comparison == ">=":
        return value >= threshold
    if comparison == "<":
        return value < threshold
    return value <= threshold


def holds(cond: P.Condition | None, ctx: Context) -> bool:
    if cond is None:
        return True
    if isinstance(cond, P.SampledIn):
        return ctx.row.token in cond.token_ids
    if isinstance(cond, P.ArgmaxIn):
        return int(torch.argmax(ctx.processed)) in cond.token_ids
    if isinstance(cond, P.TextContains):
        # The text so far: before the forward pass (writes) up to the last step; once the
        # token is drawn (reads, stops) with it (_finish adds it first).
        return ctx.row.seq.scan.contains(cond.text)
    if isinstance(cond, P.TextMatches):
        return ctx.row.seq.scan.matches(cond.pattern)
    if isinstance(cond, P.TokenProbability):
        token = ctx.row.token if cond.token_id is None else cond.token_id
        prob = float(torch.exp(ctx.logprobs[token]))
        return _compare(prob, cond.comparison, cond.value)
    if isinstance(cond, P.Entropy):
        lp = ctx.logprobs
        probs = torch.exp(lp)
        entropy = float(-(probs * torch.where(probs > 0, lp, torch.zeros_like(lp))).sum())
        return _compare(entropy, cond.comparison, cond.value)
    if isinstance(cond, P.AllOf):
        return all(holds(c, ctx) for c in cond.conditions)
    if isinstance(cond, P.AnyOf):
        return any(holds(c, ctx) for c in cond.conditions)
    if isinstance(cond, P.Not):
        return not holds(cond.condition, ctx)
    raise TypeError(f"unknown condition {type(cond).__name__}")


def holds_before_forward(condition: P.Condition | None, seq: Sequence, drain: Callable[[], None]) -> bool:
    """A module write's condition, decided before the forward pass (from the text and
    tokens of the steps before it). `drain`: waits until every step the collector holds
    is finished, so the text so far includes them all."""
    if condition is None:
        return True
    drain()
    return holds(condition, Context(Row(-1, seq, NO_OPS)))
