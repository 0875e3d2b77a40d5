"""Results shaped like vLLM's RequestOutput / CompletionOutput / Logprob."""

from __future__ import annotations

from dataclasses import dataclass, field

from .v1 import output_pb2

_FINISH_REASONS: dict[int, str | None] = {
    output_pb2.FINISH_REASON_UNSPECIFIED: None,
    output_pb2.FINISH_REASON_STOP: "stop",
    output_pb2.FINISH_REASON_LENGTH: "length",
    output_pb2.FINISH_REASON_ABORT: "abort",
}

#: vLLM's per-position logprobs: {token_id: Logprob}, the drawn token first
#: when it is not among the top ones.
PositionLogprobs = dict[int, "Logprob"]


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None
    decoded_token: str | None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    #: One dict per generated token, or None when logprobs were not asked for.
    logprobs: list[PositionLogprobs] | None
    #: "stop", "length", "abort", or None while running.
    finish_reason: str | None
    #: The stop token id or stop string that ended it, else None.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    #: One entry per prompt token (the first is None), or None when not asked for.
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0


def request_output(msg: output_pb2.RequestOutput) -> RequestOutput:
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    if len(msg.prompt_logprobs):
        prompt_logprobs = [_position(p) or None for p in msg.prompt_logprobs]
    return RequestOutput(
        request_id=msg.request_id,
        prompt=msg.prompt if msg.HasField("prompt") else None,
        prompt_token_ids=list(msg.prompt_token_ids),
        prompt_logprobs=prompt_logprobs,
        outputs=[completion_output(c) for c in msg.outputs],
        finished=msg.finished,
        num_cached_tokens=msg.num_cached_tokens,
    )


def completion_output(msg: output_pb2.CompletionOutput) -> CompletionOutput:
    stop_reason: int | str | None = None
    which = msg.WhichOneof("stop_reason")
    if which == "stop_token_id":
        stop_reason = msg.stop_token_id
    elif which == "stop_string":
        stop_reason = msg.stop_string
    return CompletionOutput(
        index=msg.index,
        text=msg.text,
        token_ids=list(msg.token_ids),
        cumulative_logprob=(
            msg.cumulative_logprob if msg.HasField("cumulative_logprob") else None
        ),
        logprobs=[_position(p) for p in msg.logprobs] if len(msg.logprobs) else None,
        finish_reason=_FINISH_REASONS.get(msg.finish_reason),
        stop_reason=stop_reason,
    )


def _position(msg: output_pb2.PositionLogprobs) -> PositionLogprobs:
    return {
        e.token_id: Logprob(logprob=e.logprob, rank=e.rank or None, decoded_token=e.decoded_token)
        for e in msg.entries
    }
