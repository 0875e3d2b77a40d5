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

    forward(logits)                       <- raw logits captured here
      apply_logits_processors(logits)     <- vLLM's processing (bias, penalties, ...)
        + tracewire writes                <- force / replace / add / bias / mask
        + processed row captured          <- what the sampler draws from
      sample(logits)                      <- vLLM draws
    -> sampled ids                        <- reads, conditions, stops evaluated here

Rows belong to requests in `input_batch.req_ids` order; rows of requests still
in a (chunked) prefill are skipped (vLLM discards their samples). A request
without a plan costs one dict lookup per step; a batch without plans goes
straight to vLLM's own code.

After the draw the hook only launches the step's reads as device work, with
non-blocking copies to the host, and hands the step to the collector thread
(collector.py), which waits for the copies, decides conditions and stops, and
sends the records. Nothing on the engine's thread waits for the device unless a
write's condition needs a value before the draw.

Failures inside one request's ops are caught per request and reported on its
record (its trace fails); vLLM's sampling always proceeds.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import plan as P
from .collector import StepCollector
from .sidechannel import ReadResult, Sender, StepBatch, StepRecord
from .tensors import RawTensor

# Under vLLM's logger: vLLM configures its handlers (with the process prefix) in the
# worker processes; a logger of our own would have none there.
log = logging.getLogger(f"vllm.{__name__}")

# Set to a number of seconds (e.g. `TRACEWIRE_HOOK_TIMES=10 make bench`): every worker
# prints where its hooks' time went over each such period, to find what bounds a
# trace's throughput. On the CPU the collector runs on the engine's thread, so its
# time is counted in both.
HOOK_TIMES_ENV = "TRACEWIRE_HOOK_TIMES"


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
    reads: tuple[P.Op, ...]
    logits_writes: tuple[P.Op, ...]
    needs_raw: bool
    needs_processed: bool
    # Reads computed for all rows at once, with the key of their batch.
    batched_reads: tuple[tuple[str, tuple[Any, ...]], ...]
    # Reads computed per row (module and logit-lens reads, the drawn sample).
    row_reads: tuple[P.Op, ...]
    # Only reads, none with a condition: every read launched is kept.
    plain: bool

    @classmethod
    def of(cls, ops: tuple[P.Op, ...]) -> _StepOps:
        reads = tuple(op for op in ops if isinstance(op.action, P.READS))
        keyed = [(op, _batch_key(op.action)) for op in reads]
        return cls(
            ops,
            reads,
            tuple(op for op in ops if isinstance(op.action, P.LOGITS_WRITES)),
            P.needs_raw_logits(ops),
            P.needs_processed_logits(ops),
            tuple((op.name, key) for op, key in keyed if key is not None),
            tuple(op for op, key in keyed if key is None),
            len(reads) == len(ops) and all(op.condition is None for op in ops),
        )


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


@dataclass
class _Sequence:
    """Per-request state the worker keeps across steps."""

    plan: P.SequencePlan
    needs_text: bool
    prompt_ids: list[int] = field(default_factory=list)
    step: int = 0
    tokens: list[int] = field(default_factory=list)  # kept only for text conditions
    error: str | None = None
    error_reported: bool = False
    patterns: dict[str, re.Pattern[str]] = field(default_factory=dict)
    # Module reads of the current step, gathered over its forward passes (a chunked
    # prefill runs several): read name -> [(positions, [rows, hidden] float32)].
    pending: dict[str, list[tuple[list[int], torch.Tensor]]] = field(default_factory=dict)
    # Write operands already on the device, by id() of the plan's action.
    operands: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    constant: _StepOps | None = None  # the ops of every step, when they never change
    last_step: int | None = None  # after it no op is selected (None: open-ended)
    _sorted: dict[tuple[int, ...], _StepOps] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if all(_always(op) for op in self.plan.ops):
            self.constant = _StepOps.of(self.plan.ops)
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
    """Host tensors of one read kind for several rows, valid once the step's copies are
    done (_StepWork.wait); viewed as numpy once, on first use."""

    __slots__ = ("_arrays", "ids", "values")

    def __init__(self, values: torch.Tensor, ids: torch.Tensor | None) -> None:
        self.values, self.ids = values, ids
        self._arrays: tuple[np.ndarray, np.ndarray | None] | None = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        if self._arrays is None:
            self._arrays = (self.values.numpy(), self.ids.numpy() if self.ids is not None else None)
        return self._arrays

    def column(self) -> ReadResult:
        """All rows at once, as sent: the server hands each trace its row."""
        values, ids = self.arrays()
        return ReadResult(RawTensor.from_numpy(values), RawTensor.from_numpy(ids) if ids is not None else None)


