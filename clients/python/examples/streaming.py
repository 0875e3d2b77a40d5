"""Streaming: each step as the engine makes it, with the reads of that step."""

import math

import tracewire
from _target import target

client = tracewire.Client(target())
tracer = client.trace("Once upon a time", temperature=0.0, max_tokens=12)
tracer.all().logprobs(top_k=2).save("lp")
for step in client.stream_trace(tracer):
    lp = step.values["lp"]
    print(step.step, repr(step.text), round(math.exp(lp.logprob), 3))
print(repr(tracer.result.outputs[0].text))
