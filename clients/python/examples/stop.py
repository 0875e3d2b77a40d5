"""Stopping early: the request ends at that step; what was read before it comes back."""

import tracewire
from _target import target

client = tracewire.Client(target())
with client.trace("The capital of France is", temperature=0.0, max_tokens=32) as tracer:
    ids = tracer.iter[:32].samples.save()
    tracer.iter[2].stop()
print(list(ids), repr(client.tokenizer.decode(list(ids))))
