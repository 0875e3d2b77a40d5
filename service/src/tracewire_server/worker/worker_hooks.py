"""Worker hooks: run each request's plan inside vLLM's worker.

Installed in every worker through `worker_extension_cls` + collective_rpc, as two
kinds of hooks that share the per-request state (`PlanHooks`):

Module hooks (eager engines only; they cannot fire inside compiled graphs): a
forward pre-hook on the model maps this forward pass's flat [tokens, hidden]
rows to requests (query_start_loc, computed tokens); forward hooks on each
addressable module then apply that step's module writes in place and copy out
the rows its module reads and logit-lens reads select. Values gathered over a
chunked prefill's several passes are joined at the step's sample.

Sampler hooks: the sampler's `forward` and `apply_logits_processors` are wrapped
on the instance:

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
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from ..shared import detokenize, steering, textmatch
from ..shared import plan as P
from ..shared.sidechannel import ReadResult, RowBlock, StepBatch, StepRecord, token_read
from ..shared.tensors import RawTensor
from .collector import StepCollector
from .sender import Sender

# Under vLLM's logger: vLLM configures its handlers (with the process prefix) in the
# worker processes; a logger of our own would have none there.
log = logging.getLogger(f"vllm.{__name__}")

# Set to a number of seconds (e.g. `TRACEWIRE_HOOK_TIMES=10 make bench`): every worker
# prints where its hooks' time went over each such period, to find what bounds a
# trace's throughput. On the CPU the collector runs on the engine's thread, so its
# time is counted in both.
HOOK_TIMES_ENV = "TRACEWIRE_HOOK_TIMES"

# A batched read of at most this many bytes (top-20 of 256 rows: 40 KB) goes whole to
# every frontend reading any of its rows; larger ones (full logits rows) are cut per
# frontend, so none is sent what it does not read.
WHOLE_COLUMN_BYTES = 256 << 10


class _HookTimes:
    """Seconds the hooks spent on the engine's thread and on the collector thread."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.engine_s = self.collector_s = self.wait_s = 0.0
        self.steps = self.rows = 0
        self._since = time.perf_counter()
        self._lock = threading.Lock()

    def add(self, engine_s: float = 0.0, collector_s: float = 0.0, wait_s: float = 0.0,
            steps: int = 0, rows: int = 0) -> None:
        with self._lock:
            self.engine_s += engine_s
            self.collector_s += collector_s
            self.wait_s += wait_s
            self.steps += steps
            self.rows += rows
            now = time.perf_counter()
            if now - self._since < self.period_s or not self.steps:
                return
            elapsed, self._since = now - self._since, now
            print(
                f"tracewire hook times pid {os.getpid()}: {self.steps} traced steps in {elapsed:.1f} s "
                f"({self.rows / self.steps:.0f} rows/step); per step: engine thread "
                f"{1e3 * self.engine_s / self.steps:.3f} ms, collector {1e3 * self.collector_s / self.steps:.3f} ms "
                f"(+{1e3 * self.wait_s / self.steps:.3f} ms waiting for the device); step interval "
                f"{1e3 * elapsed / self.steps:.3f} ms",
                file=sys.stderr, flush=True,
            )
            self.engine_s = self.collector_s = self.wait_s = 0.0
            self.steps = self.rows = 0


@dataclass(frozen=True)
class _StepOps:
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
    # with equal keys (and frontend) form one _Block. None: each row is a _Row.
    block_key: tuple[Any, ...] | None

    @classmethod
    def of(cls, ops: tuple[P.Op, ...]) -> _StepOps:
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


_BLOCK_OPS: dict[tuple[Any, ...], _StepOps] = {}


def _batch_key(action: P.Action) -> tuple[Any, ...] | None:
    """Reads with the same key are one device computation for all their rows."""
    if isinstance(action, P.ReadLogprobs):
        return ("logprobs", action.top_k)
    if isinstance(action, P.ReadLogits):
        return ("logits", action.stage, action.top_k, action.token_ids)
    return None


_NO_OPS = _StepOps.of(())
_ERROR_OPS = _StepOps.of((P.Op("error", P.StepSet(), None, P.Stop()),))


def _always(op: P.Op) -> bool:
    """Whether the op is selected at every step (then a sequence's ops never change)."""
    return op.steps == P.StepSet() and op.selects(1)


_UNKNOWN: Any = object()
_UNSEEN: Any = object()  # a request id the hooks have not looked up yet


@dataclass
class _Sequence:
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
    constant: _StepOps | None = None  # the ops of every step, when they never change
    last_step: int | None = None  # after it no op is selected (None: open-ended)
    _sorted: dict[tuple[int, ...], _StepOps] = field(default_factory=dict)
    # Compiled steering: (table, slot) of the writes this request makes at every new
    # token, when that is all it writes; None: planned per pass (_UNKNOWN: not yet seen).
    steady: Any = _UNKNOWN
    # (frontend, id of the ops) when every step reads the same and only reads: the
    # key of the _Block its rows join, found without looking at the ops each step.
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if all(_always(op) for op in self.plan.ops):
            self.constant = _StepOps.of(self.plan.ops)
            if self.constant.block_key is not None and not self.needs_text:
                self.block = (self.plan.route, id(self.constant))  # (held here: the id stays theirs)
        lasts = [op.steps.last() for op in self.plan.ops]
        if all(last is not None for last in lasts):
            self.last_step = max(lasts, default=-1)  # type: ignore[type-var]

    def ops_at(self, step: int) -> _StepOps:
        """Runs per traced row per step: answered without looking at the ops when it
        can (every step alike, or past the last selected step)."""
        if self.constant is not None:
            return self.constant
        if self.last_step is not None and step > self.last_step:
            return _NO_OPS
        ops = self.plan.active_at(step)
        if not ops:
            return _NO_OPS
        key = tuple(map(id, ops))  # the plan's own op objects (not hashable: dicts inside)
        found = self._sorted.get(key)
        if found is None:
            found = self._sorted[key] = _StepOps.of(ops)
        return found


@dataclass(slots=True)
class _Captured:
    """One row of a step's captured logits batch."""

    batch: torch.Tensor  # [rows, vocab] float32
    position: int

    @property
    def row(self) -> torch.Tensor:
        return self.batch[self.position]


