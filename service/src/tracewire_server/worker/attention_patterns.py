"""Attention-pattern reads: a query position's attention weights over key positions.

Computed from the model's own queries and keys where vLLM's `Attention` module gets
them (a forward pre-hook on `layers.L.self_attn.attn`: q / k after rotary embedding and
any q / k norm), never from vLLM's paged KV cache, whose layout differs per backend.
Keys of earlier positions are needed at every step, so each sequence reading a pattern
keeps its own float32 copy of the keys of the KV heads it reads, per layer, written by
position from its prefill on (a chunked prefill's chunks and a preemption's recompute
land where they belong); the compiler bounded that copy against the trace's read budget
(plan.ReadAttentionPattern.key_cache_bytes). The copies live in pages of one pool per
layer and KV-head selection (pattern_state.KeyPool), so that the work at each step is a
fixed set of kernels per layer however many sequences read: one copy writes every
sequence's new keys, one index gathers them, and a top k goes to the host in one copy.
The weights are softmax(scale * q . k)
over the keys the query sees (causal, within a sliding window), with soft-capping where
the layer has it, in float32, for the selected query rows of each forward pass; the
chunks of a step (a chunked prefill runs several passes) are joined at its sample
(module_reads.py). What a sequence keeps meanwhile is in pattern_state.py.

On eager engines the pre-hook computes them inside the forward pass; compiled engines with
`--compiled-pattern-reads` keep q / k in read buffers (shared/read_buffers.py) and the
host computes the same after the pass (`compute`, from module_hooks.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ..shared import plan as P
from ..shared.limits import PATTERN_BLOCK_ELEMENTS
from .host import on_device, to_host
from .pattern_state import KeyCache, KeyPool, PatternChunk, gather
from .runner import AttentionLayer

if TYPE_CHECKING:
    from collections.abc import KeysView

    from .sequences import Sequence

log = logging.getLogger(f"vllm.{__name__}")

# Scores computed at once for a block of query rows (float32 elements): bounds the
# transient memory of a long prompt's rows (64 MiB) whatever its length; the compiler
# counts it against the read budget (plan.ReadAttentionPattern.scratch_bytes).
_BLOCK_ELEMENTS = PATTERN_BLOCK_ELEMENTS


def keeps_keys(op: P.Op, step: int) -> bool:
    """Whether a pattern read needs the keys a forward pass of `step` computes: prompt
    positions only at the prefill (step 0); the new token up to its last selected step."""
    read = op.action
    assert isinstance(read, P.ReadAttentionPattern)
    if read.positions.kind in ("new_token", "all"):
        last = op.steps.last()
        return last is None or step <= last
    return step == 0 and op.steps.contains(0)


class Rows(Protocol):
    """One request's flat token rows in a forward pass (module_hooks.Span)."""

    first: int
    last: int
    pos0: int

    def rows(self, positions: P.Positions, step: int) -> tuple[list[int], list[int]]: ...


@dataclass
class _Task:
    """One sequence's pattern read at one layer in this forward pass: record the keys of
    its rows, and compute the weights of the query rows the read selects now."""

    seq: Sequence
    key: str  # the read's name @ layer
    read: P.ReadAttentionPattern
    cache: KeyCache | None  # None until the first pass on a device
    first: int  # its flat token rows [first, last), positions from pos0
    last: int
    pos0: int
    rows: list[int]  # query rows (flat), at `positions`
    positions: list[int]
    # A block row's read: its top k goes to the host with the block's column
    # (module_reads._launch_pattern_column), not a copy of its own.
    column: bool = False


