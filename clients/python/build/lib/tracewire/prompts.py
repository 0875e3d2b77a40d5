"""The prompt forms researchers pass -> tracewire.v1.Prompt.

Accepted: a string; a list of token ids; a tokenizer's {"input_ids": ...,
"attention_mask": ...} dict (one sequence); vLLM's TextPrompt {"prompt": str}
and TokensPrompt {"prompt_token_ids": [...]} dicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

from .errors import InvalidArgument
from .v1 import prompt_pb2

PromptLike = Union[str, Sequence[int], Mapping[str, Any]]


def to_prompt(prompt: Any) -> prompt_pb2.Prompt:
    if isinstance(prompt, str):
        return prompt_pb2.Prompt(text=prompt)
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return _ids(prompt["prompt_token_ids"])
        if "input_ids" in prompt:
            ids = prompt["input_ids"]
            ids = ids.tolist() if hasattr(ids, "tolist") else ids
            if ids and isinstance(ids[0], (list, tuple)):
                if len(ids) != 1:
                    raise InvalidArgument(
                        f"a tokenizer batch of {len(ids)} sequences is several prompts: "
                        "pass one sequence per prompt"
                    )
                ids = ids[0]
            return _ids(ids)
        if "prompt" in prompt:
            return to_prompt(str(prompt["prompt"]))
        raise InvalidArgument(
            "a prompt dict needs 'prompt' (TextPrompt), 'prompt_token_ids' (TokensPrompt) "
            f"or 'input_ids' (a tokenizer's output); got keys {sorted(prompt)}"
        )
    if hasattr(prompt, "tolist"):  # numpy / torch 1-D array of ids
        prompt = prompt.tolist()
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        return _ids(prompt)
    raise InvalidArgument(
        f"unsupported prompt of type {type(prompt).__name__}: pass a string, a list of "
        "token ids, a tokenizer's output dict or a vLLM prompt dict"
    )


def _ids(ids: Sequence[Any]) -> prompt_pb2.Prompt:
    return prompt_pb2.Prompt(token_ids=prompt_pb2.TokenIds(ids=[int(t) for t in ids]))