@dataclass
class _HostRead:
    """One row's read on its way to the host (a module or logit-lens read, or the
    drawn sample); batched reads are (_HostBatch, row) pairs instead."""

    batch: _HostBatch | None  # None: the drawn token itself (known after the wait)
    positions: list[int] | None = None

    def result(self, token: int) -> ReadResult:
        if self.batch is None:
            return ReadResult(RawTensor.from_numpy(np.asarray(token, dtype=np.int32)))
        values, ids = self.batch.arrays()
        return ReadResult(
            RawTensor.from_numpy(values),
            RawTensor.from_numpy(ids) if ids is not None else None,
            RawTensor.from_numpy(np.asarray(self.positions, np.int32)) if self.positions is not None else None,
        )


# A read launched for one row: its own value, or its row of a batch.
_Launched = _HostRead | tuple[_HostBatch, int]
_SAMPLE = _HostRead(None)


@dataclass(slots=True)
class _Row:
    index: int  # row in the logits
    seq: _Sequence
    selected: _StepOps  # the ops selected at this step (none: only count the step)
    step: int = -1
    raw: _Captured | None = None
    processed: _Captured | None = None
    token: int = -1
    reads: dict[str, _Launched] = field(default_factory=dict)  # conditions not yet decided
    kept: dict[str, _Launched] = field(default_factory=dict)  # the reads whose conditions held
    stopped: bool = False
    error: str | None = None


@dataclass
class _StepWork:
    """One engine step's traced rows, handed to the collector to finish."""

    rows: list[_Row]
    tokens: torch.Tensor  # host copy of the drawn ids, one per logits row
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
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


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

    def __init__(self, hooks: PlanHooks, row: _Row, drawn: bool) -> None:
        self.hooks, self.row, self.drawn = hooks, row, drawn
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

    def text(self) -> str:
        tokens = self.row.seq.tokens + ([self.row.token] if self.drawn else [])
        return self.hooks.decode(tokens)


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
        return cond.text in ctx.text()
    if isinstance(cond, P.TextMatches):
        patterns = ctx.row.seq.patterns
        if cond.pattern not in patterns:
            patterns[cond.pattern] = re.compile(cond.pattern)
        return patterns[cond.pattern].search(ctx.text()) is not None
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


def _rows_of(group: list[_Row], stage: str) -> torch.Tensor:
    """[G, vocab] float32: the group's captured rows. Rows are captured as one batch per
    stage, so this is that batch itself (no copy) when the group is all of it."""
    captures = [r.raw for r in group] if stage == "raw" else [r.processed for r in group]
    batch = captures[0].batch  # type: ignore[union-attr]
    if all(c.batch is batch for c in captures):  # type: ignore[union-attr]
        positions = [c.position for c in captures]  # type: ignore[union-attr]
        # (a row reading the same thing twice is in the group twice)
        if len(positions) == batch.shape[0] and positions == list(range(len(positions))):
            return batch
        return batch[positions]
    return torch.stack([c.batch[c.position] for c in captures])  # type: ignore[union-attr]


