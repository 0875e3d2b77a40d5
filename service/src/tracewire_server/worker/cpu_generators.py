"""Seeded requests on a CPU engine survive a chunked prefill.

When a row of the batch is still in its (chunked) prefill, vLLM throws its sampled token
away and rewinds the request's seeded generator as if it had not drawn:
`gen.set_offset(gen.get_offset() - 4)` (gpu_model_runner._bookkeeping_sync), Philox
arithmetic only CUDA generators have. A CPU generator raises "CPU Generator does not use
offset" there, inside the engine's step: the engine dies, and every request with it. Any
client can cause it: a `seed` with temperature > 0 and a prompt longer than what one step
schedules of it (--max-num-batched-tokens, or less under load).

On a CPU device the runner's `sample_tokens` leaves the generators of the rows it will
discard out of that step (sampling and bookkeeping read the same dict): their rows draw
from the global generator, for a token that is thrown away, and the request's own
generator stays exactly where the rewind would have put it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np


def keep_cpu_generators(runner: Any) -> None:
    """Wrap `runner.sample_tokens` (vLLM's V1 model runner) on a CPU device; elsewhere
    vLLM's rewind works and nothing changes."""
    device = getattr(runner, "device", None)
    if getattr(device, "type", None) != "cpu" or getattr(runner, "_tracewire_cpu_generators", False):
        return
    sample_tokens = runner.sample_tokens

    @functools.wraps(sample_tokens)
    def sample_keeping_generators(*args: Any, **kwargs: Any) -> Any:
        batch = runner.input_batch
        generators: dict[int, Any] = batch.generators
        mask = getattr(runner, "discard_request_mask", None)
        if not generators or mask is None:
            return sample_tokens(*args, **kwargs)
        rows = np.nonzero(mask.np[: batch.num_reqs])[0]
        held = {int(i): generators.pop(int(i)) for i in rows if int(i) in generators}
        try:
            return sample_tokens(*args, **kwargs)
        finally:
            generators.update(held)

    runner.sample_tokens = sample_keeping_generators
    runner._tracewire_cpu_generators = True
