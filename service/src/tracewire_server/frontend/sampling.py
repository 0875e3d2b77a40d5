"""tracewire.v1.SamplingParams -> keyword arguments for vllm.SamplingParams.

Checks what vLLM would reject (or silently misread) and names the field; the
keyword dict it returns is handed to the engine adapter unchanged.
"""

from __future__ import annotations

import math
from typing import Any

from tracewire.v1 import sampling_pb2

from ..shared.limits import ModelLimits
from .errors import InvalidArgument

# Scalar fields copied as they are when set (proto3 `optional`).
_SCALARS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)
DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default

_FLOATS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)


def to_vllm_kwargs(
    params: sampling_pb2.SamplingParams, limits: ModelLimits, field: str
) -> dict[str, Any]:
    """Validated keyword arguments for vllm.SamplingParams; `field` prefixes errors."""
    kw: dict[str, Any] = {name: getattr(params, name) for name in _SCALARS if params.HasField(name)}
    for name in _FLOATS:
        if name in kw and not math.isfinite(kw[name]):
            raise InvalidArgument(f"{field}.{name}", "must be a finite number")
    _check_ranges(kw, limits, field)

    if params.stop:
        if any(s == "" for s in params.stop):
            raise InvalidArgument(f"{field}.stop", "stop strings must not be empty")
        kw["stop"] = list(params.stop)
    if params.stop_token_ids:
        check_token_ids(params.stop_token_ids, limits, f"{field}.stop_token_ids")
        kw["stop_token_ids"] = list(params.stop_token_ids)
    if params.bad_words:
        kw["bad_words"] = list(params.bad_words)
    if params.logit_bias:
        check_token_ids(params.logit_bias.keys(), limits, f"{field}.logit_bias")
        for token, bias in params.logit_bias.items():
            if not math.isfinite(bias):
                raise InvalidArgument(f"{field}.logit_bias[{token}]", "must be a finite number")
        kw["logit_bias"] = dict(params.logit_bias)
    if params.allowed_token_ids:
        check_token_ids(params.allowed_token_ids, limits, f"{field}.allowed_token_ids")
        kw["allowed_token_ids"] = list(params.allowed_token_ids)
    return kw


def _check_ranges(kw: dict[str, Any], limits: ModelLimits, field: str) -> None:
    def bad(name: str, why: str) -> InvalidArgument:
        return InvalidArgument(f"{field}.{name}", f"{why}, got {kw[name]!r}")

    if kw.get("n", 1) < 1:
        raise bad("n", "must be >= 1")
    if kw.get("temperature", 1.0) < 0:
        raise bad("temperature", "must be >= 0")
    if not 0 < kw.get("top_p", 1.0) <= 1:
        raise bad("top_p", "must be in (0, 1]")
    if kw.get("top_k", 0) < -1:
        raise bad("top_k", "must be -1, 0 (disabled) or >= 1")
    if not 0 <= kw.get("min_p", 0.0) <= 1:
        raise bad("min_p", "must be in [0, 1]")
    if not -2 <= kw.get("presence_penalty", 0.0) <= 2:
        raise bad("presence_penalty", "must be in [-2, 2]")
    if not -2 <= kw.get("frequency_penalty", 0.0) <= 2:
        raise bad("frequency_penalty", "must be in [-2, 2]")
    if kw.get("repetition_penalty", 1.0) <= 0:
        raise bad("repetition_penalty", "must be > 0")
    if kw.get("max_tokens", 1) < 1:
        raise bad("max_tokens", "must be >= 1")
    if kw.get("min_tokens", 0) < 0:
        raise bad("min_tokens", "must be >= 0")
    if "max_tokens" in kw and kw.get("min_tokens", 0) > kw["max_tokens"]:
        raise bad("min_tokens", f"must be <= max_tokens ({kw['max_tokens']})")
    for name in ("logprobs", "prompt_logprobs"):
        if name not in kw:
            continue
        value, cap = kw[name], limits.max_logprobs
        if value < -1:
            raise bad(name, "must be -1 (whole vocabulary) or >= 0")
        if cap != -1 and (value == -1 or value > cap):
            raise bad(name, f"must be <= the server's max_logprobs ({cap})")


def check_token_ids(ids: Any, limits: ModelLimits, field: str) -> None:
    """Every id in the vocabulary; the error names `field[i]`."""
    for i, token in enumerate(ids):
        if not 0 <= token < limits.vocab_size:
            raise InvalidArgument(
                f"{field}[{i}]", f"token id {token} is outside the vocabulary [0, {limits.vocab_size})"
            )


def fit_max_tokens(
    kw: dict[str, Any], prompt_len: int, limits: ModelLimits, field: str, prompt_field: str
) -> dict[str, Any]:
    """`kw` for a prompt of `prompt_len` tokens: prompt + max_tokens must fit in
    max_model_len. vLLM's engine would accept more and end the sequence at the model's
    length with finish_reason "length", as if max_tokens had been reached: a generation
    shorter than asked for, with nothing saying why. So an explicit max_tokens that does
    not fit is refused, naming the field it came from (`field`); an unset one gets
    vLLM's default of 16 or, when the prompt leaves fewer, what it leaves (as vLLM's
    OpenAI server does)."""
    room = limits.max_model_len - prompt_len  # >= 1: to_engine_prompt checked the prompt
    if "max_tokens" not in kw:
        return kw if room >= DEFAULT_MAX_TOKENS else {**kw, "max_tokens": room}
    if kw["max_tokens"] > room:
        raise InvalidArgument(
            f"{field}.max_tokens",
            f"{kw['max_tokens']} tokens after the {prompt_len} of {prompt_field} exceed the model's "
            f"max_model_len of {limits.max_model_len}: at most {room} can be generated",
        )
    return kw
