"""The worker computes each batched read once for all the rows that read it, whatever
mix of blocks (requests that only read), one-by-one rows (writes, conditions), frontends
and untraced requests shares the batch; each record still gets exactly its own row.
Driven with a stand-in runner so the batch layout is chosen here (the engine-backed
trace tests check values against transformers)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from tracewire_server.shared import plan as P
from tracewire_server.worker import host
from tracewire_server.worker.standin import Sampler, Sender, give_model, hooks_over, records, request, runner

VOCAB = 64
ALWAYS = P.StepSet()


def _op(name: str, action: P.Action, condition: P.Condition | None = None) -> P.Op:
    return P.Op(name, ALWAYS, condition, action)


def _array(raw) -> np.ndarray:
    return np.frombuffer(raw.data, dtype=raw.dtype).reshape(raw.shape)


def _top(row: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    top = torch.topk(row, k)
    return top.values.numpy(), top.indices.numpy()


# Route (frontend), ops; None: an untraced request.
BATCH = {
    "a": (0, (_op("raw", P.ReadLogits("raw", top_k=3)), _op("top", P.ReadLogits("processed", top_k=3)))),
    "idle": None,
    "b": (1, (_op("top", P.ReadLogits("processed", top_k=3)), _op("tok", P.ReadSample()))),
    "cond": (0, (_op("top", P.ReadLogits("processed", top_k=3), P.SampledIn(frozenset(range(VOCAB)))),)),
    "c": (0, (_op("top", P.ReadLogits("processed", top_k=3)),)),
    "bias": (1, (_op("bias", P.BiasLogits({7: 100.0})), _op("top", P.ReadLogits("processed", top_k=3)))),
    "lp": (0, (_op("lp", P.ReadLogprobs(top_k=2)), _op("ids", P.ReadLogits("processed", token_ids=(1, 5))))),
    "d": (1, (_op("top", P.ReadLogits("processed", top_k=3)),)),
}


class _Doubling(Sampler):
    """A processor that changes the logits in place, as vLLM's do: raw != processed."""

    def apply_logits_processors(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.mul_(2.0)


@pytest.mark.parametrize("whole_column_bytes", [0, host.WHOLE_COLUMN_BYTES], ids=["cut per frontend", "sent whole"])
def test_each_record_gets_its_own_rows_of_shared_reads(monkeypatch, whole_column_bytes):
    monkeypatch.setattr(host, "WHOLE_COLUMN_BYTES", whole_column_bytes)
    requests, keys = {}, {}
    for name, spec in BATCH.items():
        if spec is None:
            requests[name] = request(b"")
            requests[name].sampling_params.extra_args = {}
            continue
        route, ops = spec
        keys[name] = f"key-{name}"
        requests[name] = request(P.encode_plan(P.SequencePlan(key=keys[name], ops=ops, route=route)))
    engine = runner(requests)
    planned = hooks_over(engine)
    senders = {0: Sender(), 1: Sender()}
    planned.senders.update(senders)
    sampler = _Doubling()
    planned.install(sampler)

    torch.manual_seed(0)
    steps = dict.fromkeys(BATCH, 0)  # each request's own step count
    for step in range(4):
        # Step 1 leaves a request out: the traced rows are no longer one run. At step 2
        # two requests are mid-prefill (vLLM throws their samples away): a block row and
        # a one-by-one row make no record and keep their step count.
        engine.input_batch.req_ids = [k for k in BATCH if not (step == 1 and k == "c")]
        order = engine.input_batch.req_ids
        discarded = {"d", "bias"} if step == 2 else set()
        engine.discard_request_mask = (types.SimpleNamespace(np=np.array([k in discarded for k in order]))
                                       if step >= 2 else None)
        traced = [k for k in order if k in keys and k not in discarded]
        logits = torch.randn(len(order), VOCAB)
        raw = logits.clone()
        drawn = sampler.forward(logits, None).sampled_token_ids.flatten()
        got = {r.key: r for route, sender in senders.items() for r in records(sender.batches[-1])}
        assert sorted(got) == sorted(keys[k] for k in traced)

        for name in traced:
            i, record = order.index(name), got[keys[name]]
            processed = raw[i] * 2.0
            if name == "bias":
                processed[7] += 100.0
            assert (record.step, record.token_id, record.error) == (steps[name], int(drawn[i]), None)
            steps[name] += 1
            assert record.token_id == int(processed.argmax())
            values = record.values
            if "top" in values:
                want_values, want_ids = _top(processed, 3)
                np.testing.assert_allclose(_array(values["top"].values), want_values, rtol=1e-6)
                np.testing.assert_array_equal(_array(values["top"].token_ids), want_ids)
            if name == "a":
                want_values, want_ids = _top(raw[i], 3)
                np.testing.assert_allclose(_array(values["raw"].values), want_values, rtol=1e-6)
                np.testing.assert_array_equal(_array(values["raw"].token_ids), want_ids)
            if name == "b":
                assert int(_array(values["tok"].values)) == record.token_id
            if name == "lp":
                lp = torch.log_softmax(processed, -1)
                ids = [record.token_id, *torch.topk(lp, 2).indices.tolist()]
                np.testing.assert_array_equal(_array(values["lp"].token_ids), ids)
                np.testing.assert_allclose(_array(values["lp"].values), lp[ids].numpy(), rtol=1e-5)
                np.testing.assert_allclose(_array(values["ids"].values), processed[[1, 5]].numpy(), rtol=1e-6)
        # Frontend 1 gets only its own three rows of the top-3 column shared with frontend 0,
        # or, where columns that small go whole, the column of every row reading it.
        readers = [k for k in traced if any(op.name == "top" for op in BATCH[k][1])]
        want = sum(BATCH[k][0] == 1 for k in readers) if whole_column_bytes == 0 else len(readers)
        assert [c.values.shape[0] for c in senders[1].batches[-1].columns] == [want]
        # The reads that only read travel as blocks, one per frontend; the others as records.
        blocked = {k for sender in senders.values() for b in sender.batches[-1].blocks for k in b.keys}
        assert blocked == {keys[k] for k in ("a", "b", "c", "lp", "d") if k in traced}


def _compiled_runner(requests: dict, hidden: int = 8):
    """A stand-in compiled runner with read buffers on layers 0-2 (tracewire's real
    ReadBuffers), a model the module hooks can look at, and a pass layout set per step."""
    from tracewire_server.shared.read_buffers import ReadBuffers

    engine = runner(requests)
    engine._model_forward = lambda: None
    give_model(engine, 3, hidden, VOCAB)
    buffers = ReadBuffers([0, 1, 2], max_tokens=64, hidden=hidden, dtype=torch.float32, device=torch.device("cpu"))
    return engine, buffers


def _compiled_hooks(requests: dict, order: list[str], dictionaries: tuple = ()):
    """tracewire's hooks on a stand-in compiled runner (`_compiled_runner`) whose batch is
    `order`, holding `dictionaries`: the runner, its read buffers, a Sender for frontends
    0 and 1, the sampler."""
    engine, buffers = _compiled_runner(requests)
    hooks = hooks_over(engine)
    for dictionary in dictionaries:
        hooks.dictionaries.put(dictionary)
    senders = {0: Sender(), 1: Sender()}
    hooks.senders.update(senders)
    sampler = Sampler()
    hooks.install(sampler)
    hooks.install_compiled_reads(buffers)
    engine.input_batch.req_ids = order
    return engine, buffers, senders, sampler


def test_block_module_reads_are_columns_of_each_rows_new_token():
    """Requests that only read modules at the new token travel as blocks, their values one
    gather per module for all of them: each record still gets its own row, beside rows
    that read the same module one by one (a mean, a patch source), an untraced request
    and a request whose prompt is still being prefilled in chunks. The same for the
    logit lens and for a probe's values."""
    from tracewire_server.shared.dictionary_spec import DictionaryInfo
    from tracewire_server.worker.dictionaries import Dictionary

    read = P.ReadModule("layers.1", P.Positions())
    lens = P.ReadLogitLens((0, 2), P.Positions(), top_k=3)
    weights = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    probe = Dictionary(DictionaryInfo(name="p", kind="probe", module="layers.2", input_size=8, size=3,
                                      dtype="float32", device_bytes=0), {"W": weights, "b": torch.ones(3)})
    probe_read = P.ReadDictionary(P.DictRef("p", 0, "layers.2", 3), P.Positions(), top_k=2)
    plans = {
        "a": P.SequencePlan(key="a", ops=(_op("h", read), _op("top", P.ReadLogits("processed", top_k=3)))),
        "idle": None,
        "b": P.SequencePlan(key="b", route=1, ops=(_op("h", read), _op("h2", P.ReadModule("layers.2", P.Positions())))),
        "mean": P.SequencePlan(key="mean", ops=(_op("h", P.ReadModule("layers.1", P.Positions(), mean=True)),)),
        "source": P.SequencePlan(key="source", ops=(_op("h", read),), exports=frozenset({"h"}), trace="t"),
        "chunked": P.SequencePlan(key="chunked", ops=(_op("h", read),)),
        "lens": P.SequencePlan(key="lens", route=1, ops=(_op("l", lens), _op("h", read))),
        # (with a mean: not a block, its lens computed on its own)
        "lens_row": P.SequencePlan(key="lens_row", ops=(
            _op("l", lens), _op("m", P.ReadModule("layers.0", P.Positions(), mean=True)))),
        "probe": P.SequencePlan(key="probe", route=1, ops=(_op("p", probe_read), _op("h", read))),
        "probe_row": P.SequencePlan(key="probe_row", ops=(
            _op("p", probe_read), _op("m", P.ReadModule("layers.0", P.Positions(), mean=True)))),
    }
    requests = {}
    for name, plan in plans.items():
        requests[name] = request(P.encode_plan(plan) if plan is not None else b"")
        if plan is None:
            requests[name].sampling_params.extra_args = {}
        requests[name].output_token_ids = []
    requests["chunked"].prompt_token_ids = [1, 2, 3, 4, 5]  # (the others' prompts: 2 tokens)
    order = list(plans)
    engine, buffers, senders, sampler = _compiled_hooks(requests, order, (probe,))

    steps = dict.fromkeys(plans, 0)
    for step in range(3):
        # Step 0 prefills every prompt, "chunked" only its first 3 tokens (no sample: vLLM
        # throws it away); step 1 decodes one token each and ends "chunked"'s prompt.
        counts = [3 if k == "chunked" and step == 0 else 2 if k == "chunked" and step == 1 else
                  2 if step == 0 else 1 for k in order]
        starts = np.concatenate([[0], np.cumsum(counts)])
        engine.query_start_loc = types.SimpleNamespace(np=starts)
        # tokens computed before the pass: none, "chunked"'s 3, or all but the last drawn one
        engine.input_batch.num_computed_tokens_cpu = np.array(
            [0 if step == 0 else 3 if (k == "chunked" and step == 1) else
             len(requests[k].prompt_token_ids) + len(requests[k].output_token_ids) - 1 for k in order])
        discarded = {"chunked"} if step == 0 else set()
        engine.discard_request_mask = types.SimpleNamespace(np=np.array([k in discarded for k in order]))
        # the graph's copies: every row of every layer a value of its own
        for t, layer in enumerate(buffers.layers):
            stream = getattr(buffers, buffers.names[t])
            stream[:] = (1000 * layer + 10 * torch.arange(64) + step).unsqueeze(1).float()
        engine._model_forward()
        drawn = sampler.forward(torch.randn(len(order), VOCAB), None).sampled_token_ids.flatten()
        got = {r.key: r for sender in senders.values() for r in records(sender.batches[-1])}
        traced = [k for k in order if plans[k] is not None and k not in discarded]
        assert sorted(got) == sorted(traced)
        for k in traced:
            i, record = order.index(k), got[k]
            row = int(starts[i + 1]) - 1  # the new token's flat row
            assert (record.step, record.error) == (steps[k], None), k
            steps[k] += 1
            assert sorted(record.values) == sorted(op.name for op in plans[k].ops), k
            if "h" in record.values:
                h = _array(record.values["h"].values)
                np.testing.assert_array_equal(h, np.full(h.shape, 1000 + 10 * row + step, np.float32))
            if k == "b":
                np.testing.assert_array_equal(_array(record.values["h2"].values), np.full(8, 2000 + 10 * row + step))
            if k.startswith("lens"):  # [layers, positions, k], at the new token's position
                streams = torch.stack([torch.full((8,), 1000.0 * layer + 10 * row + step) for layer in (0, 2)])
                with torch.no_grad():
                    logprobs = torch.log_softmax(engine.model.lm_head(engine.model.model.norm(streams)), -1)
                top = torch.topk(logprobs, 3)
                got_lens = record.values["l"]
                np.testing.assert_allclose(_array(got_lens.values), top.values.unsqueeze(1).numpy(), rtol=1e-6)
                np.testing.assert_array_equal(_array(got_lens.token_ids), top.indices.unsqueeze(1).numpy())
                position = int(engine.input_batch.num_computed_tokens_cpu[i]) + counts[i] - 1
                np.testing.assert_array_equal(_array(got_lens.positions), [position])
            if k.startswith("probe"):  # the top 2 of W @ stream + b on layers.2's new token
                top = torch.topk(weights @ torch.full((8,), 2000.0 + 10 * row + step) + 1, 2)
                got_probe = record.values["p"]
                np.testing.assert_allclose(_array(got_probe.values), top.values.numpy(), rtol=1e-6)
                np.testing.assert_array_equal(_array(got_probe.token_ids), top.indices.numpy())
        for k in traced:
            requests[k].output_token_ids.append(int(drawn[order.index(k)]))
        blocked = {key for sender in senders.values() for b in sender.batches[-1].blocks for key in b.keys}
        assert blocked == {k for k in ("a", "b", "chunked", "lens", "probe") if k in traced}
    assert steps["chunked"] == 2 and steps["a"] == 3


def test_a_frontends_column_rows_go_as_one_slice_and_a_block_missing_a_row_fails_alone(monkeypatch):
    """Block rows of two frontends, interleaved in the batch: each frontend is sent only
    its rows of the module's column, as one slice of it (the column is laid out block by
    block, a frontend's blocks together). A lens block one of whose rows the pass did not
    compute fails its own traces; the other frontend's lens block is still answered."""
    monkeypatch.setattr(host, "WHOLE_COLUMN_BYTES", 0)  # cut per frontend, however small
    read = P.ReadModule("layers.1", P.Positions())
    lens = P.ReadLogitLens((0, 2), P.Positions(), top_k=3)
    plans = {
        "h0": P.SequencePlan(key="h0", route=0, ops=(_op("h", read),)),
        "h1": P.SequencePlan(key="h1", route=1, ops=(_op("h", read),)),
        "l0": P.SequencePlan(key="l0", route=0, ops=(_op("l", lens),)),
        "h2": P.SequencePlan(key="h2", route=0, ops=(_op("h", read),)),
        "l1": P.SequencePlan(key="l1", route=1, ops=(_op("l", lens),)),
        "h3": P.SequencePlan(key="h3", route=1, ops=(_op("h", read),)),
    }
    requests = {name: request(P.encode_plan(plan)) for name, plan in plans.items()}
    for state in requests.values():
        state.output_token_ids = [3]  # after a 2-token prompt and one drawn token
    order = list(plans)
    engine, buffers, senders, sampler = _compiled_hooks(requests, order)
    engine.query_start_loc = types.SimpleNamespace(np=np.arange(len(order) + 1))  # one decode row each
    # Every row decodes its third token, except that the pass runs l1's row at its first
    # position (a pass that does not compute its new token, yet vLLM keeps the sample).
    engine.input_batch.num_computed_tokens_cpu = np.array([0 if k == "l1" else 2 for k in order])
    engine.discard_request_mask = types.SimpleNamespace(np=np.zeros(len(order), bool))
    for t, layer in enumerate(buffers.layers):
        getattr(buffers, buffers.names[t])[:] = (1000 * layer + 10 * torch.arange(64)).unsqueeze(1).float()
    engine._model_forward()
    sampler.forward(torch.randn(len(order), VOCAB), None)

    for route, sender in senders.items():
        batch = sender.batches[-1]
        got = {r.key: r for r in records(batch)}
        mine = [k for k in order if plans[k].route == route]
        assert sorted(got) == sorted(mine)
        for k in mine:
            row = order.index(k)
            if k.startswith("h"):
                assert got[k].error is None
                want = np.full(8, 1000 + 10 * row, np.float32)
                np.testing.assert_array_equal(_array(got[k].values["h"].values), want)
        # its rows of the layer read: exactly its own, sent as a view of the host copy
        (h_column,) = [batch.columns[c] for block in batch.blocks for name, c, _ in block.reads if name == "h"]
        assert h_column.values.shape[0] == sum(k.startswith("h") for k in mine)
        assert isinstance(h_column.values.data, memoryview)
    l1 = {r.key: r for r in records(senders[1].batches[-1])}["l1"]
    assert "saw 0 of 1 positions" in (l1.error or "")
    l0 = {r.key: r for r in records(senders[0].batches[-1])}["l0"]
    assert l0.error is None
    streams = torch.stack([torch.full((8,), 1000.0 * layer + 10 * order.index("l0")) for layer in (0, 2)])
    with torch.no_grad():
        top = torch.topk(torch.log_softmax(engine.model.lm_head(engine.model.model.norm(streams)), -1), 3)
    np.testing.assert_allclose(_array(l0.values["l"].values), top.values.unsqueeze(1).numpy(), rtol=1e-6)
    np.testing.assert_array_equal(_array(l0.values["l"].token_ids), top.indices.unsqueeze(1).numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_chunk", [1, 3, 1000])
def test_the_top_k_lens_is_computed_a_bounded_chunk_of_rows_at_a_time(monkeypatch, dtype, rows_per_chunk):
    """A lens over many layers and positions never holds more than LENS_CHUNK_BYTES of
    log-probabilities at once, and its chunks together are the whole lens: the top k of
    log_softmax(lm_head(norm(stream))), in lm_head's dtype as the model computes logits."""
    from tracewire_server.worker import module_reads

    torch.manual_seed(0)
    vocab, hidden = 990, 64  # (lm_head padded to 1000 rows, as vLLM pads the vocabulary)
    norm = torch.nn.RMSNorm(hidden).to(dtype)
    weight = (0.3 * torch.randn(1000, hidden)).to(dtype)
    streams = torch.randn(7, 4, hidden).to(dtype)  # [positions, layers, hidden]
    row_bytes = module_reads.working_bytes(vocab, 5, weight.device)
    monkeypatch.setattr(module_reads, "LENS_CHUNK_BYTES", row_bytes * rows_per_chunk)
    seen = []
    lens = module_reads.Lens(norm, weight, vocab)
    logits = lens.logits
    monkeypatch.setattr(lens, "logits", lambda rows: seen.append(rows.shape[0]) or logits(rows))
    values, ids = lens(streams, 5)
    with torch.no_grad():
        logits = (norm(streams) @ weight.t())[..., :vocab]
        want = torch.log_softmax(logits.float(), dim=-1).topk(5)
    assert max(seen) == min(rows_per_chunk, 28) and sum(seen) == 28
    assert values.dtype == torch.float32 and ids.dtype == torch.int32 and values.shape == (7, 4, 5)
    torch.testing.assert_close(values, want.values, rtol=1e-5, atol=1e-5)
    # ids: the reference's, or in bf16 (ties) ids of the same logits
    assert torch.equal(logits.gather(-1, ids.long()), logits.gather(-1, want.indices))
