"""Activation patching sweeps: the standard patching heatmap as one batched trace.

`sweep(client, clean, corrupted, layers, positions, metric=(a, b))` runs one trace: the
clean prompt reads every layer's residual stream at the positions, and one corrupted
invoke per (layer, position) replaces its residual stream there with the clean one's,
on the server (the corrupted invokes all wait for the clean one's step 0, then run
together, batched). It returns the metric of each patched run as an array
[layers, positions]: by default the logit difference logit[a] - logit[b] of the first
token the patched model would draw (step 0, lm_head's raw logits).

A single patch is plain SDK (tracing.py): save the source's module read, `.patch()` the
target's module with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .prompts import PromptLike
from .tracing import Saved, Tracer

# A metric of one patched run: from its step-0 raw logits of the ids it names.
Metric = tuple[int, int]


def sweep_trace(
    client: Any,
    clean: PromptLike,
    corrupted: PromptLike,
    layers: Sequence[int],
    positions: Sequence[int],
    metric: Metric,
    *,
    module: Callable[[int], str] = lambda layer: f"layers.{layer}",
    **sampling: Any,
) -> tuple[Tracer, list[list[Saved]]]:
    """The sweep's trace, not yet run, and per (layer, position) the saved read of the
    metric's two logits. Position p of the corrupted prompt takes position p of the clean
    one (negative positions count from each prompt's end, so prompts of different
    lengths line up at their ends). `sampling`: the trace's sampling parameters (greedy,
    max_tokens=1 unless given)."""
    good, bad = int(metric[0]), int(metric[1])
    tracer = client.trace(**{"temperature": 0.0, "max_tokens": 1, **sampling})
    wanted = [int(p) for p in positions]
    with tracer.invoke(clean) as source:
        sources = {layer: source.iter[0].module(module(layer), positions=wanted).save(f"clean@{layer}")
                   for layer in layers}
    cells: list[list[Saved]] = []
    for layer in layers:
        row = []
        for p in wanted:
            with tracer.invoke(corrupted) as target:
                target.iter[0].module(module(layer), positions=[p]).patch(sources[layer], positions=[p])
                row.append(target.iter[0].logits.raw.select([good, bad]).save("metric"))
        cells.append(row)
    return tracer, cells


def sweep(
    client: Any,
    clean: PromptLike,
    corrupted: PromptLike,
    layers: Sequence[int],
    positions: Sequence[int],
    metric: Metric,
    *,
    module: Callable[[int], str] = lambda layer: f"layers.{layer}",
    **sampling: Any,
) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Patch each (layer, position) of `corrupted` with `clean`'s residual stream, all in
    one trace; the metric's logit difference at step 0 per cell: [layers, positions]."""
    tracer, cells = sweep_trace(client, clean, corrupted, layers, positions, metric, module=module, **sampling)
    tracer.run()
    return heatmap(cells)


def heatmap(cells: list[list[Saved]]) -> np.ndarray[Any, np.dtype[np.float32]]:
    """The logit differences of a run sweep's cells (their step-0 reads): [layers, positions]."""
    out = np.empty((len(cells), len(cells[0]) if cells else 0), dtype=np.float32)
    for i, row in enumerate(cells):
        for j, saved in enumerate(row):
            logits = saved[0]
            out[i, j] = logits[0] - logits[1]
    return out


__all__ = ["Metric", "heatmap", "sweep", "sweep_trace"]
