"""Per token, with logprobs: ask the sampler for them; they ride the finished request."""

import tracewire
from _target import target

client = tracewire.Client(target())
with client.trace("The capital of France is", temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True) as tracer:
    pass
out = tracer.result
for token_id, top in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
    print(repr(client.tokenizer.decode(token_id)), [(lp.decoded_token, round(lp.logprob, 2)) for lp in top.values()])
