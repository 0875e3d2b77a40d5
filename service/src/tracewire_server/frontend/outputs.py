"""vLLM RequestOutput -> tracewire.v1.RequestOutput.

Works on vLLM's output objects by attribute only, so it does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tracewire.v1 import output_pb2

_FINISH_REASONS = {
    None: output_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": output_pb2.FINISH_REASON_STOP,
    "length": output_pb2.FINISH_REASON_LENGTH,
    "abort": output_pb2.FINISH_REASON_ABORT,
}


def request_output(
    out: Any, prompt_text: str | None, *, include_prompt: bool = True
) -> output_pb2.RequestOutput:
    """Convert one vLLM RequestOutput (cumulative or delta).

    `include_prompt=False` leaves out the prompt fields (streamed updates after
    the first one).
    """
    msg = output_pb2.RequestOutput(
        request_id=out.request_id,
        finished=bool(out.finished),
        num_cached_tokens=int(getattr(out, "num_cached_tokens", None) or 0),
    )
    if include_prompt:
        if prompt_text is not None:
            msg.prompt = prompt_text
        msg.prompt_token_ids.extend(out.prompt_token_ids or ())
        if out.prompt_logprobs is not None:
            msg.prompt_logprobs.extend(positions(out.prompt_logprobs))
    msg.outputs.extend(completion_output(c) for c in out.outputs)
    return msg


def completion_output(c: Any) -> output_pb2.CompletionOutput:
    msg = output_pb2.CompletionOutput(
        index=c.index,
        text=c.text,
        token_ids=list(c.token_ids),
        finish_reason=finish_reason(c.finish_reason),
    )
    if c.cumulative_logprob is not None:
        msg.cumulative_logprob = c.cumulative_logprob
    if c.logprobs is not None:
        msg.logprobs.extend(positions(c.logprobs))
    set_stop_reason(msg, c.stop_reason)
    return msg


def finish_reason(reason: str | None) -> output_pb2.FinishReason.ValueType:
    return _FINISH_REASONS.get(reason, output_pb2.FINISH_REASON_UNSPECIFIED)


def set_stop_reason(msg: output_pb2.CompletionOutput, reason: int | str | None) -> None:
    """vLLM reports the stop token id or stop string; None for EOS / length."""
    if isinstance(reason, int):
        msg.stop_token_id = reason
    elif isinstance(reason, str):
        msg.stop_string = reason


def positions(
    per_position: Iterable[Mapping[int, Any] | None],
) -> list[output_pb2.PositionLogprobs]:
    result = []
    for position in per_position:
        entries = []
        for token_id, lp in (position or {}).items():
            entries.append(
                output_pb2.Logprob(
                    token_id=token_id,
                    logprob=lp.logprob,
                    rank=lp.rank if lp.rank is not None else 0,
                    decoded_token=lp.decoded_token or "",
                )
            )
        result.append(output_pb2.PositionLogprobs(entries=entries))
    return result
