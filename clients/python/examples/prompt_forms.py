"""Prompt forms: a string, token ids, a tokenizer's output dict, vLLM's prompt dicts."""

import tracewire
from _target import target

client = tracewire.Client(target())
ids = client.tokenizer("The capital of France is")["input_ids"]
with client.trace(temperature=0.0, max_tokens=4) as tracer:
    with tracer.invoke(ids) as a:
        pass
    with tracer.invoke({"prompt_token_ids": ids}) as b:  # vLLM's TokensPrompt
        pass
print(a.result.outputs[0].text == b.result.outputs[0].text, repr(a.result.outputs[0].text))
