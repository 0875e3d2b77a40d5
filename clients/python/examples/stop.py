"""Stopping early: the request ends at that step (its token is kept); what was read before
it comes back. Greedy "Once upon a time" runs on for well over 32 tokens, so it is the stop
at step 2 that ends it, after three tokens (finish_reason "stop", not "length")."""

import tracewire
from _target import target

client = tracewire.Client(target())
with client.trace("Once upon a time", temperature=0.0, max_tokens=32) as tracer:
    ids = tracer.all().samples.save()  # open selector: no warning for the steps the stop cut off
    tracer.iter[2].stop()
out = tracer.result.outputs[0]
print(list(ids), repr(out.text), out.finish_reason)  # [441, 985, 276] ' there was a' stop
