"""Top k and log-sum-exp of rows a vocabulary wide, from one read of the rows.

The logit lens takes the top k log-probabilities of [rows, vocab] logits. torch.topk
over a 152k-wide row and the float32 log-softmax each take as long on an H200 as the
lm_head matmul that made the logits (0.42 and 0.28 ms against 0.43 ms for 256 rows of
Qwen3-8B's head, bench/lens_device.py): a block per row, several passes over it. Both
need less than that:

- The top k of a row lie in the k slices of it whose maxima are largest (each of the
  k elements lies in some slice; a slice outside those k has k slices above it, each
  holding an element at least its maximum). So one pass takes each SLICE columns' max,
  a small top k picks k slices, and the top k of their k x SLICE values are the row's.
- A log-probability is a logit less the row's log-sum-exp, which the same pass finds in
  float32 a block at a time (each block's max and sum of exponentials, then combined).

On a GPU the pass is one Triton kernel over a [rows, blocks] grid; elsewhere (the CPU
build, or no Triton) torch computes the same two statistics, and what follows is the
same code either way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SLICE = 128  # columns per slice whose maximum the pass keeps
_BLOCK = 4096  # columns per Triton program (a multiple of SLICE)

try:  # (not in the CPU build)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the build
    triton = None


class VocabStats(NamedTuple):
    """Per row of logits: each slice's maximum [rows, slices] and the log-sum-exp [rows],
    both float32."""

    slice_max: torch.Tensor
    log_sum_exp: torch.Tensor


def stats(logits: torch.Tensor) -> VocabStats:
    """[rows, vocab] logits (a row stride of their own allowed, unit column stride) ->
    their VocabStats, in float32 whatever the logits' dtype."""
    if logits.is_cuda and triton is not None and logits.stride(1) == 1:
        return _stats_triton(logits)
    return _stats_torch(logits)


def top_k(logits: torch.Tensor, k: int, found: VocabStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row, largest first, in the logits' dtype, and their
    ids (int64); equal logits (bf16 has many) lowest id first, on every device."""
    rows, vocab = logits.shape
    if k * SLICE >= vocab:  # (a narrow row: nothing to gain)
        picked = _first_k(logits, k)
        return logits.gather(1, picked), picked
    found = found if found is not None else stats(logits)
    # (of slices with equal maxima the lower; then in id order, so are their columns)
    slices = _first_k(found.slice_max, k).sort(dim=-1).values
    ids = (slices.unsqueeze(-1) * SLICE + torch.arange(SLICE, device=logits.device)).view(rows, k * SLICE)
    outside = ids >= vocab  # (the last slice may be short)
    values = logits.gather(1, ids.clamp_max(vocab - 1)).masked_fill(outside, float("-inf"))
    picked = _first_k(values, k)
    return values.gather(1, picked), ids.gather(1, picked)


def _first_k(values: torch.Tensor, k: int) -> torch.Tensor:
    """Where each row's k largest values are, largest first, equal values the first
    first: torch.topk over keys made unique by the column (a stable sort of the rows
    costs several times more on a GPU)."""
    bits = (values.float() + 0.0).view(torch.int32)  # (+ 0.0: -0.0 is 0.0)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # as integers, in the floats' order
    column = torch.arange(values.shape[-1], device=values.device)
    keys = ordered.long() * (1 << 32) + ((1 << 32) - 1 - column)
    return torch.topk(keys, k, dim=-1).indices


def working_bytes(vocab: int, k: int) -> int:
    """The most device memory top_k_logprobs holds per row of logits, the logits
    included: them (float32 at most), a float32 copy (torch's statistics), and the
    candidates' values, ids and their sort."""
    return 8 * vocab + 24 * min(k * SLICE, vocab)


def top_k_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of log_softmax(logits) in float32 per row, largest first, and their ids
    (int64), from one pass over the logits and a few small kernels."""
    found = stats(logits)
    values, ids = top_k(logits, k, found)
    return values.float() - found.log_sum_exp.unsqueeze(1), ids


def _stats_torch(logits: torch.Tensor) -> VocabStats:
    rows, vocab = logits.shape
    whole = vocab // SLICE * SLICE
    maxima = [logits[:, :whole].reshape(rows, whole // SLICE, SLICE).amax(-1)]
    if whole < vocab:
        maxima.append(logits[:, whole:].amax(-1, keepdim=True))
    slice_max = torch.cat(maxima, dim=1) if len(maxima) > 1 else maxima[0]
    return VocabStats(slice_max.float(), torch.logsumexp(logits.float(), dim=-1))


def _stats_triton(logits: torch.Tensor) -> VocabStats:
    rows, vocab = logits.shape
    slices, blocks = triton.cdiv(vocab, SLICE), triton.cdiv(vocab, _BLOCK)
    slice_max = torch.empty(rows, blocks * (_BLOCK // SLICE), device=logits.device, dtype=torch.float32)
    block_max = torch.empty(rows, blocks, device=logits.device, dtype=torch.float32)
    block_sum = torch.empty_like(block_max)
    if rows:
        _stats_kernel[(rows, blocks)](logits, logits.stride(0), vocab, slice_max, block_max, block_sum, blocks,
                                      BLOCK=_BLOCK, SLICE=SLICE)
    most = block_max.amax(-1, keepdim=True)
    log_sum_exp = (block_sum * torch.exp(block_max - most)).sum(-1).log() + most.squeeze(1)
    return VocabStats(slice_max[:, :slices], log_sum_exp)


if triton is not None:

    @triton.jit
    def _stats_kernel(x, row_stride, vocab, slice_max, block_max, block_sum, blocks,
                      BLOCK: tl.constexpr, SLICE: tl.constexpr):
        """One program: BLOCK columns of one row, as [BLOCK // SLICE, SLICE] -> their
        slices' maxima, the block's max and its sum of exp(x - max), in float32."""
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        per_block = BLOCK // SLICE
        cols = block * BLOCK + tl.arange(0, per_block)[:, None] * SLICE + tl.arange(0, SLICE)[None, :]
        v = tl.load(x + row * row_stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        per_slice = tl.max(v, axis=1)
        tl.store(slice_max + (row * blocks + block) * per_block + tl.arange(0, per_block), per_slice)
        most = tl.max(per_slice, axis=0)
        tl.store(block_max + row * blocks + block, most)
        tl.store(block_sum + row * blocks + block, tl.sum(tl.sum(tl.exp(v - most), axis=1), axis=0))
