"""Attention-pattern reads against transformers' `output_attentions=True` (eager attention)
on the same weights, through the SDK, on the session's eager server (conftest's `eager`).

The tiny model has 4 query heads and 2 KV heads (GQA: heads 0, 1 read KV head 0; heads 2,
3 KV head 1). The server runs with a small --max-num-batched-tokens (64), so a long
prompt runs through chunked prefill. Both sides compute in float32: tolerance 1e-5
absolute on the weights (probabilities in [0, 1]).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
import tracewire as tw
from conftest import MODEL
from trace_requests import invoke, iv, run, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc
from transformers import AutoModelForCausalLM

PROMPT = "The capital of France is"
ATOL = 1e-5
GREEDY = dict(temperature=0.0, ignore_eos=True)
STEPS = 4
# Longer than the server's --max-num-batched-tokens (64): its prefill runs in chunks.
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 14)


@pytest.fixture(scope="module", params=["eager", "server"])
def client(request):
    """The eager session server (module hooks), and the shared compiled one (`server`: its
    default graph hooks keep every layer's queries and keys, --compiled-pattern-reads)."""
    with tw.Client(request.getfixturevalue(request.param).target, timeout=180) as c:
        yield c


@pytest.fixture(scope="module")
def hf_eager():
    """transformers' own eager attention, whose weights output_attentions returns."""
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def hf_attentions(model, ids: list[int]) -> np.ndarray:
    """[layers, heads, T, T] attention weights over the sequence `ids`."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    return torch.stack([a[0] for a in out.attentions]).numpy()


def sequence_ids(tracer, prompt_ids: list[int]) -> list[int]:
    """The prompt and the tokens the server drew, less the last (which no step's query
    sees): the sequence every step's query row lives in."""
    return prompt_ids + list(tracer.result.outputs[0].token_ids)[:-1]


def test_full_rows_at_prompt_positions_and_every_new_token(client, hf_eager):
    with client.trace(PROMPT, max_tokens=STEPS, **GREEDY) as tracer:
        pattern = tracer.all().attention([0, 3], positions="all", top_k=0).save()
    prompt_ids = list(tracer.result.prompt_token_ids)
    n = len(prompt_ids)
    ref = hf_attentions(hf_eager, sequence_ids(tracer, prompt_ids))  # [4, 4, T, T]
    assert pattern.steps == list(range(STEPS))
    first = pattern[0]
    assert first.weights.shape == (2, n, 4, n) and first.weights.dtype == np.float32
    assert first.positions.tolist() == list(range(n))
    # rows of the prompt: query p over keys 0 .. n-1, keys after p weigh exactly 0
    np.testing.assert_allclose(first.weights, ref[[0, 3]][:, :, :n, :n].transpose(0, 2, 1, 3), atol=ATOL)
    assert np.all(np.triu(first.weights[0, :, 0, :], k=1) == 0)
    np.testing.assert_allclose(first.weights.sum(-1), 1.0, atol=1e-5)
    for s in range(1, STEPS):
        got = pattern[s]
        q = n - 1 + s  # the new token's position
        assert got.weights.shape == (2, 1, 4, q + 1) and got.positions.tolist() == [q]
        np.testing.assert_allclose(got.weights[:, 0], ref[[0, 3]][:, :, q, : q + 1], atol=ATOL)


def test_top_k_of_chosen_heads_with_gqa(client, hf_eager):
    """Heads 2 and 1 (in that order: KV heads 1 and 0) at the new token every step, via the
    nnsight-style path; top-k equals transformers' top-k, ids and values."""
    k = 5
    with client.trace(PROMPT, max_tokens=STEPS, **GREEDY) as tracer:
        pattern = tracer.all().model.layers[1].self_attn.pattern(heads=[2, 1], top_k=k).save()
    prompt_ids = list(tracer.result.prompt_token_ids)
    n = len(prompt_ids)
    ref = hf_attentions(hf_eager, sequence_ids(tracer, prompt_ids))[1][[2, 1]]  # [2 heads, T, T]
    for s, got in enumerate(pattern):
        q = n - 1 + s
        assert got.weights.shape == (1, 1, 2, k) and got.keys.shape == (1, 1, 2, k)
        assert got.keys.dtype == np.int32 and got.positions.tolist() == [q]
        for h in range(2):
            row = ref[h, q, : q + 1]
            want = np.argsort(-row, kind="stable")[:k]
            np.testing.assert_allclose(got.weights[0, 0, h], row[want], atol=ATOL)
            # the ids are the top ones: their weights are transformers' k largest
            np.testing.assert_allclose(row[got.keys[0, 0, h]], row[want], atol=ATOL)
            assert got.keys[0, 0, h].tolist() == want.tolist() or np.ptp(row[want]) < ATOL


def test_top_k_longer_than_the_keys_pads_with_minus_one(client, hf_eager):
    """At prompt positions query p sees p + 1 keys: a top-8 row of p < 7 ends with 0 / -1;
    so does the new token's row at step 0 (the last prompt position)."""
    with client.trace(PROMPT, max_tokens=1, **GREEDY) as tracer:
        pattern = tracer.iter[0].attention(2, heads=[1], positions="prompt", top_k=8).save()
        new = tracer.iter[0].attention(2, heads=[1], top_k=8).save()
    prompt_ids = list(tracer.result.prompt_token_ids)
    n = len(prompt_ids)
    assert n < 8
    ref = hf_attentions(hf_eager, prompt_ids)[2, 1]
    (last,) = new
    assert last.positions.tolist() == [n - 1]
    np.testing.assert_allclose(last.weights[0, 0, 0, :n], np.sort(ref[n - 1])[::-1], atol=ATOL)
    assert last.keys[0, 0, 0, n:].tolist() == [-1] * (8 - n) and last.weights[0, 0, 0, n:].tolist() == [0.0] * (8 - n)
    (got,) = pattern
    assert got.weights.shape == (1, n, 1, 8)
    for p in range(n):
        seen = min(p + 1, 8)
        keys, weights = got.keys[0, p, 0], got.weights[0, p, 0]
        assert sorted(keys[:seen].tolist()) == sorted(np.argsort(-ref[p, : p + 1])[:seen].tolist())
        np.testing.assert_allclose(weights[:seen], np.sort(ref[p, : p + 1])[::-1][:seen], atol=ATOL)
        assert keys[seen:].tolist() == [-1] * (8 - seen) and weights[seen:].tolist() == [0.0] * (8 - seen)


def test_chunked_prefill_keys_and_rows(client, hf_eager):
    """A prompt over the server's batched-token budget: its prefill runs in chunks, and both
    the prompt rows (in several chunks) and later steps (keys from every chunk) match."""
    with client.trace(LONG_PROMPT, max_tokens=3, **GREEDY) as tracer:
        rows = tracer.iter[0].attention([1, 2], positions=[0, 40, 70, -1], top_k=0).save()
        new = tracer.all().attention(2, heads=[2], top_k=0).save()
    prompt_ids = list(tracer.result.prompt_token_ids)
    n = len(prompt_ids)
    assert n > 128  # at least three chunks of 64
    ref = hf_attentions(hf_eager, sequence_ids(tracer, prompt_ids))
    (got,) = rows
    picked = [0, 40, 70, n - 1]
    assert got.positions.tolist() == picked and got.weights.shape == (2, 4, 4, n)
    for j, p in enumerate(picked):
        np.testing.assert_allclose(got.weights[:, j, :, : p + 1], ref[[1, 2]][:, :, p, : p + 1], atol=ATOL)
        assert np.all(got.weights[:, j, :, p + 1:] == 0)
    for s, step in enumerate(new):
        q = n - 1 + s
        np.testing.assert_allclose(step.weights[0, 0, 0], ref[2, 2, q, : q + 1], atol=ATOL)


def test_the_prefix_cache_is_not_read_for_pattern_reads(client, hf_eager):
    """A prompt of more than one KV block (128 on the CPU) that the prefix cache holds: a
    trace without reads is served from it, one with a new-token pattern read is not (the
    prompt's keys must run through the model) and equals transformers."""
    prompt = " ".join(["Once upon a time, in a land far away, lived a fox."] * 12)
    for _ in range(2):
        with client.trace(prompt, max_tokens=2, **GREEDY) as plain:
            plain.all().samples.save()
    assert plain.result.num_cached_tokens >= 128
    with client.trace(prompt, max_tokens=2, **GREEDY) as tracer:
        pattern = tracer.all().attention(3, heads=[0], top_k=0).save()
    assert tracer.result.num_cached_tokens == 0
    prompt_ids = list(tracer.result.prompt_token_ids)
    ref = hf_attentions(hf_eager, sequence_ids(tracer, prompt_ids))[3, 0]
    for s, got in enumerate(pattern):
        q = len(prompt_ids) - 1 + s
        np.testing.assert_allclose(got.weights[0, 0, 0], ref[q, : q + 1], atol=ATOL)


def test_concurrent_sequences_keep_their_own_keys(client, hf_eager):
    """Two invokes (different prompts, one batch) each equal their own transformers run."""
    tracer = client.trace(max_tokens=3, **GREEDY)
    saved = []
    for prompt in (PROMPT, "Once upon a time there was"):
        with tracer.invoke(prompt) as inv:
            saved.append(inv.all().attention(0, top_k=0).save())
    tracer.run()
    for inv, pattern in zip(tracer.invokes, saved, strict=True):
        prompt_ids = list(inv.result.prompt_token_ids)
        ids = prompt_ids + list(inv.result.outputs[0].token_ids)[:-1]
        ref = hf_attentions(hf_eager, ids)[0]
        for s, got in enumerate(pattern):
            q = len(prompt_ids) - 1 + s
            np.testing.assert_allclose(got.weights[0, 0], ref[:, q, : q + 1], atol=ATOL)


def test_concurrent_top_k_reads_at_every_step_are_one_column(client, hf_eager, hf):
    """Traces whose only module reads are new-token top-k patterns (and layer reads) are
    block rows: each layer's top k is computed for all of them at once and goes to the
    host as one column (worker/module_reads._launch_pattern_column). Concurrent traces
    with different prompts and reads (two sharing one read, one over two layers beside a
    layer read) each equal their own transformers run."""
    import concurrent.futures

    k, steps = 4, STEPS
    prompts = (PROMPT, "Once upon a time there was", "One, two, three, four,")

    def one(prompt):
        with client.trace(prompt, max_tokens=steps, **GREEDY) as tracer:
            if prompt == prompts[2]:
                saved = tracer.all().attention([0, 3], top_k=3).save()
                stream = tracer.all().model.layers[1].output.save()
            else:
                saved = tracer.all().model.layers[1].self_attn.pattern(heads=[2, 1], top_k=k).save()
                stream = None
        return tracer, saved, stream

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    for prompt, (tracer, saved, stream) in zip(prompts, results, strict=True):
        prompt_ids = list(tracer.result.prompt_token_ids)
        ids = sequence_ids(tracer, prompt_ids)
        n = len(prompt_ids)
        assert list(tracer.result.outputs[0].token_ids) == hf.greedy(prompt_ids, steps), prompt
        attentions = hf_attentions(hf_eager, ids)
        layers, heads, top = ([0, 3], [0, 1, 2, 3], 3) if stream is not None else ([1], [2, 1], k)
        assert len(saved) == steps
        for s, got in enumerate(saved):
            q = n - 1 + s
            assert got.weights.shape == (len(layers), 1, len(heads), top) and got.positions.tolist() == [q]
            for li, layer in enumerate(layers):
                for hi, h in enumerate(heads):
                    row = attentions[layer, h, q, : q + 1]
                    np.testing.assert_allclose(got.weights[li, 0, hi], np.sort(row)[::-1][:top], atol=ATOL,
                                               err_msg=f"{prompt!r} step {s} layer {layer} head {h}")
                    np.testing.assert_allclose(row[got.keys[li, 0, hi]], np.sort(row)[::-1][:top], atol=ATOL)
        if stream is not None:
            with torch.no_grad():
                hidden = hf_eager(torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0].numpy()
            for s, value in enumerate(stream):
                np.testing.assert_allclose(value, hidden[n - 1 + s], atol=1e-4, err_msg=f"step {s}")


def test_bad_pattern_reads_name_the_field(eager):
    with grpc.insecure_channel(eager.target) as channel:
        stub = service_pb2_grpc.TraceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            run(stub, trace(invoke(PROMPT, iv("p", read_attention_pattern=I.ReadAttentionPattern(
                layers=[0], heads=[0, 4])))))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invokes[0].interventions[0].read_attention_pattern.heads[1]" in info.value.details()
        # full rows at every step of a long generation: over a small budget, up front
        with pytest.raises(grpc.RpcError) as info:
            request = trace(invoke(PROMPT, iv("p", read_attention_pattern=I.ReadAttentionPattern(layers=[0, 1]))),
                            max_tokens=64)
            request.options.max_read_bytes = 4096
            run(stub, request)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_model_info_says_where_patterns_are_served(eager, server, graph, bare):
    """GetModelInfo's attention_patterns_refusal and pattern_readable_layers: the eager
    server serves every layer; the shared compiled one (default graph hooks) every layer from
    its buffers; the graph server layers 0-2 (layers.3 refused naming the field and the flag);
    a compiled one without graph hooks (`bare`) none, saying why."""
    infos = {name: tw.Client(s.target, timeout=60).model_info()
             for name, s in (("eager", eager), ("server", server), ("graph", graph), ("bare", bare))}
    assert [(i.attention_patterns_refusal, i.pattern_readable_layers) for i in infos.values()] == [
        ("", []), ("", [0, 1, 2, 3]), ("", [0, 1, 2]), (infos["bare"].attention_patterns_refusal, [])]
    assert "--enforce-eager" in infos["bare"].attention_patterns_refusal
    assert "--compiled-pattern-reads" in infos["bare"].attention_patterns_refusal
    for target, layers, field in ((bare.target, [0], "read_attention_pattern: "),
                                  (graph.target, [1, 3], "read_attention_pattern.layers[1]: ")):
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as info:
            run(service_pb2_grpc.TraceServiceStub(channel), trace(invoke(PROMPT, iv("p", read_attention_pattern=(
                I.ReadAttentionPattern(layers=layers))))))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details().startswith(f"invokes[0].interventions[0].{field}"), info.value.details()
    assert "not on layer 3 (--compiled-pattern-reads LAYERS" in info.value.details()


# -- what the tiny model lacks: sliding windows and soft-capping (no engine) ------------


@pytest.mark.parametrize("heads", [(3, 0, 1), (0, 1, 2, 3)])  # (every head in order: GQA as a reshape)
@pytest.mark.parametrize(("window", "cap"), [(4, 5.0), (None, 5.0), (4, None)])
def test_sliding_window_and_soft_cap_equal_transformers_eager_attention(window, cap, heads):
    """The worker's computation (KeyCache, chunks, the new token's fast path, top-k) on
    random post-rotary q / k with a window and a cap, against transformers' Gemma 2 eager
    attention (soft-capping) under its own sliding-window causal mask (masking_utils)."""
    from types import SimpleNamespace

    from tracewire_server.shared import plan as P
    from tracewire_server.worker.attention_patterns import AttentionPatterns, _Task
    from tracewire_server.worker.runner import AttentionLayer
    from transformers import masking_utils
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    T, H, KV, D, scale = 13, 4, 2, 16, 0.25
    gen = torch.Generator().manual_seed(0)
    q, k = 3 * torch.randn(T, H, D, generator=gen), 3 * torch.randn(T, KV, D, generator=gen)
    mask_fn = (masking_utils.sliding_window_causal_mask_function(window) if window
               else masking_utils.causal_mask_function)
    idx = torch.arange(T)
    allowed = torch.stack([torch.stack([mask_fn(0, 0, i, j) for j in idx]) for i in idx])
    additive = torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    module = SimpleNamespace(num_key_value_groups=H // KV, training=False)
    _, ref = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     k.transpose(0, 1)[None], additive, scaling=scale, softcap=cap)
    ref = ref[0]  # [H, T, T]

    layer = AttentionLayer(None, H, KV, D, scale, window, cap, "")
    patterns = AttentionPatterns({0: layer})
    full = P.ReadAttentionPattern((0,), heads, P.Positions("all"), 0, (0, 1), D, T)
    top = P.ReadAttentionPattern((0,), heads, P.Positions("all"), 3, (0, 1), D, T)
    seq = SimpleNamespace(key_caches={}, patterns={}, error=None)
    # a prefill in two chunks (every prompt row), then three new tokens one pass each
    for first, last in [(0, 6), (6, 10), (10, 11), (11, 12), (12, 13)]:
        rows = list(range(last - first)) if last <= 10 else [0]
        patterns._tasks = {0: [_Task(seq, key, read, seq.key_caches.get(key), 0, last - first, first, rows,
                                     [first + r for r in rows]) for key, read in (("full@0", full), ("top@0", top))]}
        patterns._hook(0, (q[first:last], k[first:last]), {})
    assert seq.error is None
    chunks = seq.patterns["full@0"]
    assert [p for c in chunks for p in c.positions] == list(range(T))
    assert [p for c in seq.patterns["top@0"] for p in c.positions] == list(range(T))
    for chunk in chunks:
        for j, p in enumerate(chunk.positions):
            row = chunk.own()[0][j]  # [heads, keys]
            np.testing.assert_allclose(row.numpy(), ref[list(heads), p, : row.shape[-1]].numpy(), atol=1e-6)
    for chunk in seq.patterns["top@0"]:
        values, ids_of = chunk.own()  # (a new token's: its row of its batch's)
        for j, p in enumerate(chunk.positions):
            for h_index, h in enumerate(heads):
                want = ref[h, p, : p + 1]
                seen = int((allowed[p, : p + 1]).sum())
                ids = ids_of[j, h_index].tolist()
                np.testing.assert_allclose(values[j, h_index, : min(3, seen)].numpy(),
                                           torch.sort(want, descending=True).values[: min(3, seen)].numpy(), atol=1e-6)
                assert all(allowed[p, i] for i in ids[:seen]) and ids[seen:] == [-1] * max(0, 3 - seen)


def test_key_caches_go_when_no_read_needs_them():
    """A sequence's keys are kept while a pattern read can still be selected, and dropped
    after its last selected step, or when the runner lets go of the request (no engine)."""
    from tracewire_server.shared import plan as P
    from tracewire_server.worker.attention_patterns import AttentionPatterns
    from tracewire_server.worker.module_hooks import Span
    from tracewire_server.worker.runner import AttentionLayer
    from tracewire_server.worker.sequences import Sequence

    layer = AttentionLayer(None, 4, 2, 8, 0.5, None, None, "")
    patterns = AttentionPatterns({0: layer})
    read = P.ReadAttentionPattern((0,), (1,), P.Positions(), 2, (0,), 8, 10)
    plan = P.SequencePlan("k", (P.Op("p", P.StepSet(stop=2), None, read),))  # steps 0 and 1
    q, k = torch.randn(6, 4, 8), torch.randn(6, 2, 8)

    def run_pass(seq, live, n, pos0, drawn):
        """A forward pass of n tokens of the request from position pos0."""
        patterns.begin(live)
        patterns.plan("r", seq, Span.of(5, drawn, 0, n, pos0))
        patterns._hook(0, (q[:n], k[:n]), {})

    seq = Sequence(plan, needs_text=False, prompt_ids=[1, 2, 3, 4, 5])
    assert seq.reads_patterns
    run_pass(seq, {"r"}, 5, 0, 0)  # the prefill: step 0's query row
    assert seq.error is None and seq.key_caches["p@0"].known == 5 and len(seq.patterns["p@0"]) == 1
    seq.step = 1
    run_pass(seq, {"r"}, 1, 5, 1)
    assert seq.key_caches["p@0"].known == 6
    seq.step = 2  # past the read's last step: its keys go
    run_pass(seq, {"r"}, 1, 6, 2)
    assert seq.key_caches == {} and patterns._holders == {}
    other = Sequence(plan, needs_text=False, prompt_ids=[1, 2, 3, 4, 5])
    run_pass(other, {"r"}, 5, 0, 0)
    assert other.key_caches
    patterns.begin(set())  # the request ended before its last step
    assert other.key_caches == {} and patterns._holders == {}
    # every page went back to its pool, and the empty pool went
    assert patterns._pools == {}


def test_key_pool_pages_are_taken_reused_and_gathered_by_position():
    """The paged key store (no engine): each sequence's keys land at its own pages, a
    gather returns each one's positions in order whatever pages it holds, and pages go
    back when a cache goes."""
    from tracewire_server.worker.pattern_state import PAGE, KeyCache, KeyPool, gather

    pool = KeyPool(2, 4, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    a, b = (KeyCache(pool, (0, 1), 100, (0, 1, 2, 3), 2) for _ in range(2))
    keys_a, keys_b = torch.randn(40, 2, 4, generator=gen), torch.randn(40, 2, 4, generator=gen)

    def write(cache, start, keys):
        end = start + keys.shape[0]
        pool.write(torch.tensor(cache.slots(start, end)), keys, cache.kv_index)
        cache.wrote(end)

    for start, end in [(0, 5), (5, 21), (21, 22), (22, 40)]:  # interleaved: their pages interleave
        write(a, start, keys_a[start:end])
        write(b, start, keys_b[start:end])
    assert len(a.pages) == len(b.pages) == -(-40 // PAGE) and not set(a.pages) & set(b.pages)
    torch.testing.assert_close(a.upto(23), keys_a[:23], rtol=0, atol=0)
    both = gather([a, b], [40, 17])
    assert both.shape == (2, 40, 2, 4)
    torch.testing.assert_close(both[0], keys_a, rtol=0, atol=0)
    torch.testing.assert_close(both[1, :17], keys_b[:17], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="41 known|asked for"):
        gather([a], [41])
    with pytest.raises(RuntimeError, match="past the 100 positions"):
        a.slots(40, 101)
    with pytest.raises(RuntimeError, match="never ran through the model"):
        b.slots(41, 42)
    held = len(a.pages)
    del a
    assert pool.used == len(b.pages) and len(pool._free) >= held
    c = KeyCache(pool, (0, 1), 100, (0, 1), 2)
    write(c, 0, keys_a[:PAGE])
    assert pool.used == len(b.pages) + 1
    del b, c
    assert pool.used == 0 and pool.pages.shape[0] == 0
