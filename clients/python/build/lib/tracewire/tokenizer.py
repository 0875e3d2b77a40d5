"""The served model's tokenizer, through the Tokenize / Detokenize RPCs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .v1 import service_pb2


class RemoteTokenizer:
    """encode / decode / __call__ like a Hugging Face tokenizer, served remotely (decode keeps
    special tokens unless skip_special_tokens=True, as Hugging Face does)."""

    def __init__(self, call: Callable[[str, Any], Any]) -> None:
        self._call = call

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        response = self._call(
            "Tokenize",
            service_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
        )
        return list(response.token_ids)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        response = self._call(
            "Detokenize",
            service_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens),
        )
        return str(response.text)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """A tokenizer's output dict: {"input_ids": [...], "attention_mask": [...]}."""
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}
