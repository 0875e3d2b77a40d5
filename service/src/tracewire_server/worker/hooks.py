"""PlanHooks: runs each request's plan inside vLLM's worker, one engine step at a time.

Installed in every worker through `worker_extension_cls` + collective_rpc
(extension.py), as two kinds of hooks that share the per-request state (sequences.py):

Module hooks (module_hooks.py; eager engines only, they cannot fire inside compiled
graphs; compiled engines steer through tables, steering_slots.py): a
forward pre-hook on the model maps this forward pass's flat [tokens, hidden]
rows to requests (query_start_loc, computed tokens); forward hooks on each
addressable module then apply that step's module writes in place and copy out
the rows its module reads and logit-lens reads select. Values gathered over a
chunked prefill's several passes are joined at the step's sample.

Sampler hooks (here): the sampler's `forward` and `apply_logits_processors` are
wrapped on the instance:

    forward(logits)                       <- reads of the raw logits launched here
      apply_logits_processors(logits)     <- vLLM's processing (bias, penalties, ...)
        + reads before the writes         <- LOGITS_STAGE_BEFORE_WRITES; write conditions
        + tracewire writes                <- force / replace / add / bias / mask
        + reads of the processed logits   <- what the sampler draws from
      sample(logits)                      <- vLLM draws
    -> sampled ids                        <- logprobs, per-row reads; conditions and
                                             stops evaluated (collector)

Rows belong to requests in `input_batch.req_ids` order; rows of requests still
in a (chunked) prefill are skipped (vLLM discards their samples). A request
without a plan costs one dict lookup per step; a batch without plans goes
straight to vLLM's own code. Reads batched across rows (top-k, chosen ids, full
rows, logprobs) are one device computation per kind, taken from the logits where
they stand, with no copy of the rows first. Requests that only read (and only
such batched reads or the drawn token) are handled as blocks: arrays of rows,
with a few list entries per request and step.

After the draw the hook only launches the step's remaining reads as device work,
with non-blocking copies to the host, and hands the step to the collector thread
(collector.py), which waits for the copies, decides conditions and stops, and
sends the records. Nothing on the engine's thread waits for the device unless a
write's condition needs a value before the draw.

Failures inside one request's ops are caught per request and reported on its
record (its trace fails); vLLM's sampling always proceeds.

This module is the step's life (sampler hooks, which rows are traced, the draw, the
collector's finish); what each op does lives beside it: logits_reads.py,
logits_writes.py, module_reads.py, module_hooks.py, conditions.py; batch.py and
sequences.py hold the state; outgoing.py and sender.py the records' way out; and
runner.py is the only code that touches vLLM's runner.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from typing import Any, cast

import torch

from ..shared import plan as P
from ..shared import read_buffers, steering
from .batch import Block, Row, Step, StepWork
from .collector import StepCollector
from .conditions import Context, holds, remember_condition_values
from .dictionaries import Dictionaries, Loads
from .host import SAMPLE, to_host
from .logits_reads import BEFORE_WRITES, PROCESSED, RAW, UNWRITTEN, launch_batched, launch_logprobs
from .logits_writes import write_and_capture
from .module_hooks import ModuleHooks
from .module_reads import launch_column_reads, launch_module_reads
from .ops import ERROR_OPS, NO_OPS, StepOps
from .outgoing import Outgoing
from .patch_store import PatchStore
from .runner import RunnerView
from .sender import Sender
from .sequences import Sequences
from .steering_slots import SteeringSlots
from .timing import HOOK_TIMES_ENV, HookTimes

# Under vLLM's logger: vLLM configures its handlers (with the process prefix) in the
# worker processes; a logger of our own would have none there.
log = logging.getLogger(f"vllm.{__name__}")

_UNSEEN: Any = object()  # a request id the hooks have not looked up yet


class PlanHooks:
    """Owns the per-request plans and wraps one model runner's sampler."""

    def __init__(self, runner: RunnerView, fault_injection: bool) -> None:
        self.runner = runner
        # One side channel per frontend process, by route (on each pipeline stage's worker
        # that sends, RunnerView.sends; empty elsewhere).
        self.senders: dict[int, Sender] = {}
        self.fault_injection = fault_injection
        self.sequences = Sequences(runner)
        self._step: Step | None = None
        self.modules: ModuleHooks | None = None  # eager engines, and compiled ones with read buffers
        self.steering: SteeringSlots | None = None  # compiled engines with --compiled-steering
        # Activation patching: patch sources' values, per trace, until the trace ends.
        self.patches = PatchStore()
        # Probes and SAEs the frontends loaded (reads, writes and conditions use them).
        self.dictionaries = Dictionaries()
        self.loads = Loads(self.dictionaries, runner)
        # Off the engine's thread only where the device runs ahead of the host.
        self.collector: StepCollector[StepWork] = StepCollector(self._finish, threaded=runner.device_runs_ahead)
        period = float(os.environ.get(HOOK_TIMES_ENV) or 0)
        self.times: HookTimes | None = HookTimes(period) if period > 0 else None

    # -- installation ----------------------------------------------------------

    def install(self, sampler: Any) -> None:
        original_forward = sampler.forward
        original_apply = sampler.apply_logits_processors

        times = self.times

        def forward(logits: torch.Tensor, sampling_metadata: Any, *args: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                step = self._traced_step()
                if step:  # raw-stage reads: before vLLM's processors change the logits
                    launch_batched(step, logits, RAW)
            except Exception as e:  # noqa: BLE001 - vLLM's step must go on
                self._fail_batch("before the draw", e)
                step = None
            if not step:
                return original_forward(logits, sampling_metadata, *args, **kw)
            self._step = step
            spent = step.engine_s = time.perf_counter() - started
            try:
                out = original_forward(logits, sampling_metadata, *args, **kw)
            finally:
                self._step = None
            if times:
                started = time.perf_counter()
            try:
                self._after_sample(step, out.sampled_token_ids)
            except Exception as e:  # noqa: BLE001 - vLLM's step must go on
                self._fail_batch("after the draw", e, step)
            if times:
                times.add(engine_s=spent + time.perf_counter() - started, steps=1, rows=step.size())
            return out

        def apply_logits_processors(logits: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
            logits = original_apply(logits, *args, **kw)
            step = self._step
            if step:
                started = time.perf_counter()
                try:
                    writes = any(row.selected.logits_writes for row in step.rows)
                    if writes:
                        # Launched before the writes change rows in place (on a GPU, stream
                        # order puts these reads first).
                        launch_batched(step, logits, BEFORE_WRITES)
                    write_and_capture(step.rows, logits, self.collector.drain, self.fault_injection)
                    # After the writes: what is drawn from. Without writes this step both
                    # stages are the same row, read in one pass.
                    launch_batched(step, logits, PROCESSED if writes else UNWRITTEN)
                except Exception as e:  # noqa: BLE001 - vLLM's step must go on
                    self._fail_batch("at the logits writes", e, step)
                spent = time.perf_counter() - started
                step.engine_s += spent
                if times:
                    times.add(engine_s=spent)
            return logits

        sampler.forward = forward
        sampler.apply_logits_processors = apply_logits_processors

    def install_module_hooks(self) -> None:
        """Forward hooks on every addressable module (eager engines)."""
        self.modules = ModuleHooks(self.runner, self.sequences, self.collector.drain, self.patches,
                                   self.dictionaries)
        self.modules.install()

    def install_compiled_reads(self, buffers: read_buffers.ReadBuffers) -> None:
        """Take module reads' rows from the compiled graph's read buffers after each forward pass."""
        self.modules = ModuleHooks(self.runner, self.sequences, self.collector.drain, self.patches,
                                   self.dictionaries, buffers=buffers)
        self.modules.install()

    def install_compiled_steering(self, tables: list[steering.SteeringTables | steering.UnitTables]) -> None:
        """Fill the compiled graph's steering tables before each forward pass."""
        self.steering = SteeringSlots(self.runner, self.sequences, tables, self.collector.drain, self.dictionaries,
                                      self.patches)
        self.steering.install()

    # -- per step --------------------------------------------------------------

    def _fail_batch(self, where: str, error: Exception, step: Step | None = None) -> None:
        """A failure in the hooks' own bookkeeping (a tracewire bug, not one request's op,
        which fails only that request): vLLM's step goes on, and every traced request in
        the batch fails with the error, reported at its next step."""
        log.exception("tracewire hooks failed %s; failing the traces in this batch", where)
        message = f"tracewire hooks failed {where}: {type(error).__name__}: {error}"
        if step is not None:
            step.fail(message)
        for req_id in self.runner.req_ids:
            seq = self.sequences.by_id.get(req_id)
            if seq is not None and seq.error is None:
                seq.error = message

    def _traced_step(self) -> Step:
        """This step's traced rows: a block entry for each row that only reads (a few
        list appends), a Row for the others; idle rows only count the step."""
        req_ids = self.runner.req_ids
        discard_np = self.runner.discarded(len(req_ids))
        if discard_np is not None and not discard_np.any():
            discard_np = None  # one check for the step: under load rows mid-prefill are rare
        rows: list[Row] = []
        blocks: dict[tuple[int, int], Block] = {}
        sequences = self.sequences
        get = sequences.by_id.get
        for i, req_id in enumerate(req_ids):
            # A request seen before and untraced is one dict lookup; one that reads the
            # same at every step (the common traced case under load) a few list appends.
            seq = get(req_id, _UNSEEN)
            if seq is _UNSEEN:
                seq = sequences.get(req_id)
                get = sequences.by_id.get  # (it may have made a new dict)
            if seq is None or (discard_np is not None and discard_np[i]):
                continue  # (mid-prefill: vLLM throws this sample away)
            key = seq.block
            if key is not None and seq.error is None:
                ops = seq.constant
            else:
                if seq.error_reported:
                    continue
                ops = seq.ops_at(seq.step)
                if seq.error is not None or not seq.blocks(ops):
                    if ops is NO_OPS and seq.error is None and not seq.needs_text:
                        seq.step += 1  # nothing to do, record or remember at this step
                        continue
                    row = Row(i, seq, ops)
                    if seq.error is not None:  # failed in a module hook: report it on this step
                        row.selected, row.error = ERROR_OPS, seq.error
                    rows.append(row)
                    continue
                key = (seq.plan.route, id(ops))  # alive: the block holds it
            block = blocks.get(key)
            if block is None:
                block = blocks[key] = Block(cast(StepOps, ops), key[0])
            block.index.append(i)
            block.seqs.append(seq)
            block.steps.append(seq.step)
            seq.step += 1
        return Step(rows, list(blocks.values()))

    def _after_sample(self, step: Step, sampled: torch.Tensor) -> None:
        """Launch the rest of the step's reads (every read selected now, its condition
        decided later) and hand the step to the collector. No waiting for the device."""
        started = time.perf_counter()
        drawn = sampled.view(sampled.shape[0], -1)[:, 0]
        launch_logprobs(step, drawn)
        fired = []
        for row in [row for row in step.rows if row.error is None and row.selected.reads_per_row]:
            for name in row.selected.samples:
                row.reads[name] = SAMPLE  # the token itself, known once the step is done
            if row.selected.module_reads:
                fired.append(row)
        if self.modules is not None:  # blocks' module reads: a column per module
            launch_column_reads(step.blocks, self.modules.take_columns(), self.modules.lens, self.dictionaries)
        try:
            launch_module_reads(fired, self.modules.lens if self.modules is not None else None, self.patches,
                                self.dictionaries)
        except Exception as e:  # noqa: BLE001 - a batch failure fails the traces in it
            for row in fired:
                row.error = f"{type(e).__name__}: {e}"
        # On the CPU vLLM may reuse the sampled-ids buffer: keep a copy of our own.
        tokens = (to_host(drawn) if drawn.device.type != "cpu" else drawn.clone()).numpy()  # see HostBatch
        done = None
        if drawn.device.type == "cuda":
            # Blocking: the collector sleeps until the step is done. A default event's
            # synchronize() spins, and a spinning collector holds a whole core for as
            # long as traced requests run, a core the frontends and vLLM's own threads
            # need under load.
            done = torch.cuda.Event(blocking=True)
            done.record()
        for row in step.rows:
            row.step = row.seq.step
            row.seq.step += 1
        step.engine_s += time.perf_counter() - started  # (before: on the CPU submit finishes the step)
        self.collector.submit(StepWork(step, tokens, done))

    def _finish(self, work: StepWork) -> None:
        """On the collector thread: the step's values are on the host now; decide its
        conditions and stops, send its records, extend each sequence's text."""
        started = time.perf_counter()
        work.wait()
        ready = time.perf_counter()
        tokens = work.tokens
        batches: defaultdict[int, Outgoing] = defaultdict(Outgoing)  # by route
        for row in work.step.rows:
            seq = row.seq
            row.token = int(tokens[row.index])
            if seq.tracker is not None:  # before the conditions: the text includes the token
                seq.scan.extend(seq.tracker.add(row.token))
            if row.selected.ops:
                if row.error is None and row.selected.condition_reads:
                    remember_condition_values(row)  # (before the conditions: they use them)
                if row.error is None and row.selected.plain:
                    row.kept = row.reads  # the common case: keep every read, nothing to decide
                elif row.error is None:
                    try:
                        self._decide(row)
                    except Exception as e:  # noqa: BLE001 - fails this request's trace only
                        row.error = f"{type(e).__name__}: {e}"
                if row.error is not None:
                    seq.error, seq.error_reported = row.error, True  # no more work for this request
                batches[seq.plan.route].add(seq.plan.key, row)
        for block in work.step.blocks:
            out = batches[block.route]
            block_tokens = tokens[block.index].tolist()
            if block.error is None:
                out.add_block(block, block_tokens)
                continue
            for seq, step, token in zip(block.seqs, block.steps, block_tokens, strict=True):
                seq.error, seq.error_reported = block.error, True
                out.add_failed(seq.plan.key, step, token, block.error)
        finished = time.perf_counter() - ready  # up to the sends (their cost is the pipe's)
        for route, out in batches.items():
            sender = self.senders.get(route)
            if sender is not None:
                sender.send(out.message(work.step.engine_s, finished))
        if self.times:
            self.times.add(collector_s=time.perf_counter() - ready, wait_s=ready - started)

    def _decide(self, row: Row) -> None:
        """This row's stops, and which of its launched reads it keeps."""
        ctx = Context(row)
        for op in row.selected.ops:
            if isinstance(op.action, P.READS):
                if op.name in row.selected.condition_reads:
                    continue  # a condition's value: kept on the sequence, never returned
                if holds(op.condition, ctx):
                    row.kept[op.name] = row.reads[op.name]
            elif isinstance(op.action, P.Stop):
                if holds(op.condition, ctx):
                    row.stopped = True
