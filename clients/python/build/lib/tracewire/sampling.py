"""Sampling keywords (vLLM's SamplingParams names) -> tracewire.v1.SamplingParams."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InvalidArgument
from .v1 import sampling_pb2

#: Every keyword the service accepts, as vLLM's SamplingParams names it.
SAMPLING_KEYWORDS: tuple[str, ...] = tuple(
    f.name for f in sampling_pb2.SamplingParams.DESCRIPTOR.fields
)


def check_keywords(keywords: Mapping[str, Any]) -> None:
    """Raise InvalidArgument for a keyword vLLM's SamplingParams does not carry here."""
    for name in keywords:
        if name not in SAMPLING_KEYWORDS:
            close = difflib.get_close_matches(name, SAMPLING_KEYWORDS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise InvalidArgument(
                f"unknown sampling parameter {name!r}.{hint} "
                f"Valid ones: {', '.join(SAMPLING_KEYWORDS)}",
                field=name,
            )


def sampling_params(**keywords: Any) -> sampling_pb2.SamplingParams:
    """Build the message from vLLM-style keywords; None means unset."""
    check_keywords(keywords)
    msg = sampling_pb2.SamplingParams()
    for name, value in keywords.items():
        if value is None:
            continue
        if name == "logit_bias":
            msg.logit_bias.update({int(k): float(v) for k, v in dict(value).items()})
        elif name == "stop":
            msg.stop.extend([value] if isinstance(value, str) else list(value))
        elif name in ("stop_token_ids", "allowed_token_ids"):
            getattr(msg, name).extend(int(t) for t in _sequence(name, value))
        elif name == "bad_words":
            msg.bad_words.extend(_sequence(name, value))
        else:
            try:
                setattr(msg, name, value)
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"sampling parameter {name}={value!r}: {e}", field=name) from None
    return msg


def _sequence(name: str, value: Any) -> Sequence[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidArgument(f"sampling parameter {name} must be a list", field=name)
    return value
