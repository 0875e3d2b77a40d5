"""vocab_topk against a float64 log-softmax and torch's own top k and log-sum-exp: the same
values and ids over widths with and without a short last slice, dtypes, strided rows and
ties, by both ways it computes them: torch's calls, and the one Triton kernel a GPU runs.
The kernel's cases run where Triton can: on a GPU (tests/gpu.sh on the H200), or on the
CPU under Triton's interpreter (`make test-kernels`, which `make test` runs:
`TRITON_INTERPRET=1 pytest` of this file and tests/test_stream_norm.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tracewire_server.worker import triton_kernels, vocab_topk

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (way, device): torch's calls on each device; the Triton kernel where it runs
WAYS = [("torch", d) for d in DEVICES]
if vocab_topk.triton is not None and (torch.cuda.is_available() or triton_kernels.interpreted()):
    WAYS.append(("triton", "cuda" if torch.cuda.is_available() else "cpu"))


def _top_k_logprobs(way: str, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if way == "triton":
        assert vocab_topk.fused(logits, k)
        return vocab_topk.unpacked(vocab_topk._top_k_logprobs_triton(logits, k))
    found = vocab_topk.stats(logits)
    values, ids = vocab_topk.top_k(logits, k, found)
    return found.logprobs(values), ids.to(torch.int32)


def _logits(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(rows, vocab, generator=g)).to(dtype).to(device)


def _exact_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The reference values: the top k of log_softmax in float64, as float32. (torch's own
    float32 log_softmax is no reference: on one CPU build it is 3e-5 off over a 152k row.)"""
    return torch.log_softmax(logits.double(), dim=-1).topk(k, dim=-1).values.float()


