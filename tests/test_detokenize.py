"""Per-step text deltas: multi-byte characters split over byte-level tokens arrive whole."""

from __future__ import annotations

from conftest import MODEL
from tracewire_server.detokenize import TextTracker
from transformers import AutoTokenizer


def test_deltas_concatenate_and_never_split_characters():
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    text = " héllo ✓ 日本語 — naïve café 🙂 The capital of France is Paris."
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # unseen characters fall back to byte tokens
    tracker = TextTracker(lambda chunk: tok.decode(chunk))
    deltas = [tracker.add(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens end mid-character and add nothing yet
