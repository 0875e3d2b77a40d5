"""What the served model allows: the facts request validation checks against."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

# How the engine runs, which decides the module interventions it serves.
EngineMode = Literal["eager", "compiled", "compiled_steering"]


# The lm_head work (multiply-adds) a trace's logit-lens reads may ask of one engine step:
# 65536 residual streams through a 152k x 4096 lm_head (Qwen3-8B), ~0.1 s of an H200's step
# that every other request waits out. A lens over every layer and prompt position of a long
# prompt would otherwise stall the engine for seconds.
LENS_WORK = 65536 * 151936 * 4096

# Attention-pattern weights are computed for a block of query rows at a time
# (worker/attention_patterns.py): at most PATTERN_BLOCK_ELEMENTS float32 elements a block
# (64 MiB), however long the prompt, and never less than one row (its heads over every
# key). Up to PATTERN_SCRATCH_COPIES such blocks are alive at once (the padded keys, the
# scores, the scaled and masked scores, their softmax), one read and layer after another:
# the transient memory a pattern read may take, counted against the trace's read budget.
PATTERN_BLOCK_ELEMENTS = 1 << 24
PATTERN_SCRATCH_COPIES = 4

# The worker's patch store (worker/patch_store.py) holds at most this many bytes of patch
# sources' values; the frontends admit patching traces against it before they start
# (frontend/patch_room.py), so it never drops a live trace's values. Set by the server's
# --patch-store-bytes (one value both sides read: the engine's processes inherit it).
# A compiled layer table's dictionary clamp columns (shared/steering.py: one per (dictionary,
# feature, value) clamped at once, shared by the slots clamping it), and the features one
# clamp write may name there (a slot's columns).
CLAMP_COLUMNS = 64
CLAMP_FEATURES = 8
PATCH_STORE_BYTES_ENV = "TRACEWIRE_PATCH_STORE_BYTES"
DEFAULT_PATCH_STORE_BYTES = 4 << 30


def patch_store_bytes() -> int:
    """The patch store's size: $TRACEWIRE_PATCH_STORE_BYTES, else the default."""
    value = os.environ.get(PATCH_STORE_BYTES_ENV, "")
    return int(value) if value else DEFAULT_PATCH_STORE_BYTES


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int  # vLLM's engine-wide cap on logprobs / prompt_logprobs (-1: vocab)
    hidden_size: int = 0
    num_layers: int = 0
    modules: frozenset[str] = frozenset()  # module paths reads may address
    # Module hooks only fire outside compiled graphs: the engine must run eager.
    module_interventions: bool = False
    # A compiled engine started with --compiled-steering serves the writes its graph
    # tables can express: add / replace / zero on these decoder layers (steering.py).
    steerable_layers: frozenset[int] = frozenset()
    # A compiled engine started with --compiled-reads keeps these decoder layers'
    # residual streams in graph buffers (read_buffers.py): reads of them are served.
    readable_layers: frozenset[int] = frozenset()
    # ... and with --compiled-unit-reads these layers' attention heads and MLP neurons
    # (o_proj's and down_proj's inputs): reads of layers.L.self_attn.heads / .mlp.act.
    unit_readable_layers: frozenset[int] = frozenset()
    # ... and with --compiled-unit-steering write tables for these layers' heads and
    # neurons: add / replace / zero of layers.L.self_attn.heads / .mlp.act units.
    unit_steerable_layers: frozenset[int] = frozenset()
    # ... and with --compiled-pattern-reads these layers' attention queries and keys in
    # graph buffers: attention-pattern reads of them are served.
    pattern_readable_layers: frozenset[int] = frozenset()
    # ... and with --compiled-module-reads / --compiled-module-steering buffers / write
    # tables for these other modules' outputs (embed_tokens, layers.L.self_attn,
    # layers.L.mlp, norm: graph_layers.module_sites), by module path.
    readable_modules: frozenset[str] = frozenset()
    steerable_modules: frozenset[str] = frozenset()
    # ... and with --compiled-mean-ablation its write tables take mean ablations.
    compiled_means: bool = False
    # ... and with --compiled-dictionary-clamps these decoder layers' tables clamp (and
    # ablate) SAE features (steering.CLAMP_FEATURES per write).
    clamp_layers: frozenset[int] = frozenset()
    # Units of the unit-addressed modules (plan.unit_kind): attention query heads of
    # head_dim each (o_proj's input), MLP neurons (down_proj's input).
    num_attention_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    # Heads and neurons are split across tensor-parallel ranks: unit interventions
    # need 1.
    tensor_parallel_size: int = 1
    # Attention patterns: query head h reads KV head h // (heads / kv_heads);
    # `attention_patterns_refused` says why this server cannot serve them ("": it can).
    num_key_value_heads: int = 0
    attention_patterns_refused: str = ""
    # Pipeline parallelism: the stages hold consecutive layers, stage s from layer
    # stage_first_layers[s] on (embed_tokens on the first, norm and lm_head on the last).
    # Module interventions run on the stage holding their module; what needs the sample
    # or lm_head (conditions, the logit lens) runs on the last.
    pipeline_parallel_size: int = 1
    stage_first_layers: tuple[int, ...] = (0,)
    lens_work: int = LENS_WORK

    @property
    def max_lens_rows(self) -> int:
        """The most residual streams a trace's logit-lens reads may put through lm_head at
        one step (layers x positions x sequences): `lens_work` over lm_head's size (and
        an int32, as ModelInfo carries it)."""
        return max(1, min(self.lens_work // max(1, self.vocab_size * self.hidden_size), 2**31 - 1))

    @property
    def last_stage(self) -> int:
        return self.pipeline_parallel_size - 1

    def stage_of(self, module: str) -> int:
        """The pipeline stage holding `module` (0 without stages)."""
        if self.pipeline_parallel_size <= 1 or module == "embed_tokens":
            return 0
        if not module.startswith("layers."):
            return self.last_stage  # norm
        layer = int(module.split(".")[1])
        return max(s for s, first in enumerate(self.stage_first_layers) if first <= layer)

    def pipeline_stage_refusal(self, module: str, what: str) -> str:
        """Why `what` (something the last stage computes) cannot use `module` ("": it can):
        under pipeline parallelism an earlier stage holds it."""
        if self.stage_of(module) == self.last_stage:
            return ""
        first = self.stage_first_layers[-1]
        return (f"{what} runs on the last pipeline stage (pipeline_parallel_size {self.pipeline_parallel_size}), "
                f"and {module!r} is on stage {self.stage_of(module)}; the last stage holds layers.{first} to "
                f"layers.{self.num_layers - 1} and norm")

    def attention_patterns_refusal(self) -> str:
        """Why read_attention_pattern is refused on this server; "" when it is served (a
        compiled engine: on its pattern_readable_layers)."""
        if not self.module_interventions and not self.pattern_readable_layers:
            return ("attention patterns need the model's queries and keys: an eager engine (--enforce-eager), "
                    "or a compiled one that keeps them in graph buffers (--compiled-pattern-reads)")
        if self.attention_patterns_refused:
            return self.attention_patterns_refused
        if not self.num_attention_heads or not self.num_key_value_heads:
            return "this server does not know its model's attention heads"
        return ""

    @property
    def engine_mode(self) -> EngineMode:
        if self.module_interventions:
            return "eager"
        return "compiled_steering" if self.steerable_layers or self.unit_steerable_layers else "compiled"
