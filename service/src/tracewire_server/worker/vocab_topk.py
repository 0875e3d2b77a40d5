"""The top k log-probabilities of rows a vocabulary wide, from one read of the rows.

The logit lens takes the top k log-probabilities of [rows, vocab] logits. On an H200,
torch.topk over a 152k-wide row and the float32 log-softmax each take about as long as
the lm_head matmul that made the logits (0.43 and 0.28 ms against 0.45 ms for 256 rows
of Qwen3-8B's head: bench/lens_device.py). Both need less:

- The top k of a row lie in the k slices of it whose maxima are largest (each of the
  k elements lies in some slice; a slice outside those k has k slices above it, each
  holding an element at least its maximum). So one pass takes each SLICE columns' max,
  then k slices are picked, and the top k of their k x SLICE values are the row's.
- A log-probability is (logit - the row's max) - log(sum(exp(logits - max))), as
  log_softmax computes it; the same pass finds both in float32 (a running max and sum).

Equal logits (bf16 has many) come lowest id first, on every device.

On a GPU all of it is one Triton kernel, a program per row: the engine's thread makes
one launch (each torch call lets go of the GIL, and a lens made of twenty small torch
calls ran at 0.58x of raw vLLM where the old three ran at 0.80x, bench/results
2026-12-04). Elsewhere (a CPU, but under the tests' Triton interpreter; no Triton; k
over FUSED_K) torch computes the same in a few calls: `stats`, then `top_k`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .triton_kernels import compile_quietly, runs_on, triton

if triton is not None:
    import triton.language as tl

SLICE = 128  # columns per slice whose maximum the pass keeps
FUSED_K = 32  # the Triton kernel's largest k (its candidates: k x SLICE values in registers)
_SLICES_PER_STEP = 32  # slices the kernel's first pass reads at a time (4096 columns)


class VocabStats(NamedTuple):
    """Per row of logits, in float32: each slice's maximum [rows, slices], the row's
    maximum [rows] and log(sum(exp(logits - maximum))) [rows]. A log-probability is
    (logit - maximum) - log_sum, as log_softmax computes it (a logit less the log-sum-exp
    loses ~1e-6 to cancellation next to log-probabilities near 0)."""

    slice_max: torch.Tensor
    row_max: torch.Tensor
    log_sum: torch.Tensor

    @property
    def log_sum_exp(self) -> torch.Tensor:
        return self.row_max + self.log_sum

    def logprobs(self, values: torch.Tensor) -> torch.Tensor:
        """[rows, k] logits of these rows -> their log-probabilities, float32."""
        return (values.float() - self.row_max.unsqueeze(1)) - self.log_sum.unsqueeze(1)


def working_bytes(vocab: int, k: int, device: torch.device) -> int:
    """The most device memory top_k_logprobs holds per row of logits on `device`, the
    logits included (float32 at most). The kernel: them and its scratch. Torch's calls:
    them, a float32 copy (the log-sum-exp), and the candidates' values, ids and keys."""
    if _fuses(device, vocab, k):
        return 4 * vocab + 4 * triton.next_power_of_2(triton.cdiv(vocab, SLICE))
    return 8 * vocab + 24 * min(k * SLICE, vocab)


def top_k_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, vocab] logits (rows may have a stride of their own) -> the top k of each
    row's log_softmax in float32, largest first, and their ids (int32)."""
    return unpacked(top_k_packed(logits, k))


def top_k_packed(logits: torch.Tensor, k: int) -> torch.Tensor:
    """top_k_logprobs in one float32 tensor [2, rows, k]: the log-probabilities, then
    their ids' int32 bits (`unpacked`). One tensor is one copy to the host where two
    were two copy launches and two host calls more on the engine's thread; each half
    stays contiguous (a strided view costs the collector a copy that lets go of the GIL)."""
    if fused(logits, k):
        return _top_k_logprobs_triton(logits, k)
    found = stats(logits)
    values, ids = top_k(logits, k, found)
    return torch.stack([found.logprobs(values), ids.to(torch.int32).view(torch.float32)])


def unpacked(packed: torch.Tensor | np.ndarray) -> tuple:
    """top_k_packed's [2, rows, k] -> its log-probabilities [rows, k] and their ids
    [rows, k] (int32): contiguous views, of a tensor or of its host copy's numpy array."""
    values, ids = packed[0], packed[1]
    return values, ids.view(torch.int32) if isinstance(ids, torch.Tensor) else ids.view(np.int32)


def warm_up(logits: torch.Tensor) -> None:
    """Compile the kernel for logits like these now, at the engine's start
    (triton_kernels.compile_quietly)."""
    if fused(logits, 1):
        compile_quietly(lambda: _top_k_logprobs_triton(logits, 1))


