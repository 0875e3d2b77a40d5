"""Several prompts: one per invoke, batched by the engine; an invoke's keywords override the trace's."""

import tracewire
from _target import target

client = tracewire.Client(target())
with client.trace(max_tokens=8) as tracer:
    with tracer.invoke("The capital of France is", temperature=0.0) as cold:
        pass
    with tracer.invoke("The capital of France is", temperature=1.5, seed=1) as hot:
        pass
print(repr(cold.result.outputs[0].text), repr(hot.result.outputs[0].text))
