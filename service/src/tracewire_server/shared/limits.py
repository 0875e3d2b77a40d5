"""What the served model allows: the facts request validation checks against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How the engine runs, which decides the module interventions it serves.
EngineMode = Literal["eager", "compiled", "compiled_steering"]


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
    # Pipeline parallelism: the stages hold consecutive layers; the hooks run on the last
    # stage only (it draws the sample), which holds layers from `last_stage_first_layer`.
    pipeline_parallel_size: int = 1
    last_stage_first_layer: int = 0

    def pipeline_stage_refusal(self, module: str) -> str:
        """Why `module` takes no interventions on this server ("": it does): under pipeline
        parallelism only the last stage's modules do."""
        if self.pipeline_parallel_size <= 1 or module == "norm":
            return ""
        if module.startswith("layers.") and int(module.split(".")[1]) >= self.last_stage_first_layer:
            return ""
        return (f"{module!r} runs on an earlier pipeline stage than the sample (pipeline_parallel_size "
                f"{self.pipeline_parallel_size}); interventions are served on the last stage's modules: "
                f"layers.{self.last_stage_first_layer} to layers.{self.num_layers - 1} and norm")

    def attention_patterns_refusal(self) -> str:
        """Why read_attention_pattern is refused on this server; "" when it is served."""
        if not self.module_interventions:
            return "attention patterns are computed in module hooks: they need an eager engine (--enforce-eager)"
        if self.attention_patterns_refused:
            return self.attention_patterns_refused
        if not self.num_attention_heads or not self.num_key_value_heads:
            return "this server does not know its model's attention heads"
        return ""

    @property
    def engine_mode(self) -> EngineMode:
        if self.module_interventions:
            return "eager"
        return "compiled_steering" if self.steerable_layers else "compiled"
