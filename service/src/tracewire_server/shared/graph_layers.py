"""The decoder layers a compiled graph gets hooks on (--compiled-steering, --compiled-reads).

Both attach their hooks while the model loads, before vLLM compiles it, to the layers
their flag lists that this rank holds; both size their buffers for the largest pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def hooked_layers(model: torch.nn.Module, listed: list[int] | str, flag: str) -> tuple[torch.nn.Module, list[int]]:
    """`model`'s decoder stack and the layers `listed` ("all", or numbers) names among
    those on this rank; a model without one, or a layer it lacks, fails naming `flag`."""
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        raise RuntimeError(f"{flag} needs a decoder model with model.layers; {type(model).__name__} has none")
    count = len(inner.layers)
    if isinstance(listed, list) and (missing := sorted(set(listed) - set(range(count)))):
        raise ValueError(f"{flag} lists layers {missing}; the model has layers 0-{count - 1}")
    start = getattr(inner, "start_layer", 0)
    end = getattr(inner, "end_layer", count)  # pipeline parallel: this rank's layers
    return inner, [layer for layer in range(start, end) if listed == "all" or layer in listed]


def hook_layers(inner: torch.nn.Module, layers: list[int], hook: Callable[[int, Any], Any]) -> None:
    """A forward hook on each of `layers` (decoder layer numbers) calling `hook(i, output)`,
    `i` the layer's index in `layers` (its table or buffer); what `hook` returns replaces
    the layer's output, as a forward hook's return value does."""
    for table, layer in enumerate(layers):
        inner.layers[layer].register_forward_hook(lambda module, args, output, table=table: hook(table, output))


def max_tokens(vllm_config: Any) -> int:
    """The most flat token rows a forward pass runs (the largest batch, or CUDA graph)."""
    sizes = getattr(vllm_config.compilation_config, "cudagraph_capture_sizes", None) or [0]
    return max(int(vllm_config.scheduler_config.max_num_batched_tokens), max(sizes))


def module_sites(inner: torch.nn.Module, layers: list[int]) -> dict[str, torch.nn.Module]:
    """The other module outputs a compiled graph can keep or write (--compiled-module-reads,
    --compiled-module-steering): the embeddings, `layers`' attention and MLP outputs, and
    the final norm, by the module paths the eager hooks give them (worker/runner.py's
    modules); a model without one of them fails saying which."""
    found: dict[str, torch.nn.Module] = {}
    for path, module in [("embed_tokens", getattr(inner, "embed_tokens", None))] + [
            (f"layers.{layer}.{part}", getattr(inner.layers[layer], part, None))
            for layer in layers for part in ("self_attn", "mlp")] + [("norm", getattr(inner, "norm", None))]:
        if not isinstance(module, torch.nn.Module):
            raise RuntimeError(f"{type(inner).__name__} has no module {path!r} to keep buffers or tables for")
        found[path] = module
    return found
