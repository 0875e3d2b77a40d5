"""Dictionary arithmetic over many rows goes a bounded chunk of rows at a time (a long
prompt through a wide SAE would otherwise hold [positions, features] float32 at once), and
the chunks together give what the whole computation gives: reads of every kind, at
prompt positions and at new tokens, and clamp writes. Worker code alone, on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tracewire_server.shared import plan as P
from tracewire_server.shared.dictionary_spec import DictionaryInfo
from tracewire_server.worker import dictionaries as D
from tracewire_server.worker.dictionary_reads import DictionaryWant, launch_dictionary_reads

HIDDEN, SIZE = 16, 40


def _sae(activation: str) -> D.Dictionary:
    g = torch.Generator().manual_seed(1)
    tensors = {"W_enc": torch.randn(HIDDEN, SIZE, generator=g), "b_enc": torch.randn(SIZE, generator=g) * 0.1,
               "W_dec": torch.randn(SIZE, HIDDEN, generator=g), "b_dec": torch.randn(HIDDEN, generator=g) * 0.1,
               "threshold": torch.rand(SIZE, generator=g)}
    info = DictionaryInfo(name="sae", kind="sae", module="layers.0", input_size=HIDDEN, size=SIZE, dtype="float32",
                          device_bytes=0, sae_activation=activation, sae_top_k=7 if activation == "topk" else 0)
    return D.Dictionary(info, tensors)


READS = {
    "all": {},
    "top": {"top_k": 4},
    "some": {"features": (0, 5, 39)},
    "error": {"error": True},
}


def _wants(dictionary: D.Dictionary) -> tuple[list[DictionaryWant], dict[str, torch.Tensor]]:
    """A prompt read of 11 positions and 5 rows' new-token reads of every kind."""
    g = torch.Generator().manual_seed(2)
    ref = P.DictRef(dictionary.info.name, dictionary.info.generation, dictionary.info.module, SIZE)
    wants, inputs = [], {}
    for kind, extra in READS.items():
        read = P.ReadDictionary(ref, P.Positions(), **extra)
        prompt = torch.randn(11, HIDDEN, generator=g)
        inputs[f"prompt {kind}"] = prompt
        wants.append(DictionaryWant(SimpleNamespace(reads={}, error=None), f"prompt {kind}", read, prompt,
                                    list(range(11))))
        for r in range(5):
            row = torch.randn(1, HIDDEN, generator=g)
            inputs[f"new {kind} {r}"] = row
            wants.append(DictionaryWant(SimpleNamespace(reads={}, error=None), f"new {kind} {r}", read, row, None))
    return wants, inputs


def _result(want: DictionaryWant) -> tuple[np.ndarray, np.ndarray | None]:
    launched = want.row.reads[want.name]
    batch = launched.batch
    if hasattr(launched, "row"):  # a row of a column
        return batch.values[launched.row], None if batch.ids is None else batch.ids[launched.row]
    return batch.values, batch.ids


def _expected(dictionary: D.Dictionary, want: DictionaryWant, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
    """The read computed on its rows whole, by hand."""
    values = dictionary.values(x)
    read = want.read
    if read.error:
        recon = values @ dictionary.directions + dictionary.decoder_bias
        return torch.linalg.vector_norm(x - recon, dim=-1, keepdim=True).numpy(), None
    if read.top_k:
        top = torch.topk(values, read.top_k, dim=-1)
        return top.values.numpy(), top.indices.numpy()
    if read.features:
        return values[:, list(read.features)].numpy(), None
    return values.numpy(), None


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "topk"])
def test_reads_in_chunks_equal_the_whole_computation(monkeypatch, activation):
    dictionary = _sae(activation)
    monkeypatch.setattr(D, "CHUNK_BYTES", 3 * (12 * SIZE + 8 * HIDDEN))  # 3 rows a chunk
    assert dictionary.chunk_rows == 3
    seen = []
    whole = dictionary.values
    monkeypatch.setattr(dictionary, "values", lambda x: seen.append(x.shape[0]) or whole(x))
    registry = D.Dictionaries()
    registry.put(dictionary)
    wants, inputs = _wants(dictionary)
    launch_dictionary_reads(wants, registry)
    assert max(seen) == 3 and sum(seen) == 4 * (11 + 5)  # every row once, 3 at most at a time
    for want in wants:
        assert want.row.error is None
        got_values, got_ids = _result(want)
        values, ids = _expected(dictionary, want, inputs[want.name])
        np.testing.assert_allclose(got_values.reshape(values.shape), values, rtol=1e-5, atol=1e-5)
        if ids is not None:
            assert np.array_equal(got_ids.reshape(ids.shape), ids)


def test_clamp_in_chunks_equals_the_whole_computation(monkeypatch):
    dictionary = _sae("relu")
    x = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(3))
    whole = dictionary.clamp_delta(x, (1, 7), 2.5)
    monkeypatch.setattr(D, "CHUNK_BYTES", 4 * (12 * SIZE + 8 * HIDDEN))
    assert len(dictionary.chunks(x)) == 3
    torch.testing.assert_close(dictionary.clamp_delta(x, (1, 7), 2.5), whole)
    # the whole computation by hand: sum_f (2.5 - a_f(x)) W_dec[f]
    by_hand = (2.5 - dictionary.values(x)[:, [1, 7]]) @ dictionary.directions[[1, 7]]
    torch.testing.assert_close(whole, by_hand)


def test_the_chunk_bound_holds_for_a_wide_sae():
    info = DictionaryInfo(name="wide", kind="sae", module="layers.0", input_size=4096, size=131072,
                          dtype="bfloat16", device_bytes=0)
    rows = D.Dictionary.chunk_rows.fget(SimpleNamespace(info=info))
    assert rows * (12 * 131072 + 8 * 4096) <= D.CHUNK_BYTES < (rows + 1) * (12 * 131072 + 8 * 4096)