def shared_key_scores(queries: torch.Tensor, keys: torch.Tensor, cache: KeyCache) -> torch.Tensor:
    """q . k of query rows [R, heads, D] (float32) over one sequence's keys [L, kv, D]:
    [R, heads, L]. GQA by KV head: the keys are never repeated per query head."""
    r, h, d = queries.shape
    kv = keys.shape[1]
    if cache.grouped:  # every query head in order: a reshape
        return torch.matmul(queries.view(r, kv, h // kv, d), keys.permute(1, 2, 0)).reshape(r, h, -1)
    scores = queries.new_empty((r, h, keys.shape[0]))
    for column, heads in cache.by_kv:
        scores.index_copy_(1, heads, torch.einsum("rgd,ld->rgl", queries.index_select(1, heads), keys[:, column]))
    return scores


def own_key_scores(queries: torch.Tensor, keys: torch.Tensor, cache: KeyCache) -> torch.Tensor:
    """q . k of one query row per sequence [B, heads, D] (float32) over each one's own
    keys [B, L, kv, D]: [B, heads, L]."""
    b, h, d = queries.shape
    kv = keys.shape[2]
    if cache.grouped:
        return torch.matmul(queries.view(b, kv, h // kv, d), keys.permute(0, 2, 3, 1)).reshape(b, h, -1)
    scores = queries.new_empty((b, h, keys.shape[1]))
    for column, heads in cache.by_kv:
        scores.index_copy_(1, heads, torch.einsum("bgd,bld->bgl", queries.index_select(1, heads), keys[:, :, column]))
    return scores


def _softmax(scores: torch.Tensor, positions: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """Soft-capped, masked softmax of scaled scores [rows, heads, L] of queries at
    `positions` [rows] over keys 0 .. L - 1: keys a query does not see (after it, outside
    its window) weigh exactly 0."""
    if layer.soft_cap is not None:
        scores = layer.soft_cap * torch.tanh(scores / layer.soft_cap)
    key_pos = torch.arange(scores.shape[-1], device=scores.device)
    distance = positions[:, None] - key_pos[None, :]  # [rows, L]
    hidden = distance < 0
    if layer.sliding_window is not None:
        hidden |= distance >= layer.sliding_window
    return torch.softmax(scores.masked_fill(hidden[:, None, :], float("-inf")), dim=-1)


def top_k(
    probs: torch.Tensor, positions: torch.Tensor, k: int, layer: AttentionLayer
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest weights of each row with their key positions, largest first:
    entries past the keys a query sees are 0 with key position -1."""
    rows, heads, length = probs.shape
    key_pos = torch.arange(length, device=probs.device)
    distance = positions[:, None] - key_pos[None, :]
    seen = distance >= 0
    if layer.sliding_window is not None:
        seen &= distance < layer.sliding_window
    # unseen keys rank below every seen one (weights are >= 0), then are blanked
    ranked = probs.masked_fill(~seen[:, None, :], -1.0)
    found = torch.topk(ranked, min(k, length), dim=-1)
    values, ids = found.values, found.indices.to(torch.int32)
    blank = values < 0
    values = values.masked_fill(blank, 0.0)
    ids = ids.masked_fill(blank, -1)
    if k > length:
        pad = k - length
        values = torch.cat([values, values.new_zeros((rows, heads, pad))], dim=-1)
        ids = torch.cat([ids, ids.new_full((rows, heads, pad), -1)], dim=-1)
    return values, ids


class AttentionPatterns:
    """Pre-hooks on each decoder layer's attention module: planned per forward pass
    (module_hooks.py calls `begin` then `plan` for each request in the pass)."""

    def __init__(self, layers: dict[int, AttentionLayer]) -> None:
        self.layers = layers
        self._tasks: dict[int, list[_Task]] = {}
        # Requests holding key caches: dropped when the runner lets go of them (a request
        # that ended before its last selected step holds no memory after it).
        self._holders: dict[str, Sequence] = {}
        # Each layer's and KV-head selection's keys, of every sequence keeping them.
        self._pools: dict[tuple[int, tuple[int, ...], int, torch.device], KeyPool] = {}

    def install(self) -> None:
        for index, layer in self.layers.items():
            layer.module.register_forward_pre_hook(
                lambda module, args, kwargs, index=index: self._hook(index, args, kwargs), with_kwargs=True
            )

    def begin(self, live: KeysView[str]) -> None:
        """A new forward pass: no tasks yet; caches of requests that ended go."""
        self._tasks = {}
        if self._holders:
            gone = [r for r in self._holders if r not in live]
            for req_id in gone:
                self._holders.pop(req_id).key_caches.clear()
            if gone:  # (pools are keyed by what requests chose: empty ones go too)
                self._pools = {key: pool for key, pool in self._pools.items() if pool.used}

    def plan(self, req_id: str, seq: Sequence, span: Rows, column: bool = False) -> None:
        """This pass's tasks for one request: every pattern read that still needs keys
        records this pass's; those selected now compute their query rows. `column`: its
        row is a block row (its new token's top k goes to the host with the block's)."""
        step = seq.step
        kept = False
        for op, keys in seq.pattern_reads:
            read = op.action
            assert isinstance(read, P.ReadAttentionPattern)
            if not keeps_keys(op, step):
                continue
            kept = True
            rows, positions = span.rows(read.positions, step) if op.selects(step) else ([], [])
            for key, index in keys:
                cache = seq.key_caches.get(key)
                if cache is None:  # (its first pass: the layer is checked once)
                    layer = self.layers.get(index)
                    problem = self._problem(read, index, layer)
                    if problem:
                        seq.error = seq.error or f"attention pattern read {op.name!r}: layer {index}: {problem}"
                        return
                self._tasks.setdefault(index, []).append(_Task(
                    seq, key, read, cache, span.first, span.last, span.pos0, rows, positions, column))
        if kept:
            self._holders[req_id] = seq
        elif seq.key_caches:
            seq.key_caches.clear()  # past every pattern read's last step
            self._holders.pop(req_id, None)

    @staticmethod
    def _problem(read: P.ReadAttentionPattern, index: int, layer: AttentionLayer | None) -> str:
        if layer is None:
            return "no attention module there"
        if layer.unsupported:
            return f"attention patterns are not computed for {layer.unsupported}"
        if max(read.heads) >= layer.num_heads or max(read.kv_heads) >= layer.num_kv_heads:
            return f"this worker holds {layer.num_heads} query / {layer.num_kv_heads} KV heads"
        if layer.head_size != read.head_dim:
            return f"head size {layer.head_size}, not the {read.head_dim} the server planned for"
        return ""

    def planned_layers(self) -> list[int]:
        """The layers this pass computes patterns at (a compiled pass: from read buffers)."""
        return [index for index, tasks in self._tasks.items() if tasks]

    def _hook(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The eager pre-hook: this pass's q and k at layer `index`, as the model calls it."""
        self.compute(index, args[0] if args else kwargs.get("query"),
                     args[1] if len(args) > 1 else kwargs.get("key"))

    def compute(self, index: int, q: torch.Tensor | None, k: torch.Tensor | None) -> None:
        """The planned patterns at layer `index` from this pass's queries and keys there
        ([tokens, heads x head_size] each). Never raises into vLLM's step: a failure fails
        the traces involved."""
        tasks = self._tasks.get(index)
        if not tasks:
            return
        try:
            layer = self.layers[index]
            if q is None or k is None:
                raise RuntimeError("no queries and keys at this layer")
            q = q.detach().reshape(-1, layer.num_heads, layer.head_size)
            k = k.detach().reshape(-1, layer.num_kv_heads, layer.head_size)
        except Exception as e:  # noqa: BLE001
            log.exception("attention-pattern hook on layer %d failed", index)
            for task in tasks:
                task.seq.error = task.seq.error or f"{type(e).__name__} in layers.{index}.self_attn.attn: {e}"
            return
        self._write_keys(index, tasks, layer, k)
        new_tokens: dict[tuple[int, tuple[int, ...], int], list[_Task]] = {}
        for task in tasks:
            if task.cache is None or not task.rows:
                continue  # (no keys: its write failed its trace)
            if len(task.rows) == 1:  # a new token's row: computed with the others like it below
                new_tokens.setdefault((id(task.cache.pool), task.read.heads, task.read.top_k), []).append(task)
                continue
            try:
                length = task.positions[-1] + 1  # the rows are ascending: the last sees the most keys
                chunk = self._rows(task, layer, q, task.cache.upto(length), task.cache)
                task.seq.patterns.setdefault(task.key, []).append(chunk)
            except Exception as e:  # noqa: BLE001 - fails this request's trace only
                log.exception("attention-pattern read %s failed", task.key)
                task.seq.error = task.seq.error or f"{type(e).__name__} in layers.{index}.self_attn.attn: {e}"
        for group in new_tokens.values():
            try:
                self._new_tokens(group, layer, q)
            except Exception as e:  # noqa: BLE001 - fails these requests' traces only
                log.exception("attention-pattern reads at layer %d failed", index)
                for task in group:
                    task.seq.error = task.seq.error or f"{type(e).__name__} in layers.{index}.self_attn.attn: {e}"

    def _pool(self, index: int, read: P.ReadAttentionPattern, device: torch.device) -> KeyPool:
        """The pool of the keys `read` keeps at layer `index` (one per KV-head selection)."""
        key = (index, read.kv_heads, read.head_dim, device)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = KeyPool(len(read.kv_heads), read.head_dim, device)
        return pool

    def _write_keys(self, index: int, tasks: list[_Task], layer: AttentionLayer, k: torch.Tensor) -> None:
        """Every task's keys of this pass into its cache: one copy per pool for all of
        them. A task whose keys cannot be kept fails its trace (cache None after)."""
        by_pool: dict[int, tuple[KeyCache, list[int], list[int], list[tuple[_Task, int]]]] = {}
        for task in tasks:
            try:
                cache = task.cache
                if cache is None:
                    cache = task.seq.key_caches[task.key] = KeyCache(
                        self._pool(index, task.read, k.device), task.read.kv_heads, task.read.max_len,
                        task.read.heads, layer.num_heads // layer.num_kv_heads)
                end = task.pos0 + task.last - task.first
                slots = cache.slots(task.pos0, end)
            except Exception as e:  # noqa: BLE001 - fails this request's trace only
                log.exception("attention-pattern read %s failed", task.key)
                task.seq.error = task.seq.error or f"{type(e).__name__} in layers.{index}.self_attn.attn: {e}"
                task.cache = None
                continue
            task.cache = cache
            found = by_pool.get(id(cache.pool))
            if found is None:
                found = by_pool[id(cache.pool)] = (cache, [], [], [])
            found[1].extend(range(task.first, task.last))
            found[2].extend(slots)
            found[3].append((task, end))
        for first, rows, slot_list, ends in by_pool.values():
            try:
                both = on_device(np.array([rows, slot_list], dtype=np.int64), k.device, torch.long)
                first.pool.write(both[1], k.index_select(0, both[0]), first.kv_index)
            except Exception as e:  # noqa: BLE001 - fails these requests' traces only
                log.exception("attention-pattern keys at layer %d failed", index)
                for task, _ in ends:
                    task.seq.error = task.seq.error or f"{type(e).__name__} in layers.{index}.self_attn.attn: {e}"
                    task.cache = None
                continue
            for task, end in ends:
                assert task.cache is not None
                task.cache.wrote(end)

    @staticmethod
    def _new_tokens(group: list[_Task], layer: AttentionLayer, q: torch.Tensor) -> None:
        """One query row each (the new token, every step) of sequences reading the same
        heads: their keys gathered from their pool padded to the longest, one set of
        kernels for a block of them rather than a set per sequence (this runs per layer
        at every step), and a top k's values one copy to the host for the block."""
        read = group[0].read
        cache = group[0].cache
        assert cache is not None
        heads = len(read.heads)
        longest = max(task.positions[0] for task in group) + 1
        # (a block's padded keys and its scores within the transient bound)
        block = max(1, _BLOCK_ELEMENTS // (longest * max(heads, len(read.kv_heads) * read.head_dim)))
        for start in range(0, len(group), block):
            part = group[start:start + block]
            lengths = [task.positions[0] + 1 for task in part]
            operands = on_device(np.array([[t.positions[0] for t in part], [t.rows[0] for t in part]]),
                                 q.device, torch.long)
            positions, rows = operands[0], operands[1]
            keys = gather([t.cache for t in part], lengths)  # type: ignore[misc]  # [B, L, kv, D]
            queries = q.index_select(0, rows).index_select(1, cache.heads).to(torch.float32)  # [B, heads, D]
            probs = _softmax(own_key_scores(queries, keys, cache) * layer.scale, positions, layer)  # [B, heads, L]
            if read.top_k:
                values, ids = top_k(probs, positions, read.top_k, layer)
                # (a one-layer read of a row, not a block's, takes its row of this copy:
                # module_reads._pattern_value; a block's rows go with the block's column)
                if all(task.column for task in part):
                    for j, task in enumerate(part):
                        task.seq.patterns.setdefault(task.key, []).append(PatternChunk(task.positions, values, ids,
                                                                                       None, j))
                    continue
                host_values, host_ids = to_host(values).numpy(), to_host(ids).numpy()
                for j, task in enumerate(part):
                    chunk = PatternChunk(task.positions, values, ids, (host_values[j:j + 1], host_ids[j:j + 1]), j)
                    task.seq.patterns.setdefault(task.key, []).append(chunk)
            else:
                for j, task in enumerate(part):
                    chunk = PatternChunk(task.positions, probs[j:j + 1, :, : task.positions[0] + 1], None)
                    task.seq.patterns.setdefault(task.key, []).append(chunk)

    def _rows(self, task: _Task, layer: AttentionLayer, q: torch.Tensor, keys: torch.Tensor,
              cache: KeyCache) -> PatternChunk:
        """Query rows at prompt positions over keys [L, kv, D]: masked, in blocks."""
        read = task.read
        rows = on_device(task.rows, q.device, torch.long)
        queries = q.index_select(0, rows).index_select(1, cache.heads).to(torch.float32)  # [rows, heads, D]
        positions = on_device(task.positions, q.device, torch.long)
        block = max(1, _BLOCK_ELEMENTS // (len(read.heads) * keys.shape[0]))
        values, ids = [], []
        for start in range(0, len(task.rows), block):
            part = positions[start:start + block]
            scores = shared_key_scores(queries[start:start + block], keys, cache) * layer.scale
            probs = _softmax(scores, part, layer)
            if read.top_k:
                v, i = top_k(probs, part, read.top_k, layer)
                values.append(v)
                ids.append(i)
            else:
                values.append(probs)
        return PatternChunk(task.positions, torch.cat(values), torch.cat(ids) if ids else None)
