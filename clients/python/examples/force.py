"""Forcing the draw: the engine continues from the forced token."""

import tracewire
from _target import target

client = tracewire.Client(target())
berlin = client.tokenizer.encode(" Berlin")[0]
with client.trace("The capital of France is", temperature=0.0, max_tokens=8) as tracer:
    tracer.iter[0].samples = berlin
print(tracer.result.outputs[0].text)
