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
from .host import scalar
from .ops import NO_OPS
from .sequences import Sequence


class Context:
    """What a condition can look at for one row at one step. `before_draw`: a write's
    condition, decided before this step's forward pass / draw (dictionary values are then
    the previous step's)."""

    def __init__(self, row: Row, before_draw: bool = False) -> None:
        self.row = row
        self.before_draw = before_draw
        self._logprobs: torch.Tensor | None = None

    def dictionary_value(self, cond: P.DictionaryValue) -> float | None:
        """The value the condition compares: this step's (its internal read, on the host
        now), or before the draw the previous step's (None at step 0: the leaf is false)."""
        key = cond.read_name()
        seq = self.row.seq
        if self.before_draw:
            found = seq.condition_values.get(key)
            return found[1] if found is not None and found[0] == seq.step - 1 else None
        return scalar(self.row.reads[key])

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
    if isinstance(cond, P.DictionaryValue):
        value = ctx.dictionary_value(cond)
        return value is not None and _compare(value, cond.comparison, cond.value)
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
    return holds(condition, Context(Row(-1, seq, NO_OPS), before_draw=True))


def remember_condition_values(row: Row) -> None:
    """Keep this step's dictionary-condition values on the sequence, for the writes of the
    next step (which decide before their forward pass)."""
    for name in row.selected.condition_reads:
        launched = row.reads.get(name)
        if launched is not None:
            row.seq.condition_values[name] = (row.step, scalar(launched))
