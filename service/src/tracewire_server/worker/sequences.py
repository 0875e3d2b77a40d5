"""The per-request state the worker keeps across steps, and the registry of it.

A request's plan arrives in its SamplingParams and is decoded the first time the
hooks see the request; the registry keeps one Sequence per request (None: untraced)
while the runner holds the request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..shared import detokenize, textmatch
from ..shared import plan as P
from .dictionaries import Dictionary
from .host import on_device
from .ops import NO_OPS, StepOps
from .pattern_state import KeyCache, PatternChunk
from .runner import RunnerView

# Sequence.steady before the steering planner has looked at the request.
UNPLANNED: Any = object()


def _always(op: P.Op) -> bool:
    """Whether the op is selected at every step (then a sequence's ops never change)."""
    return op.steps == P.StepSet() and op.selects(1)


@dataclass
class Sequence:
    """Per-request state the worker keeps across steps."""

    plan: P.SequencePlan
    needs_text: bool
    prompt_ids: list[int] = field(default_factory=list)
    step: int = 0
    # Text conditions: the text generated so far, as the client is sent it (its deltas
    # from the same tracker, on the same settings, as the server's; detokenize.py), held
    # as much as the conditions need of it (textmatch.py).
    tracker: detokenize.TextTracker | detokenize.DecodeStreamTracker | None = None
    error: str | None = None
    error_reported: bool = False
    scan: textmatch.TextScan = field(default_factory=textmatch.TextScan)
    # Module reads of the current step, gathered over its forward passes (a chunked
    # prefill runs several): read name -> [(positions, [rows, hidden] float32)].
    pending: dict[str, list[tuple[list[int], torch.Tensor]]] = field(default_factory=dict)
    # Write operands already on the device, by id() of the plan's action.
    operands: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    constant: StepOps | None = None  # the ops of every step, when they never change
    last_step: int | None = None  # after it no op is selected (None: open-ended)
    _sorted: dict[tuple[int, ...], StepOps] = field(default_factory=dict)
    # Compiled steering: (table, slot) of the writes this request makes at every new
    # token, when that is all it writes; None: planned per pass (UNPLANNED: not yet seen).
    steady: Any = UNPLANNED
    # (frontend, id of the ops) when every step reads the same and only reads: the
    # key of the Block its rows join, found without looking at the ops each step.
    block: tuple[int, int] | None = None
    # Whether its module reads may be column reads of a block (module_hooks.py gathers a
    # block's rows at once): not where a read is a patch source (each row's value is
    # stored) or under pipeline parallelism (earlier stages send each row's values).
    column_blocks: bool = True
    # The modules it reads at every new token as a block row when that is all its module
    # ops do (no writes, no attention patterns): the module hooks then plan its row by
    # these alone, vectorized with the others' (module_hooks.py). Empty otherwise.
    column_only: tuple[str, ...] = ()
    # Attention-pattern reads (attention_patterns.py): whether the plan has any; the
    # keys they need, by read name @ layer; this step's computed chunks, likewise.
    reads_patterns: bool = False
    # Each of them with the (name @ layer, layer) keys it keeps: found once, not per pass.
    pattern_reads: tuple[tuple[P.Op, tuple[tuple[str, int], ...]], ...] = ()
    # The plan's module reads and writes with their index in plan.ops (the module hooks
    # look only at these, each pass: most plans have none or one).
    hidden_ops: tuple[tuple[int, P.Op], ...] = ()
    # The module writes made so far, as (step, index in plan.ops): made again where vLLM
    # recomputes a preempted request (recompute.py).
    applied: set[tuple[int, int]] = field(default_factory=set)
    # Dictionary conditions' values, by internal read name: (step, value) of the last step
    # computed (writes look at the previous step's).
    condition_values: dict[str, tuple[int, float]] = field(default_factory=dict)
    key_caches: dict[str, KeyCache] = field(default_factory=dict)
    patterns: dict[str, list[PatternChunk]] = field(default_factory=dict)

    def write_vector(self, write: P.WriteModule, like: torch.Tensor,
                     dictionary: Dictionary | None = None) -> torch.Tensor:
        """A module write's operand (its float32 `vector`, times its scale for adds; for a
        dictionary steer, value * its features' directions) on `like`'s device in its
        dtype: built the first time, then kept in `operands`."""
        key = id(write)
        found = self.operands.get(key)
        if found is None:
            if write.dictionary is not None:
                assert dictionary is not None
                steer = write.dictionary
                vector = dictionary.direction(steer.features, steer.value).to(device=like.device, dtype=like.dtype)
                found = self.operands[key] = (vector,)
                return vector
            values = np.frombuffer(write.vector, "<f4")
            if write.edit == "add":
                values = values * np.float32(write.scale)
            found = self.operands[key] = (on_device(values, like.device, torch.float32).to(like.dtype),)
        return found[0]

    def __post_init__(self) -> None:
        self.pattern_reads = tuple(
            (op, tuple((key, int(key.rsplit("@", 1)[1])) for key, _ in op.action.module_reads(op.name)))
            for op in self.plan.ops if isinstance(op.action, P.ReadAttentionPattern))
        self.reads_patterns = bool(self.pattern_reads)
        self.hidden_ops = tuple((k, op) for k, op in enumerate(self.plan.ops) if isinstance(op.action, P.HIDDEN_OPS))
        if all(_always(op) for op in self.plan.ops):
            self.constant = StepOps.of(self.plan.ops)
            if self.blocks(self.constant):
                self.block = (self.plan.route, id(self.constant))  # (held here: the id stays theirs)
                column_ops = {name for name, _ in self.constant.column_reads}
                if (self.constant.column_paths and not self.reads_patterns
                        and all(op.name in column_ops for _, op in self.hidden_ops)):
                    self.column_only = self.constant.column_paths
        lasts = [op.steps.last() for op in self.plan.ops]
        if all(last is not None for last in lasts):
            self.last_step = max(lasts, default=-1)  # type: ignore[type-var]

    def blocks(self, ops: StepOps) -> bool:
        """Whether its row joins a Block at a step with these ops."""
        return (ops.block_key is not None and not self.needs_text
                and (self.column_blocks or not ops.column_reads))

    def ops_at(self, step: int) -> StepOps:
        """Runs per traced row per step: answered without looking at the ops when it
        can (every step alike, or past the last selected step)."""
        if self.constant is not None:
            return self.constant
        if self.last_step is not None and step > self.last_step:
            return NO_OPS
        ops = self.plan.active_at(step)
        if not ops:
            return NO_OPS
        key = tuple(map(id, ops))  # the plan's own op objects (not hashable: dicts inside)
        found = self._sorted.get(key)
        if found is None:
            found = self._sorted[key] = StepOps.of(ops)
        return found


class Sequences:
    """Every request the hooks have seen, by vLLM request id: its Sequence, or None when
    it has no plan (one dict lookup per step from then on)."""

    def __init__(self, runner: RunnerView) -> None:
        self.runner = runner
        self.by_id: dict[str, Sequence | None] = {}
        self.module_writers: set[str] = set()  # live requests whose plans write modules
        # Called with each module writer that ended (its steering slots go back).
        self.writer_ended: Callable[[str], None] | None = None

    def get(self, req_id: str) -> Sequence | None:
        """The request's Sequence, its plan decoded the first time it is asked for."""
        if req_id in self.by_id:
            return self.by_id[req_id]
        blob = self.runner.plan_blob(req_id)
        # (Under pipeline parallelism its stage's ops: none here, untraced here.)
        plan = P.decode_plan(blob).on_stage(self.runner.stage) if blob is not None else None
        seq = None
        if plan is not None and plan.ops:
            prompt_ids = self.runner.prompt_ids(req_id)
            single_stage = self.runner.stage == 0 and self.runner.samples
            seq = Sequence(plan, needs_text=plan.needs_text(), prompt_ids=prompt_ids,
                           column_blocks=single_stage and not plan.exports)
            if seq.needs_text:
                seq.tracker = detokenize.text_tracker(self.runner.tokenizer, prompt_ids, plan.skip_special_tokens)
                seq.scan = textmatch.TextScan(plan.text_needles())
            if any(isinstance(op.action, P.WriteModule) for op in plan.ops):
                self.module_writers.add(req_id)
        live = self.runner.live()
        if len(self.by_id) > 2 * len(live) + 64:
            self.by_id = {k: v for k, v in self.by_id.items() if k in live}
            self.forget_ended_writers()
        self.by_id[req_id] = seq
        return seq

    def forget_ended_writers(self) -> None:
        """Requests that ended give back their steering slots."""
        if self.module_writers:
            for req_id in self.module_writers.difference(self.runner.live()):
                self.module_writers.discard(req_id)
                if self.writer_ended is not None:
                    self.writer_ended(req_id)