class _HostBatch:
    """Host arrays of one read kind for several rows, valid once the step's copies are
    done (_StepWork.wait). Viewed as numpy here, on the engine thread (the view keeps
    the host tensor alive): torch's .numpy() lets go of the GIL, and every time the
    collector thread lets go of it, it waits to get it back from a busy engine thread."""

    __slots__ = ("_whole", "ids", "values")

    def __init__(self, values: torch.Tensor, ids: torch.Tensor | None) -> None:
        self.values: np.ndarray = values.numpy()
        self.ids: np.ndarray | None = ids.numpy() if ids is not None else None
        self._whole: ReadResult | None = None

    @property
    def rows(self) -> int:
        return int(self.values.shape[0])

    @property
    def small(self) -> bool:
        """Small enough to send whole to every frontend reading any of its rows: cheaper
        than cutting each one its rows (Python per row, on the collector's GIL time)."""
        return self.values.nbytes + (self.ids.nbytes if self.ids is not None else 0) <= WHOLE_COLUMN_BYTES

    def column(self, rows: list[int] | None = None) -> ReadResult:
        """These rows (None: all) at once, as sent: the server hands each trace its row.
        All of them are converted once, however many frontends they go to."""
        values, ids = self.values, self.ids
        if rows is None:
            if self._whole is None:
                self._whole = ReadResult(RawTensor.from_numpy(values),
                                         RawTensor.from_numpy(ids) if ids is not None else None)
            return self._whole
        return ReadResult(RawTensor.rows_of(values, rows), RawTensor.rows_of(ids, rows) if ids is not None else None)


@dataclass
class _HostRead:
    """One row's read on its way to the host (a module or logit-lens read, or the
    drawn sample); batched reads are (_HostBatch, row) pairs instead."""

    batch: _HostBatch | None  # None: the drawn token itself (known after the wait)
    positions: list[int] | None = None

    def result(self, token: int) -> ReadResult:
        if self.batch is None:
            return token_read(token)
        whole = self.batch.column()
        if self.positions is None:
            return whole
        return ReadResult(whole.values, whole.token_ids, RawTensor.from_numpy(np.asarray(self.positions, np.int32)))


# A read launched for one row: its own value, or its row of a batch.
_Launched = _HostRead | tuple[_HostBatch, int]
_SAMPLE = _HostRead(None)


@dataclass(slots=True)
class _Row:
    index: int  # row in the logits
    seq: _Sequence
    selected: _StepOps  # the ops selected at this step (none: only count the step)
    step: int = -1
    processed: _Captured | None = None  # for conditions on the sampler's row
    token: int = -1
    reads: dict[str, _Launched] = field(default_factory=dict)  # conditions not yet decided
    kept: dict[str, _Launched] = field(default_factory=dict)  # the reads whose conditions held
    stopped: bool = False
    error: str | None = None


@dataclass(slots=True)
class _Block:
    """Traced rows of one step with the same block key and frontend (they only read,
    and only batched reads or the drawn token): arrays, a few list entries per row.
    Their steps are counted when the block is formed (no module reads need them)."""

    ops: _StepOps
    route: int
    index: list[int] = field(default_factory=list)  # rows in the logits, ascending
    seqs: list[_Sequence] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    # read name -> (its batch, the batch row of each of this block's rows)
    reads: dict[str, tuple[_HostBatch, list[int]]] = field(default_factory=dict)
    error: str | None = None


@dataclass(slots=True)
class _Step:
    """One engine step's traced rows: rows one by one, blocks as arrays."""

    rows: list[_Row]
    blocks: list[_Block]
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
_Target = tuple[_Row | _Block, str]


@dataclass
class _StepWork:
    """One engine step's traced rows, handed to the collector to finish."""

    step: _Step
    tokens: np.ndarray  # host copy of the drawn ids, one per logits row (filled once done)
    done: torch.cuda.Event | None  # recorded after the step's copies (None: CPU, already done)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a tensor this step computed, valid after _StepWork.wait(). On a GPU
    a non-blocking copy into pinned memory: the engine never waits for values it does
    not need itself. On the CPU the tensor itself (callers pass tensors they own)."""
    if t.device.type == "cpu":
        return t
    # One call (each torch call lets go of the GIL, which a busy engine thread then waits
    # to get back): a non-blocking copy off the device lands in pinned memory.
    return t.to("cpu", non_blocking=True)


def _on_device(values: np.ndarray | list[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small operand on `device` without waiting for the device: a blocking copy from
    pageable memory would synchronize it, a non-blocking one from pinned memory does not."""
    if isinstance(values, np.ndarray) and not values.flags.writeable:
        values = values.copy()  # torch wants writable memory (frombuffer over plan bytes is not)
    cpu = torch.as_tensor(values).to(dtype)
    if device.type == "cpu":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)


class _Context:
    """What a condition can look at for one row at one step."""

    def __init__(self, row: _Row) -> None:
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


def _holds(cond: P.Condition | None, ctx: _Context) -> bool:
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
        return all(_holds(c, ctx) for c in cond.conditions)
    if isinstance(cond, P.AnyOf):
        return any(_holds(c, ctx) for c in cond.conditions)
    if isinstance(cond, P.Not):
        return not _holds(cond.condition, ctx)
    raise TypeError(f"unknown condition {type(cond).__name__}")


