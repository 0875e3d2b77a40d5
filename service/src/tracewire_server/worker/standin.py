"""A stand-in for vLLM's model runner and sampler, to drive the real hooks without an engine.

For cases vLLM cannot be made to produce (a failure inside the hooks' own bookkeeping,
chosen row layouts, hundreds of requests coming and going) and for bench/hooks.py;
end-to-end behaviour is tested against the real engine elsewhere. Nothing in the
server imports it.

It fakes vLLM's runner (the attributes runner.py reads), not runner.py's RunnerView:
the hooks are driven through the real RunnerView, so the unit tests cover runner.py
too, and bench/hooks.py times the hot path as it runs inside vLLM, the view's
per-step reads included. The price: porting runner.py to a new vLLM means changing
the attribute names here to match. It lives in the package, not in tests/, so that
the tests and the benchmark import it the same way, with no path set up for it.
"""

from __future__ import annotations

import types

import torch

from ..shared import plan as P
from ..shared import sidechannel
from .hooks import PlanHooks
from .runner import RunnerView


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


def give_model(engine: types.SimpleNamespace, layers: int, hidden: int, vocab: int) -> None:
    """Give a stand-in runner a model the module hooks can look at: `layers` decoder
    layers (no attention), the final norm and lm_head (the logit lens applies them)."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(layers))
    model.model.norm = torch.nn.RMSNorm(hidden)
    model.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    engine.model = model
    engine.model_config.get_vocab_size = lambda: vocab


def hooks_over(engine: types.SimpleNamespace, fault_injection: bool = False) -> PlanHooks:
    """The real hooks over `engine` (a stand-in runner), the sampler not wrapped yet."""
    return PlanHooks(RunnerView(engine), fault_injection)


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
