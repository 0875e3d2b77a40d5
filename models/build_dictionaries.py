#!/usr/bin/env python3
"""Build the dictionaries shipped with tracewire-tiny: a linear probe and a small sparse
autoencoder, trained on the model's own residual stream after layer 2 ("layers.2").

Steps (deterministic: fixed seeds, deterministic torch algorithms, fixed thread count,
CPU; 5-13 minutes measured on the shared 2-core VM at a load average near 20, most of it the
SAE's steps):

1. Run HF transformers (float32) over every document of models/corpus/tracewire_corpus.txt
   (each as its own sequence, in padded batches) and keep the hidden state after layer 2 at
   every position (output_hidden_states[3]), with the token that follows it.
2. Probe "next-token-class" (k = 3, sigmoid): logistic regression predicting whether the
   next token is punctuation, a capitalised word, or the end of the text. 400 full-batch
   Adam steps on binary cross-entropy.
3. SAE "res-l2-sae" (d = 1024, ReLU): x -> relu((x - b_dec) @ W_enc + b_enc) @ W_dec + b_dec,
   600 Adam steps on batches of 1024 positions, loss = MSE + L1_COEF * sum_f |a_f| *
   ||W_dec[f]||. Each feature's label is the token at which it fires most over the corpus
   ("dead" for a feature that never fires).
4. Write NAME.safetensors (float32) + NAME.json (a DictionarySpec in protobuf's JSON
   form) for each into --out (default models/tracewire-tiny/dictionaries), and print the
   probe's accuracy and the SAE's explained variance and L0.

Usage:
    python models/build_dictionaries.py [--out models/tracewire-tiny/dictionaries]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoTokenizer, Qwen3ForCausalLM  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = HERE / "tracewire-tiny"
CORPUS = HERE / "corpus" / "tracewire_corpus.txt"
SEED = 1234
LAYER = 2  # the residual stream after this decoder layer: module "layers.2"
MODULE = f"layers.{LAYER}"
BATCH_DOCS = 64

PROBE_NAME = "next-token-class"
PROBE_LABELS = ("next token is punctuation", "next token is a capitalised word", "next token ends the text")
PROBE_STEPS = 400

SAE_NAME = "res-l2-sae"
SAE_FEATURES = 1024
SAE_STEPS = 500
SAE_BATCH = 512
L1_COEF = 3e-3


def log(msg: str) -> None:
    print(f"[build_dictionaries] {msg}", flush=True)


def residual_stream(threads: int) -> tuple[torch.Tensor, list[int], list[int], list[str]]:
    """(x [n, hidden] after layer LAYER, each position's token id, the next token's id
    (eos at a document's end), the vocabulary's token strings)."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = Qwen3ForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    docs = [d.strip() for d in CORPUS.read_text().split("\n\n") if d.strip()]
    eos = tokenizer.eos_token_id
    rows, tokens, nexts = [], [], []
    encoded = [tokenizer(doc)["input_ids"] for doc in docs]
    with torch.no_grad():
        # Batches of documents, right-padded (causal attention: a document's positions
        # never see the padding after it), keeping each document's own positions.
        for start in range(0, len(encoded), BATCH_DOCS):
            batch = encoded[start : start + BATCH_DOCS]
            width = max(len(ids) for ids in batch)
            ids = torch.tensor([ids + [eos] * (width - len(ids)) for ids in batch])
            mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in batch])
            hidden = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[LAYER + 1]
            for i, doc_ids in enumerate(batch):
                rows.append(hidden[i, : len(doc_ids)])
                tokens.extend(doc_ids)
                nexts.extend([*doc_ids[1:], eos])
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    strings = [tokenizer.convert_tokens_to_string([t]) for t in vocab]
    return torch.cat(rows), tokens, nexts, strings


def probe_targets(nexts: list[int], strings: list[str], eos: int) -> torch.Tensor:
    def classes(token: int) -> list[float]:
        text = strings[token].strip()
        return [
            float(token != eos and bool(text) and all(not c.isalnum() for c in text)),
            float(token != eos and text[:1].isupper()),
            float(token == eos),
        ]

    return torch.tensor([classes(t) for t in nexts])