def _operands(
    seq: _Sequence, action: P.Write, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """The action's vectors and ids on the device, built once per request. A module
    write's vector comes in the activations' dtype, times its scale for adds."""
    key = id(action)
    if key not in seq.operands:
        if isinstance(action, (P.ReplaceLogits, P.AddLogits)):
            found: tuple[torch.Tensor, ...] = (_on_device(np.frombuffer(action.values, "<f4"), device, torch.float32),)
        elif isinstance(action, P.WriteModule):
            vector = np.frombuffer(action.vector, "<f4")
            if action.edit == "add":
                vector = vector * np.float32(action.scale)
            found = (_on_device(vector, device, torch.float32).to(dtype),)
        elif isinstance(action, P.BiasLogits):
            found = (
                _on_device(list(action.bias.keys()), device, torch.long),
                _on_device(np.asarray(list(action.bias.values()), np.float32), device, torch.float32),
            )
        elif isinstance(action, P.MaskLogits):
            found = (_on_device(list(action.token_ids), device, torch.long),)
        else:
            found = ()
        seq.operands[key] = found
    return seq.operands[key]


def _apply_write(action: P.Write, row: torch.Tensor, seq: _Sequence, fault_injection: bool) -> None:
    if isinstance(action, P.ForceSample):
        # Only the forced token stays finite: greedy and random sampling (any
        # temperature, top-k, top-p) must then draw it.
        row.fill_(float("-inf"))
        row[action.token_id] = 0.0
    elif isinstance(action, P.ReplaceLogits):
        row.copy_(_operands(seq, action, row.device)[0])
    elif isinstance(action, P.AddLogits):
        row.add_(_operands(seq, action, row.device)[0])
    elif isinstance(action, P.BiasLogits):
        ids, vals = _operands(seq, action, row.device)
        row.index_add_(0, ids, vals.to(row.dtype))
    elif isinstance(action, P.MaskLogits):
        row.index_fill_(0, _operands(seq, action, row.device)[0], float("-inf"))
    elif isinstance(action, P.InjectFault):
        if fault_injection:
            raise RuntimeError(action.message)
    else:
        raise TypeError(f"unknown write {type(action).__name__}")


def _top_k(src: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values and int32 ids of the k largest per row, largest first, on src's
    device. torch.topk on the CPU too: with the one or two threads a CPU worker has, it
    beat numpy's argpartition + argsort at every width and row count measured (1-256
    rows, vocabularies of 2k-152k), by up to 2.5x."""
    top = torch.topk(src, k)
    values = top.values  # (vLLM's sampler works in float32 already: no call to make it so)
    return values if values.dtype == torch.float32 else values.float(), top.indices.to(torch.int32)


def _take_rows(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, bool]:
    """These rows of the logits (ascending, each once), and whether that is a view: it
    is when they are one run (every request traced, the common case under load), with
    no index to send to the device; otherwise a gathered copy."""
    first = rows[0]
    if rows[-1] - first + 1 == len(rows):  # ascending and unique: a run
        return logits[first:first + len(rows)], True
    return logits.index_select(0, _on_device(rows, logits.device, torch.long)), False


def _capture(logits: torch.Tensor, rows: list[_Row]) -> list[_Captured]:
    """One copy of these rows' logits (in logits order), float32, for conditions on
    them; each row gets a handle into it."""
    src, is_view = _take_rows(logits.detach(), [r.index for r in rows])
    batch = src.to(torch.float32, copy=is_view)
    return [_Captured(batch, j) for j in range(len(rows))]


def _gathered(row: _Row, key: str, module: str, positions_of: P.Positions) -> tuple[torch.Tensor, list[int]]:
    """The rows one hidden read gathered over this step's forward passes (a chunked
    prefill runs several), checked complete: [positions, hidden] and the positions."""
    chunks = row.seq.pending.pop(key, [])
    positions = [p for chunk_positions, _ in chunks for p in chunk_positions]
    if positions_of.new_token_only(row.seq.step):
        expected = 1
    else:
        expected = len(positions_of.prompt_positions(len(row.seq.prompt_ids)))
    if len(positions) != expected:
        raise RuntimeError(
            f"read {key!r} of {module!r} saw {len(positions)} of {expected} positions "
            "(positions served from the prefix cache never run through the model)"
        )
    # (one chunk, the common case: its rows as they are, already our own copy)
    return (chunks[0][1] if len(chunks) == 1 else torch.cat([t for _, t in chunks])), positions


def _logit_lens_value(row: _Row, name: str, read: P.ReadLogitLens, lens: _Lens) -> _HostRead:
    """log_softmax(lm_head(norm(stream))) per layer and position: [layers, positions, k]."""
    streams, positions = [], []
    for key, path in read.module_reads(name):
        values, positions = _gathered(row, key, path, read.positions)
        streams.append(values)
    logprobs = lens(torch.stack(streams))  # [layers, positions, vocab]
    if read.top_k:
        top = torch.topk(logprobs, read.top_k, dim=-1)
        return _HostRead(_HostBatch(_to_host(top.values), _to_host(top.indices.to(torch.int32))), positions)
    return _HostRead(_HostBatch(_to_host(logprobs), None), positions)


def _module_value(row: _Row, name: str, read: P.ReadModule) -> _HostRead:
    """A module read of the prompt's positions, or their mean (new-token reads travel as
    one column per module: _launch_row_reads)."""
    values, positions = _gathered(row, name, read.module, read.positions)
    if read.mean:
        return _HostRead(_HostBatch(_to_host(values.mean(0)), None))
    # [positions, hidden], with the prompt positions
    return _HostRead(_HostBatch(_to_host(values), None), positions=positions)


def _launch_row_reads(rows: list[_Row], lens: _Lens | None) -> None:
    """Launch the reads computed per row (module and logit-lens reads, the drawn
    sample), each on its way to the host. A module's new-token reads for every row are
    one [rows, hidden] column with one copy to the host, not a copy per row. A read that
    fails fails its own row's trace."""
    new_token: dict[str, list[tuple[_Row, str, torch.Tensor]]] = {}
    for row in rows:
        try:
            for op in row.selected.row_reads:
                a = op.action
                if isinstance(a, P.ReadModule):
                    if not a.mean and a.positions.new_token_only(row.seq.step):
                        values, _ = _gathered(row, op.name, a.module, a.positions)
                        new_token.setdefault(a.module, []).append((row, op.name, values[0]))
                    else:
                        row.reads[op.name] = _module_value(row, op.name, a)
                elif isinstance(a, P.ReadLogitLens):
                    assert lens is not None
                    row.reads[op.name] = _logit_lens_value(row, op.name, a, lens)
                else:
                    assert isinstance(a, P.ReadSample)
                    row.reads[op.name] = _SAMPLE
        except Exception as e:  # noqa: BLE001 - fails this request's trace only
            row.error = f"{type(e).__name__}: {e}"
    for members in new_token.values():
        members = [m for m in members if m[0].error is None]
        if members:
            batch = _HostBatch(_to_host(torch.stack([values for _, _, values in members])), None)
            for j, (row, name, _) in enumerate(members):
                row.reads[name] = (batch, j)


def _stage(key: tuple[Any, ...]) -> P.LogitsStage:
    """The logits a batched read is computed from (logprobs: the sampler's row)."""
    return "processed" if key[0] == "logprobs" else cast(P.LogitsStage, key[1])


# The stages _launch_batched serves at each point of the sampler's row.
_RAW: frozenset[P.LogitsStage] = frozenset({"raw"})
_BEFORE_WRITES: frozenset[P.LogitsStage] = frozenset({"before_writes"})
_PROCESSED: frozenset[P.LogitsStage] = frozenset({"processed"})
_UNWRITTEN: frozenset[P.LogitsStage] = _BEFORE_WRITES | _PROCESSED


def _union(targets: list[_Target]) -> list[int]:
    """The logits rows the targets read, ascending, each once."""
    if len(targets) == 1 and type(targets[0][0]) is _Block:
        return targets[0][0].index  # the common case: ascending already
    return sorted({r for target, _ in targets for r in (target.index if type(target) is _Block else (target.index,))})


