"""A failure in the worker hooks' own bookkeeping never breaks vLLM's step: the
sampler still returns vLLM's draw, and the traced requests of that batch fail with
the error on their next record. (The hooks are driven here with a stand-in for
vLLM's model runner and sampler: the failure is one vLLM cannot be made to cause.)"""

from __future__ import annotations

import types

import torch
from tracewire_server import plan as P
from tracewire_server import worker_hooks as W

VOCAB = 50
TOP = P.Op("top", P.StepSet(), None, P.ReadLogits("raw", top_k=3))


def _request(blob: bytes) -> types.SimpleNamespace:
    params = types.SimpleNamespace(extra_args={P.EXTRA_ARGS_KEY: blob})
    return types.SimpleNamespace(sampling_params=params, prompt_token_ids=[1, 2])


class _Sender:
    def __init__(self) -> None:
        self.batches: list[W.StepBatch] = []

    def send(self, batch: W.StepBatch) -> None:
        self.batches.append(batch)


def _records(batch: W.StepBatch) -> list[W.StepRecord]:
    """Every record of a step message, blocks' records as the server sees them."""
    blocks = [block.record(j, batch.columns) for block in batch.blocks for j in range(len(block.keys))]
    return [*batch.records, *blocks]


class _Sampler:
    """vLLM's sampler as the hooks see it: forward calls apply_logits_processors."""

    def forward(self, logits: torch.Tensor, metadata: object) -> types.SimpleNamespace:
        logits = self.apply_logits_processors(logits)
        return types.SimpleNamespace(sampled_token_ids=logits.argmax(-1, keepdim=True))

    def apply_logits_processors(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def test_a_bookkeeping_failure_fails_the_batch_traces_not_the_step():
    good = P.SequencePlan(key="good", ops=(TOP,))
    requests = {"r0": _request(P.encode_plan(good))}
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=["r0"]), requests=requests,
        device=torch.device("cpu"), discard_request_mask=None,
        model_config=types.SimpleNamespace(enforce_eager=False),
    )
    hooks = W.PlanHooks(runner, fault_injection=False)
    sender = hooks.senders[0] = _Sender()
    sampler = _Sampler()
    hooks.install(sampler)
    logits = torch.randn(2, VOCAB)

    out = sampler.forward(logits[:1], None)  # step 0 of r0: an ordinary record
    (first,) = _records(sender.batches[-1])
    assert first.key == "good" and first.error is None and first.values["top"].values.shape == (3,)

    # A request whose plan cannot be decoded joins the batch: the hooks fail inside.
    requests["r1"] = _request(b"\xc1 not msgpack")
    runner.input_batch.req_ids = ["r0", "r1"]
    out = sampler.forward(logits, None)
    assert out.sampled_token_ids.flatten().tolist() == logits.argmax(-1).tolist()  # vLLM's draw
    sent = len(sender.batches)

    # Next step: r0's trace hears why (r1 is still undecodable; the step still runs).
    out = sampler.forward(logits, None)
    assert out.sampled_token_ids.flatten().tolist() == logits.argmax(-1).tolist()
    del requests["r1"]
    runner.input_batch.req_ids = ["r0"]
    sampler.forward(logits[:1], None)
    records = [r for b in sender.batches[sent:] for r in _records(b)]
    # (step 2: the engine drew step 1 without the hooks; the error is reported at step 2)
    assert records and records[0].key == "good" and records[0].step == 2
    assert "tracewire hooks failed before the draw" in (records[0].error or "")