def fused(logits: torch.Tensor, k: int) -> bool:
    """Whether top_k_logprobs makes these logits' top k in one Triton kernel."""
    return _fuses(logits.device, logits.shape[1], k) and logits.stride(1) == 1


def _fuses(device: torch.device, vocab: int, k: int) -> bool:
    return runs_on(device) and 1 <= k <= FUSED_K and k * SLICE < vocab


def stats(logits: torch.Tensor) -> VocabStats:
    """[rows, vocab] logits -> their VocabStats, in float32 whatever the logits' dtype."""
    rows, vocab = logits.shape
    whole = vocab // SLICE * SLICE
    maxima = [logits[:, :whole].reshape(rows, whole // SLICE, SLICE).amax(-1)]
    if whole < vocab:
        maxima.append(logits[:, whole:].amax(-1, keepdim=True))
    slice_max = (torch.cat(maxima, dim=1) if len(maxima) > 1 else maxima[0]).float()
    row_max = slice_max.amax(-1)
    return VocabStats(slice_max, row_max, (logits.float() - row_max.unsqueeze(1)).exp().sum(-1).log())


def top_k(logits: torch.Tensor, k: int, found: VocabStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row, largest first, in the logits' dtype, and their
    ids (int64)."""
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


def _top_k_logprobs_triton(logits: torch.Tensor, k: int) -> torch.Tensor:
    rows, vocab = logits.shape
    slices = triton.next_power_of_2(triton.cdiv(vocab, SLICE))
    scratch = torch.empty(rows, slices, device=logits.device, dtype=torch.float32)
    packed = torch.empty(2, rows, k, device=logits.device, dtype=torch.float32)
    if rows:
        _top_k_kernel[(rows,)](logits, logits.stride(0), vocab, scratch, packed, rows, k, SLICES=slices,
                               SLICE=SLICE, STEP=_SLICES_PER_STEP, K=FUSED_K, num_warps=8)
    return packed


if triton is not None:

    # One compiled kernel per model and dtype, whatever k (K is FUSED_K's slots, k a value
    # Triton does not specialize on): a compile in a traced step would stall every request.
    @triton.jit(do_not_specialize=["rows", "k"])
    def _top_k_kernel(x, row_stride, vocab, scratch, packed, rows, k,
                      SLICES: tl.constexpr, SLICE: tl.constexpr, STEP: tl.constexpr, K: tl.constexpr):
        """One row: its slices' maxima (into `scratch`), its maximum and sum of exponentials
        in one pass, the k slices with the largest maxima, then the top k of their
        columns as log-probabilities (VocabStats.logprobs' arithmetic) and their ids'
        bits, into the row of `packed` (top_k_packed)."""
        row = tl.program_id(0).to(tl.int64)
        base = x + row * row_stride
        own = scratch + row * SLICES
        n_slices = tl.cdiv(vocab, SLICE)
        most = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        for start in range(0, vocab, STEP * SLICE):
            cols = start + tl.arange(0, STEP)[:, None] * SLICE + tl.arange(0, SLICE)[None, :]
            v = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            per_slice = tl.max(v, axis=1)
            at = start // SLICE + tl.arange(0, STEP)
            tl.store(own + at, per_slice, mask=at < n_slices)
            new_most = tl.maximum(most, tl.max(per_slice, axis=0))
            total = total * tl.exp(most - new_most) + tl.sum(tl.sum(tl.exp(v - new_most), axis=1), axis=0)
            most = new_most
        log_sum = tl.log(total)
        tl.debug_barrier()  # (the scratch written above is read below by other threads)

        # the k slices with the largest maxima, of equal maxima the lower
        slice_ids = tl.arange(0, SLICES)
        left = slice_ids < n_slices
        maxima = tl.load(own + slice_ids, mask=left, other=float("-inf"))
        slots = tl.arange(0, K)
        chosen = tl.zeros((K,), tl.int32)
        for j in range(k):
            best = tl.max(tl.where(left, maxima, float("-inf")), axis=0)
            first = tl.min(tl.where(left & (maxima == best), slice_ids, SLICES), axis=0)
            chosen = tl.where(slots == j, first, chosen)
            left = left & (slice_ids != first)

        # their columns' top k, equal values the lowest id first
        cols = chosen[:, None] * SLICE + tl.arange(0, SLICE)[None, :]
        left = (slots[:, None] < k) & (cols < vocab)
        v = tl.load(base + cols, mask=left, other=float("-inf")).to(tl.float32)
        for j in range(k):
            best = tl.max(tl.max(tl.where(left, v, float("-inf")), axis=1), axis=0)
            first = tl.min(tl.min(tl.where(left & (v == best), cols, vocab), axis=1), axis=0)
            left = left & (cols != first)
            tl.store(packed + row * k + j, (best - most) - log_sum)
            tl.store(packed + (rows + row) * k + j, first.to(tl.int32).to(tl.float32, bitcast=True))
