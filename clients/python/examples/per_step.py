"""Per step, the logits and the draw: the [vocab] row the sampler draws from, and what it drew."""

import numpy as np
import tracewire
from _target import target

client = tracewire.Client(target())
with client.trace("The capital of France is", temperature=0.8, top_p=0.95, seed=0, max_tokens=6) as tracer:
    logits = tracer.all().logits.save()
    samples = tracer.all().samples.save()

for step, row, drawn in zip(logits.steps, logits, samples, strict=True):
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    print(step, repr(client.tokenizer.decode(drawn)), round(float(probs[drawn]), 3),
          "greedy:", repr(client.tokenizer.decode(int(probs.argmax()))))
