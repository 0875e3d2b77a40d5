"""A stand-in for vLLM's model runner and sampler, as tracewire's worker hooks see
them, to drive the real hooks without an engine: for cases vLLM cannot be made to
produce (a failure inside the hooks' own bookkeeping, chosen row layouts) and for
bench/hooks.py. End-to-end behaviour is tested against the real engine elsewhere."""

from __future__ import annotations

import types

import torch
from tracewire_server.shared import plan as P
from tracewire_server.shared import sidechannel


def request(blob: bytes) -> types.SimpleNamespace:
    """A request as the runner holds it, its plan bytes in extra_args."""
    params = types.SimpleNamespace(extra_args={P.EXTRA_ARGS_KEY: blob})
    return types.SimpleNamespace(sampling_params=params, prompt_token_ids=[1, 2])


def runner(requests: dict[str, types.SimpleNamespace]) -> types.SimpleNamespace:
    """A CPU model runner whose batch holds `requests` in order (reassign
    `input_batch.req_ids` to change the batch)."""
    return types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=list(requests)), requests=requests,
        device=torch.device("cpu"), discard_request_mask=None,
        model_config=types.SimpleNamespace(enforce_eager=False),
    )


class Sampler:
    """vLLM's sampler as the hooks see it: forward calls apply_logits_processors
    (which does nothing here) and draws greedily."""

    def forward(self, logits: torch.Tensor, metadata: object) -> types.SimpleNamespace:
        logits = self.apply_logits_processors(logits)
        return types.SimpleNamespace(sampled_token_ids=logits.argmax(-1, keepdim=True))

    def apply_logits_processors(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class Sender:
    """Keeps the step messages a frontend would receive."""

    def __init__(self) -> None:
        self.batches: list[sidechannel.StepBatch] = []

    def send(self, batch: sidechannel.StepBatch) -> None:
        self.batches.append(batch)


def records(batch: sidechannel.StepBatch) -> list[sidechannel.StepRecord]:
    """Every record of a step message as the server resolves it (blocks' too)."""
    blocks = [block.record(j, batch.columns) for block in batch.blocks for j in range(len(block.keys))]
    return [*(sidechannel.resolve(r, batch.columns) for r in batch.records), *blocks]
