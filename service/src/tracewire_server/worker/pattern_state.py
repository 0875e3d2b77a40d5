"""What a sequence with attention-pattern reads keeps between forward passes: its keys,
and the weights computed in this step's passes until its sample joins them.

Separate from the computation (attention_patterns.py) because the per-request state
(sequences.py) holds these.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import numpy as np
import torch

from .host import on_device


class PatternChunk(NamedTuple):
    """One forward pass's rows of a pattern read at one layer: [rows, heads, K] weights
    (full rows: K = the chunk's last query position + 1) and, for top-k, their key
    positions (int32, -1 past the keys a query sees). A new token's top k, computed with
    other sequences', also comes as its part of their one copy to the host (`host`:
    values and ids, numpy views filled once the step's copies are done)."""

    positions: list[int]
    values: torch.Tensor
    ids: torch.Tensor | None
    host: tuple[np.ndarray, np.ndarray] | None = None
    # A new token's: `values` and `ids` are its batch's, this its row there (cut only
    # where a read joins layers: `own`)
    row: int | None = None

    def own(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This chunk's values and ids, [rows, heads, K]."""
        if self.row is None:
            return self.values, self.ids
        j = self.row
        return self.values[j:j + 1], self.ids[j:j + 1] if self.ids is not None else None


# Positions a page of a KeyPool holds: a sequence wastes less than one page per read and
# layer, and a batch's keys are gathered through a page table of length / PAGE entries.
PAGE = 16


class KeyPool:
    """Post-rotary keys of every sequence reading some KV heads of one layer, in one paged
    float32 tensor [pages, PAGE, kv_heads, head_dim], so that a pass writes all of its
    sequences' keys with one copy and a step gathers a batch's keys with one index, not
    kernels per sequence (the engine thread launches these at every step). Pages are
    taken as a sequence's positions arrive and given back when its KeyCache goes; the
    tensor grows by half again when none is free, and is let go when none is used: what
    it holds is the live sequences' keys (each bounded by the compiler), rounded up to
    pages, and the growth's slack."""

    def __init__(self, kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.kv_heads, self.head_dim, self.device = kv_heads, head_dim, device
        self.pages = self._empty(0)
        self._free: list[int] = []
        self.used = 0

    def _empty(self, count: int) -> torch.Tensor:
        # zeros, not empty: a batch's gather reads past a short sequence's keys (masked
        # later), and uninitialized memory could hold NaN
        return torch.zeros((count, PAGE, self.kv_heads, self.head_dim), dtype=torch.float32, device=self.device)

    @property
    def flat(self) -> torch.Tensor:
        """[pages x PAGE, kv_heads, head_dim]: slot s is position s % PAGE of page s // PAGE."""
        return self.pages.view(-1, self.kv_heads, self.head_dim)

    def take(self, count: int) -> list[int]:
        if len(self._free) < count:
            have = self.pages.shape[0]
            grown = max(have + count - len(self._free), have + have // 2, 4)
            pages = self._empty(grown)
            pages[:have] = self.pages
            self.pages = pages
            self._free.extend(range(grown - 1, have - 1, -1))
        taken = [self._free.pop() for _ in range(count)]
        self.used += count
        return taken

    def give(self, pages: list[int]) -> None:
        self._free.extend(pages)
        self.used -= len(pages)
        if not self.used:  # nothing live: the memory goes back to the allocator
            self.pages, self._free = self._empty(0), []

    def write(self, slots: torch.Tensor, keys: torch.Tensor, kv_index: torch.Tensor) -> None:
        """The `kv_index` heads of `keys` [n, all kv heads, head_dim], as float32, at flat
        `slots` [n]."""
        self.flat.index_copy_(0, slots, keys.index_select(1, kv_index).to(torch.float32))


class KeyCache:
    """One sequence's post-rotary keys of some KV heads at one layer, by position, in its
    pages of a KeyPool, up to the plan's max_len (what the compiler counted); with the
    read's head indices. Its pages go back to the pool when it goes."""

    def __init__(self, pool: KeyPool, kv_heads: tuple[int, ...], max_len: int, heads: tuple[int, ...],
                 group: int) -> None:
        device = pool.device
        self.pool = pool
        self.kv_index = on_device(list(kv_heads), device, torch.long)
        # The read's query heads, and each one's KV head as an index into these keys (GQA:
        # query head h reads KV head h // group): on the device once, not every step.
        self.heads = on_device(list(heads), device, torch.long)
        kv_of = [kv_heads.index(h // group) for h in heads]
        # Per KV head kept here: which of the read's query heads read it (GQA without
        # repeating the keys for each query head).
        self.by_kv = [(j, on_device([i for i, c in enumerate(kv_of) if c == j], device, torch.long))
                      for j in sorted(set(kv_of))]
        # Every query head in order (the read named none): GQA is a reshape, not a gather.
        self.grouped = heads == tuple(range(len(kv_heads) * group)) and kv_heads == tuple(range(len(kv_heads)))
        self.max_len = max_len
        self.pages: list[int] = []
        self.known = 0  # positions 0 .. known - 1 are written
        # (the list itself: what it holds when the cache goes)
        weakref.finalize(self, pool.give, self.pages)

    def slots(self, pos0: int, end: int) -> list[int]:
        """The pool slots to write positions pos0 .. end - 1 at, taking pages as needed:
        never past max_len, never leaving positions unwritten before them."""
        if end > self.max_len:
            raise RuntimeError(f"position {end - 1} is past the {self.max_len} positions the read was planned for")
        if pos0 > self.known:
            raise RuntimeError(f"keys of positions {self.known} .. {pos0 - 1} never ran through the model "
                               "(served from the prefix cache?)")
        short = -(-end // PAGE) - len(self.pages)
        if short > 0:
            self.pages.extend(self.pool.take(short))
        pages = self.pages
        return [pages[p // PAGE] * PAGE + p % PAGE for p in range(pos0, end)]

    def wrote(self, end: int) -> None:
        """Positions up to end - 1 are written (at `slots`, with KeyPool.write)."""
        self.known = max(self.known, end)

    def upto(self, length: int) -> torch.Tensor:
        """Keys of positions 0 .. length - 1, every one of them written: [length, kv, D]."""
        return gather([self], [length])[0]


def gather(caches: list[KeyCache], lengths: list[int]) -> torch.Tensor:
    """Keys of several sequences of one pool, positions 0 .. length - 1 each, padded to
    the longest: [B, L, kv, D] with one page table and one index (past a sequence's
    length: other keys, which its softmax masks)."""
    pool = caches[0].pool
    longest = max(lengths)
    width = -(-longest // PAGE)
    table: list[list[int]] = []
    for cache, length in zip(caches, lengths, strict=True):
        if length > cache.known:
            raise RuntimeError(f"keys up to position {length - 1} asked for, {cache.known} known")
        pages = cache.pages[:width]
        table.append(pages if len(pages) == width else pages + [0] * (width - len(pages)))
    table_t = on_device(np.array(table, dtype=np.int64), pool.device, torch.long)
    position = torch.arange(longest, device=pool.device)
    slots = table_t[:, position // PAGE] * PAGE + position % PAGE  # [B, L]
    return pool.flat[slots]


def joined(chunks: list[PatternChunk]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """A step's chunks of one layer's read as one [positions, heads, K] (full rows padded
    with 0 to the last position's keys), its key positions (top-k), and the positions."""
    positions = [p for chunk in chunks for p in chunk.positions]
    owned = [chunk.own() for chunk in chunks]
    if len(owned) == 1:
        return owned[0][0], owned[0][1], positions
    if owned[0][1] is not None:
        return torch.cat([v for v, _ in owned]), torch.cat([i for _, i in owned if i is not None]), positions
    length = max(v.shape[-1] for v, _ in owned)
    values = [torch.nn.functional.pad(v, (0, length - v.shape[-1])) for v, _ in owned]
    return torch.cat(values), None, positions
