"""An earlier pipeline stage's steps: module reads and writes where no sample is drawn.

Under pipeline parallelism only the last stage computes logits and draws; the sampler
hooks (hooks.py), which count each request's steps and send its records, run there. An
earlier stage holds some of the layers: the module hooks run on it as anywhere
(module_hooks.py), and after each forward pass this counts the steps of the requests the
pass computed a next token for, launches their module reads, and sends the stage's part
of each step's record (token -1: the stage does not know it); the server joins the parts
(SequencePlan.parts_at). The compiler keeps what needs the last stage off earlier
stages: conditions, the logit lens, patch operands.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from .batch import Row
from .dictionaries import Dictionaries
from .module_hooks import Span
from .module_reads import launch_module_reads
from .ops import NO_OPS
from .outgoing import Outgoing
from .patch_store import PatchStore
from .runner import RunnerView
from .sender import Sender
from .sequences import Sequence, Sequences

log = logging.getLogger(f"vllm.{__name__}")


class StageSteps:
    """Counts steps and sends module reads on a pipeline stage that draws no samples."""

    def __init__(self, runner: RunnerView, sequences: Sequences, senders: dict[int, Sender],
                 patches: PatchStore, dictionaries: Dictionaries) -> None:
        self.runner = runner
        self.sequences = sequences
        self.senders = senders
        self.patches = patches
        self.dictionaries = dictionaries

    def install(self) -> None:
        self.runner.after_forward(self._finish_safely)

    def _finish_safely(self) -> None:
        try:
            self._finish()
        except Exception:  # noqa: BLE001 - never break vLLM's forward pass
            log.exception("finishing a pipeline stage's step failed")

    def _rows(self) -> tuple[list[Row], list[Sequence]]:
        """This pass's requests that computed their next token and have ops at the step
        (or a failure to report), and every request that computed its next token."""
        runner = self.runner
        req_ids = runner.req_ids
        starts, computed = runner.query_starts(len(req_ids)), runner.computed_tokens(len(req_ids))
        rows, stepped = [], []
        for i, req_id in enumerate(req_ids):
            seq = self.sequences.get(req_id)
            if seq is None or seq.error_reported:
                continue
            span = Span.of(len(seq.prompt_ids), runner.output_count(req_id), int(starts[i]), int(starts[i + 1]),
                           int(computed[i]))
            if not span.samples:
                continue  # (a chunk of its prompt: the step goes on in the next pass)
            ops = seq.ops_at(seq.step)
            if ops is not NO_OPS or seq.error is not None:
                row = Row(i, seq, ops, step=seq.step)
                row.error = seq.error
                rows.append(row)
            stepped.append(seq)
        return rows, stepped

    def _finish(self) -> None:
        rows, stepped = self._rows()
        try:
            launch_module_reads([row for row in rows if row.error is None and row.selected.module_reads], None,
                                self.patches, self.dictionaries)
        finally:
            for seq in stepped:  # (after the reads: they look at the step they serve)
                seq.step += 1
        if not rows:
            return
        if torch.device(self.runner.device).type == "cuda":
            torch.cuda.current_stream().synchronize()  # (the reads' copies to the host)
        batches: defaultdict[int, Outgoing] = defaultdict(Outgoing)  # by route
        for row in rows:
            if row.error is None:
                row.kept = row.reads  # (no conditions on earlier stages: the compiler refuses them)
            else:
                row.seq.error, row.seq.error_reported = row.error, True
            batches[row.seq.plan.route].add(row.seq.plan.key, row)
        for route, out in batches.items():
            sender = self.senders.get(route)
            if sender is not None:
                sender.send(out.message(0.0, 0.0))
