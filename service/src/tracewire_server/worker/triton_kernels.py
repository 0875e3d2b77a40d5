"""Running tracewire's own Triton kernels inside vLLM's worker (vocab_topk.py, stream_norm.py).

What every such kernel needs, in one place: whether Triton is there at all (the CPU
build has none), whether a tensor's device can run it (a GPU, or Triton's interpreter,
the tests' way to run a kernel on the CPU), and a compile at the engine's start that
vLLM's JIT monitor does not see.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

try:  # (vLLM's CPU build installs it; a build without it runs torch's calls)
    import triton
except ImportError:  # pragma: no cover - depends on the build
    triton = None


def interpreted() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) runs kernels on the CPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel can run on tensors of `device`."""
    return triton is not None and (device.type == "cuda" or interpreted())


def compile_quietly(first_call: Callable[[], object]) -> None:
    """Make a kernel's first call (its compile) now, at the engine's start, not at a
    traced step, where the compile would stall every request; out of sight of vLLM's
    JIT monitor (`--jit-monitor-mode error` fails the start on a compile it sees after
    the engine's own warm-up): this compile is part of a warm-up too."""
    runtime = triton.knobs.runtime
    hook = getattr(runtime, "jit_post_compile_hook", None)
    runtime.jit_post_compile_hook = None
    try:
        first_call()
    finally:
        runtime.jit_post_compile_hook = hook
