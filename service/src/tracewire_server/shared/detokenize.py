"""Incremental detokenization: the text each new token adds.

The prefix/read-offset scheme vLLM uses, so a token that ends inside a multi-byte
character adds "" and the character arrives with the token that completes it.
`DecodeStreamTracker` runs it in the Rust tokenizer (one call per token), primed
with the prompt as vLLM primes its own detokenizer, so the deltas join into the
text vLLM returns; `TextTracker` is the same scheme in Python over any decode
function, for tokenizers without a Rust backend.

`text_tracker` picks one of them for a tokenizer. The server streams each step's text
delta from it, and the worker hooks decide text conditions on the same deltas, so
a condition sees exactly the text the client is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenizers.decoders import DecodeStream


class TextTracker:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""  # decode(ids[prefix:read]), kept until the offsets move

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(self._prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(self._prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix : self._read])
            return delta
        return ""


class DecodeStreamTracker:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer  # a tokenizers.Tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tokenizer, token_id) or ""
        except Exception:  # noqa: BLE001
            # The stream's state breaks on some non-monotonic byte output (as vLLM's
            # does: vllm#17448); vLLM starts a fresh one there, and so do we.
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            return self._stream.step(self._tokenizer, token_id) or ""


def fast_decoder(tokenizer: Any) -> Any | None:
    """The tokenizer's Rust backend when decoding with it is all Hugging Face's decode
    would do (no clean-up of spaces), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def text_tracker(
    tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool
) -> TextTracker | DecodeStreamTracker:
    """Per generated token (`.add(id)`), the text it adds to the output."""
    fast = fast_decoder(tokenizer)
    if fast is None:
        return TextTracker(lambda ids: str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)))
    return DecodeStreamTracker(fast, prompt_ids, skip_special_tokens)
