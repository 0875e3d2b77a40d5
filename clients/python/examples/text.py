"""Text: a trace's result is vLLM's RequestOutput for the request."""

import tracewire
from _target import target

client = tracewire.Client(target())
with client.trace("The capital of France is", temperature=0.0, max_tokens=32) as tracer:
    pass
out = tracer.result
print(out.outputs[0].text)
print(out.outputs[0].token_ids[:8], out.outputs[0].finish_reason)
