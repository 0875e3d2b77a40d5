"""The logit lens's first step: the model's final norm over residual-stream rows gathered
from several layers at once.

A lens over L layers for n batch rows normalizes n x L rows that lie in L tensors (a
compiled engine's read buffers, one a layer: shared/read_buffers.py). In torch that is
L gathers, a stack, a cast and the norm's own ~7 kernels, each call a host launch that
lets go of the GIL (~20 us apiece on the H200's host, more than the device work of a
lens step). On a GPU this is one Triton kernel instead: each program loads one row from
where it lies (an element offset from the first tensor), and applies vLLM's RMSNorm
(vllm/ir/ops/layernorm.py: float32 math, the weight's dtype for the product) writing
rows in the lm_head's dtype. Only a norm it reproduces takes it: vLLM's plain RMSNorm,
checked against the norm's own forward once, at the engine's start; any other norm
(Gemma's 1 + weight, a LayerNorm, ...) runs as the model defines it, through torch.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .host import on_device
from .triton_kernels import compile_quietly, runs_on, triton

if triton is not None:
    import triton.language as tl

log = logging.getLogger(f"vllm.{__name__}")

MAX_KERNEL_HIDDEN = 16384  # a row in one program's registers (larger: torch's calls)


class StreamNorm:
    """`norm` applied to chosen rows of several [tokens, hidden] tensors, in `dtype` (the
    lm_head's: the lens casts streams to it before the norm, as the model's own pass
    holds them)."""

    def __init__(self, norm: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.norm = norm
        self.dtype = dtype
        self.device = device
        self.fused = _reproducible(norm, device) and self._kernel_agrees()

    @torch.no_grad()
    def __call__(self, sources: list[torch.Tensor], rows: np.ndarray) -> torch.Tensor:
        """rows [n, L] (int): output row r*L + l is norm(sources[l][rows[r, l]]), as
        [n*L, hidden] in `dtype`."""
        if self.fused and _kernel_takes(sources):
            return _norm_rows_triton(sources, rows, self.norm, self.dtype)
        return self._torch(sources, rows)

    def _torch(self, sources: list[torch.Tensor], rows: np.ndarray) -> torch.Tensor:
        n, layers = rows.shape
        if layers == 1 and np.array_equal(rows[:, 0], np.arange(sources[0].shape[0])):
            x = sources[0]  # (every row of one tensor, in order: no gather)
        else:
            index = on_device(rows, sources[0].device, torch.long)
            x = torch.stack([s.index_select(0, index[:, layer]) for layer, s in enumerate(sources)], dim=1)
        normed = self.norm.forward(x.reshape(n * layers, -1).to(device=self.device, dtype=self.dtype))
        return normed[0] if isinstance(normed, tuple) else normed  # (.forward: not through a hook on "norm")

    def _kernel_agrees(self) -> bool:
        """Whether the kernel gives what the norm's own forward gives, on rows like a
        residual stream's (an offset, a spread): to the output dtype's rounding. Run at
        the engine's start; it compiles the kernel there too (out of a traced step)."""
        hidden = self.norm.weight.shape[0]
        generator = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(8, hidden, generator=generator) * 3 + 1).to(device=self.device, dtype=self.dtype)
        rows = np.arange(8).reshape(4, 2)
        try:
            got: list[torch.Tensor] = []
            compile_quietly(lambda: got.append(_norm_rows_triton([x[0::2], x[1::2]], rows // 2, self.norm,
                                                                 self.dtype)))
            want = self._torch([x], np.arange(8).reshape(8, 1)).float()
            close = bool(((got[0].float() - want).abs() <= want.abs() * 2.0**-6 + 1e-6).all())
        except Exception:  # noqa: BLE001 - a kernel that cannot run: torch's calls
            log.exception("the lens's norm kernel failed its check; the lens normalizes in torch")
            return False
        if not close:
            log.warning("the lens's norm kernel disagrees with %s; the lens normalizes in torch", type(self.norm))
        return close


def _reproducible(norm: torch.nn.Module, device: torch.device) -> bool:
    """Whether `norm` is one the kernel computes: vLLM's RMSNorm itself (not a subclass,
    which may change the arithmetic), weighted, its variance over the whole row."""
    if not runs_on(device):
        return False
    try:
        from vllm.model_executor.layers.layernorm import RMSNorm
    except ImportError:  # pragma: no cover - the worker runs inside vLLM
        return False
    weight = getattr(norm, "weight", None)
    return (type(norm) is RMSNorm and getattr(norm, "has_weight", False)
            and getattr(norm, "variance_size_override", 0) is None
            and isinstance(getattr(norm, "variance_epsilon", None), float)
            and isinstance(weight, torch.Tensor) and weight.dim() == 1 and _same_device(weight.device, device)
            and weight.shape[0] <= MAX_KERNEL_HIDDEN)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """(torch.device("cuda") != torch.device("cuda:0"): an index left out is the current one)"""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _kernel_takes(sources: list[torch.Tensor]) -> bool:
    """Rows the kernel can address: one dtype, each row contiguous, every tensor an
    element offset from the first."""
    first = sources[0]
    size = first.element_size()
    return all(s.dtype == first.dtype and s.dim() == 2 and s.stride(1) == 1 and s.device == first.device
               and (s.data_ptr() - first.data_ptr()) % size == 0 for s in sources)


def _norm_rows_triton(sources: list[torch.Tensor], rows: np.ndarray, norm: torch.nn.Module,
                      dtype: torch.dtype) -> torch.Tensor:
    first = sources[0]
    size = first.element_size()
    bases = np.array([(s.data_ptr() - first.data_ptr()) // size for s in sources], np.int64)
    strides = np.array([s.stride(0) for s in sources], np.int64)
    starts = (bases + rows.astype(np.int64) * strides).reshape(-1)  # [n*L], each row's first element
    weight = norm.weight
    hidden = weight.shape[0]
    out = torch.empty(starts.shape[0], hidden, dtype=dtype, device=first.device)
    if starts.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_rows[(starts.shape[0],)](first, on_device(starts, first.device, torch.int64), weight, out,
                                           hidden, norm.variance_epsilon, BLOCK=block,
                                           num_warps=max(1, min(16, block // 256)))
    return out


if triton is not None:

    @triton.jit
    def _rms_norm_rows(base, starts, weight, out, hidden, eps, BLOCK: tl.constexpr):
        """One output row a program: x = base[starts[o]:][:hidden] in out's dtype, then
        rms_norm as vllm/ir/ops/layernorm.py computes it (float32 math, each cast of
        its rounded as torch rounds it)."""
        o = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        start = tl.load(starts + o)
        x = _rounded(tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32), out.dtype.element_ty)
        variance = tl.sum(x * x, axis=0) / hidden
        w = tl.load(weight + cols, mask=mask, other=0.0)
        y = _rounded(x * tl.rsqrt(variance + eps), w.dtype) * w.to(tl.float32)  # x.to(weight.dtype) * weight
        y = _rounded(_rounded(y, w.dtype), out.dtype.element_ty)  # .to(orig_dtype)
        tl.store(out + o.to(tl.int64) * hidden + cols, y.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """float32 `x` rounded to `dtype` (to nearest, ties to even, as torch casts), held in
        float32. bfloat16 by its bits: Triton's interpreter truncates a bfloat16 cast."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)
