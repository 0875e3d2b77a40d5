"""Decoder-layer reads built into compiled graphs and CUDA graphs (`--compiled-reads`).

Python forward hooks cannot fire inside a compiled / CUDA-graph forward pass, so a
compiled engine cannot copy out the rows a trace reads as the eager one does
(worker/module_hooks.py). Instead the graph itself keeps each readable layer's
residual stream: a hook traced into the graph copies the layer's output, every row of
the pass, into a persistent buffer of fixed address,

    stream_L[:tokens] = hidden + residual          after each readable layer L

and after the forward pass the host takes the rows its reads select from there
(worker/module_hooks.py, CompiledReads), in the same stream order as any later kernel:
no synchronization, and graph replay needs no recapture. The copy is of every row
because a graph cannot branch on which rows are read; it costs one fused add-and-copy
per readable layer per pass (for 64 decoding requests of an 8B model, 512 KiB a
layer), and the buffers hold `max_tokens` rows a layer (the largest pass vLLM runs).

The hooks are registered after the steering tables' (shared/steering.py) on the same
layers, so a read sees the stream after that layer's writes, as on an eager engine.
The model loader that attaches both lives in steering.py.
"""

from __future__ import annotations

from typing import Any

import torch

from .graph_layers import hook_layers, hooked_layers

# vllm_config.additional_config key: the decoder layers that get read buffers, or "all".
# Part of vLLM's compile-cache key (as steering.LAYERS is).
LAYERS = "tracewire_read_buffers"


def layers_of(additional_config: dict[str, Any] | None) -> list[int] | str | None:
    """The layers an engine's config gives read buffers: a list, "all", or None (none)."""
    return (additional_config or {}).get(LAYERS)


class ReadBuffers(torch.nn.Module):
    """Each readable layer's residual stream of the last forward pass (buffers: fixed addresses).

    A buffer per layer, not one [layers, tokens, hidden] tensor: the compiler turns a
    slice copy into one buffer into an in-place write of those rows, but several layers'
    copies into slices of one shared tensor into a copy of the whole tensor per pass
    (seen in vLLM's compiled code on the CPU build: every layer's max_tokens rows, twice)."""

    def __init__(self, layers: list[int], max_tokens: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.layers = layers  # decoder layer numbers on this rank, in buffer order
        self.table_of = {layer: t for t, layer in enumerate(layers)}
        self.names = [f"layer_{layer}" for layer in layers]
        for name in self.names:
            self.register_buffer(name, torch.zeros(max_tokens, hidden, dtype=dtype, device=device), persistent=False)

    def capture(self, table: int, output: Any) -> None:
        """In the graph: keep this layer's stream. vLLM's decoder layers return (hidden,
        residual) with the add deferred to the next norm; the stream is their sum."""
        if isinstance(output, tuple):
            hidden, residual = output[0], output[1] if len(output) > 1 else None
            stream = hidden if residual is None else hidden + residual
        else:
            stream = output
        getattr(self, self.names[table])[: stream.shape[0]].copy_(stream)

    def stream(self, layer: int, tokens: int) -> torch.Tensor:
        """On the host, after the forward pass: layer `layer`'s stream of that pass's
        `tokens` flat rows (a view: the next pass overwrites it)."""
        buffer: torch.Tensor = getattr(self, self.names[self.table_of[layer]])
        return buffer[:tokens]


def attach(model: torch.nn.Module, vllm_config: Any, max_tokens: int) -> ReadBuffers | None:
    """Register read buffers on `model`'s decoder layers the config lists (before its
    first forward pass compiles it); None when it lists none."""
    listed = layers_of(vllm_config.additional_config)
    if listed is None:
        return None
    inner, layers = hooked_layers(model, listed, "--compiled-reads")
    weight = next(model.parameters())
    buffers = ReadBuffers(layers, max_tokens, int(vllm_config.model_config.get_hidden_size()),
                          weight.dtype, weight.device)
    inner.tracewire_reads = buffers
    hook_layers(inner, layers, buffers.capture)
    return buffers


def find(model: Any) -> ReadBuffers | None:
    return getattr(getattr(model, "model", None), "tracewire_reads", None)
