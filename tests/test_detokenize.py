"""Per-step text deltas: multi-byte characters split over byte-level tokens arrive whole."""

from __future__ import annotations

import pytest
from conftest import MODEL
from tracewire_server.shared.detokenize import DecodeStreamTracker, TextTracker
from transformers import AutoTokenizer

TEXT = " héllo ✓ 日本語 — naïve café 🙂 The capital of France is Paris."


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(MODEL))


def test_deltas_concatenate_and_never_split_characters(tok):
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # unseen characters fall back to byte tokens
    tracker = TextTracker(lambda chunk: tok.decode(chunk))
    deltas = [tracker.add(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens end mid-character and add nothing yet


def test_the_rust_stream_gives_the_same_deltas_after_a_prompt(tok):
    prompt = tok.encode("The capital of France is")
    ids = tok.encode(TEXT)
    rust = DecodeStreamTracker(tok._tokenizer, prompt, skip_special_tokens=True)
    python = TextTracker(lambda chunk: tok.decode(chunk, skip_special_tokens=True))
    deltas = [rust.add(t) for t in ids]
    assert deltas == [python.add(t) for t in ids]
    assert "".join(deltas) == TEXT


def test_special_tokens_are_skipped_or_kept_as_asked(tok):
    eos = tok.eos_token_id
    ids = [*tok.encode(" Paris"), eos]
    assert "".join(DecodeStreamTracker(tok._tokenizer, [], True).add(t) for t in ids) == " Paris"
    kept = "".join(DecodeStreamTracker(tok._tokenizer, [], False).add(t) for t in ids)
    assert kept == " Paris" + tok.decode([eos])
