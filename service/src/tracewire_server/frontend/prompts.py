"""tracewire.v1.Prompt -> the token ids the engine runs, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tracewire.v1 import prompt_pb2

from ..shared.limits import ModelLimits
from .errors import InvalidArgument
from .sampling import check_token_ids


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class EnginePrompt:
    """A prompt as the engine gets it: ids always, the text when there was one."""

    token_ids: list[int]
    text: str | None


def to_engine_prompt(
    prompt: prompt_pb2.Prompt, encoder: Encoder, limits: ModelLimits, field: str
) -> EnginePrompt:
    kind = prompt.WhichOneof("kind")
    if kind == "text":
        if not prompt.text:
            raise InvalidArgument(f"{field}.text", "prompt text must not be empty")
        ids = encoder.encode(prompt.text)
        text: str | None = prompt.text
        if not ids:
            raise InvalidArgument(f"{field}.text", "prompt text tokenizes to no tokens")
    elif kind == "token_ids":
        ids = list(prompt.token_ids.ids)
        text = None
        if not ids:
            raise InvalidArgument(f"{field}.token_ids.ids", "prompt token ids must not be empty")
        check_token_ids(ids, limits, f"{field}.token_ids.ids")
    else:
        raise InvalidArgument(field, "prompt is empty: set text or token_ids")
    if len(ids) >= limits.max_model_len:
        raise InvalidArgument(
            field,
            f"prompt is {len(ids)} tokens; max_model_len is {limits.max_model_len} "
            "and at least one token must be generated",
        )
    return EnginePrompt(token_ids=ids, text=text)
