"""What a sequence with attention-pattern reads keeps between forward passes: its keys,
and the weights computed in this step's passes until its sample joins them.

Separate from the computation (attention_patterns.py) because the per-request state
(sequences.py) holds these.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .host import on_device


class PatternChunk(NamedTuple):
    """One forward pass's rows of a pattern read at one layer: [rows, heads, K] weights
    (full rows: K = the chunk's last query position + 1) and, for top-k, their key
    positions (int32, -1 past the keys a query sees)."""

    positions: list[int]
    values: torch.Tensor
    ids: torch.Tensor | None


class KeyCache:
    """One sequence's post-rotary keys of some KV heads at one layer, by position:
    [positions, kv_heads, head_dim] float32, grown as positions arrive, up to the
    plan's max_len (what the compiler counted); with the read's head indices."""

    def __init__(self, kv_heads: tuple[int, ...], head_dim: int, max_len: int, device: torch.device,
                 heads: tuple[int, ...], group: int) -> None:
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
        self.keys = torch.empty((0, len(kv_heads), head_dim), dtype=torch.float32, device=device)
        self.known = 0  # positions 0 .. known - 1 are written

    def write(self, pos0: int, keys: torch.Tensor) -> None:
        """Keys of positions pos0 .. pos0 + len(keys) - 1: [n, all kv heads, head_dim]."""
        end = pos0 + keys.shape[0]
        if end > self.max_len:
            raise RuntimeError(f"position {end - 1} is past the {self.max_len} positions the read was planned for")
        if pos0 > self.known:
            raise RuntimeError(f"keys of positions {self.known} .. {pos0 - 1} never ran through the model "
                               "(served from the prefix cache?)")
        if end > self.keys.shape[0]:  # grow geometrically, never past max_len
            grown = torch.empty((min(self.max_len, max(end, 2 * self.keys.shape[0])), *self.keys.shape[1:]),
                                dtype=self.keys.dtype, device=self.keys.device)
            grown[: self.keys.shape[0]] = self.keys
            self.keys = grown
        self.keys[pos0:end] = keys.index_select(1, self.kv_index).to(torch.float32)
        self.known = max(self.known, end)

    def upto(self, length: int) -> torch.Tensor:
        """Keys of positions 0 .. length - 1, every one of them written."""
        if length > self.known:
            raise RuntimeError(f"keys up to position {length - 1} asked for, {self.known} known")
        return self.keys[:length]


def joined(chunks: list[PatternChunk]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """A step's chunks of one layer's read as one [positions, heads, K] (full rows padded
    with 0 to the last position's keys), its key positions (top-k), and the positions."""
    positions = [p for chunk in chunks for p in chunk.positions]
    if len(chunks) == 1:
        return chunks[0].values, chunks[0].ids, positions
    if chunks[0].ids is not None:
        return torch.cat([c.values for c in chunks]), torch.cat([c.ids for c in chunks if c.ids is not None]), positions
    length = max(c.values.shape[-1] for c in chunks)
    values = [torch.nn.functional.pad(c.values, (0, length - c.values.shape[-1])) for c in chunks]
    return torch.cat(values), None, positions