def _launch_batched(step: _Step, logits: torch.Tensor, stages: frozenset[P.LogitsStage]) -> None:
    """Launch these stages' batched reads for the step's rows and blocks: one device
    computation per read key over all the rows reading it, straight from the logits as
    they are now (nothing is copied first: _take_rows), each result on its way to the
    host. Logprobs need the draw: their log_softmax is taken now and finished by
    _launch_logprobs."""
    groups: dict[tuple[Any, ...], list[_Target]] = {}
    for row in step.rows:
        if row.error is None:
            for name, key in row.selected.batched_reads:
                if _stage(key) in stages:
                    groups.setdefault(key, []).append((row, name))
    for block in step.blocks:
        for name, key in block.ops.batched_reads:
            if _stage(key) in stages:
                groups.setdefault(key, []).append((block, name))
    for key, targets in groups.items():
        try:
            rows = _union(targets)
            first = rows[0]
            src, is_view = _take_rows(logits, rows)
            where = None if is_view else {r: p for p, r in enumerate(rows)}
            if key[0] == "logprobs":
                lp = torch.log_softmax(src, dim=-1, dtype=torch.float32)
                step.logprobs.append((key, lp, rows, first, where, targets))
                continue
            values, ids = _logits(src, *key[2:])
            _assign(_HostBatch(_to_host(values), _to_host(ids) if ids is not None else None), targets, first, where)
        except Exception as e:  # noqa: BLE001 - fails the traces reading it
            _fail_targets(targets, e)


def _launch_logprobs(step: _Step, drawn: torch.Tensor) -> None:
    """[rows, 1 + k] logprobs of the drawn token then the top k, and their ids.
    `drawn`: the step's sampled ids on the device, one per logits row."""
    for (_, top_k), lp, rows, first, where, targets in step.logprobs:
        try:
            if where is None:
                ids = drawn[first:first + len(rows)]
            else:
                ids = drawn.index_select(0, _on_device(rows, drawn.device, torch.long))
            ids = ids.to(device=lp.device, dtype=torch.long).unsqueeze(1)
            if top_k:
                ids = torch.cat([ids, torch.topk(lp, top_k).indices], dim=1)
            _assign(_HostBatch(_to_host(lp.gather(1, ids)), _to_host(ids.to(torch.int32))), targets, first, where)
        except Exception as e:  # noqa: BLE001 - fails the traces reading it
            _fail_targets(targets, e)


def _assign(batch: _HostBatch, targets: list[_Target], first: int, where: dict[int, int] | None) -> None:
    """Give each target its rows of the batch, which holds logits rows `first`... (a
    run) or the rows `where` maps to batch rows."""
    for target, name in targets:
        if type(target) is _Block:
            index = target.index
            target.reads[name] = (batch, [r - first for r in index] if where is None else [where[r] for r in index])
        else:
            target.reads[name] = (batch, target.index - first if where is None else where[target.index])


def _fail_targets(targets: list[_Target], error: Exception) -> None:
    for target, _ in targets:
        target.error = target.error or f"{type(error).__name__}: {error}"


