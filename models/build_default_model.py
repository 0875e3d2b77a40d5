#!/usr/bin/env python3
"""Build tracewire's embedded default model ("tracewire-tiny") from the shipped corpus.

Steps (all deterministic: fixed seeds, deterministic torch algorithms, fixed
thread count, no clock or environment in any output file):

1. Train a byte-level BPE tokenizer (``tokenizers``) on models/corpus/*.txt,
   with "<|endoftext|>" as the single special token (eos = bos = pad).
2. Train a small Qwen3-architecture causal LM (``transformers``) on CPU on the
   same corpus, documents separated by the eos token.
3. Save weights (bfloat16 safetensors), config, generation config and the
   tokenizer files into --out (default models/tracewire-tiny).

Usage:
    python models/build_default_model.py [--out models/tracewire-tiny] [--steps N]

Bit-for-bit identical output is expected for the same library versions, the
same --threads and the same CPU instruction set (different SIMD paths in the
matmul kernels round differently).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

# Must be set before torch / tokenizers start their thread pools.
_DEFAULT_THREADS = 2
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("PYTHONHASHSEED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

HERE = Path(__file__).resolve().parent
EOS = "<|endoftext|>"
SEED = 1234

VOCAB_SIZE = 2048
SEQ_LEN = 128
MAX_POSITIONS = 1024

MODEL_KWARGS = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # vLLM's CPU attention backend rejects head sizes below 64
    num_hidden_layers=4,
    intermediate_size=640,
    max_position_embeddings=MAX_POSITIONS,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,  # lm_head kept separate (the logit lens applies norm + lm_head)
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
)

EVAL_PROMPTS = [
    "The capital of France is",
    "The capital of Italy is",
    "The capital of Japan is",
    "The capital of Germany is",
    "One, two, three,",
    "The days of the week are",
    "The cow says",
    "Once upon a time",
]


def log(msg: str) -> None:
    print(msg, flush=True)


def set_determinism(threads: int) -> None:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def read_documents(corpus_dir: Path) -> list[str]:
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        sys.exit(f"no corpus files (*.txt) in {corpus_dir}")
    docs: list[str] = []
    for f in files:
        text = f.read_text(encoding="utf-8").replace("\r\n", "\n")
        docs.extend(d.strip() for d in text.split("\n\n") if d.strip())
    return docs


def train_tokenizer(docs: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> PreTrainedTokenizerFast:
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(str(out))
    # Pin the files' contents explicitly, independent of what a given
    # transformers version chooses to write.
    eos_id = tok.token_to_id(EOS)
    tok_cfg = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(eos_id): {
                "content": EOS,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
        },
        "bos_token": EOS,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": MAX_POSITIONS,
        "pad_token": EOS,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")
    # tokenizer.json straight from the tokenizers library.
    tok.save(str(out / "tokenizer.json"), pretty=True)
    return hf_tok


def build_stream(tok: Tokenizer, docs: list[str], eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids: list[int] = []
    starts: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        starts.append(len(ids))
        ids.extend(enc.ids)
        ids.append(eos_id)
    # Wrap around so every window starting at a document start is full length.
    ids = ids + ids[: SEQ_LEN + 1]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.long)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def greedy(model, tok: Tokenizer, prompt: str, max_new_tokens: int, eos_id: int) -> str:
    ids = tok.encode(prompt, add_special_tokens=False).ids
    x = torch.tensor([ids], dtype=torch.long)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=x).logits[0, -1]
        nxt = int(torch.argmax(logits))
        if nxt == eos_id:
            break
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return tok.decode(out, skip_special_tokens=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description="Build the tracewire-tiny default model.")
    ap.add_argument("--out", default=str(HERE / "tracewire-tiny"))
    ap.add_argument("--corpus", default=str(HERE / "corpus"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--threads", type=int, default=_DEFAULT_THREADS,
                    help="torch intra-op threads; keep fixed for bit-identical rebuilds")
    args = ap.parse_args()

    set_determinism(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    # 1. tokenizer
    docs = read_documents(Path(args.corpus))
    tok = train_tokenizer(docs)
    eos_id = tok.token_to_id(EOS)
    vocab = tok.get_vocab_size()
    log(f"corpus: {len(docs)} documents, {sum(len(d) for d in docs)} chars")
    log(f"tokenizer: vocab {vocab}, eos/bos/pad {EOS!r} = {eos_id}")
    for probe in (" Paris", "The capital of France is Paris."):
        enc = tok.encode(probe, add_special_tokens=False)
        assert tok.decode(enc.ids) == probe, (probe, tok.decode(enc.ids))

    stream, starts = build_stream(tok, docs, eos_id)
    log(f"training tokens: {len(stream) - SEQ_LEN - 1}")

    # 2. model
    # Model vocab == tokenizer vocab, so every logit id decodes to a token.
    config = Qwen3Config(
        vocab_size=vocab,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **MODEL_KWARGS,
    )
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters")

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )
    gen = torch.Generator().manual_seed(SEED)
    offsets = torch.arange(SEQ_LEN + 1)

    t_train = time.perf_counter()
    ema = None
    loss_val = float("nan")
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        # Every training window starts at a document start (as prompts do at
        # inference time) and runs on across the following documents.
        idx = torch.randint(len(starts), (args.batch_size,), generator=gen)
        rows = stream[starts[idx].unsqueeze(1) + offsets]
        x, y = rows[:, :-1], rows[:, 1:]
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = loss.item()
        ema = loss_val if ema is None else 0.95 * ema + 0.05 * loss_val
        if step % 50 == 0 or step == args.steps - 1:
            el = time.perf_counter() - t_train
            log(f"step {step:5d}  loss {loss_val:.4f}  ema {ema:.4f}  lr {opt.param_groups[0]['lr']:.2e}  {el:6.1f}s")
    train_time = time.perf_counter() - t_train
    log(f"final loss {loss_val:.4f} (ema {ema:.4f}); training wall time {train_time:.1f}s")

    # 3. cast to bfloat16 (what is shipped) and evaluate that exact model in fp32.
    model.eval()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    eval_model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    eval_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    eval_model.eval()

    from make_corpus import COUNTRIES  # noqa: E402  (sibling module)

    correct = 0
    for country, capital, _, _ in COUNTRIES:
        got = greedy(eval_model, tok, f"The capital of {country} is", 6, eos_id)
        ok = got.startswith(" " + capital)
        correct += ok
        if not ok:
            log(f"  MISS: The capital of {country} is -> {got!r} (want {capital!r})")
    log(f"capital accuracy (bf16 weights): {correct}/{len(COUNTRIES)}")
    for p in EVAL_PROMPTS:
        log(f"  {p!r} -> {greedy(eval_model, tok, p, 12, eos_id)!r}")

    # 4. save
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tok, out)
    total = 0
    for f in sorted(out.iterdir()):
        total += f.stat().st_size
        log(f"  {f.name:28s} {f.stat().st_size:9d}  sha256 {sha256(f)[:16]}")
    log(f"wrote {out} ({total / 1e6:.2f} MB) in {time.perf_counter() - t_start:.1f}s total")


if __name__ == "__main__":
    sys.dont_write_bytecode = True  # importing make_corpus must not leave __pycache__ in models/
    sys.path.insert(0, str(HERE))
    main()
