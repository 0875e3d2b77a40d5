"""Module reads and logit-lens reads: values of a module's output at chosen positions.

The module hooks (module_hooks.py) copy out the rows these reads select during the
forward pass, into each Sequence's `pending`; at the step's sample this joins a
read's chunks (a chunked prefill runs several passes), checks them complete, and
launches the read's value to the host: the rows, their mean, or (logit lens) the
final norm and lm_head applied to them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
from .pattern_state import PatternChunk, joined
from .stream_norm import StreamNorm
from .unit_hooks import select_units, take_rows
from .vocab_topk import stats, top_k_packed, unpacked, warm_up, working_bytes

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
        self.norm = StreamNorm(norm, weight.dtype, weight.device)
        self.weight = weight
        self.head = weight.t()  # (a view made once: a .t() a chunk is a host call a chunk)
        self.vocab_size = vocab_size
        self.gather = gather
        # (logits as self.logits makes them: rows of the padded vocabulary, lm_head's dtype)
        warm_up(torch.zeros(1, weight.shape[0], dtype=weight.dtype, device=weight.device)[:, :vocab_size])

    @torch.no_grad()
    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] normalized streams (StreamNorm's) -> [rows, vocab] logits, in
        lm_head's dtype (as the model's own)."""
        logits = normed @ self.head
        if self.gather is not None:  # [rows, the padded vocab], every rank's slice in order
            logits = self.gather(logits.contiguous())
        return logits if logits.shape[1] == self.vocab_size else logits[:, : self.vocab_size]

    @torch.no_grad()
    def __call__(self, streams: torch.Tensor, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[..., hidden] -> [..., vocab] float32 log-probabilities, or (top_k > 0) the top_k
        of them [..., k] and their ids (int32)."""
        lead = streams.shape[:-1]
        flat = streams.reshape(-1, streams.shape[-1])
        values, ids = self.of_rows([flat], np.arange(flat.shape[0]).reshape(-1, 1), top_k)
        return values.reshape(*lead, -1), None if ids is None else ids.reshape(*lead, top_k)

    @torch.no_grad()
    def of_rows(self, sources: list[torch.Tensor], rows: np.ndarray,
                top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lens of rows[r, l] of sources[l] ([tokens, hidden] each, any float dtype):
        [n, L, vocab] log-probabilities, or (top_k > 0) [n, L, k] and their ids."""
        n, layers = rows.shape
        if top_k:
            values, ids = unpacked(self.top_k_of_rows(sources, rows, top_k))
            return values.reshape(n, layers, top_k), ids.reshape(n, layers, top_k)
        # every log-probability (all returned: --max-read-bytes bounds them), in the top-k
        # reads' arithmetic (vocab_topk.VocabStats.logprobs): a full row and a top-k
        # read of the same stream agree to float32 rounding
        chunk = max(1, LENS_CHUNK_BYTES // (12 * self.vocab_size))  # (logits, a float32 copy, exponentials)
        parts = [stats(logits).logprobs(logits) for logits in self._logit_chunks(sources, rows, chunk)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(n, layers, -1), None

    @torch.no_grad()
    def top_k_of_rows(self, sources: list[torch.Tensor], rows: np.ndarray, top_k: int) -> torch.Tensor:
        """of_rows' top k as one tensor, [2, n * L, top_k] (vocab_topk.top_k_packed): what
        the lens's reads send to the host, in one copy."""
        chunk = max(1, LENS_CHUNK_BYTES // working_bytes(self.vocab_size, top_k, self.weight.device))
        parts = [top_k_packed(logits, top_k) for logits in self._logit_chunks(sources, rows, chunk)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _logit_chunks(self, sources: list[torch.Tensor], rows: np.ndarray, chunk: int) -> Iterator[torch.Tensor]:
        """The rows' logits in order, [chunk, vocab] at a time (a few hundred rows of a
        large vocabulary fill LENS_CHUNK_BYTES); their normalized streams a bounded
        number of rows at a time too (in lm_head's dtype)."""
        per_norm = max(1, LENS_CHUNK_BYTES // (self.weight.element_size() * self.weight.shape[1] * rows.shape[1]))
        for first in range(0, rows.shape[0], per_norm):
            normed = self.norm(sources, rows[first:first + per_norm])
            for start in range(0, normed.shape[0], chunk):
                yield self.logits(normed[start:start + chunk])


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
    """A layer the read names twice (1 and -3 of 4 layers) was gathered once: its stream
    serves both places."""
    gathered: dict[str, tuple[torch.Tensor, list[int]]] = {}
    for key, path in read.module_reads(name):
        if key not in gathered:
            gathered[key] = _gathered(row, key, path, read.positions)
    streams = [gathered[key][0] for key, _ in read.module_reads(name)]
    return _LensWant(row, name, read.top_k, streams, next(iter(gathered.values()))[1])


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
            # One copy to the host for the group, each row a view of its part (a copy per
            # row cost two copy launches per row per step: most of the lens's host time);
            # a top k's values and ids in that one copy (Lens.top_k_of_rows). The views
            # below only split the leading axis of contiguous arrays: numpy never copies
            # for that (a copy would read the host buffer before the device's copy into
            # it is done).
            if k:
                every = np.arange(flat.shape[0]).reshape(-1, 1)
                host_values, host_ids = unpacked(to_host(lens.top_k_of_rows([flat], every, k)).numpy())
            else:
                host_values, host_ids = to_host(lens(flat)[0]).numpy(), None
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
    if len(read.layers) == 1:
        key = read.module_reads(name)[0][0]
        chunks = row.seq.patterns.get(key, [])
        if len(chunks) == 1 and chunks[0].host is not None and len(chunks[0].positions) == expected:
            # a new token's top k: its part of its batch's one copy to the host
            del row.seq.patterns[key]
            host_values, host_ids = chunks[0].host
            return HostRead(HostBatch.of_arrays(host_values[None], host_ids[None]), chunks[0].positions)
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
    """A module's new-token values for the block rows reading it this step: `rows` of
    `source` ([tokens, hidden]); for each batch row its index into `rows` (-1: none);
    each row's token position. On a compiled engine `source` is the layer's read buffer
    as the pass left it (no copy: its readers launch at this step's sample, on the
    pass's stream, before the next pass overwrites it); on an eager one the rows the
    hook copied out (float32, `rows` 0..n-1)."""

    source: torch.Tensor
    rows: np.ndarray
    where: np.ndarray
    positions: np.ndarray
    unit_width: int = 0  # a unit address's column (its module input): one unit's width; else 0

    def rows_of(self, members: list[tuple[Block, str]]) -> np.ndarray:
        """The members' rows of `source`, block after block."""
        return self.rows[np.concatenate([self.where[block.index] for block, _ in members])]

    def take(self, members: list[tuple[Block, str]]) -> torch.Tensor:
        """The members' values, [rows, hidden] float32."""
        index = on_device(self.rows_of(members), self.source.device, torch.long)
        return self.source.index_select(0, index).to(torch.float32)

    def units(self, members: list[tuple[Block, str]], read: P.ReadModule) -> HostBatch:
        """A unit read's column for the members: the chosen units of each row's module
        input (or the top k, with their ids), as a row's read gives them."""
        index = on_device(self.rows_of(members), self.source.device, torch.long)
        chosen, ids = select_units(take_rows(self.source, self.unit_width, index), read.module, read.units)
        return HostBatch(to_host(chosen), to_host(ids) if ids is not None else None)


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
        if type(read) is P.ReadAttentionPattern:
            _launch_pattern_column(read, members)
            continue
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
                x = columns[paths[0]].take(members)  # (a deleted or replaced dictionary fails these blocks)
                batch = dictionary_column(read, dictionaries.get(read.dictionary), x)
            elif P.unit_kind(read.module):
                batch = columns[paths[0]].units(members, read)
            else:
                batch = HostBatch(to_host(columns[paths[0]].take(members)), None)
        except Exception as e:  # noqa: BLE001 - fails the blocks reading it
            for block, _ in members:
                block.error = block.error or f"{type(e).__name__}: {e}"
            continue
        _give_rows(batch, members)


def _give_rows(batch: HostBatch, members: list[tuple[Block, str]]) -> None:
    """Each member block's rows of a column made for them in this order."""
    offset = 0
    for block, name in members:  # each block's rows: one range of the column
        block.reads[name] = ColumnRows(batch, list(range(offset, offset + len(block.index))))
        offset += len(block.index)


def _launch_pattern_column(read: P.ReadAttentionPattern, members: list[tuple[Block, str]]) -> None:
    """A new token's top-k attention pattern for every member block row: [rows, layers,
    1, heads, k] weights and key positions, and the rows' positions beside them (as a
    row's read gives them: _pattern_value). attention_patterns.py computed each layer's
    top k for many sequences at once; their rows are gathered here with one index per
    layer and batch, and the column goes to the host in one copy each. A block a row
    of which has no pattern fails alone."""
    layers = len(read.layers)
    kept: list[tuple[Block, str]] = []
    chunks: list[list[PatternChunk]] = []  # per kept row: its chunk at each layer
    for block, name in sorted(members, key=lambda member: member[0].route):  # (as _complete orders them)
        keys = [key for key, _ in read.module_reads(name)]
        rows: list[list[PatternChunk]] = []
        for seq in block.seqs:
            found = [seq.patterns.pop(key, None) for key in keys]
            if not all(f is not None and len(f) == 1 and f[0].row is not None for f in found):
                block.error = block.error or (f"read {name!r} of layers {list(read.layers)} saw no attention "
                                              "pattern of the new token (its forward pass did not compute it)")
                break
            rows.append([f[0] for f in found])  # type: ignore[index]
        else:
            kept.append((block, name))
            chunks.extend(rows)
    if not kept:
        return
    try:
        values = torch.stack([_pattern_rows([row[layer] for row in chunks], False) for layer in range(layers)], 1)
        ids = torch.stack([_pattern_rows([row[layer] for row in chunks], True) for layer in range(layers)], 1)
        positions = np.array([row[0].positions for row in chunks], np.int32)  # [rows, 1]
        batch = HostBatch.of_arrays(to_host(values.unsqueeze(2)).numpy(), to_host(ids.unsqueeze(2)).numpy(),
                                    positions)
    except Exception as e:  # noqa: BLE001 - fails the blocks reading it
        for block, _ in kept:
            block.error = block.error or f"{type(e).__name__}: {e}"
        return
    _give_rows(batch, kept)


def _pattern_rows(chunks: list[PatternChunk], ids: bool) -> torch.Tensor:
    """The chunks' rows of their batches' top k ([rows, heads, k] values, or key
    positions): one index per batch (most often one batch for them all)."""
    by_batch: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for out, chunk in enumerate(chunks):
        source = chunk.ids if ids else chunk.values
        assert source is not None and chunk.row is not None
        found = by_batch.get(id(source))
        if found is None:
            found = by_batch[id(source)] = (source, [], [])
        found[1].append(chunk.row)
        found[2].append(out)
    parts, order = [], []
    for source, rows, outs in by_batch.values():
        parts.append(source.index_select(0, on_device(rows, source.device, torch.long)))
        order.extend(outs)
    if len(parts) == 1:
        return parts[0]
    joined_rows = torch.cat(parts)
    back = np.empty(len(order), np.int64)
    back[order] = np.arange(len(order))  # output row -> its place in joined_rows
    return joined_rows.index_select(0, on_device(back, joined_rows.device, torch.long))


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


def _lens_column(read: P.ReadLogitLens, members: list[tuple[Block, str]], paths: list[str],
                 columns: dict[str, Column], lens: Lens) -> HostBatch:
    """One logit-lens read for every member block row: [rows, layers, 1, k] (one
    position: the new token's), its positions a column beside it. The layers' rows go
    to the lens as they lie (Lens.of_rows: on a GPU one norm kernel over them all)."""
    rows = np.stack([columns[path].rows_of(members) for path in paths], axis=1)  # [rows, layers]
    first = columns[paths[0]]
    positions = first.positions[np.concatenate([first.where[block.index] for block, _ in members])]
    sources = [columns[path].source for path in paths]
    if read.top_k:  # (one copy to the host: the top k's values and ids packed together)
        host = to_host(lens.top_k_of_rows(sources, rows, read.top_k)).numpy()
        values, ids = unpacked(host)
        shape = (len(rows), len(paths), 1, read.top_k)
        return HostBatch.of_arrays(values.reshape(shape), ids.reshape(shape), positions.reshape(-1, 1))
    values, _ = lens.of_rows(sources, rows)
    return HostBatch.of_arrays(to_host(values.unsqueeze(2)).numpy(), None, positions.reshape(-1, 1))


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
