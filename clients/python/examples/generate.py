"""Without a block: a plain run over a list of prompts, nothing traced."""

import tracewire
from _target import target

client = tracewire.Client(target())
outputs = client.generate(["The capital of France is", "The capital of Japan is"], temperature=0.0, max_tokens=8)
print([o.outputs[0].text for o in outputs])
