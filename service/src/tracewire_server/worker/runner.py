"""vLLM's model runner as the worker hooks see it: the only code touching vLLM's worker internals.

The hooks read the runner's batch (which request each logits row belongs to, how far
each one's prompt has run), wrap its sampler and its `_model_forward`, and hook its
model's modules. None of that is vLLM's public API, and each vLLM version moves some
of it. So it is read here and nowhere else: a vLLM upgrade means porting this file,
as frontend/vllm_compat.py is the server side's. Everything it hands out is plain
data (lists, numpy arrays, ints) or the torch objects the hooks wrap.

Only what runs per engine step is here, read per step, never cached: vLLM replaces
some of these objects between steps (the batch's req_ids list, the masks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, KeysView
from typing import Any, NamedTuple

import numpy as np
import torch

from ..shared import plan as P
from ..shared import read_buffers, steering


def _held(module: torch.nn.Module) -> bool:
    """Not vLLM's stand-in for a module another pipeline stage holds."""
    return type(module).__name__ != "PPMissingLayer"


def _groups() -> tuple[Any, Any] | None:
    """vLLM's pipeline and tensor parallel groups of this worker; None outside a distributed
    worker (the hooks' unit tests and bench/hooks.py run a stand-in runner: one stage, one
    rank)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_pp_group(), parallel_state.get_tp_group()


def check_supported(runner: Any) -> None:
    """Refuse runners whose sampler the hooks cannot wrap."""
    sampler = getattr(runner, "sampler", None)
    if not hasattr(runner, "input_batch") or not hasattr(sampler, "apply_logits_processors"):
        raise RuntimeError(  # vLLM's V2 runner (vllm/v1/worker/gpu/) has another sampler
            f"tracewire needs vLLM's V1 model runner, not {type(runner).__module__}; "
            "unset VLLM_USE_V2_MODEL_RUNNER"
        )


class AttentionLayer(NamedTuple):
    """A decoder layer's vLLM `Attention` module and what its weights depend on. The
    model calls it as `module(q, k, v)` with q / k after rotary embedding (and any q / k
    norm): [tokens, num_heads * head_size] / [tokens, num_kv_heads * head_size]."""

    module: torch.nn.Module
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None  # a query sees itself and the sliding_window - 1 keys before it
    soft_cap: float | None  # scaled logits -> soft_cap * tanh(logits / soft_cap)
    unsupported: str  # "": patterns are computed right; else what the layer does that they do not


def _attention_unsupported(attn: Any) -> str:
    """What a vLLM attention module does that a pattern computed from q, k, the scale, the
    causal mask, a sliding window and soft-capping would get wrong ("" when nothing)."""
    from vllm.model_executor.layers.attention import Attention

    impl = getattr(attn, "impl", None)
    if type(attn) is not Attention:  # MLA, encoder-only, chunked-local, static sinks, ...
        return f"its attention is {type(attn).__name__}, not plain decoder attention"
    if str(getattr(attn, "attn_type", "decoder")) not in ("decoder", "AttentionType.DECODER"):
        return f"its attention type is {attn.attn_type}"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi position biases"
    if getattr(attn, "has_sink", False) or getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    if getattr(attn, "kv_sharing_target_layer_name", None) is not None:
        return "keys shared with another layer"
    if getattr(attn, "use_mm_prefix", False):
        return "a bidirectional multimodal prefix"
    if "DualChunk" in type(impl).__name__:
        return "dual-chunk attention"
    return ""


class RunnerView:
    """vLLM's V1 model runner (vllm/v1/worker/gpu_model_runner.py), typed, for the hooks.

    The batch: logits row i (and query span i of the forward pass's flat token rows)
    belongs to request `req_ids[i]`."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner

    # -- the batch, per step -----------------------------------------------------

    @property
    def req_ids(self) -> list[str]:
        """The requests of this step's rows, in row order."""
        return self._runner.input_batch.req_ids  # type: ignore[no-any-return]

    def discarded(self, rows: int) -> np.ndarray | None:
        """Which of the first `rows` rows' samples vLLM throws away (requests still in a
        chunked prefill); None: it keeps them all."""
        mask = getattr(self._runner, "discard_request_mask", None)
        return mask.np[:rows] if mask is not None else None

    def query_starts(self, rows: int) -> np.ndarray:
        """Where each request's flat token rows start in this forward pass, and one past
        the last: `rows + 1` entries."""
        return self._runner.query_start_loc.np[: rows + 1]  # type: ignore[no-any-return]

    def computed_tokens(self, rows: int) -> np.ndarray:
        """Each request's tokens computed before this forward pass (the position of its
        first flat row)."""
        return self._runner.input_batch.num_computed_tokens_cpu[:rows]  # type: ignore[no-any-return]

    # -- requests ----------------------------------------------------------------

    def live(self) -> KeysView[str]:
        """The requests the runner holds now (running or preempted): a live view."""
        return self._runner.requests.keys()  # type: ignore[no-any-return]

    def plan_blob(self, req_id: str) -> bytes | None:
        """The request's tracewire plan as it travelled (SamplingParams.extra_args)."""
        params = getattr(self._runner.requests.get(req_id), "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        return extra.get(P.EXTRA_ARGS_KEY)  # type: ignore[no-any-return]

    def prompt_ids(self, req_id: str) -> list[int]:
        return list(self._runner.requests[req_id].prompt_token_ids or ())

    def output_count(self, req_id: str) -> int:
        """Tokens the request has drawn so far."""
        return len(self._runner.requests[req_id].output_token_ids)

    # -- the engine ----------------------------------------------------------------

    @property
    def device_runs_ahead(self) -> bool:
        """Whether the device runs ahead of the host (a GPU): then the hooks finish steps
        on a thread of their own (worker/collector.py)."""
        device = getattr(self._runner, "device", None)
        return device is None or device.type == "cuda"

    @property
    def device(self) -> torch.device:
        """The device the model's weights live on (dictionaries are loaded there)."""
        return torch.device(getattr(self._runner, "device", "cpu"))

    @property
    def hidden_size(self) -> int:
        return int(self._runner.model_config.get_hidden_size())

    @property
    def eager(self) -> bool:
        """No compiled graphs: Python forward hooks fire."""
        return bool(self._runner.model_config.enforce_eager)

    @property
    def vocab_size(self) -> int:
        return int(self._runner.model_config.get_vocab_size())

    @property
    def sampler(self) -> Any:
        """vLLM's sampler: its `forward` and `apply_logits_processors` are wrapped."""
        return self._runner.sampler

    def steering_tables(self) -> steering.SteeringTables | None:
        """The compiled graph's steering tables (--compiled-steering), if it has them."""
        return steering.find(self._runner.get_model())

    def unit_steering_tables(self) -> steering.UnitTables | None:
        """Its heads' and neurons' write tables (--compiled-unit-steering), if it has them."""
        return steering.find_units(self._runner.get_model())

    def module_steering_tables(self) -> steering.SteeringTables | None:
        """Its other modules' write tables (--compiled-module-steering), if it has them."""
        return steering.find_modules(self._runner.get_model())

    def before_model_forward(self, hook: Callable[[], None]) -> None:
        """Call `hook` on the host before each forward pass (before a compiled graph is
        replayed): wraps the runner's `_model_forward`."""
        original = self._runner._model_forward

        def model_forward(*args: Any, **kw: Any) -> Any:
            hook()
            return original(*args, **kw)

        self._runner._model_forward = model_forward

    def after_model_forward(self, hook: Callable[[], None]) -> None:
        """Call `hook` on the host after each forward pass is launched (a compiled graph
        replayed; on a GPU it may still run: kernels `hook` launches queue after it)."""
        original = self._runner._model_forward

        def model_forward(*args: Any, **kw: Any) -> Any:
            output = original(*args, **kw)
            hook()
            return output

        self._runner._model_forward = model_forward

    def read_buffers(self) -> read_buffers.ReadBuffers | None:
        """The compiled graph's read buffers (--compiled-reads), if it has them."""
        return read_buffers.find(self._runner.get_model())

    def pass_tokens(self, rows: int) -> int:
        """The flat token rows of this forward pass's requests (a CUDA graph may pad more)."""
        return int(self.query_starts(rows)[-1])

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The tokenizer the server decodes with: vLLM's, built from the same model config
        (loaded the first time a trace has a text condition)."""
        try:  # vLLM >= 0.30
            from vllm.tokenizers import cached_tokenizer_from_config
        except ImportError:  # pragma: no cover - vLLM 0.26
            from vllm.transformers_utils.tokenizer import cached_tokenizer_from_config
        return cached_tokenizer_from_config(self._runner.vllm_config.model_config)

    # -- the model (eager engines) -------------------------------------------------

    def on_forward(self, hook: Callable[[], None]) -> None:
        """Call `hook` before each forward pass of the model (eager: it fires)."""
        self._runner.model.register_forward_pre_hook(lambda module, args: hook())

    def modules(self) -> dict[str, torch.nn.Module]:
        """GetModelInfo's module paths -> the modules of a vLLM decoder-only model."""
        inner = self._runner.model.model
        found: dict[str, torch.nn.Module] = {"embed_tokens": inner.embed_tokens, "norm": inner.norm}
        found = {path: module for path, module in found.items() if _held(module)}  # (pipeline stages)
        for i, layer in self.layers():
            found[f"layers.{i}"] = layer
            found[f"layers.{i}.self_attn"] = layer.self_attn
            found[f"layers.{i}.mlp"] = layer.mlp
        return found

    def attention_layers(self) -> dict[int, AttentionLayer]:
        """Each decoder layer's attention module (`layers.L.self_attn.attn`), by layer."""
        found: dict[int, AttentionLayer] = {}
        for i, layer in self.layers():
            attn = getattr(getattr(layer, "self_attn", None), "attn", None)
            if attn is None:
                continue
            impl = getattr(attn, "impl", None)
            window = getattr(attn, "sliding_window", None)
            cap = getattr(impl, "logits_soft_cap", None)  # (backends store "none" as None or 0)
            scale = getattr(impl, "scale", None)  # the backend's, the one it computes with
            unsupported = _attention_unsupported(attn) or ("" if scale is not None else "no scale on its backend")
            found[i] = AttentionLayer(
                module=attn,
                num_heads=int(attn.num_heads),
                num_kv_heads=int(attn.num_kv_heads),
                head_size=int(attn.head_size),
                scale=float(scale or 0.0),
                sliding_window=int(window) if window and window > 0 else None,
                soft_cap=float(cap) if cap else None,
                unsupported=unsupported,
            )
        return found

    def unit_modules(self) -> dict[str, tuple[torch.nn.Module, int]]:
        """The unit-addressed paths (plan.unit_kind) -> the module whose input they are,
        and the width of one unit: layers.L.self_attn.heads is o_proj's input
        ([tokens, heads * head_dim], vLLM's attention output), layers.L.mlp.act is
        down_proj's ([tokens, intermediate], the activated gate * up). Layers without
        them (other architectures) have no such paths."""
        found: dict[str, tuple[torch.nn.Module, int]] = {}
        for i, layer in self.layers():
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if hasattr(attn, "o_proj") and hasattr(attn, "head_dim"):
                found[f"layers.{i}{P.HEADS_SUFFIX}"] = (attn.o_proj, int(attn.head_dim))
            if hasattr(mlp, "down_proj"):
                found[f"layers.{i}{P.NEURONS_SUFFIX}"] = (mlp.down_proj, 1)
        return found

    def layers(self) -> list[tuple[int, torch.nn.Module]]:
        """The decoder layers this worker holds, by number: all of them, or under pipeline
        parallelism its stage's (vLLM puts a PPMissingLayer in the others' places)."""
        return [(i, layer) for i, layer in enumerate(self._runner.model.model.layers) if _held(layer)]

    # -- pipeline stages -------------------------------------------------------------

    @property
    def samples(self) -> bool:
        """Whether this worker draws the samples: the last pipeline stage (every worker
        without pipeline parallelism). Only there do the hooks run."""
        groups = _groups()
        return groups is None or bool(groups[0].is_last_rank)

    @property
    def stage(self) -> int:
        """This worker's pipeline stage (0 without pipeline parallelism)."""
        groups = _groups()
        return 0 if groups is None else int(groups[0].rank_in_group)

    @property
    def sends(self) -> bool:
        """Whether this worker sends its stage's records: its first tensor-parallel rank
        (the other ranks compute the same values)."""
        groups = _groups()
        return groups is None or bool(groups[1].rank_in_group == 0)

    def after_forward(self, hook: Callable[[], None]) -> None:
        """Call `hook` after each forward pass of the model (eager: it fires)."""
        self._runner.model.register_forward_hook(lambda module, args, output: hook())

    def prepare_pipeline_stage(self) -> None:
        """Make the buffers a later pipeline stage receives its input in, where vLLM did
        not: its CPU runner makes them in the warm-up run it skips for eager engines
        (vLLM 0.32), and the stage's first step then fails its assertion. As vLLM's
        _dummy_run makes them."""
        groups = _groups()
        runner = self._runner
        if groups is None or groups[0].is_first_rank or getattr(runner, "intermediate_tensors", True) is not None:
            return
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)

    def lens_parts(self) -> tuple[torch.nn.Module, torch.Tensor] | None:
        """The model's final norm and lm_head weight (the logit lens applies them)."""
        model = self._runner.model
        if not (_held(model.lm_head) and _held(model.model.norm)):
            return None  # an earlier pipeline stage's (the compiler keeps the lens off it)
        return model.model.norm, model.lm_head.weight

    def vocab_gather(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Under tensor parallelism lm_head is vocab-parallel: each rank holds a slice of
        its rows (padded), so a rank's `x @ weight.T` is its slice of the logits. This
        joins the ranks' slices along the last dimension, in vocab order (vLLM's own
        LogitsProcessor gathers its logits the same way). None: one rank holds it all.
        A collective: every rank of the group must call it, in the same order (they do:
        each runs the same hooks on the same batch)."""
        from vllm.distributed import tensor_model_parallel_all_gather

        groups = _groups()
        if groups is None or groups[1].world_size == 1:
            return None
        return functools.partial(tensor_model_parallel_all_gather, dim=-1)
