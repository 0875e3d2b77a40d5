"""HF transformers on the served weights: the independent reference for the tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class HFReference:
    def __init__(self, model_dir: Path) -> None:
        torch.manual_seed(0)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    @torch.no_grad()
    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """[vocab] float32 logits for the token after `ids` (a full forward pass)."""
        out = self.model(torch.tensor([ids]))
        return out.logits[0, -1].float()

    @torch.no_grad()
    def greedy(self, ids: list[int], steps: int, eos: int | None = None) -> list[int]:
        """Step-by-step greedy decoding: argmax of a full forward pass each step."""
        ids = list(ids)
        generated: list[int] = []
        for _ in range(steps):
            token = int(self.next_logits(ids).argmax())
            generated.append(token)
            ids.append(token)
            if eos is not None and token == eos:
                break
        return generated
