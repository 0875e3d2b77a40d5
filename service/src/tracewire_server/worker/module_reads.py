"""Module reads and logit-lens reads: values of a module's output at chosen positions.

The module hooks (module_hooks.py) copy out the rows these reads select during the
forward pass, into each Sequence's `pending`; at the step's sample this joins a
read's chunks (a chunked prefill runs several passes), checks them complete, and
launches the read's value to the host: the rows, their mean, or (logit lens) the
final norm and lm_head applied to them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from ..shared import plan as P
from .batch import Block, Row
from .dictionaries import Dictionaries
from .dictionary_reads import DictionaryWant, launch_dictionary_reads
from .dictionary_reads import column as dictionary_column
from .host import ColumnRow, ColumnRows, HostBatch, HostRead, on_device, to_host
from .patch_store import PatchStore
from .pattern_state import joined
from .unit_hooks import select_units
from .vocab_topk import stats, top_k_logprobs, warm_up, working_bytes

# A top-k lens holds at most this many bytes of device memory at a time for its logits
# and their top k (vocab_topk.working_bytes a row: on a GPU ~440 rows of a 152k vocabulary).
LENS_CHUNK_BYTES = 256 << 20


class Lens:
    """The model's own final norm and lm_head, applied to residual streams: log-probabilities
    in float32 from logits in lm_head's dtype, as the model computes its own.
    `gather`: under tensor parallelism `weight` is this rank's slice of the vocab-parallel
    lm_head; it joins every rank's slice of the logits (runner.vocab_gather)."""

    def __init__(self, norm: torch.nn.Module, weight: torch.Tensor, vocab_size: int,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.norm = norm
        self.weight = weight
        self.vocab_size = vocab_size
        self.gather = gather
        # (logits as self.logits makes them: rows of the padded vocabulary, lm_head's dtype)
        warm_up(torch.zeros(1, weight.shape[0], dtype=weight.dtype, device=weight.device)[:, :vocab_size])

    @torch.no_grad()
    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] logits, in lm_head's dtype (as the model's own)."""
        normed = self.norm.forward(streams.to(device=self.weight.device, dtype=self.weight.dtype))
        normed = normed[0] if isinstance(normed, tuple) else normed  # (.forward: not through a hook on "norm")
        logits = normed @ self.weight.t()
        if self.gather is not None:  # [rows, the padded vocab], every rank's slice in order
            logits = self.gather(logits.contiguous())
        return logits[:, : self.vocab_size]

    @torch.no_grad()
    def __call__(self, streams: torch.Tensor, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[..., hidden] -> [..., vocab] float32 log-probabilities, or (top_k > 0) the top_k
        of them [..., k] and their ids (int32)."""
        lead = streams.shape[:-1]
        flat = streams.reshape(-1, streams.shape[-1])
        if not top_k:  # every log-probability (all returned: --max-read-bytes bounds them)
            return self._full(flat).reshape(*lead, -1), None
        # Top k: [rows, vocab] exists a chunk of rows at a time, so the device memory a
        # lens over many layers and prompt positions takes is bounded; vocab_topk finds
        # each chunk's top k and log-sum-exp in one pass over its logits (on a GPU one
        # kernel: each torch call here lets go of the GIL).
        chunk = max(1, LENS_CHUNK_BYTES // working_bytes(self.vocab_size, top_k, self.weight.device))
        values, ids = [], []
        for start in range(0, flat.shape[0], chunk):
            top_values, top_ids = top_k_logprobs(self.logits(flat[start:start + chunk]), top_k)
            values.append(top_values)
            ids.append(top_ids)
        joined = (values[0], ids[0]) if len(values) == 1 else (torch.cat(values), torch.cat(ids))
        return joined[0].reshape(*lead, top_k), joined[1].reshape(*lead, top_k)

    def _full(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 log-probabilities, a chunk of rows at a time, in the top-k
        reads' arithmetic (vocab_topk.VocabStats.logprobs): a full row and a top-k read
        of the same stream agree to float32 rounding."""
        chunk = max(1, LENS_CHUNK_BYTES // (12 * self.vocab_size))  # (logits, a float32 copy, exponentials)
        parts = []
        for start in range(0, flat.shape[0], chunk):
            logits = self.logits(flat[start:start + chunk])
            parts.append(stats(logits).logprobs(logits))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _gathered(row: Row, key: str, module: str, positions_of: P.Positions) -> tuple[torch.Tensor, list[int]]:
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


class _LensWant(NamedTuple):
    """A row's logit-lens read: its streams, joined with other rows' into one lm_head matmul."""

    row: Row
    name: str
    top_k: int
    streams: list[torch.Tensor]  # per layer, [positions, hidden]
    positions: list[int]


def _lens_want(row: Row, name: str, read: P.ReadLogitLens) -> _LensWant:
    streams, positions = [], []
    for key, path in read.module_reads(name):
        values, positions = _gathered(row, key, path, read.positions)
        streams.append(values)
    return _LensWant(row, name, read.top_k, streams, positions)


def _launch_lens(wants: list[_LensWant], lens: Lens) -> None:
    """log_softmax(lm_head(norm(stream))) per layer and position, [layers, positions, k],
    for every row: one norm and lm_head matmul per top_k over all rows' streams (a matmul
    a row would read lm_head's weights once per row)."""
    by_k: dict[int, list[_LensWant]] = {}
    for want in wants:
        by_k.setdefault(want.top_k, []).append(want)
    for k, group in by_k.items():
        try:
            # every row's layers in order, [layers x positions, hidden] each: one cat for
            # the group (a stack per row was a kernel launch per row per step)
            flat = torch.cat([stream for w in group for stream in w.streams])
            values, ids = lens(flat, k)
            # One copy to the host for the group, each row a view of its part (a copy per
            # row cost two copy launches per row per step: most of the lens's host time).
            host_values = to_host(values).numpy()
            host_ids = None if ids is None else to_host(ids).numpy()
            offset = 0
            for w in group:
                n = len(w.streams) * len(w.positions)
                shape = (len(w.streams), len(w.positions), -1)
                batch = HostBatch.of_arrays(host_values[offset:offset + n].reshape(shape),
                                            None if host_ids is None else host_ids[offset:offset + n].reshape(shape))
                w.row.reads[w.name] = HostRead(batch, w.positions)
                offset += n
        except Exception as e:  # noqa: BLE001 - fails the rows that read it
            for w in group:
                w.row.error = f"{type(e).__name__}: {e}"


def _export(store: PatchStore, row: Row, name: str, values: torch.Tensor) -> None:
    """Keep a patch source's rows of this step for the writes that take them (a copy of
    its own: `values` may be a slice of every request's rows of the module)."""
    plan = row.seq.plan
    store.put(plan.trace, plan.invoke, name, row.seq.step, values.clone())


def _module_value(row: Row, name: str, read: P.ReadModule, store: PatchStore | None = None) -> HostRead:
    """A module read of the prompt's positions, or their mean (new-token reads travel as
    one column per module: launch_module_reads)."""
    values, positions = _gathered(row, name, read.module, read.positions)
    if store is not None and name in row.seq.plan.exports and not read.mean:
        _export(store, row, name, values)
    if P.unit_kind(read.module):
        # heads / neurons: the chosen units (top-k: with their ids), of the mean
        # when reduced ([positions, units(, head_dim)] or [units(, head_dim)])
        chosen, ids = select_units(values.mean(0) if read.mean else values, read.module, read.units)
        return HostRead(HostBatch(to_host(chosen), to_host(ids) if ids is not None else None),
                        positions=None if read.mean else positions)
    if read.mean:
        return HostRead(HostBatch(to_host(values.mean(0)), None))
    # [positions, hidden], with the prompt positions
    return HostRead(HostBatch(to_host(values), None), positions=positions)


def _pattern_value(row: Row, name: str, read: P.ReadAttentionPattern) -> HostRead:
    """Attention weights per layer, query position and head: [layers, positions, heads,
    K] (attention_patterns.py computed them in the forward pass)."""
    if read.positions.new_token_only(row.seq.step):
        expected = 1
    else:
        expected = len(read.positions.prompt_positions(len(row.seq.prompt_ids)))
    values, ids, positions = [], [], []
    for key, path in read.module_reads(name):
        chunks = row.seq.patterns.pop(key, [])
        layer_values, layer_ids, positions = joined(chunks) if chunks else (None, None, [])
        if layer_values is None or len(positions) != expected:
            raise RuntimeError(
                f"read {key!r} of {path!r} saw {len(positions)} of {expected} query positions "
                "(positions served from the prefix cache never run through the model)"
            )
        values.append(layer_values)
        if layer_ids is not None:
            ids.append(layer_ids)
    return HostRead(HostBatch(to_host(torch.stack(values)), to_host(torch.stack(ids)) if ids else None), positions)


class Column(NamedTuple):
    """A module's new-token values for the block rows reading it this step: [n, hidden]
    float32; for each batch row its row of `values` (-1: none); each row's token position."""

    values: torch.Tensor
    where: np.ndarray
    positions: np.ndarray


def launch_column_reads(blocks: list[Block], columns: dict[str, Column], lens: Lens | None,
                        dictionaries: Dictionaries | None = None) -> None:
    """Launch the blocks' module reads: each module's column (module_hooks.py gathered
    every block row's new-token value in one pass) goes to the host in one copy; the
    logit lens is one lm_head matmul per read over every block row reading it, a
    dictionary read one matmul. A block missing a row of a column fails its own traces,
    not the other blocks'."""
    groups: dict[P.ReadModule | P.ReadLogitLens | P.ReadDictionary, list[tuple[Block, str]]] = {}
    for block in blocks:
        for name, read in block.ops.column_reads:
            groups.setdefault(read, []).append((block, name))
    for read, members in groups.items():
        paths = [path for _, path in read.module_reads("")]
        members = _complete(members, paths, columns)
        if not members:
            continue
        try:
            if type(read) is P.ReadLogitLens:
                assert lens is not None
                batch = _lens_column(read, members, paths, columns, lens)
            elif type(read) is P.ReadDictionary:
                assert dictionaries is not None
                column = columns[paths[0]]  # (a deleted or replaced dictionary fails these blocks)
                x = column.values.index_select(0, _rows_on_device(members, column))
                batch = dictionary_column(read, dictionaries.get(read.dictionary), x)
            else:
                column = columns[paths[0]]
                batch = HostBatch(to_host(column.values.index_select(0, _rows_on_device(members, column))), None)
        except Exception as e:  # noqa: BLE001 - fails the blocks reading it
            for block, _ in members:
                block.error = block.error or f"{type(e).__name__}: {e}"
            continue
        offset = 0
        for block, name in members:  # each block's rows: one range of the column
            block.reads[name] = ColumnRows(batch, list(range(offset, offset + len(block.index))))
            offset += len(block.index)


def _complete(members: list[tuple[Block, str]], paths: list[str],
              columns: dict[str, Column]) -> list[tuple[Block, str]]:
    """The members whose block has its every row in each of these columns (the others'
    blocks fail), a frontend's blocks next to each other: then the rows a frontend reads
    are one slice of the column (outgoing.py sends a slice without cutting it)."""
    kept = []
    for block, name in members:
        for path in paths:
            column = columns.get(path)
            if column is None or (column.where[block.index] < 0).any():
                block.error = block.error or (f"read {name!r} of {path!r} saw 0 of 1 positions (its forward pass "
                                              "did not compute the new token)")
                break
        else:
            kept.append((block, name))
    return sorted(kept, key=lambda member: member[0].route)


def _rows_on_device(members: list[tuple[Block, str]], column: Column) -> torch.Tensor:
    """The members' rows of the column, block after block, as a device index."""
    rows = np.concatenate([column.where[block.index] for block, _ in members])
    return on_device(rows, column.values.device, torch.long)


def _lens_column(read: P.ReadLogitLens, members: list[tuple[Block, str]], paths: list[str],
                 columns: dict[str, Column], lens: Lens) -> HostBatch:
    """One logit-lens read for every member block row: [rows, layers, 1, k] (one
    position: the new token's), its positions a column beside it."""
    ordered: dict[int, torch.Tensor] = {}  # by id of a `where`: the layers read by the same rows share it
    streams = []
    for path in paths:
        column = columns[path]
        rows = ordered.get(id(column.where))
        if rows is None:
            rows = ordered[id(column.where)] = _rows_on_device(members, column)
        streams.append(column.values.index_select(0, rows))
    first = columns[paths[0]]
    positions = first.positions[np.concatenate([first.where[block.index] for block, _ in members])]
    values, ids = lens(torch.stack(streams, dim=1), read.top_k)  # [rows, layers, vocab or k]
    return HostBatch.of_arrays(to_host(values.unsqueeze(2)).numpy(),
                               None if ids is None else to_host(ids.unsqueeze(2)).numpy(),
                               positions.reshape(-1, 1))


def launch_module_reads(rows: list[Row], lens: Lens | None, store: PatchStore | None = None,
                        dictionaries: Dictionaries | None = None) -> None:
    """Launch the rows' module and logit-lens reads, each on its way to the host. A
    module's new-token reads for every row are one [rows, hidden] column with one copy
    to the host, not a copy per row. A read that fails fails its own row's trace.
    Reads other invokes patch from (the plan's exports) also go into `store`."""
    new_token: dict[str | tuple[str, P.Units | None], list[_NewToken]] = {}
    dictionary_wants: list[DictionaryWant] = []
    lens_wants: list[_LensWant] = []
    for row in rows:
        try:
            for op in row.selected.module_reads:
                a = op.action
                if isinstance(a, P.ReadModule):
                    if not a.mean and a.positions.new_token_only(row.seq.step):
                        values, _ = _gathered(row, op.name, a.module, a.positions)
                        # (unit reads: a column per module and selection, cut once for all rows)
                        column = (a.module, a.units) if P.unit_kind(a.module) else a.module
                        new_token.setdefault(column, []).append(_NewToken(row, op.name, values[0]))
                        if store is not None and op.name in row.seq.plan.exports:
                            _export(store, row, op.name, values)
                    else:
                        row.reads[op.name] = _module_value(row, op.name, a, store)
                elif isinstance(a, P.ReadAttentionPattern):
                    row.reads[op.name] = _pattern_value(row, op.name, a)
                elif isinstance(a, P.ReadDictionary):
                    values, positions = _gathered(row, op.name, a.dictionary.module, a.positions)
                    new = a.positions.new_token_only(row.seq.step)
                    dictionary_wants.append(DictionaryWant(row, op.name, a, values, None if new else positions))
                else:
                    assert isinstance(a, P.ReadLogitLens)
                    lens_wants.append(_lens_want(row, op.name, a))
        except Exception as e:  # noqa: BLE001 - fails this request's trace only
            row.error = f"{type(e).__name__}: {e}"
    if lens_wants:
        assert lens is not None
        _launch_lens([w for w in lens_wants if w.row.error is None], lens)
    if dictionary_wants:
        assert dictionaries is not None
        launch_dictionary_reads([w for w in dictionary_wants if w.row.error is None], dictionaries)
    for column, members in new_token.items():
        members = [m for m in members if m.row.error is None]
        if members:
            stacked = torch.stack([m.value for m in members])
            if isinstance(column, tuple):  # a unit read's column: [rows, units(, head_dim)]
                module, units = column
                chosen, ids = select_units(stacked, module, units)
                batch = HostBatch(to_host(chosen), to_host(ids) if ids is not None else None)
            else:
                batch = HostBatch(to_host(stacked), None)
            for j, m in enumerate(members):
                m.row.reads[m.name] = ColumnRow(batch, j)


class _NewToken(NamedTuple):
    """A row's new-token read of a module, joined with the other rows' into one column."""

    row: Row
    name: str
    value: torch.Tensor  # [hidden]