def _top_k(src: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and int32 ids of the k largest per row, largest first, on src's device.
    On the CPU numpy's partition beats torch.topk by ~1.5x at vocabulary widths."""
    if src.device.type != "cpu":
        top = torch.topk(src, k)
        return top.values, top.indices.to(torch.int32)
    values = src.numpy()
    idx = np.argpartition(values, -k, axis=1)[:, -k:]
    part = np.take_along_axis(values, idx, 1)
    order = np.argsort(-part, axis=1, kind="stable")
    top_values = np.take_along_axis(part, order, 1)
    return torch.from_numpy(top_values), torch.from_numpy(np.take_along_axis(idx, order, 1).astype(np.int32))


def _capture(logits: torch.Tensor, rows: list[_Row]) -> list[_Captured]:
    """One copy of these rows' logits, float32; each row gets a handle into it. Rows
    come in logits order; when they are one run of rows (every request traced, the
    common case at load) a slice is copied, with no index to send to the device."""
    first, n = rows[0].index, len(rows)
    if rows[-1].index - first + 1 == n:
        batch = logits.detach()[first:first + n].to(torch.float32, copy=True)
    else:
        index = _on_device([r.index for r in rows], logits.device, torch.long)
        batch = logits.detach().index_select(0, index).float()
    return [_Captured(batch, j) for j in range(n)]


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
    return torch.cat([t for _, t in chunks]), positions


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
    values, positions = _gathered(row, name, read.module, read.positions)
    if read.mean:
        return _HostRead(_HostBatch(_to_host(values.mean(0)), None))
    if read.positions.new_token_only(row.seq.step):
        return _HostRead(_HostBatch(_to_host(values[0]), None))  # [hidden]
    # [positions, hidden], with the prompt positions
    return _HostRead(_HostBatch(_to_host(values), None), positions=positions)


def _launch_reads(rows: list[_Row], lens: _Lens | None, drawn: torch.Tensor) -> None:
    """Launch every read of this step as device work, batched across rows by read kind
    (one topk / gather / log_softmax per kind instead of one per row), each result on its
    way to the host. `drawn`: the step's sampled ids on the device, one per logits row."""
    groups: dict[tuple[Any, ...], list[tuple[_Row, str]]] = {}
    for row in rows:
        ops = row.selected
        for name, key in ops.batched_reads:
            members = groups.get(key)
            if members is None:
                members = groups[key] = []
            members.append((row, name))
        for op in ops.row_reads:
            a = op.action
            if isinstance(a, P.ReadModule):
                row.reads[op.name] = _module_value(row, op.name, a)
            elif isinstance(a, P.ReadLogitLens):
                assert lens is not None
                row.reads[op.name] = _logit_lens_value(row, op.name, a, lens)
            else:
                assert isinstance(a, P.ReadSample)
                row.reads[op.name] = _SAMPLE
    for key, members in groups.items():
        group = [row for row, _ in members]
        if key[0] == "logprobs":
            values, ids = _logprobs(group, key[1], drawn)
        else:
            values, ids = _logits(group, *key[1:])
        batch = _HostBatch(_to_host(values), _to_host(ids) if ids is not None else None)
        for j, (row, name) in enumerate(members):
            row.reads[name] = (batch, j)


def _logprobs(rows: list[_Row], top_k: int | None, drawn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, 1 + k] logprobs of the drawn token then the top k, and their ids."""
    lp = torch.log_softmax(_rows_of(rows, "processed"), dim=-1)
    index = _on_device([r.index for r in rows], drawn.device, torch.long)
    ids = drawn.index_select(0, index).to(device=lp.device, dtype=torch.long).unsqueeze(1)
    if top_k:
        ids = torch.cat([ids, torch.topk(lp, top_k).indices], dim=1)
    return lp.gather(1, ids), ids.to(torch.int32)


def _logits(
    rows: list[_Row], stage: str, top_k: int | None, token_ids: tuple[int, ...] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows' logits at `stage`: top k, chosen ids, or whole rows; and their ids."""
    src = _rows_of(rows, stage)
    if top_k is not None:
        return _top_k(src, top_k)
    if token_ids is not None:
        values = src.index_select(1, _on_device(list(token_ids), src.device, torch.long))
        return values, torch.tensor(token_ids, dtype=torch.int32).expand(values.shape[0], -1).contiguous()
    return src, None


def _is_decoder_layer(path: str) -> bool:
    return path.startswith("layers.") and path.count(".") == 1


def _module_output(path: str, output: Any) -> torch.Tensor:
    """The value a module read sees: for decoder layers the residual stream after the
    layer (vLLM's layers return (hidden, residual) with the add deferred to the next
    norm: the stream is their sum); for the final norm its normed output."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        if _is_decoder_layer(path) and residual is not None:
            return hidden + residual
        return hidden
    return output


def _edit_module_output(path: str, output: Any, edits: list[tuple[list[int], P.WriteModule, _Sequence]]) -> None:
    """Apply module writes in place. For decoder layers the edit is to the residual stream
    (hidden + residual): only `hidden` changes, so the stream becomes what was asked."""
    is_layer = isinstance(output, tuple) and _is_decoder_layer(path)
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


@dataclass(frozen=True)
class _Want:
    """One module read to serve from this forward pass: these rows of the flat
    [num_tokens, hidden] activations, at these token positions."""

    seq: _Sequence
    name: str
    rows: slice | list[int]
    positions: list[int]


class _Outgoing:
    """One step's message to one frontend: a record per traced row, and each batched
    read once for all its rows (a column), which the records point into. Per row this
    costs a few references, not a tensor conversion."""

    __slots__ = ("_index", "columns", "records")

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.columns: list[_HostBatch] = []
        self._index: dict[int, int] = {}  # id(batch) -> column

    def add(self, key: str, row: _Row) -> None:
        values: dict[str, ReadResult] = {}
        rows: dict[str, tuple[int, int]] = {}
        if row.error is None:
            for name, read in row.kept.items():
                if type(read) is tuple:
                    batch, j = read
                    c = self._index.get(id(batch))
                    if c is None:
                        c = self._index[id(batch)] = len(self.columns)
                        self.columns.append(batch)
                    rows[name] = (c, j)
                else:
                    values[name] = read.result(row.token)  # type: ignore[union-attr]
        self.records.append(StepRecord(key, row.step, row.token, values, row.stopped, row.error, rows))

    def message(self) -> StepBatch:
        return StepBatch(self.records, [batch.column() for batch in self.columns])


class PlanHooks:
    """Owns the per-request plans and wraps one model runner's sampler."""

    def __init__(self, runner: Any, fault_injection: bool) -> None:
        self.runner = runner
        # One side channel per frontend process, by route (rank 0 only; empty elsewhere).
        self.senders: dict[int, Sender] = {}
        self.fault_injection = fault_injection
        self.sequences: dict[str, _Sequence | None] = {}
        self._rows: list[_Row] | None = None
        self._tokenizer: Any = None
        self.lens: _Lens | None = None
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
            started = time.perf_counter() if times else 0.0
            try:
                rows = self._traced_rows()
                if rows:
                    self._capture_raw(rows, logits)
            except Exception as e:  # noqa: BLE001 - vLLM's step must go on
                self._fail_batch("before the draw", e)
                rows = []
            if not rows:
                return original_forward(logits, sampling_metadata, *args, **kw)
            self._rows = rows
            if times:
                spent = time.perf_counter() - started
            try:
                out = original_forward(logits, sampling_metadata, *args, **kw)
            finally:
                self._rows = None
            if times:
                started = time.perf_counter()
            try:
                self._after_sample(rows, out.sampled_token_ids)
            except Exception as e:  # noqa: BLE001 - vLLM's step must go on
                self._fail_batch("after the draw", e, rows)
            if times:
                times.add(engine_s=spent + time.perf_counter() - started, steps=1, rows=len(rows))
            return out

        def apply_logits_processors(logits: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
            logits = original_apply(logits, *args, **kw)
            if self._rows:
                started = time.perf_counter() if times else 0.0
                try:
                    self._write_and_capture(self._rows, logits)
                except Exception as e:  # noqa: BLE001 - vLLM's step must go on
                    self._fail_batch("at the logits writes", e, self._rows)
                if times:
                    times.add(engine_s=time.perf_counter() - started)
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
        req_ids = batch.req_ids
        starts = self.runner.query_start_loc.np
        computed = batch.num_computed_tokens_cpu
        for i, req_id in enumerate(req_ids):
            seq = self._sequence(req_id)
            if seq is None or seq.error is not None:
                continue
            ops = [op for op in seq.plan.active_at(seq.step) if isinstance(op.action, P.HIDDEN_OPS)]
            if not ops:
                continue
            state = self.runner.requests[req_id]
            first, last = int(starts[i]), int(starts[i + 1])  # rows of this request
            pos0 = int(computed[i])  # position of its first row
            prompt_len = len(state.prompt_token_ids or ())
            samples_now = pos0 + (last - first) >= prompt_len + len(state.output_token_ids)
            for op in ops:
                action = op.action
                assert isinstance(action, P.HIDDEN_OPS)
                wanted: list[int] = []
                if seq.step == 0 and action.positions.kind != "new_token":
                    here = range(pos0, pos0 + last - first)  # positions this pass computes
                    wanted = [p for p in action.positions.prompt_positions(prompt_len) if p in here]
                elif samples_now and (action.positions.kind in ("new_token", "all")):
                    wanted = [pos0 + last - first - 1]
                if not wanted:
                    continue
                rows = [first + p - pos0 for p in wanted]
                if isinstance(action, P.WriteModule):
                    if op.condition is not None:
                        self.collector.drain()  # the text so far includes every finished step
                    if op.condition is None or _holds(op.condition, _Context(self, _Row(-1, seq, ()), drawn=False)):
                        self._edits.setdefault(action.module, []).append((rows, action, seq))
                    continue
                sources = (
                    [(op.name, action.module)] if isinstance(action, P.ReadModule) else action.module_reads(op.name)
                )
                for key, path in sources:
                    self._wants.setdefault(path, []).append(_Want(seq, key, rows, wanted))

    def _module_hook(self, path: str, output: Any) -> None:
        """Never raises into vLLM's forward pass: a failure fails the traces involved."""
        edits = self._edits.get(path)
        wants = self._wants.get(path)
        try:
            if edits:
                _edit_module_output(path, output, edits)  # in place: reads below see the edit
            if wants:
                value = _module_output(path, output)
                for want in wants:
                    # A copy: the activation buffer is reused by the next forward pass.
                    rows = value[want.rows].detach().to(torch.float32, copy=True)
                    want.seq.pending.setdefault(want.name, []).append((want.positions, rows))
        except Exception as e:  # noqa: BLE001
            log.exception("module hook on %s failed", path)
            for seq in [w.seq for w in wants or ()] + [seq for _, _, seq in edits or ()]:
                seq.error = seq.error or f"{type(e).__name__} in {path}: {e}"

    # -- per step --------------------------------------------------------------

    def _fail_batch(self, where: str, error: Exception, rows: list[_Row] | None = None) -> None:
        """A failure in the hooks' own bookkeeping (a tracewire bug, not one request's op,
        which fails only that request): vLLM's step goes on, and every traced request in
        the batch fails with the error, reported at its next step."""
        log.exception("tracewire hooks failed %s; failing the traces in this batch", where)
        message = f"tracewire hooks failed {where}: {type(error).__name__}: {error}"
        for row in rows or ():
            row.error = row.error or message
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
            seq = _Sequence(plan, needs_text=plan.needs_text(), prompt_ids=list(state.prompt_token_ids or ()))
        if len(self.sequences) > 2 * len(self.runner.requests) + 64:
            live = self.runner.requests.keys()
            self.sequences = {k: v for k, v in self.sequences.items() if k in live}
        self.sequences[req_id] = seq
        return seq

    def _traced_rows(self) -> list[_Row]:
        batch = self.runner.input_batch
        req_ids = batch.req_ids
        discard = getattr(self.runner, "discard_request_mask", None)
        discard_np = discard.np[: len(req_ids)] if discard is not None else None
        rows = []
        known = self.sequences
        for i, req_id in enumerate(req_ids):
            # The common case (a request seen before, untraced) is one dict lookup.
            seq = known[req_id] if req_id in known else self._sequence(req_id)
            if seq is None or seq.error_reported:
                continue
            if discard_np is not None and discard_np[i]:
                continue  # mid-prefill: vLLM throws this sample away
            selected = seq.ops_at(seq.step)
            if selected is _NO_OPS and seq.error is None and not seq.needs_text:
                seq.step += 1  # nothing to do, record or remember at this step
                continue
            row = _Row(i, seq, selected)
            if seq.error is not None:  # failed in a module hook: report it on this step
                row.selected, row.error = _ERROR_OPS, seq.error
            rows.append(row)
        return rows

    def _capture_raw(self, rows: list[_Row], logits: torch.Tensor) -> None:
        wanted = [row for row in rows if row.selected.needs_raw]
        if wanted:
            for row, captured in zip(wanted, _capture(logits, wanted), strict=True):
                row.raw = captured

    def _write_and_capture(self, rows: list[_Row], logits: torch.Tensor) -> None:
        for row in rows:
            if not row.selected.logits_writes:
                continue
            try:
                wrote = False
                ctx = _Context(self, row, drawn=False)
                for op in row.selected.logits_writes:
                    if op.condition is not None and row.processed is None:
                        self.collector.drain()  # the text so far includes every finished step
                        (row.processed,) = _capture(logits, [row])
                    # Conditions see the row as vLLM made it, before any of our writes.
                    if _holds(op.condition, ctx):
                        _apply_write(op.action, logits[row.index], row.seq, self.fault_injection)
                        wrote = True
                if wrote:
                    row.processed = None  # captured again below, after the writes
            except Exception as e:  # noqa: BLE001 - fails this request's trace only
                row.error = f"{type(e).__name__}: {e}"
        wanted = [r for r in rows if r.selected.needs_processed and r.processed is None]
        if wanted:
            for row, captured in zip(wanted, _capture(logits, wanted), strict=True):
                row.processed = captured

    def _after_sample(self, rows: list[_Row], sampled: torch.Tensor) -> None:
        """Launch the step's reads (every read selected now, its condition decided later)
        and hand the step to the collector. No waiting for the device here."""
        drawn = sampled.view(sampled.shape[0], -1)[:, 0]
        fired = [row for row in rows if row.error is None and row.selected.reads]
        try:
            _launch_reads(fired, self.lens, drawn)
        except Exception as e:  # noqa: BLE001 - a batch failure fails the traces in it
            for row in fired:
                row.error = f"{type(e).__name__}: {e}"
        # On the CPU vLLM may reuse the sampled-ids buffer: keep a copy of our own.
        tokens = _to_host(drawn) if drawn.device.type != "cpu" else drawn.clone()
        done = None
        if drawn.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        for row in rows:
            row.step = row.seq.step
            row.seq.step += 1
        self.collector.submit(_StepWork(rows, tokens, done))

    def _finish(self, work: _StepWork) -> None:
        """On the collector thread: the step's values are on the host now; decide its
        conditions and stops, send its records, extend each sequence's text."""
        started = time.perf_counter()
        work.wait()
        ready = time.perf_counter()
        tokens = work.tokens.tolist()
        batches: dict[int, _Outgoing] = {}
        for row in work.rows:
            seq = row.seq
            row.token = int(tokens[row.index])
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
                out = batches.get(seq.plan.route)
                if out is None:
                    out = batches[seq.plan.route] = _Outgoing()
                out.add(seq.plan.key, row)
            if seq.needs_text:
                seq.tokens.append(row.token)
        for route, out in batches.items():
            sender = self.senders.get(route)
            if sender is not None:
                sender.send(out.message())
        if self.times:
            self.times.add(collector_s=time.perf_counter() - ready, wait_s=ready - started)

    def _decide(self, row: _Row) -> None:
        """This row's stops, and which of its launched reads it keeps."""
        ctx = _Context(self, row, drawn=True)
        for op in row.selected.ops:
            if isinstance(op.action, P.READS):
                if _holds(op.condition, ctx):
                    row.kept[op.name] = row.reads[op.name]
            elif isinstance(op.action, P.Stop):
                if _holds(op.condition, ctx):
                    row.stopped = True

    def decode(self, tokens: list[int]) -> str:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            config = self.runner.vllm_config.model_config
            self._tokenizer = AutoTokenizer.from_pretrained(
                config.tokenizer, trust_remote_code=config.trust_remote_code
            )
        return str(self._tokenizer.decode(tokens, skip_special_tokens=True))


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
    return hooks
