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
    # Attention geometry (GQA: query head h reads KV head h // (heads / kv_heads)), for
    # attention-pattern reads; `attention_patterns_refused` says why this server cannot
    # serve them ("": it can).
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    attention_patterns_refused: str = ""

    @property
    def engine_mode(self) -> EngineMode:
        if self.module_interventions:
            return "eager"
        return "compiled_steering" if self.steerable_layers else "compiled"