def _first_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the whole row sorted, largest first, equal values lowest id first."""
    ordered = torch.sort(logits, dim=-1, descending=True, stable=True)
    return ordered.values[:, :k], ordered.indices[:, :k]


@pytest.mark.parametrize("way,device", WAYS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1280, 1000, 4096 + 77, 151936])
def test_top_k_logprobs_equal_log_softmax_then_topk(way, device, dtype, vocab):
    logits = _logits(9, vocab, dtype, device)
    for k in (1, 5, 7) + ((32,) if vocab > 32 * vocab_topk.SLICE else ()):
        values, ids = _top_k_logprobs(way, logits, k)
        assert values.dtype == torch.float32 and ids.dtype == torch.int32 and values.shape == (9, k)
        torch.testing.assert_close(values, _exact_top_k(logits, k), rtol=1e-5, atol=2e-5)
        # the same ids, equal logits (bf16 and fp16 have many) lowest id first
        assert torch.equal(ids.long(), _first_k(logits, k)[1])


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_logprobs_takes_the_kernel_where_it_runs(device):
    logits = _logits(3, 4096, torch.bfloat16, device)
    expect = vocab_topk.triton is not None and (device == "cuda" or triton_kernels.interpreted())
    assert vocab_topk.fused(logits, 5) == expect
    assert not vocab_topk.fused(logits, vocab_topk.FUSED_K + 1)  # (torch's calls: any k)
    values, ids = vocab_topk.top_k_logprobs(logits, vocab_topk.FUSED_K + 1)
    torch.testing.assert_close(values, _exact_top_k(logits, vocab_topk.FUSED_K + 1), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_the_stats_are_each_slices_max_and_the_rows_log_sum_exp(device):
    vocab = 3 * vocab_topk.SLICE + 5  # a short last slice
    logits = _logits(4, vocab, torch.float32, device)
    found = vocab_topk.stats(logits)
    pad = torch.full((4, 4 * vocab_topk.SLICE - vocab), float("-inf"), device=device)
    want_max = torch.cat([logits, pad], dim=1).view(4, 4, vocab_topk.SLICE).amax(-1)
    assert torch.equal(found.slice_max, want_max)
    torch.testing.assert_close(found.log_sum_exp, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("way,device", WAYS)
def test_log_probabilities_near_zero_keep_their_precision(way, device):
    """A confident row (one logit far above the rest) at a large offset: its top
    log-probability is near 0, where a logit less the log-sum-exp (~32) would lose
    several 1e-6 to cancellation. Against float64."""
    logits = _logits(8, 5000, torch.float32, device, seed=3) + 20.0
    logits[:, 17] += 12.0
    values, ids = _top_k_logprobs(way, logits, 3)
    exact = torch.log_softmax(logits.double(), dim=-1).gather(1, ids.long())
    torch.testing.assert_close(values.double(), exact, rtol=0, atol=1e-6)


@pytest.mark.parametrize("way,device", WAYS)
def test_rows_with_a_stride_of_their_own(way, device):
    """The lens's logits are [:, :vocab] of lm_head's padded vocabulary: rows strided."""
    padded = _logits(6, 1000 + 24, torch.bfloat16, device, seed=1)
    logits = padded[:, :1000]
    values, ids = _top_k_logprobs(way, logits, 5)
    torch.testing.assert_close(values, _exact_top_k(logits, 5), rtol=1e-5, atol=2e-5)
    assert torch.equal(ids.long(), _first_k(logits, 5)[1])


def test_working_bytes_bound_what_a_row_holds():
    cpu = torch.device("cpu")
    if not triton_kernels.interpreted():
        assert vocab_topk.working_bytes(151936, 5, cpu) == 8 * 151936 + 24 * 5 * vocab_topk.SLICE
    assert vocab_topk.working_bytes(1000, 500, cpu) == 8 * 1000 + 24 * 1000  # (candidates: the whole row)
    if vocab_topk.triton is not None:  # the kernel: the logits and a float32 max per slice (2048 slots)
        assert vocab_topk.working_bytes(151936, 5, torch.device("cuda")) == 4 * 151936 + 4 * 2048


@pytest.mark.parametrize("way,device", WAYS)
def test_ties_and_a_row_whose_top_k_share_one_slice(way, device):
    vocab = 8 * vocab_topk.SLICE
    logits = torch.zeros(4, vocab, device=device)
    logits[0, 130:136] = 5.0  # six equal maxima in one slice: the five lowest ids
    logits[1, [3, 300, 700, 900, 1000]] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], device=device)  # five slices
    logits[2] = torch.arange(vocab, device=device) % 7  # ties everywhere
    logits[3, [900, 5, 260, 520, 130, 700]] = 1.0  # equal slice maxima: the lower slices' columns first
    values, ids = _top_k_logprobs(way, logits, 5)
    assert ids.tolist() == [[130, 131, 132, 133, 134], [1000, 900, 700, 300, 3], [6, 13, 20, 27, 34],
                            [5, 130, 260, 520, 700]]
    torch.testing.assert_close(values, torch.log_softmax(logits.double(), -1).gather(1, ids.long()).float())
    # a row of -inf but for three: the first three, then the lowest ids of -inf
    logits[0] = float("-inf")
    logits[0, [700, 10, 400]] = 0.0
    values, ids = _top_k_logprobs(way, logits, 5)
    assert ids[0].tolist() == [10, 400, 700, 0, 1] and values[0, 3:].isneginf().all()


@pytest.mark.parametrize("device", DEVICES)
def test_narrow_rows_and_no_rows(device):
    logits = _logits(2, 300, torch.float32, device)  # k x SLICE >= vocab: torch.topk itself
    values, ids = vocab_topk.top_k(logits, 3)
    assert torch.equal(values, torch.topk(logits, 3).values) and torch.equal(ids, _first_k(logits, 3)[1])
    for way, on in WAYS:
        if on == device:
            values, ids = _top_k_logprobs(way, torch.empty(0, 2000, device=device), 4)
            assert values.shape == (0, 4) and ids.shape == (0, 4)


@pytest.mark.parametrize("way,device", WAYS)
def test_the_packed_top_k_unpacks_on_the_host_to_the_same_values_and_ids(way, device):
    """What a lens read sends to the host: one float32 tensor, the values then the ids'
    bits, viewed apart in numpy (no copy: the copy off the device may not be done yet)."""
    logits = _logits(6, 4096 + 77, torch.bfloat16, device)
    packed = (vocab_topk._top_k_logprobs_triton(logits, 5) if way == "triton"
              else vocab_topk.top_k_packed(logits, 5))
    assert packed.shape == (2, 6, 5) and packed.dtype == torch.float32
    host = packed.cpu().numpy()
    values, ids = vocab_topk.unpacked(host)
    # views of the host copy, each contiguous (the collector cuts rows from their bytes)
    assert values.base is not None and ids.base is not None
    assert values.flags.c_contiguous and ids.flags.c_contiguous
    np.testing.assert_allclose(values, _exact_top_k(logits, 5).cpu().numpy(), rtol=1e-5, atol=2e-5)
    assert ids.dtype == np.int32 and np.array_equal(ids, _first_k(logits, 5)[1].cpu().numpy())
