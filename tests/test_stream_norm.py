"""StreamNorm, the logit lens's final norm over rows gathered from several layers' tensors,
against an independent float64 RMSNorm: rows from several tensors with their own row
strides, repeated and out of order, in each dtype; by both ways it computes them (torch's
calls, and the Triton kernel a GPU runs: on the CPU under Triton's interpreter, as
tests/test_vocab_topk.py says). Norms the kernel does not reproduce run as the model
defines them. And Lens.of_rows, rows as they lie, equals the lens of the same rows stacked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tracewire_server.worker import module_reads, triton_kernels
from tracewire_server.worker.stream_norm import StreamNorm
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL = triton_kernels.runs_on(DEVICE)  # (a GPU, or TRITON_INTERPRET=1 with Triton installed)
HIDDEN = 96  # (not a power of two: the kernel's masked tail)


def _vllm_norm(cls: type = RMSNorm, dtype: torch.dtype = torch.bfloat16, **kw: object) -> torch.nn.Module:
    with set_current_vllm_config(VllmConfig()):
        norm = cls(HIDDEN, eps=1e-5, **kw)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, HIDDEN))
    return norm.to(device=DEVICE, dtype=dtype)


def _sources(dtype: torch.dtype) -> list[torch.Tensor]:
    """Three [tokens, hidden] tensors like a pass's layers: one contiguous, one every other
    row of a larger one, one the left half of wider rows (a row stride of its own)."""
    torch.manual_seed(0)
    plain = torch.randn(5, HIDDEN) * 3 + 1
    every_other = (torch.randn(12, HIDDEN) * 20)[::2]
    half = torch.randn(4, 2 * HIDDEN)[:, :HIDDEN]
    return [t.to(device=DEVICE, dtype=dtype) for t in (plain, every_other, half)]


def _reference(sources: list[torch.Tensor], rows: np.ndarray, weight: torch.Tensor, eps: float,
               dtype: torch.dtype) -> torch.Tensor:
    """rms_norm in float64 of each row cast to `dtype` (the lens casts streams to lm_head's
    dtype first, as the model holds them), times the weight."""
    x = torch.stack([sources[j][int(rows[r, j])] for r in range(rows.shape[0]) for j in range(rows.shape[1])])
    x = x.to(dtype).double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


ROWS = np.array([[4, 5, 0], [0, 0, 3], [2, 1, 1], [2, 1, 1]])  # [n, layers]: out of order, repeated
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-22}


@pytest.mark.parametrize("fused", [False, True] if KERNEL else [False])
@pytest.mark.parametrize("lm_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float32])
def test_rows_of_several_tensors_are_normalized_as_rms_norm_computes(fused, lm_dtype, source_dtype):
    norm = _vllm_norm(dtype=lm_dtype)
    stream_norm = StreamNorm(norm, lm_dtype, DEVICE)
    assert stream_norm.fused == KERNEL  # (vLLM's RMSNorm: the kernel wherever it runs)
    stream_norm.fused = fused
    sources = _sources(source_dtype)
    got = stream_norm(sources, ROWS)
    assert got.dtype == lm_dtype and got.shape == (ROWS.size, HIDDEN)
    want = _reference(sources, ROWS, norm.weight, 1e-5, lm_dtype)
    # to the output's rounding (and the weight's product, rounded once more)
    torch.testing.assert_close(got.double(), want, rtol=2 * ULP[lm_dtype], atol=1e-6)
    # the repeated row: the same values
    assert torch.equal(got[6:9], got[9:12])
    if fused:  # and the norm's own forward (torch's calls): to a rounding flip here and there
        stream_norm.fused = False
        own = stream_norm(sources, ROWS).double()
        assert ((got.double() - own).abs() <= own.abs() * ULP[lm_dtype] + 1e-6).all()


@pytest.mark.parametrize("make", [
    lambda: _vllm_norm(GemmaRMSNorm),  # 1 + weight
    lambda: _vllm_norm(var_hidden_size=HIDDEN // 2),  # the variance of part of the row
    lambda: _vllm_norm(has_weight=False),
    lambda: torch.nn.RMSNorm(HIDDEN, eps=1e-5).to(device=DEVICE, dtype=torch.bfloat16),
    lambda: torch.nn.LayerNorm(HIDDEN).to(device=DEVICE, dtype=torch.bfloat16),
], ids=["gemma", "partial variance", "no weight", "torch RMSNorm", "LayerNorm"])
def test_norms_the_kernel_does_not_reproduce_run_as_the_model_defines_them(make):
    norm = make()
    with torch.no_grad():
        if isinstance(getattr(norm, "weight", None), torch.nn.Parameter):
            norm.weight.copy_(torch.linspace(-0.5, 1.5, HIDDEN))
        if getattr(norm, "bias", None) is not None:
            norm.bias.fill_(0.25)
    stream_norm = StreamNorm(norm, torch.bfloat16, DEVICE)
    assert not stream_norm.fused
    sources = _sources(torch.float32)
    x = torch.stack([sources[j][int(ROWS[r, j])] for r in range(ROWS.shape[0]) for j in range(3)])
    with torch.no_grad():
        want = norm(x.to(torch.bfloat16))
    want = want[0] if isinstance(want, tuple) else want
    assert torch.equal(stream_norm(sources, ROWS), want)


@pytest.mark.parametrize("top_k", [0, 4])
def test_the_lens_of_rows_as_they_lie_is_the_lens_of_them_stacked(top_k):
    torch.manual_seed(1)
    vocab = 300  # (lm_head padded to 320 rows)
    weight = (0.3 * torch.randn(320, HIDDEN)).to(device=DEVICE, dtype=torch.bfloat16)
    lens = module_reads.Lens(_vllm_norm(), weight, vocab)
    sources = _sources(torch.bfloat16)
    values, ids = lens.of_rows(sources, ROWS, top_k)
    stacked = torch.stack([torch.stack([sources[j][int(r)] for j, r in enumerate(row)]) for row in ROWS])
    want_values, want_ids = lens(stacked, top_k)  # [n, layers, ...]
    assert values.shape == want_values.shape == (4, 3, top_k or vocab)
    torch.testing.assert_close(values, want_values, rtol=0, atol=0)
    if top_k:
        assert torch.equal(ids, want_ids)
    else:
        assert ids is None and want_ids is None
        # and independently: log_softmax of the float64 norm's bf16 logits, to the rounding
        # of a bf16 logit or two (a normalized value a rounding apart moves a logit as much)
        normed = _reference(sources, ROWS, lens.norm.norm.weight, 1e-5, torch.bfloat16)
        logits = (normed.to(torch.bfloat16) @ weight.t())[:, :vocab].double()
        torch.testing.assert_close(values.reshape(-1, vocab).double(), torch.log_softmax(logits, -1),
                                   rtol=2.0**-6, atol=2.0**-5)
