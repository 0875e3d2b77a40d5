"""Incremental detokenization: the text each new token adds.

The same prefix/read-offset scheme vLLM uses, so a token that ends inside a
multi-byte character adds "" and the character arrives with the token that
completes it. Each step decodes only a short window, not the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable


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