def _logits(
    src: torch.Tensor, top_k: int | None, token_ids: tuple[int, ...] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """These logits rows as read: top k, chosen ids, or whole rows (a copy: the
    sampler may change the logits in place); float32, and their ids."""
    if top_k is not None:
        return _top_k(src, top_k)
    if token_ids is not None:
        values = src.index_select(1, _on_device(list(token_ids), src.device, torch.long)).float()
        return values, torch.tensor(token_ids, dtype=torch.int32).expand(values.shape[0], -1).contiguous()
    return src.to(torch.float32, copy=True), None


def _module_output(path: str, output: Any) -> torch.Tensor:
    """The value a module read sees: for decoder layers the residual stream after the
    layer (vLLM's layers return (hidden, residual) with the add deferred to the next
    norm: the stream is their sum); for the final norm its normed output."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        if P.is_decoder_layer(path) and residual is not None:
            return hidden + residual
        return hidden
    return output


def _edit_module_output(path: str, output: Any, edits: list[tuple[list[int], P.WriteModule, _Sequence]]) -> None:
    """Apply module writes in place. For decoder layers the edit is to the residual stream
    (hidden + residual): only `hidden` changes, so the stream becomes what was asked."""
    is_layer = isinstance(output, tuple) and P.is_decoder_layer(path)
    target = output[0] if isinstance(output, tuple) else output
    residual = output[1] if is_layer and output[1] is not None else None
    if all(edit.edit == "add" for _, edit, _ in edits):
        # Steering, the common case: stream + s*v is hidden + s*v, for every row of every
        # request at once (one index_add_, not a few kernels per request).
        rows = [row for edit_rows, _, _ in edits for row in edit_rows]
        vectors = torch.cat([_vector(seq, edit, target).expand(len(r), -1) for r, edit, seq in edits])
        target.index_add_(0, _on_device(rows, target.device, torch.long), vectors)
        return
    for rows, edit, seq in edits:
        index = _on_device(rows, target.device, torch.long)
        stream = target[index] + (residual[index] if residual is not None else 0)
        if edit.edit == "add":
            new_stream = stream + _vector(seq, edit, target)
        elif edit.edit == "replace":
            new_stream = _vector(seq, edit, target).expand_as(stream)
        elif edit.edit == "zero":
            new_stream = torch.zeros_like(stream)
        else:  # mean over the selected positions
            new_stream = stream.mean(0, keepdim=True).expand_as(stream)
        new_target = new_stream - (residual[index] if residual is not None else 0)
        target.index_copy_(0, index, new_target.to(target.dtype))


def _vector(seq: _Sequence, edit: P.WriteModule, like: torch.Tensor) -> torch.Tensor:
    return _operands(seq, edit, like.device, like.dtype)[0]


class _Lens:
    """The model's own final norm and lm_head, applied to residual streams (float32)."""

    def __init__(self, model: Any, vocab_size: int) -> None:
        self.norm = model.model.norm
        self.weight = model.lm_head.weight
        self.vocab_size = vocab_size

    @torch.no_grad()
    def __call__(self, streams: torch.Tensor) -> torch.Tensor:
        device, dtype = self.weight.device, self.weight.dtype
        flat = streams.reshape(-1, streams.shape[-1]).to(device=device, dtype=dtype)
        normed = self.norm.forward(flat)  # .forward: not through our own hook on "norm"
        normed = normed[0] if isinstance(normed, tuple) else normed
        logits = (normed @ self.weight.t())[:, : self.vocab_size].float()
        return torch.log_softmax(logits, dim=-1).reshape(*streams.shape[:-1], -1)


def _modules(model: Any) -> dict[str, torch.nn.Module]:
    """GetModelInfo's module paths -> the modules of a vLLM decoder-only model."""
    inner = model.model
    found: dict[str, torch.nn.Module] = {"embed_tokens": inner.embed_tokens, "norm": inner.norm}
    for i, layer in enumerate(inner.layers):
        found[f"layers.{i}"] = layer
        found[f"layers.{i}.self_attn"] = layer.self_attn
        found[f"layers.{i}.mlp"] = layer.mlp
    return found


@dataclass(slots=True)
class _Span:
    """One request's rows in a forward pass's flat [tokens, hidden] activations."""

    first: int  # its first row
    last: int  # one past its last row
    pos0: int  # the token position of its first row
    prompt_len: int
    samples: bool  # this pass computes its next token (not a chunk of its prompt)

    @classmethod
    def of(cls, state: Any, first: int, last: int, pos0: int) -> _Span:
        prompt_len = len(state.prompt_token_ids or ())
        samples = pos0 + (last - first) >= prompt_len + len(state.output_token_ids)
        return cls(first, last, pos0, prompt_len, samples)

    def rows(self, positions: P.Positions, step: int) -> tuple[list[int], list[int]]:
        """The rows, and their token positions, that `positions` selects at `step`."""
        wanted: list[int] = []
        if step == 0 and positions.kind != "new_token":
            here = range(self.pos0, self.pos0 + self.last - self.first)  # positions this pass computes
            wanted = [p for p in positions.prompt_positions(self.prompt_len) if p in here]
        elif self.samples and positions.kind in ("new_token", "all"):
            wanted = [self.pos0 + self.last - self.first - 1]
        return [self.first + p - self.pos0 for p in wanted], wanted


@dataclass(frozen=True)
class _Want:
    """One module read to serve from this forward pass: these rows of the flat
    [num_tokens, hidden] activations, at these token positions."""

    seq: _Sequence
    name: str
    rows: list[int]
    positions: list[int]


class _Outgoing:
    """One step's message to one frontend: a record per traced row, a RowBlock per
    block, and each batched read once (a column), which the records and blocks point
    into. Per row this costs a few references, not a tensor conversion; per block row,
    a list entry. A column computed over several frontends' rows goes whole to each one
    reading it when it is small (WHOLE_COLUMN_BYTES), else with only the rows that
    frontend reads (a full-vocabulary read is not sent whole to every frontend)."""

    __slots__ = ("_blocks", "_records", "_used")

    def __init__(self) -> None:
        # StepRecord fields, with the column rows still as (batch, batch row)
        self._records: list[tuple[Any, ...]] = []
        self._blocks: list[tuple[_Block, list[int]]] = []
        self._used: dict[int, tuple[_HostBatch, list[int]]] = {}  # id(batch) -> (batch, rows read)

    def _use(self, batch: _HostBatch, rows: list[int] | tuple[int]) -> None:
        found = self._used.get(id(batch))
        if found is None:
            self._used[id(batch)] = (batch, list(rows))
        else:
            found[1].extend(rows)

    def add(self, key: str, row: _Row) -> None:
        values: dict[str, ReadResult] = {}
        refs: dict[str, tuple[_HostBatch, int]] = {}
        if row.error is None:
            for name, read in row.kept.items():
                if type(read) is tuple:
                    refs[name] = read
                    self._use(read[0], (read[1],))
                else:
                    values[name] = read.result(row.token)  # type: ignore[union-attr]
        self._records.append((key, row.step, row.token, values, row.stopped, row.error, refs))

    def add_failed(self, key: str, step: int, token: int, error: str) -> None:
        self._records.append((key, step, token, {}, False, error, {}))

    def add_block(self, block: _Block, tokens: list[int]) -> None:
        for batch, rows in block.reads.values():
            self._use(batch, rows)
        self._blocks.append((block, tokens))

    def message(self, engine_s: float, collector_s: float) -> StepBatch:
        columns: list[ReadResult] = []
        # id(batch) -> (its column, batch row -> column row; None: the same)
        place: dict[int, tuple[int, dict[int, int] | None]] = {}
        for ident, (batch, used) in self._used.items():
            rows = sorted(set(used)) if not batch.small else None
            if rows is None or len(rows) == batch.rows:
                place[ident] = (len(columns), None)
                columns.append(batch.column())
            else:
                place[ident] = (len(columns), {r: p for p, r in enumerate(rows)})
                columns.append(batch.column(rows))
        records = []
        for key, step, token, values, stopped, error, refs in self._records:
            rows = {}
            for name, (batch, j) in refs.items():
                c, where = place[id(batch)]
                rows[name] = (c, j if where is None else where[j])
            records.append(StepRecord(key, step, token, values, stopped, error, rows))
        blocks = []
        for block, tokens in self._blocks:
            reads = []
            for name, (batch, batch_rows) in block.reads.items():
                c, where = place[id(batch)]
                reads.append((name, c, batch_rows if where is None else [where[r] for r in batch_rows]))
            keys = [seq.plan.key for seq in block.seqs]
            blocks.append(RowBlock(keys, block.steps, tokens, reads, list(block.ops.samples)))
        return StepBatch(records, columns, blocks, engine_s, collector_s)


class PlanHooks:
    """Owns the per-request plans and wraps one model runner's sampler."""

    def __init__(self, runner: Any, fault_injection: bool) -> None:
        self.runner = runner
        # One side channel per frontend process, by route (rank 0 only; empty elsewhere).
        self.senders: dict[int, Sender] = {}
        self.fault_injection = fault_injection
        self.sequences: dict[str, _Sequence | None] = {}
        self._step: _Step | None = None
        self.lens: _Lens | None = None
        self.steering: steering.SlotPlanner | None = None  # compiled engines with --compiled-steering
        self.module_writers: set[str] = set()  # live requests whose plans write modules
        # The requests of the last forward pass, when it decoded them one token each and
        # the next pass may keep its steering slots should it decode the same ones.
        self._steered_batch: list[str] | None = None
        # Off the engine's thread only where the device runs ahead of the host.
        threaded = runner.device.type == "cuda" if hasattr(runner, "device") else True
        self.collector: StepCollector[_StepWork] = StepCollector(self._finish, threaded=threaded)
        period = float(os.environ.get(HOOK_TIMES_ENV) or 0)
        self.times: _HookTimes | None = _HookTimes(period) if period > 0 else None

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
                    _launch_batched(step, logits, _RAW)
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
                        _launch_batched(step, logits, _BEFORE_WRITES)
                    self._write_and_capture(step.rows, logits)
                    # After the writes: what is drawn from. Without writes this step both
                    # stages are the same row, read in one pass.
                    _launch_batched(step, logits, _PROCESSED if writes else _UNWRITTEN)
                except Exception as e:  # noqa: BLE001 - vLLM's step must go on
                    self._fail_batch("at the logits writes", e, step)
                spent = time.perf_counter() - started
                step.engine_s += spent
                if times:
                    times.add(engine_s=spent)
            return logits

        sampler.forward = forward
        sampler.apply_logits_processors = apply_logits_processors

    def install_module_hooks(self, model: Any) -> None:
        """Forward hooks on every addressable module; idle unless this forward pass has
        module reads (they only fire in eager steps, outside compiled graphs)."""
        self._wants: dict[str, list[_Want]] = {}
        self._edits = {}
        self.lens = _Lens(model, self.runner.model_config.get_vocab_size())
        model.register_forward_pre_hook(lambda module, args: self._plan_forward_safely())
        for path, module in _modules(model).items():
            module.register_forward_hook(
                lambda module, args, output, path=path: self._module_hook(path, output)
            )

    def install_compiled_steering(self, runner: Any, tables: steering.SteeringTables) -> None:
        """Fill the compiled graph's steering tables before each forward pass (wraps the
        runner's `_model_forward`, which runs on the host before the graph is replayed)."""
        self.steering = steering.SlotPlanner(tables)
        original = runner._model_forward

        def model_forward(*args: Any, **kw: Any) -> Any:
            self._steer_safely()
            return original(*args, **kw)

        runner._model_forward = model_forward

    def _steer_safely(self) -> None:
        planner = self.steering
        assert planner is not None
        batch = self.runner.input_batch
        if batch.req_ids == self._steered_batch and self.runner.query_start_loc.np[len(batch.req_ids)] == len(
            batch.req_ids
        ):
            return  # the same requests decoding as in the last pass: the tables already hold their slots
        self._steered_batch = None
        rows: list[int] = []
        tables: list[int] = []
        slots: list[int] = []
        try:
            if self._writes_modules(planner) and self._plan_steering(planner, rows, tables, slots):
                self._steered_batch = list(batch.req_ids)
            planner.fill(rows, tables, slots)
        except Exception as e:  # noqa: BLE001 - never break vLLM's forward pass
            self._steered_batch = None
            log.exception("filling the steering tables failed; failing the batch's steering traces")
            for req_id in self.module_writers:
                seq = self.sequences.get(req_id)
                if seq is not None:
                    seq.error = seq.error or f"{type(e).__name__} filling the steering tables: {e}"
            planner.fill([], [], [])  # nobody steered this pass, rather than stale slots

    def _writes_modules(self, planner: steering.SlotPlanner) -> bool:
        """Whether a request in this batch has module writes: requests without cost a
        set difference per forward pass. Ended requests give back their slots."""
        for req_id in set(self.runner.input_batch.req_ids).difference(self.sequences):
            self._sequence(req_id)  # a request's first pass: its plan is read here
        self._forget_ended_writers()
        return bool(self.module_writers)

    def _forget_ended_writers(self) -> None:
        """Requests that ended give back their steering slots."""
        if self.module_writers:
            for req_id in self.module_writers.difference(self.runner.requests):
                self.module_writers.discard(req_id)
                if self.steering is not None:
                    self.steering.release(req_id)

    def _plan_steering(self, planner: steering.SlotPlanner, rows: list[int], tables: list[int],
                       slots: list[int]) -> bool:
        """This pass's writes as (flat token row, table, slot) triples. True when the next
        pass may keep them, should it decode the same requests one token each: every
        writer here decodes one new token and writes the same at every new token."""
        repeatable = True
        batch = self.runner.input_batch
        req_ids = batch.req_ids
        starts = self.runner.query_start_loc.np[: len(req_ids) + 1].tolist()
        computed = batch.num_computed_tokens_cpu[: len(req_ids)].tolist()
        requests = self.runner.requests
        writers = self.module_writers
        for i, req_id in enumerate(req_ids):
            if req_id not in writers:
                continue
            seq = self.sequences.get(req_id)
            if seq is None or seq.error is not None:
                continue
            state = requests[req_id]
            first, last, pos0 = starts[i], starts[i + 1], computed[i]
            if seq.steady is _UNKNOWN:
                seq.steady = self._steady_slots(planner, req_id, seq)
            if seq.steady is not None:  # the same writes at every new token (inlined: per row)
                if pos0 + last - first >= len(seq.prompt_ids) + len(state.output_token_ids):
                    for table, slot in seq.steady:
                        rows.append(last - 1)
                        tables.append(table)
                        slots.append(slot)
                    repeatable = repeatable and last - first == 1
                else:
                    repeatable = False  # a prompt chunk: its next pass may reach the new token
                continue
            repeatable = False
            span = _Span.of(state, first, last, pos0)
            by_row: dict[tuple[int, int], list[int]] = {}  # (table, row) -> op indices
            for k, op in enumerate(seq.plan.ops):
                if not isinstance(op.action, P.WriteModule) or not op.selects(seq.step):
                    continue
                op_rows = span.rows(op.action.positions, seq.step)[0]
                table = planner.table_of.get(P.layer_number(op.action.module))
                if table is not None and op_rows and self._write_holds(op, seq):
                    for row in op_rows:
                        by_row.setdefault((table, row), []).append(k)
            for (table, row), ks in by_row.items():
                slot = self._slot(planner, req_id, seq, table, ks)
                if slot is None:
                    break
                rows.append(row)
                tables.append(table)
                slots.append(slot)
        return repeatable

    def _steady_slots(self, planner: steering.SlotPlanner, req_id: str, seq: _Sequence) -> list[tuple[int, int]] | None:
        """(table, slot) of each layer this request writes, when it writes the same way
        at every new token and nowhere else (steering); None otherwise."""
        writes = [k for k, op in enumerate(seq.plan.ops) if isinstance(op.action, P.WriteModule)]
        steady = seq.constant is not None and all(
            seq.plan.ops[k].condition is None and seq.plan.ops[k].action.positions.kind == "new_token"  # type: ignore[union-attr]
            for k in writes
        )
        if not steady:
            return None
        by_table: dict[int, list[int]] = {}
        for k in writes:
            module = seq.plan.ops[k].action.module  # type: ignore[union-attr]
            table = planner.table_of.get(P.layer_number(module))
            if table is not None:  # else another pipeline stage holds that layer
                by_table.setdefault(table, []).append(k)
        found = []
        for table, ks in by_table.items():
            slot = self._slot(planner, req_id, seq, table, ks)
            if slot is None:
                return []
            found.append((table, slot))
        return found

    def _slot(
        self, planner: steering.SlotPlanner, req_id: str, seq: _Sequence, table: int, ks: list[int]
    ) -> int | None:
        edits = [seq.plan.ops[k].action for k in ks]
        slot = planner.slot(table, req_id, edits,  # type: ignore[arg-type]
                            lambda edit: _vector(seq, edit, planner.tables.vectors))
        if slot is None:
            seq.error = seq.error or (
                f"more than {planner.tables.vectors.shape[1] - 1} different writes at layer "
                f"{planner.tables.layers[table]} at once: too many distinct steering vectors in flight"
            )
        return slot

    def _plan_forward_safely(self) -> None:
        try:
            self._plan_forward()
        except Exception:  # noqa: BLE001 - never break vLLM's forward pass
            log.exception("planning module hooks failed; no module interventions this step")
            self._wants, self._edits = {}, {}

    def _plan_forward(self) -> None:
        """Map this forward pass's flat token rows to the module reads and writes they serve."""
        self._wants = {}
        self._edits: dict[str, list[tuple[list[int], P.WriteModule, _Sequence]]] = {}
        batch = self.runner.input_batch
        starts = self.runner.query_start_loc.np
        computed = batch.num_computed_tokens_cpu
        for i, req_id in enumerate(batch.req_ids):
            seq = self._sequence(req_id)
            if seq is None or seq.error is not None:
                continue
            ops = [op for op in seq.plan.active_at(seq.step) if isinstance(op.action, P.HIDDEN_OPS)]
            if not ops:
                continue
            span = _Span.of(self.runner.requests[req_id], int(starts[i]), int(starts[i + 1]), int(computed[i]))
            for op in ops:
                action = op.action
                assert isinstance(action, P.HIDDEN_OPS)
                rows, wanted = span.rows(action.positions, seq.step)
                if not rows:
                    continue
                if isinstance(action, P.WriteModule):
                    if self._write_holds(op, seq):
                        self._edits.setdefault(action.module, []).append((rows, action, seq))
                    continue
                sources = (
                    [(op.name, action.module)] if isinstance(action, P.ReadModule) else action.module_reads(op.name)
                )
                for key, path in sources:
                    self._wants.setdefault(path, []).append(_Want(seq, key, rows, wanted))

    def _write_holds(self, op: P.Op, seq: _Sequence) -> bool:
        """A module write's condition, decided before the forward pass (from the text and
        tokens of the steps before it)."""
        if op.condition is None:
            return True
        self.collector.drain()  # the text so far includes every finished step
        return _holds(op.condition, _Context(_Row(-1, seq, ())))

    def _module_hook(self, path: str, output: Any) -> None:
        """Never raises into vLLM's forward pass: a failure fails the traces involved."""
        edits = self._edits.get(path)
        wants = self._wants.get(path)
        try:
            if edits:
                _edit_module_output(path, output, edits)  # in place: reads below see the edit
            if wants:
                # Every request's rows in one gather (a copy: the activation buffer is
                # reused by the next forward pass); each read keeps its slice of it.
                value = _module_output(path, output).detach()
                index = [r for want in wants for r in want.rows]
                taken = value.index_select(0, _on_device(index, value.device, torch.long)).to(torch.float32)
                offset = 0
                for want in wants:
                    n = len(want.rows)
                    want.seq.pending.setdefault(want.name, []).append((want.positions, taken[offset:offset + n]))
                    offset += n
        except Exception as e:  # noqa: BLE001
            log.exception("module hook on %s failed", path)
            for seq in [w.seq for w in wants or ()] + [seq for _, _, seq in edits or ()]:
                seq.error = seq.error or f"{type(e).__name__} in {path}: {e}"

    # -- per step --------------------------------------------------------------

    def _fail_batch(self, where: str, error: Exception, step: _Step | None = None) -> None:
        """A failure in the hooks' own bookkeeping (a tracewire bug, not one request's op,
        which fails only that request): vLLM's step goes on, and every traced request in
        the batch fails with the error, reported at its next step."""
        log.exception("tracewire hooks failed %s; failing the traces in this batch", where)
        message = f"tracewire hooks failed {where}: {type(error).__name__}: {error}"
        if step is not None:
            step.fail(message)
        for req_id in self.runner.input_batch.req_ids:
            seq = self.sequences.get(req_id)
            if seq is not None and seq.error is None:
                seq.error = message

    def _sequence(self, req_id: str) -> _Sequence | None:
        if req_id in self.sequences:
            return self.sequences[req_id]
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        blob = extra.get(P.EXTRA_ARGS_KEY)
        seq = None
        if blob is not None:
            plan = P.decode_plan(blob)
            prompt_ids = list(state.prompt_token_ids or ())
            seq = _Sequence(plan, needs_text=plan.needs_text(), prompt_ids=prompt_ids)
            if seq.needs_text:
                seq.tracker = detokenize.text_tracker(self.tokenizer, prompt_ids, plan.skip_special_tokens)
                seq.scan = textmatch.TextScan(plan.text_needles())
            if any(isinstance(op.action, P.WriteModule) for op in plan.ops):
                self.module_writers.add(req_id)
        if len(self.sequences) > 2 * len(self.runner.requests) + 64:
            live = self.runner.requests.keys()
            self.sequences = {k: v for k, v in self.sequences.items() if k in live}
            self._forget_ended_writers()
        self.sequences[req_id] = seq
        return seq

    def _traced_step(self) -> _Step:
        """This step's traced rows: a block entry for each row that only reads (a few
        list appends), a _Row for the others; idle rows only count the step."""
        batch = self.runner.input_batch
        req_ids = batch.req_ids
        discard = getattr(self.runner, "discard_request_mask", None)
        discard_np = discard.np[: len(req_ids)] if discard is not None else None
        if discard_np is not None and not discard_np.any():
            discard_np = None  # one check for the step: under load rows mid-prefill are rare
        rows: list[_Row] = []
        blocks: dict[tuple[int, int], _Block] = {}
        get = self.sequences.get
        for i, req_id in enumerate(req_ids):
            # A request seen before and untraced is one dict lookup; one that reads the
            # same at every step (the common traced case under load) a few list appends.
            seq = get(req_id, _UNSEEN)
            if seq is _UNSEEN:
                seq = self._sequence(req_id)
                get = self.sequences.get  # (it may have made a new dict)
            if seq is None or (discard_np is not None and discard_np[i]):
                continue  # (mid-prefill: vLLM throws this sample away)
            key = seq.block
            if key is not None and seq.error is None:
                ops = seq.constant
            else:
                if seq.error_reported:
                    continue
                ops = seq.ops_at(seq.step)
                if seq.error is not None or seq.needs_text or ops.block_key is None:
                    if ops is _NO_OPS and seq.error is None and not seq.needs_text:
                        seq.step += 1  # nothing to do, record or remember at this step
                        continue
                    row = _Row(i, seq, ops)
                    if seq.error is not None:  # failed in a module hook: report it on this step
                        row.selected, row.error = _ERROR_OPS, seq.error
                    rows.append(row)
                    continue
                key = (seq.plan.route, id(ops))  # alive: the block holds it
            block = blocks.get(key)
            if block is None:
                block = blocks[key] = _Block(cast(_StepOps, ops), key[0])
            block.index.append(i)
            block.seqs.append(seq)
            block.steps.append(seq.step)
            seq.step += 1
        return _Step(rows, list(blocks.values()))

    def _write_and_capture(self, rows: list[_Row], logits: torch.Tensor) -> None:
        for row in rows:
            if not row.selected.logits_writes:
                continue
            try:
                wrote = False
                ctx = _Context(row)
                if any(op.condition is not None for op in row.selected.logits_writes):
                    # Conditions see the row as vLLM made it, before any of our writes (a
                    # LOGITS_STAGE_BEFORE_WRITES read): captured before the first write,
                    # whatever order the writes come in.
                    self.collector.drain()  # the text so far includes every finished step
                    (row.processed,) = _capture(logits, [row])
                for op in row.selected.logits_writes:
                    if _holds(op.condition, ctx):
                        _apply_write(op.action, logits[row.index], row.seq, self.fault_injection)
                        wrote = True
                if wrote:
                    row.processed = None  # captured again below, after the writes
            except Exception as e:  # noqa: BLE001 - fails this request's trace only
                row.error = f"{type(e).__name__}: {e}"
        wanted = [r for r in rows if r.selected.needs_processed and r.processed is None and r.error is None]
        if wanted:
            for row, captured in zip(wanted, _capture(logits, wanted), strict=True):
                row.processed = captured

    def _after_sample(self, step: _Step, sampled: torch.Tensor) -> None:
        """Launch the rest of the step's reads (every read selected now, its condition
        decided later) and hand the step to the collector. No waiting for the device."""
        started = time.perf_counter()
        drawn = sampled.view(sampled.shape[0], -1)[:, 0]
        _launch_logprobs(step, drawn)
        fired = [row for row in step.rows if row.error is None and row.selected.row_reads]
        try:
            _launch_row_reads(fired, self.lens)
        except Exception as e:  # noqa: BLE001 - a batch failure fails the traces in it
            for row in fired:
                row.error = f"{type(e).__name__}: {e}"
        # On the CPU vLLM may reuse the sampled-ids buffer: keep a copy of our own.
        tokens = (_to_host(drawn) if drawn.device.type != "cpu" else drawn.clone()).numpy()  # see _HostBatch
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
        self.collector.submit(_StepWork(step, tokens, done))

    def _finish(self, work: _StepWork) -> None:
        """On the collector thread: the step's values are on the host now; decide its
        conditions and stops, send its records, extend each sequence's text."""
        started = time.perf_counter()
        work.wait()
        ready = time.perf_counter()
        tokens = work.tokens
        batches: defaultdict[int, _Outgoing] = defaultdict(_Outgoing)  # by route
        for row in work.step.rows:
            seq = row.seq
            row.token = int(tokens[row.index])
            if seq.tracker is not None:  # before the conditions: the text includes the token
                seq.scan.extend(seq.tracker.add(row.token))
            if row.selected.ops:
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

    def _decide(self, row: _Row) -> None:
        """This row's stops, and which of its launched reads it keeps."""
        ctx = _Context(row)
        for op in row.selected.ops:
            if isinstance(op.action, P.READS):
                if _holds(op.condition, ctx):
                    row.kept[op.name] = row.reads[op.name]
            elif isinstance(op.action, P.Stop):
                if _holds(op.condition, ctx):
                    row.stopped = True

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The tokenizer the server decodes with: vLLM's, built from the same model config
        (loaded the first time a trace has a text condition)."""
        from ..frontend.vllm_compat import tokenizer_from_config

        return tokenizer_from_config(self.runner.vllm_config.model_config)


class TracewireWorkerExtension:
    """Mixed into vLLM's worker class (worker_extension_cls)."""

    def tracewire_install(self, address: str, fault_injection: bool = False, route: int = 0) -> int:
        """Wrap the sampler (once) and connect frontend `route`'s side channel. Every
        frontend process sharing this engine calls this with its own address and route."""
        rank = getattr(self, "rank", 0)
        hooks: PlanHooks | None = getattr(self, "tracewire_hooks", None)
        if hooks is None:
            runner = self.model_runner  # type: ignore[attr-defined]
            hooks = self.tracewire_hooks = _install_hooks(runner, fault_injection)
        if rank == 0:
            previous = hooks.senders.get(route)
            hooks.senders[route] = Sender(address)
            if previous is not None:  # the frontend asked again (engine.py)
                previous.close()
            log.info("tracewire hooks installed; records of frontend %d go to %s", route, address)
        return int(rank)


def _install_hooks(runner: Any, fault_injection: bool) -> PlanHooks:
    """Wrap `runner`'s sampler (and, eager, its modules). A module function, not a method
    of the extension: vLLM would offer every method as a collective_rpc call."""
    sampler = getattr(runner, "sampler", None)
    if not hasattr(runner, "input_batch") or not hasattr(sampler, "apply_logits_processors"):
        raise RuntimeError(  # vLLM's V2 runner (vllm/v1/worker/gpu/) has another sampler
            f"tracewire needs vLLM's V1 model runner, not {type(runner).__module__}; "
            "unset VLLM_USE_V2_MODEL_RUNNER"
        )
    hooks = PlanHooks(runner, fault_injection)
    hooks.install(runner.sampler)
    if runner.model_config.enforce_eager:  # hooks cannot fire inside compiled graphs
        hooks.install_module_hooks(runner.model)
    elif (tables := steering.find(runner.get_model())) is not None:
        hooks.install_compiled_steering(runner, tables)
    return hooks
