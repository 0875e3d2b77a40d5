"""Module hooks: module writes and the copies module reads take, in the forward pass.

On eager engines a pre-hook maps the pass's flat [tokens, hidden] rows to requests
(query starts, computed tokens: a Span each); each addressable module's forward hook
then applies that pass's writes in place and copies out the rows its reads select
(module_reads.py turns them into values at the step's sample).

Compiled engines run no Python hooks in the pass: they steer through
shared/steering.py's tables (planned by steering_slots.py), and with read buffers
(shared/read_buffers.py) the same plan is made on the host before the pass and its
decoder-layer and unit reads take their rows from the buffers after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch

from ..shared import plan as P
from ..shared.read_buffers import ReadBuffers
from . import recompute
from .attention_patterns import AttentionPatterns
from .conditions import holds_before_forward
from .dictionaries import Dictionaries, Dictionary
from .host import on_device
from .module_reads import Column, Lens
from .patch_store import PatchStore
from .runner import RunnerView
from .sequences import Sequence, Sequences
from .unit_hooks import edit_units, take_rows

# Under vLLM's logger: vLLM configures its handlers (with the process prefix) in the
# worker processes; a logger of our own would have none there.
log = logging.getLogger(f"vllm.{__name__}")


def computes_new_token(pos0: Any, tokens: Any, prompt_len: Any, drawn: Any) -> Any:
    """Whether a request's `tokens` rows of a pass from position `pos0` end at its new
    token (a pass that samples it), not inside its prompt (a chunk of a prefill). Ints,
    or numpy arrays of them (one answer per request)."""
    return pos0 + tokens >= prompt_len + drawn


@dataclass(slots=True)
class Span:
    """One request's rows in a forward pass's flat [tokens, hidden] activations."""

    first: int  # its first row
    last: int  # one past its last row
    pos0: int  # the token position of its first row
    prompt_len: int
    samples: bool  # this pass computes its next token (not a chunk of its prompt)
    # Positions an earlier step computed: vLLM preempted the request and recomputes it
    # (recompute.py makes its module writes again there).
    recomputed: range = range(0)

    @classmethod
    def of(cls, prompt_len: int, drawn: int, first: int, last: int, pos0: int) -> Span:
        """`drawn`: the tokens the request has drawn before this pass."""
        samples = computes_new_token(pos0, last - first, prompt_len, drawn)
        return cls(first, last, pos0, prompt_len, samples, recompute.recomputed(pos0, last - first, prompt_len, drawn))

    def replays(self, seq: Sequence) -> list[recompute.Replay]:
        """The writes `seq` made before at positions this pass recomputes."""
        if not self.recomputed or not seq.applied:
            return []
        return recompute.replays(seq.plan, seq.applied, self.first, self.pos0, self.recomputed, self.prompt_len)

    def rows(self, positions: P.Positions, step: int) -> tuple[list[int], list[int]]:
        """The rows, and their token positions, that `positions` selects at `step`."""
        wanted: list[int] = []
        if step == 0 and positions.kind != "new_token":
            here = range(self.pos0, self.pos0 + self.last - self.first)  # positions this pass computes
            wanted = [p for p in positions.prompt_positions(self.prompt_len) if p in here]
        elif self.samples and positions.kind in ("new_token", "all"):
            wanted = [self.pos0 + self.last - self.first - 1]
        return [self.first + p - self.pos0 for p in wanted], wanted


class Want(msgspec.Struct, gc=False):
    """One module read to serve from this forward pass: these rows of the flat
    [num_tokens, hidden] activations, at these token positions. (A struct: made per
    traced row and read each pass, and cheaper to make than a dataclass.)"""

    seq: Sequence
    name: str
    rows: list[int]
    positions: list[int]


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


def _edit_module_output(path: str, output: Any, edits: list[Edit]) -> None:
    """Apply module writes in place. For decoder layers the edit is to the residual stream
    (hidden + residual): only `hidden` changes, so the stream becomes what was asked."""
    is_layer = isinstance(output, tuple) and P.is_decoder_layer(path)
    target = output[0] if isinstance(output, tuple) else output
    residual = output[1] if is_layer and output[1] is not None else None
    if all(e.write.edit in ("add", "steer") for e in edits):
        # Steering, the common case: stream + s*v is hidden + s*v, for every row of every
        # request at once (one index_add_, not a few kernels per request).
        rows = [row for e in edits for row in e.rows]
        vectors = torch.cat([e.seq.write_vector(e.write, target, e.dictionary).expand(len(e.rows), -1)
                             for e in edits])
        target.index_add_(0, on_device(rows, target.device, torch.long), vectors)
        return
    for e in edits:
        rows, edit, seq = e.rows, e.write, e.seq
        index = on_device(rows, target.device, torch.long)
        stream = target[index] + (residual[index] if residual is not None else 0)
        if e.operand is not None:  # patch / add_read: another invoke's rows, row for row
            operand = e.operand.to(device=target.device, dtype=stream.dtype)
            new_stream = operand if edit.edit == "patch" else stream + edit.scale * operand
        elif edit.edit in ("add", "steer"):
            new_stream = stream + seq.write_vector(edit, target, e.dictionary)
        elif edit.edit == "clamp":
            assert e.dictionary is not None and edit.dictionary is not None
            clamp = edit.dictionary
            new_stream = stream + e.dictionary.clamp_delta(stream, clamp.features, clamp.value).to(stream.dtype)
        elif edit.edit == "replace":
            new_stream = seq.write_vector(edit, target).expand_as(stream)
        elif edit.edit == "zero":
            new_stream = torch.zeros_like(stream)
        else:  # mean over the selected positions
            new_stream = stream.mean(0, keepdim=True).expand_as(stream)
        new_target = new_stream - (residual[index] if residual is not None else 0)
        target.index_copy_(0, index, new_target.to(target.dtype))


class _ColumnIndex(NamedTuple):
    """The rows a pass's column reads take (shared by the modules the same rows read):
    the flat rows, the numpy `where` / positions of their Columns, and (eager engines,
    which copy the rows out in the hook) the rows as a device index."""

    planned: list[int]
    rows: np.ndarray
    where: np.ndarray
    positions: np.ndarray
    index: torch.Tensor | None


class PlannedColumn(NamedTuple):
    """A pass's rows of one module that blocks read (planned before the pass): the batch
    rows reading it, their new tokens' flat rows and token positions."""

    batch_rows: list[int]
    rows: list[int]
    positions: list[int]


