"""Realistic model shapes for GPU benchmarks, with dummy weights (no hub here).

A shape is a Hugging Face config.json; the tokenizer is tracewire-tiny's (its 2048
ids fit in any of these vocabularies). vLLM loads such a directory with
load_format="dummy": random weights, the real shapes and kernels.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 0,
}

SHAPES = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
}


def write_model_dir(shape: str, directory: Path) -> Path:
    """config.json of `shape` plus tracewire-tiny's tokenizer, in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[shape])
    config["max_window_layers"] = config["num_hidden_layers"]
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = ROOT / "models" / "tracewire-tiny"
    if not (tokenizer / "tokenizer.json").exists():  # (a carried snapshot without models/: empty prompts)
        raise SystemExit(f"bench: no tokenizer at {tokenizer}; carry models/tracewire-tiny's tokenizer files")
    for name in TOKENIZER_FILES:
        source = tokenizer / name
        if source.exists():
            shutil.copy(source, directory / name)
    return directory
