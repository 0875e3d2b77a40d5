"""The served model's tokenizer, through the Tokenize / Detokenize RPCs: the same requests
(rpcs.py) sent through a client's blocking or awaited unary call."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

from . import rpcs
from .rpcs import Rpc

T = TypeVar("T")


class Unary(Protocol):
    """A client's blocking unary call: send `rpc`, return its decoded answer."""

    def __call__(self, rpc: Rpc[T]) -> T: ...


class AwaitedUnary(Protocol):
    """A client's awaited unary call."""

    def __call__(self, rpc: Rpc[T]) -> Awaitable[T]: ...


class RemoteTokenizer:
    """encode / decode / __call__ like a Hugging Face tokenizer, served remotely (decode keeps
    special tokens unless skip_special_tokens=True, as Hugging Face does)."""

    def __init__(self, call: Unary) -> None:
        self._call = call

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._call(rpcs.tokenize(text, add_special_tokens))

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._call(rpcs.detokenize(token_ids, skip_special_tokens))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """A tokenizer's output dict: {"input_ids": [...], "attention_mask": [...]}."""
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}


class AsyncTokenizer:
    """encode / decode through the RPCs, awaited."""

    def __init__(self, call: AwaitedUnary) -> None:
        self._call = call

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._call(rpcs.tokenize(text, add_special_tokens))

    async def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        return await self._call(rpcs.detokenize(token_ids, skip_special_tokens))
