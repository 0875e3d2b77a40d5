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

Units (`--compiled-unit-reads`) are kept the same way, from module inputs: a pre-hook
traced into the graph copies o_proj's input (the attention output, [tokens, heads x
head_dim]: layers.L.self_attn.heads) and down_proj's (the activated gate x up, [tokens,
intermediate]: layers.L.mlp.act) into buffers of their own. They cost more than a
layer's stream (an 8B model's neurons are 3x its hidden size), hence a flag of their own.

Attention patterns (`--compiled-pattern-reads`) need each layer's queries and keys after
rotary embedding, where vLLM's `Attention` module (layers.L.self_attn.attn) gets them: a
pre-hook traced into the graph copies both into buffers, and after the pass the host
computes the patterns from there exactly as the eager pre-hook computes them from its
arguments (worker/attention_patterns.py).

The other addressable modules (`--compiled-module-reads`): the embeddings, each listed
layer's attention and MLP outputs (layers.L.self_attn, layers.L.mlp) and the final norm,
hidden-size outputs all, get a forward hook and a buffer each, as a layer's stream does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .graph_layers import hook_layers, hooked_layers, module_sites
from .plan import HEADS_SUFFIX, NEURONS_SUFFIX, layer_number

# vllm_config.additional_config keys: the decoder layers that get read buffers of their
# residual streams / of their units (heads and neurons), or "all". Part of vLLM's
# compile-cache key (as steering.LAYERS is).
LAYERS = "tracewire_read_buffers"
UNIT_LAYERS = "tracewire_unit_read_buffers"
PATTERN_LAYERS = "tracewire_pattern_read_buffers"
# ... the decoder layers whose attention and MLP outputs get buffers, with the embeddings'
# and the final norm's (graph_layers.module_sites).
MODULE_LAYERS = "tracewire_module_read_buffers"


def layers_of(additional_config: dict[str, Any] | None, key: str = LAYERS) -> list[int] | str | None:
    """The layers an engine's config gives read buffers: a list, "all", or None (none)."""
    return (additional_config or {}).get(key)


