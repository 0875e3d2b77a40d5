"""A failure in the worker hooks' own bookkeeping never breaks vLLM's step: the
sampler still returns vLLM's draw, and the traced requests of that batch fail with
the error on their next record. (The hooks are driven here with a stand-in for
vLLM's model runner and sampler: the failure is one vLLM cannot be made to cause.)"""

from __future__ import annotations

import torch
from tracewire_server.shared import plan as P
from tracewire_server.worker.standin import Sampler, Sender, hooks_over, records, request, runner

VOCAB = 50
TOP = P.Op("top", P.StepSet(), None, P.ReadLogits("raw", top_k=3))


def test_a_bookkeeping_failure_fails_the_batch_traces_not_the_step():
    good = P.SequencePlan(key="good", ops=(TOP,))
    requests = {"r0": request(P.encode_plan(good))}
    engine = runner(requests)
    planned = hooks_over(engine)
    sender = planned.senders[0] = Sender()
    sampler = Sampler()
    planned.install(sampler)
    logits = torch.randn(2, VOCAB)

    out = sampler.forward(logits[:1], None)  # step 0 of r0: an ordinary record
    (first,) = records(sender.batches[-1])
    assert first.key == "good" and first.error is None and first.values["top"].values.shape == (3,)

    # A request whose plan cannot be decoded joins the batch: the hooks fail inside.
    requests["r1"] = request(b"\xc1 not msgpack")
    engine.input_batch.req_ids = ["r0", "r1"]
    out = sampler.forward(logits, None)
    assert out.sampled_token_ids.flatten().tolist() == logits.argmax(-1).tolist()  # vLLM's draw
    sent = len(sender.batches)

    # Next step: r0's trace hears why (r1 is still undecodable; the step still runs).
    out = sampler.forward(logits, None)
    assert out.sampled_token_ids.flatten().tolist() == logits.argmax(-1).tolist()
    del requests["r1"]
    engine.input_batch.req_ids = ["r0"]
    sampler.forward(logits[:1], None)
    later = [r for b in sender.batches[sent:] for r in records(b)]
    # (step 2: the engine drew step 1 without the hooks; the error is reported at step 2)
    assert later and later[0].key == "good" and later[0].step == 2
    assert "tracewire hooks failed before the draw" in (later[0].error or "")
