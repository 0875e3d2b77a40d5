"""Conditional interventions: stop at the first period; force " Berlin" only where " Paris" would win."""

import tracewire as tw
from _target import target

client = tw.Client(target())
period = client.tokenizer.encode(".")[0]
paris, berlin = client.tokenizer.encode(" Paris")[0], client.tokenizer.encode(" Berlin")[0]

with client.trace("The capital of France is", temperature=0.0, max_tokens=32, ignore_eos=True) as tracer:
    tracer.stop(when=tw.sampled_in(period))
print(repr(tracer.result.outputs[0].text))

with client.trace(temperature=0.0, max_tokens=4) as tracer:
    for prompt in ("The capital of France is", "The capital of Japan is"):
        with tracer.invoke(prompt) as invoke:
            invoke.all().when(tw.argmax_in(paris)).samples = berlin
print([inv.result.outputs[0].text for inv in tracer.invokes])