class ReadBuffers(torch.nn.Module):
    """Each readable layer's residual stream of the last forward pass (buffers: fixed addresses).

    A buffer per layer, not one [layers, tokens, hidden] tensor: the compiler turns a
    slice copy into one buffer into an in-place write of those rows, but several layers'
    copies into slices of one shared tensor into a copy of the whole tensor per pass
    (seen in vLLM's compiled code on the CPU build: every layer's max_tokens rows, twice)."""

    def __init__(self, layers: list[int], max_tokens: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, units: dict[str, UnitInput] | None = None,
                 attention: dict[int, AttentionInput] | None = None, modules: list[str] | None = None) -> None:
        super().__init__()
        self.layers = layers  # decoder layer numbers on this rank, in buffer order
        self.table_of = {layer: t for t, layer in enumerate(layers)}
        self.names = [f"layer_{layer}" for layer in layers]
        for name in self.names:
            self.register_buffer(name, torch.zeros(max_tokens, hidden, dtype=dtype, device=device), persistent=False)
        # Unit addresses (layers.L.self_attn.heads, layers.L.mlp.act) -> their module input's buffer
        self.units = dict(units or {})
        for unit in self.units.values():
            self.register_buffer(unit.buffer, torch.zeros(max_tokens, unit.width, dtype=dtype, device=device),
                                 persistent=False)
        # Other module paths (module_sites: hidden-size outputs) -> their buffer
        self.modules = {path: f"module_{k}" for k, path in enumerate(modules or [])}
        for buffer in self.modules.values():
            self.register_buffer(buffer, torch.zeros(max_tokens, hidden, dtype=dtype, device=device), persistent=False)
        # Decoder layer -> its attention module's queries' and keys' widths (patterns)
        self.attention = dict(attention or {})
        for layer, inputs in self.attention.items():
            self.register_buffer(f"queries_{layer}", torch.zeros(max_tokens, inputs.query_width, dtype=dtype,
                                                                 device=device), persistent=False)
            self.register_buffer(f"keys_{layer}", torch.zeros(max_tokens, inputs.key_width, dtype=dtype,
                                                              device=device), persistent=False)

    def capture(self, table: int, output: Any) -> None:
        """In the graph: keep this layer's stream. vLLM's decoder layers return (hidden,
        residual) with the add deferred to the next norm; the stream is their sum."""
        if isinstance(output, tuple):
            hidden, residual = output[0], output[1] if len(output) > 1 else None
            stream = hidden if residual is None else hidden + residual
        else:
            stream = output
        getattr(self, self.names[table])[: stream.shape[0]].copy_(stream)

    def capture_module(self, path: str, output: Any) -> None:
        """In the graph: keep a module site's output (the final norm's: its normed output,
        as an eager read sees it)."""
        value = output[0] if isinstance(output, tuple) else output
        getattr(self, self.modules[path])[: value.shape[0]].copy_(value)

    def capture_input(self, buffer: str, value: torch.Tensor) -> None:
        """In the graph, before o_proj / down_proj run: keep their input."""
        getattr(self, buffer)[: value.shape[0]].copy_(value)

    def capture_attention(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """In the graph, before layer `layer`'s attention runs: keep its queries and keys
        (called as `attn(q, k, v)`, [tokens, heads x head_size] each, after rotary)."""
        q = args[0] if args else kwargs["query"]
        k = args[1] if len(args) > 1 else kwargs["key"]
        getattr(self, f"queries_{layer}")[: q.shape[0]].copy_(q.reshape(q.shape[0], -1))
        getattr(self, f"keys_{layer}")[: k.shape[0]].copy_(k.reshape(k.shape[0], -1))

    def attention_inputs(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """On the host, after the forward pass: layer `layer`'s queries and keys of that
        pass's `tokens` rows (views, as stream() gives)."""
        return getattr(self, f"queries_{layer}")[:tokens], getattr(self, f"keys_{layer}")[:tokens]

    def stream(self, layer: int, tokens: int) -> torch.Tensor:
        """On the host, after the forward pass: layer `layer`'s stream of that pass's
        `tokens` flat rows (a view: the next pass overwrites it)."""
        buffer: torch.Tensor = getattr(self, self.names[self.table_of[layer]])
        return buffer[:tokens]

    def output(self, path: str, tokens: int) -> torch.Tensor:
        """On the host, after the forward pass: the output of module `path` (a decoder
        layer's stream, or a module site's) of that pass's `tokens` rows, as stream() gives."""
        if path in self.modules:
            buffer: torch.Tensor = getattr(self, self.modules[path])
            return buffer[:tokens]
        return self.stream(layer_number(path), tokens)

    def unit_input(self, path: str, tokens: int) -> torch.Tensor:
        """On the host, after the forward pass: the input of unit address `path`'s module
        ([tokens, units x unit width]), as stream() gives a layer's."""
        buffer: torch.Tensor = getattr(self, self.units[path].buffer)
        return buffer[:tokens]


@dataclass(frozen=True)
class UnitInput:
    """A unit address's module input kept in a buffer: its name, its width (all units),
    and one unit's width (head_dim for heads, 1 for neurons)."""

    buffer: str
    width: int
    unit_width: int


@dataclass(frozen=True)
class AttentionInput:
    """A layer's attention queries and keys kept in buffers: their widths on this rank."""

    query_width: int  # heads x head_size
    key_width: int  # KV heads x head_size


def attach(model: torch.nn.Module, vllm_config: Any, max_tokens: int) -> ReadBuffers | None:
    """Register read buffers on `model`'s decoder layers (and units, and attention inputs)
    the config lists (before its first forward pass compiles it); None when it lists none."""
    listed = layers_of(vllm_config.additional_config)
    unit_listed = layers_of(vllm_config.additional_config, UNIT_LAYERS)
    pattern_listed = layers_of(vllm_config.additional_config, PATTERN_LAYERS)
    module_listed = layers_of(vllm_config.additional_config, MODULE_LAYERS)
    if listed is None and unit_listed is None and pattern_listed is None and module_listed is None:
        return None
    inner, layers = hooked_layers(model, listed or [], "--compiled-reads")
    _, unit_layers = hooked_layers(model, unit_listed or [], "--compiled-unit-reads")
    _, pattern_layers = hooked_layers(model, pattern_listed or [], "--compiled-pattern-reads")
    inputs = unit_inputs(inner, unit_layers)
    attention = attention_inputs(inner, pattern_layers)
    sites = module_sites(inner, hooked_layers(model, module_listed, "--compiled-module-reads")[1]) \
        if module_listed is not None else {}
    weight = next(model.parameters())
    buffers = ReadBuffers(layers, max_tokens, int(vllm_config.model_config.get_hidden_size()),
                          weight.dtype, weight.device, {path: unit for path, (_, unit) in inputs.items()},
                          {layer: found for layer, (_, found) in attention.items()}, list(sites))
    inner.tracewire_reads = buffers
    hook_layers(inner, layers, buffers.capture)
    for path, module in sites.items():
        module.register_forward_hook(lambda module, args, output, path=path: buffers.capture_module(path, output))
    for module, unit in inputs.values():
        module.register_forward_pre_hook(
            lambda module, args, buffer=unit.buffer: buffers.capture_input(buffer, args[0]))
    for layer, (module, _) in attention.items():
        module.register_forward_pre_hook(
            lambda module, args, kwargs, layer=layer: buffers.capture_attention(layer, args, kwargs),
            with_kwargs=True)
    return buffers


def attention_inputs(inner: torch.nn.Module, layers: list[int]) -> dict[int, tuple[torch.nn.Module, AttentionInput]]:
    """Each of `layers`' attention module (layers.L.self_attn.attn, as the eager hooks find
    it: worker/runner.py's attention_layers) and its inputs' widths on this rank."""
    found: dict[int, tuple[torch.nn.Module, AttentionInput]] = {}
    for layer in layers:
        attn = getattr(getattr(inner.layers[layer], "self_attn", None), "attn", None)
        if attn is None or not all(hasattr(attn, a) for a in ("num_heads", "num_kv_heads", "head_size")):
            raise RuntimeError(f"{type(inner).__name__}'s layer {layer} has no attention module with heads "
                               "to keep queries and keys for")
        found[layer] = (attn, AttentionInput(int(attn.num_heads) * int(attn.head_size),
                                             int(attn.num_kv_heads) * int(attn.head_size)))
    return found


def unit_inputs(inner: torch.nn.Module, layers: list[int]) -> dict[str, tuple[torch.nn.Module, UnitInput]]:
    """The unit addresses of `layers` (as the eager hooks find them: worker/runner.py's
    unit_modules) -> the module whose input they are, and its buffer. The width is this
    rank's part of the input (row-parallel linears split it under tensor parallelism)."""
    found: dict[str, tuple[torch.nn.Module, UnitInput]] = {}
    for layer in layers:
        block = inner.layers[layer]
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        if hasattr(attn, "o_proj") and hasattr(attn, "head_dim"):
            found[f"layers.{layer}{HEADS_SUFFIX}"] = (
                attn.o_proj, UnitInput(f"heads_{layer}", _input_width(attn.o_proj), int(attn.head_dim)))
        if hasattr(mlp, "down_proj"):
            found[f"layers.{layer}{NEURONS_SUFFIX}"] = (
                mlp.down_proj, UnitInput(f"act_{layer}", _input_width(mlp.down_proj), 1))
    if layers and not found:
        raise RuntimeError(f"{type(inner).__name__}'s layers have no o_proj / down_proj: no heads or neurons to "
                           "keep buffers or tables for")
    return found


def _input_width(linear: torch.nn.Module) -> int:
    """A linear layer's input width on this rank (vLLM's row-parallel linears, or torch's)."""
    for name in ("input_size_per_partition", "in_features"):
        if (width := getattr(linear, name, None)) is not None:
            return int(width)
    raise RuntimeError(f"cannot tell {type(linear).__name__}'s input width")


def find(model: Any) -> ReadBuffers | None:
    return getattr(getattr(model, "model", None), "tracewire_reads", None)
