"""Several sequences: n=k fans one prompt out; a saved read comes back per sequence."""

import tracewire
from _target import target

client = tracewire.Client(target())
with client.trace("The capital of France is", temperature=1.0, seed=0, max_tokens=8, n=3) as tracer:
    first = tracer.iter[0].samples.save()
print([seq.value for seq in first])
print([c.text for c in tracer.result.outputs])