class Edit(NamedTuple):
    """One request's module write in this forward pass: at these flat token rows."""

    rows: list[int]
    write: P.WriteModule
    seq: Sequence
    # patch / add_read: the stored source rows for `rows`, in order ([len(rows), width])
    operand: torch.Tensor | None = None
    dictionary: Dictionary | None = None  # steer / clamp: the dictionary the write names


class ModuleHooks:
    """Forward hooks on every addressable module of an eager engine (they cannot fire
    inside compiled graphs): a pre-hook on the model plans each forward pass, and each
    module's hook then makes its writes and copies out its reads' rows. Idle unless the
    pass has module reads or writes. With a compiled engine's read buffers, no module
    hooks: the plan is made before the pass and its reads' rows taken after it."""

    def __init__(self, runner: RunnerView, sequences: Sequences, drain: Callable[[], None],
                 store: PatchStore | None = None, dictionaries: Dictionaries | None = None,
                 buffers: ReadBuffers | None = None) -> None:
        self.runner = runner
        # A compiled engine's read buffers: its reads only (the compiler refuses the rest).
        self.buffers = buffers
        self.dictionaries = dictionaries if dictionaries is not None else Dictionaries()
        self.store = store if store is not None else PatchStore()  # patch sources' values
        self.sequences = sequences
        self.drain = drain  # (module_writes' text conditions: every finished step first)
        parts = runner.lens_parts()
        self.lens = Lens(*parts, runner.vocab_size, gather=runner.vocab_gather()) if parts is not None else None
        self.patterns = AttentionPatterns(runner.attention_layers())
        self._wants: dict[str, list[Want]] = {}
        self._edits: dict[str, list[Edit]] = {}
        # Blocks' column reads (a module's new-token value, for every block row reading
        # it): by module path, the batch rows reading it and their flat token rows; once
        # gathered, `columns` holds each path's values for the sampler hooks.
        self._column_rows: dict[str, PlannedColumn] = {}
        self.columns: dict[str, Column] = {}
        self._column_index: _ColumnIndex | None = None  # the pass's last column's (_shared_index)

    def install(self) -> None:
        if self.buffers is not None:  # compiled: planned and read on the host around the pass
            self.runner.before_model_forward(self._plan_safely)
            self.runner.after_model_forward(self._take_buffered)
            return
        self.runner.on_forward(self._plan_safely)
        self.patterns.install()
        for path, module in self.runner.modules().items():
            module.register_forward_hook(
                lambda module, args, output, path=path: self._hook(path, output)
            )
        # Heads and neurons are module inputs (o_proj's, down_proj's): pre-hooks.
        for path, (module, width) in self.runner.unit_modules().items():
            module.register_forward_pre_hook(
                lambda module, args, path=path, width=width: self._unit_hook(path, args[0], width)
            )

    def _plan_safely(self) -> None:
        try:
            self._plan()
        except Exception:  # noqa: BLE001 - never break vLLM's forward pass
            log.exception("planning module hooks failed; no module interventions this step")
            self._wants, self._edits, self._column_rows, self._column_index = {}, {}, {}, None
            self.patterns.begin(self.runner.live())

    def _plan(self) -> None:
        """Map this forward pass's flat token rows to the module reads and writes they serve."""
        self._wants = {}
        self._edits = {}
        self._column_rows = {}
        self.columns = {}
        self._column_index = None
        self.patterns.begin(self.runner.live())
        req_ids = self.runner.req_ids
        starts = self.runner.query_starts(len(req_ids))
        computed = self.runner.computed_tokens(len(req_ids))
        compiled = self.buffers is not None  # (its writes: steering_slots.py)
        # Block rows reading modules at their new token: by the modules they read, their
        # batch rows, prompt lengths and tokens drawn; planned together below, a few appends
        # each here (a row that does nothing else, the common traced row under load, is
        # looked at no further: Sequence.column_only).
        column_groups: dict[tuple[str, ...], tuple[list[int], list[int], list[int]]] = {}
        output_count = self.runner.output_count
        for i, req_id in enumerate(req_ids):
            seq = self.sequences.get(req_id)
            if seq is None or seq.error is not None:
                continue
            if not (seq.column_only or seq.hidden_ops or seq.applied):
                continue  # (a plan with pattern reads has hidden ops)
            now = seq.constant if seq.column_only else seq.ops_at(seq.step)
            columns = bool(now.column_reads) and seq.blocks(now)
            if columns and now.column_paths:  # its row joins a block: its module reads are columns
                group = column_groups.get(now.column_paths)
                if group is None:
                    group = column_groups[now.column_paths] = ([], [], [])
                group[0].append(i)
                group[1].append(len(seq.prompt_ids))
                group[2].append(output_count(req_id))
                if seq.column_only:
                    continue  # nothing else in the pass
            ops = [(k, op) for k, op in seq.hidden_ops
                   if op.selects(seq.step) and not (columns and type(op.action) is not P.WriteModule)]
            if not ops and not seq.reads_patterns and not seq.applied:
                continue
            span = Span.of(len(seq.prompt_ids), self.runner.output_count(req_id),
                           int(starts[i]), int(starts[i + 1]), int(computed[i]))
            if seq.reads_patterns:  # (their keys at every pass, selected or not; a block's top k: a column)
                self.patterns.plan(req_id, seq, span, column=columns)
            for replay in [] if compiled else span.replays(seq):  # a recomputed request: its writes there again
                assert isinstance(replay.op.action, P.WriteModule)
                self._edit(seq, replay.op.action, replay.step, replay.rows, replay.positions)
            for k, op in ops:
                action = op.action
                assert isinstance(action, P.HIDDEN_OPS)
                if isinstance(action, P.ReadAttentionPattern):
                    continue  # planned above
                rows, wanted = span.rows(action.positions, seq.step)
                if not rows:
                    continue
                if isinstance(action, P.WriteModule):
                    if not compiled and holds_before_forward(op.condition, seq, self.drain):
                        self._edit(seq, action, seq.step, rows, wanted)
                        seq.applied.add((seq.step, k))
                    continue
                # (once per key: a lens naming a layer twice, as 1 and -3 of 4, reads its stream once)
                for key, path in dict.fromkeys(action.module_reads(op.name)):
                    self._wants.setdefault(path, []).append(Want(seq, key, rows, wanted))
        for paths, (batch_rows, prompt_lens, drawn) in column_groups.items():
            self._plan_column_rows(paths, np.asarray(batch_rows), np.asarray(prompt_lens), np.asarray(drawn),
                                   starts, computed)

    def _plan_column_rows(self, paths: tuple[str, ...], batch_rows: np.ndarray, prompt_lens: np.ndarray,
                          drawn: np.ndarray, starts: np.ndarray, computed: np.ndarray) -> None:
        """Batch rows reading these modules at their new token: each token's flat row and
        position, where this pass computes it (not a chunk of its prompt). In numpy, for
        every block row reading the same modules at once."""
        first, last, pos0 = starts[batch_rows], starts[batch_rows + 1], computed[batch_rows]
        new = computes_new_token(pos0, last - first, prompt_lens, drawn)
        taken = batch_rows[new].tolist()
        rows = (last[new] - 1).tolist()
        positions = (pos0[new] + last[new] - first[new] - 1).tolist()
        for path in paths:
            found = self._column_rows.get(path)
            if found is None:
                found = self._column_rows[path] = PlannedColumn([], [], [])
            found.batch_rows.extend(taken)
            found.rows.extend(rows)
            found.positions.extend(positions)

    def _gather_column(self, path: str, value: torch.Tensor, planned: PlannedColumn, unit_width: int = 0) -> None:
        """An eager pass's column of `value` ([tokens, hidden]; a unit address's module
        input, units of `unit_width`) for the batch rows reading it, in one gather (a
        copy: later modules of the pass reuse the activations' memory); its rows in the
        Column are then 0..n-1."""
        shared = self._shared_index(planned, value.device)
        assert shared.index is not None
        copied = value.index_select(0, shared.index).to(torch.float32)
        self.columns[path] = Column(copied, np.arange(len(planned.rows)), shared.where, shared.positions, unit_width)

    def _shared_index(self, planned: PlannedColumn, device: torch.device | None) -> _ColumnIndex:
        """The column index of `planned` rows: the last one made when the rows are the same
        (a lens's layers, most often: one copy of the index to the device for all of them,
        and the lens orders them once, module_reads._lens_column). `device`: where the
        rows are gathered in a hook (eager), None when they are read from buffers."""
        shared = self._column_index
        if shared is None or shared.planned != planned.rows or (device is not None and shared.index is None):
            rows = np.asarray(planned.rows, np.int64)
            where = np.full(len(self.runner.req_ids), -1, np.int64)
            where[planned.batch_rows] = np.arange(len(planned.batch_rows))
            shared = self._column_index = _ColumnIndex(
                planned.rows, rows, where, np.asarray(planned.positions, np.int32),
                on_device(rows, device, torch.long) if device is not None else None)
        return shared

    def take_columns(self) -> dict[str, Column]:
        """This step's column reads, for the sampler hooks (once: the next pass makes new ones)."""
        columns, self.columns = self.columns, {}
        return columns

    def _edit(self, seq: Sequence, write: P.WriteModule, step: int, rows: list[int], wanted: list[int]) -> None:
        """Plan `write` at these rows of the pass (positions `wanted`), as step `step` makes it."""
        operand = dictionary = None
        try:
            if write.ref is not None:
                operand = self.store.operand(write, len(seq.prompt_ids), step, wanted)
            if write.dictionary is not None:
                dictionary = self.dictionaries.get(write.dictionary.dictionary)
        except RuntimeError as e:  # fails this request's trace only
            seq.error = seq.error or f"{write.edit} of {write.module}: {e}"
            return
        self._edits.setdefault(write.module, []).append(Edit(rows, write, seq, operand, dictionary))

    def _hook(self, path: str, output: Any) -> None:
        """Never raises into vLLM's forward pass: a failure fails the traces involved."""
        edits = self._edits.get(path)
        wants = self._wants.get(path)
        try:
            if edits:
                _edit_module_output(path, output, edits)  # in place: reads below see the edit
            column = self._column_rows.get(path)
            if column is not None:
                self._gather_column(path, _module_output(path, output).detach(), column)
            if wants:
                # Every request's rows in one gather (a copy: the activation buffer is
                # reused by the next forward pass); each read keeps its slice of it.
                value = _module_output(path, output).detach()
                index = [r for want in wants for r in want.rows]
                taken = value.index_select(0, on_device(index, value.device, torch.long)).to(torch.float32)
                _keep(wants, taken)
        except Exception as e:  # noqa: BLE001
            _fail(path, e, wants, edits)

    def _take_buffered(self) -> None:
        """After a compiled pass: each read layer's rows from its read buffer, as `_hook`
        takes them from the output on an eager engine. Never raises into vLLM's step."""
        wants, self._wants = self._wants, {}
        columns, self._column_rows = self._column_rows, {}
        patterns = self.patterns.planned_layers()
        if not wants and not columns and not patterns:
            return
        assert self.buffers is not None
        tokens = self.runner.pass_tokens(len(self.runner.req_ids))
        for index in patterns:  # (the compiler refuses layers without buffers: else those traces fail)
            kept = index in self.buffers.attention
            self.patterns.compute(index, *(self.buffers.attention_inputs(index, tokens) if kept else (None, None)))
        for path, planned in columns.items():
            # No device work here: the column is the layer's buffer and the rows its
            # readers take (they launch at this step's sample, before the next pass
            # overwrites the buffer, and on the same stream: module_reads.Column).
            try:
                shared = self._shared_index(planned, None)
                if P.unit_kind(path):  # heads / neurons: their module's input
                    self.columns[path] = Column(self.buffers.unit_input(path, tokens), shared.rows, shared.where,
                                                shared.positions, self.buffers.units[path].unit_width)
                else:
                    self.columns[path] = Column(self.buffers.output(path, tokens), shared.rows,
                                                shared.where, shared.positions)
            except Exception:  # noqa: BLE001 - the blocks reading it fail (no column)
                log.exception("read buffer column of %s failed", path)
        for path, path_wants in wants.items():
            try:
                rows = [r for want in path_wants for r in want.rows]
                if P.unit_kind(path):  # heads / neurons: their module's input (--compiled-unit-reads)
                    value = self.buffers.unit_input(path, tokens)
                    index = on_device(rows, value.device, torch.long)
                    _keep(path_wants, take_rows(value, self.buffers.units[path].unit_width, index))
                else:
                    value = self.buffers.output(path, tokens)
                    index = on_device(rows, value.device, torch.long)
                    _keep(path_wants, value.index_select(0, index).to(torch.float32))
            except Exception as e:  # noqa: BLE001
                _fail(path, e, path_wants, None)

    def _unit_hook(self, path: str, value: torch.Tensor, unit_width: int) -> None:
        """A pre-hook on o_proj / down_proj: unit writes and reads on their input
        (unit_hooks.py). Never raises into vLLM's forward pass."""
        edits = self._edits.get(path)
        wants = self._wants.get(path)
        try:
            if edits:
                edit_units(value, unit_width, edits)  # in place: o_proj / down_proj see it
            column = self._column_rows.get(path)
            if column is not None:
                self._gather_column(path, value.detach(), column, unit_width)
            if wants:
                index = on_device([r for want in wants for r in want.rows], value.device, torch.long)
                _keep(wants, take_rows(value, unit_width, index))
        except Exception as e:  # noqa: BLE001
            _fail(path, e, wants, edits)


def _keep(wants: list[Want], taken: torch.Tensor) -> None:
    """Each read keeps its slice of the rows taken for every read of the module."""
    offset = 0
    for want in wants:
        n = len(want.rows)
        want.seq.pending.setdefault(want.name, []).append((want.positions, taken[offset:offset + n]))
        offset += n


def _fail(path: str, e: Exception, wants: list[Want] | None, edits: list[Edit] | None) -> None:
    """A hook that failed fails the traces it served, and only those."""
    log.exception("module hook on %s failed", path)
    for seq in [w.seq for w in wants or ()] + [edit.seq for edit in edits or ()]:
        seq.error = seq.error or f"{type(e).__name__} in {path}: {e}"