def train_probe(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    w = torch.zeros(y.shape[1], x.shape[1], requires_grad=True)
    b = torch.zeros(y.shape[1], requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(PROBE_STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w.T + b, y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = ((x @ w.T + b > 0).float() == y).float().mean(0)
    log(f"probe: loss {loss.item():.4f}; accuracy per output {[round(a, 4) for a in accuracy.tolist()]}; "
        f"positives {y.sum(0).int().tolist()} of {len(y)}")
    return {"W": w.detach().contiguous(), "b": b.detach().contiguous()}


def train_sae(x: torch.Tensor, l1_coef: float = L1_COEF) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    hidden = x.shape[1]
    w_dec = torch.randn(SAE_FEATURES, hidden)
    w_dec = (w_dec / w_dec.norm(dim=1, keepdim=True) * 0.1).requires_grad_()
    w_enc = w_dec.detach().T.clone().requires_grad_()
    b_enc = torch.zeros(SAE_FEATURES, requires_grad=True)
    b_dec = x.mean(0).clone().requires_grad_()
    opt = torch.optim.Adam([w_enc, b_enc, w_dec, b_dec], lr=1e-3)
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(SAE_STEPS):
        batch = x[torch.randint(len(x), (SAE_BATCH,), generator=generator)]
        acts = torch.relu((batch - b_dec) @ w_enc + b_enc)
        recon = acts @ w_dec + b_dec
        l1 = (acts * w_dec.norm(dim=1)).sum(1).mean()
        loss = (recon - batch).pow(2).sum(1).mean() + l1_coef * l1
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acts = torch.relu((x - b_dec) @ w_enc + b_enc)
        recon = acts @ w_dec + b_dec
        explained = 1 - (recon - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
        l0 = (acts > 0).float().sum(1).mean()
        log(f"sae: explained variance {explained.item():.3f}, mean L0 {l0.item():.1f} of {SAE_FEATURES}, "
            f"dead features {int(((acts > 0).sum(0) == 0).sum())}")
    return {"W_enc": w_enc.detach().contiguous(), "b_enc": b_enc.detach().contiguous(),
            "W_dec": w_dec.detach().contiguous(), "b_dec": b_dec.detach().contiguous()}


def feature_labels(x: torch.Tensor, sae: dict[str, torch.Tensor], tokens: list[int], strings: list[str]) -> list[str]:
    with torch.no_grad():
        acts = torch.relu((x - sae["b_dec"]) @ sae["W_enc"] + sae["b_enc"])
        best, where = acts.max(0)
    peaks = zip(best.tolist(), where.tolist(), strict=True)
    return [f"top token {strings[tokens[i]]!r}" if v > 0 else "dead" for v, i in peaks]


def write(out: Path, name: str, tensors: dict[str, torch.Tensor], spec: dict[str, object]) -> None:
    save_file(tensors, str(out / f"{name}.safetensors"))
    (out / f"{name}.json").write_text(json.dumps(spec, indent=2) + "\n")
    log(f"wrote {name}: {', '.join(f'{k} {list(v.shape)}' for k, v in tensors.items())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=MODEL / "dictionaries")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--l1", type=float, default=L1_COEF, help="the SAE's L1 coefficient")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    started = time.monotonic()
    x, tokens, nexts, strings = residual_stream(args.threads)
    log(f"{len(x)} positions of {MODULE} from {CORPUS.name} ({time.monotonic() - started:.1f} s)")
    eos = AutoTokenizer.from_pretrained(MODEL).eos_token_id
    probe = train_probe(x, probe_targets(nexts, strings, eos))
    sae = train_sae(x, args.l1)
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out, PROBE_NAME, probe, {
        "kind": "DICTIONARY_KIND_PROBE",
        "module": MODULE,
        "probe_activation": "PROBE_ACTIVATION_SIGMOID",
        "labels": list(PROBE_LABELS),
        "description": "Logistic regression on the residual stream after layer 2 of tracewire-tiny: "
                       "the probability that the next token is punctuation, a capitalised word, or the "
                       "end of the text (models/build_dictionaries.py).",
    })
    write(args.out, SAE_NAME, sae, {
        "kind": "DICTIONARY_KIND_SAE",
        "module": MODULE,
        "sae_activation": "SAE_ACTIVATION_RELU",
        "subtract_decoder_bias": True,
        "labels": feature_labels(x, sae, tokens, strings),
        "description": f"A ReLU sparse autoencoder ({SAE_FEATURES} features) on the residual stream after "
                       "layer 2 of tracewire-tiny, trained on its corpus (models/build_dictionaries.py); "
                       "labels: the token each feature fires on most.",
    })
    log(f"done in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
