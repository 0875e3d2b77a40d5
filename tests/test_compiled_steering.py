"""Decoder-layer writes on a compiled engine (--compiled-steering), against transformers.

The server here runs vLLM compiled (torch.compile on the CPU; on a GPU also CUDA
graphs), with the writes built into the compiled graph as tables (steering.py). The
same edits applied by forward hooks in transformers are the reference; the eager
engine's module hooks (test_hidden_states.py) must give the same.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import numpy as np
import prefix_cache
import pytest
import torch
import tracewire as tw
from test_heads_neurons import (
    HEAD_DIM,
    STEPS,
    check_head_replace_and_add,
    check_logits,
    check_neuron_set_zero_and_add,
    check_write_against_hf,
    hf_inputs,
    zero_heads,
)
from test_heads_neurons import PROMPT as HEADS_PROMPT
from test_hidden_states import GREEDY, PROMPT, hf_steered, steer
from trace_requests import f32, invoke, iv, run, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc

RAW = I.ReadLogits(stage=I.LOGITS_STAGE_RAW, full=I.FullRow())


def hf_greedy_adding(hf, ids, n, vector, positions):
    """transformers' greedy continuation with `vector` added to layers.1's output at these
    token positions (in every forward pass that computes them)."""
    def hook(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        for pos in positions:
            if pos < hidden.shape[1]:
                hidden[0, pos] += vector
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = hf.model.model.layers[1].register_forward_hook(hook)
    try:
        return hf.greedy(ids, n)
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def steerable(graph):
    # conftest's compiled server: tables on the layers the tests write (the tiny model
    # has 4): layers.3 has none
    return graph


@pytest.fixture(scope="module")
def sstub(steerable):
    with grpc.insecure_channel(steerable.target) as channel:
        yield service_pb2_grpc.TraceServiceStub(channel)


def test_model_info_says_compiled_steering_and_its_layers(steerable):
    with tw.Client(steerable.target, timeout=60) as client:
        info = client.model_info()
    assert info.engine_mode == "compiled_steering" and info.steerable_layers == [0, 1, 2]
    assert info.unit_steerable_layers == [0, 1, 2]


# -- heads and neurons (--compiled-unit-steering) ----------------------------------------


@pytest.fixture(scope="module")
def gsdk(steerable):
    with tw.Client(steerable.target, timeout=120) as client:
        yield client


def test_head_and_neuron_writes_at_every_position_equal_hfs_pre_hooks(gsdk, hf):
    """The unit tables (o_proj's and down_proj's inputs through a * x + b): test_heads_neurons'
    writes and its transformers reference, on the compiled engine."""
    check_write_against_hf(gsdk, hf, lambda ref: ref.select([1, 3]).zero(), "layers.1.self_attn.heads", zero_heads)
    check_head_replace_and_add(gsdk, hf)
    check_neuron_set_zero_and_add(gsdk, hf)


def test_a_head_steered_at_every_new_token_and_a_read_of_it_equal_hf(gsdk, hf):
    """The steady path (the same write at every new token: one slot, kept while the batch
    decodes) and a unit read of the written head: the read sees the write."""
    n = len(hf.encode(HEADS_PROMPT))
    vector = np.random.default_rng(3).normal(size=HEAD_DIM).astype(np.float32) * 4
    with gsdk.trace(HEADS_PROMPT, max_tokens=STEPS, **GREEDY) as tracer:
        heads = tracer.all().model.layers[1].self_attn.heads.output
        heads.select([2]).add(vector)
        seen = heads.select([2, 0]).save()
        raw = tracer.all().logits.raw.save()

    def add_new(x):  # the new token's row of each pass (vLLM computes each position once)
        x[n - 1:, 2] += torch.from_numpy(vector)
        return x

    tokens = tracer.result.outputs[0].token_ids
    check_logits(hf, tokens, raw, {"layers.1.self_attn.heads": add_new})
    ref, _ = hf_inputs(hf, hf.encode(HEADS_PROMPT) + tokens[:-1], {"layers.1.self_attn.heads": add_new})
    for step in range(STEPS):
        np.testing.assert_allclose(seen[step], ref["layers.1.self_attn.heads"][n - 1 + step][[2, 0]], atol=1e-4)


def test_steering_every_step_matches_transformers(sstub, hf):
    vector = np.random.default_rng(0).normal(size=hf.model.config.hidden_size).astype(np.float32)
    ids = hf.encode(PROMPT)
    result = run(sstub, trace(invoke(PROMPT, iv(write_module=steer(vector, scale=4.0)), iv("raw", read_logits=RAW)),
                              max_tokens=6, **GREEDY))
    tokens = result.tokens()
    assert tokens != hf.greedy(ids, 6)  # the vector changes the continuation
    seq = list(ids)
    for step in range(6):
        ref = hf_steered(hf, seq, 1, lambda rows: rows + 4.0 * torch.from_numpy(vector), len(ids) - 1)
        np.testing.assert_allclose(result.values("raw")[step], ref.numpy(), atol=2e-3, rtol=1e-4)
        assert tokens[step] == int(ref.argmax())
        seq.append(tokens[step])


def test_replace_and_zero_at_prompt_positions(sstub, hf):
    hidden = hf.model.config.hidden_size
    ids = hf.encode(PROMPT)
    vector = np.random.default_rng(1).normal(size=hidden).astype(np.float32)
    at = I.Positions(prompt_list=I.PositionList(positions=[1, 2]))
    replace = I.WriteModule(module="layers.2", positions=at, replace=f32(vector))
    zero = I.WriteModule(module="layers.0", positions=I.Positions(prompt_list=I.PositionList(positions=[3])),
                         zero=I.ZeroAblation())
    writes = [iv(write_module=replace), iv(write_module=zero)]
    result = run(sstub, trace(invoke(PROMPT, *writes, iv("raw", read_logits=RAW)), max_tokens=1, **GREEDY))

    def edit(rows_of):
        def hook(module, args, output):
            hidden_states = (output[0] if isinstance(output, tuple) else output).clone()
            for pos, value in rows_of.items():
                hidden_states[0, pos] = value
            return (hidden_states, *output[1:]) if isinstance(output, tuple) else hidden_states
        return hook

    handles = [hf.model.model.layers[2].register_forward_hook(edit({1: torch.from_numpy(vector),
                                                                    2: torch.from_numpy(vector)})),
               hf.model.model.layers[0].register_forward_hook(edit({3: torch.zeros(hidden)}))]
    try:
        with torch.no_grad():
            ref = hf.model(torch.tensor([ids])).logits[0, -1].float()
    finally:
        for h in handles:
            h.remove()
    np.testing.assert_allclose(result.values("raw")[0], ref.numpy(), atol=2e-3, rtol=1e-4)
    assert not np.allclose(result.values("raw")[0], hf.next_logits(ids).numpy(), atol=1e-2)


def test_concurrent_steering_and_plain_requests_keep_to_their_rows(steerable, sstub, hf):
    rng = np.random.default_rng(3)
    vectors = [rng.normal(size=256).astype(np.float32) * s for s in (3.0, -3.0, 6.0)]
    # two writes on one layer compose in plan order: adding v and then -v is no write
    both = trace(invoke(PROMPT, iv(write_module=steer(vectors[0])), iv(write_module=steer(vectors[0], scale=-1.0))),
                 max_tokens=8, **GREEDY)
    requests = [trace(invoke(PROMPT, iv(write_module=steer(v))), max_tokens=8, **GREEDY) for v in vectors] + [both]
    solo = [run(sstub, r).tokens() for r in requests]
    assert len({tuple(t) for t in solo[:3]}) == 3
    assert solo[3] == hf.greedy(hf.encode(PROMPT), 8) != solo[0]
    client = tw.Client(steerable.target, timeout=120)
    story = "Once upon a time"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        plain = [pool.submit(client.generate, story, max_tokens=12, **GREEDY) for _ in range(3)]
        together = list(pool.map(lambda r: run(sstub, r).tokens(), requests * 2))
        outs = [f.result()[0] for f in plain]
    assert together == solo * 2
    assert all(o.outputs[0].token_ids == hf.greedy(hf.encode(story), 12) for o in outs)


def test_steering_from_a_later_step_only(sstub, hf):
    """Tables are cleared between forward passes: only the positions of the selected
    steps are steered (their keys and values stay steered in the cache, as in eager)."""
    vector = torch.from_numpy(np.random.default_rng(4).normal(size=256).astype(np.float32) * 8.0)
    late = iv(sel=steps(start=3, stop=5), write_module=steer(vector.numpy()))
    tokens = run(sstub, trace(invoke(PROMPT, late), max_tokens=8, **GREEDY)).tokens()
    ids = hf.encode(PROMPT)
    steered = {len(ids) - 1 + 3, len(ids) - 1 + 4}  # the position each selected step computes

    assert tokens == hf_greedy_adding(hf, ids, 8, vector, steered)
    assert tokens[:3] == hf.greedy(ids, 3) and tokens != hf.greedy(ids, 8)


def test_what_the_compiled_tables_cannot_do_is_refused(sstub, bare):
    zero = np.zeros(256, np.float32)
    cases = [  # (what the read buffers cannot read: test_compiled_reads.py)
        (iv(write_module=steer(zero, module="layers.3.mlp")), "write_module.module", "--compiled-module-steering"),
        (iv(write_module=steer(zero, module="layers.3")), "write_module.module", "layers 0, 1, 2 only"),
        (iv(write_module=I.WriteModule(module="layers.3.self_attn.heads", zero=I.ZeroAblation())),
         "write_module.module", "heads and MLP neurons on layers 0, 1, 2 only"),
    ]
    for intervention, field, says in cases:
        with pytest.raises(grpc.RpcError) as info:
            run(sstub, trace(invoke(PROMPT, intervention)))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, field
        assert f"interventions[0].{field}" in info.value.details() and says in info.value.details()
    # a compiled server without graph hooks names both ways out
    with grpc.insecure_channel(bare.target) as channel, pytest.raises(grpc.RpcError) as info:
        run(service_pb2_grpc.TraceServiceStub(channel), trace(invoke(PROMPT, iv(write_module=steer(zero)))))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enforce-eager" in info.value.details() and "--compiled-steering" in info.value.details()
    assert "--compiled-unit-steering" in info.value.details()
    # (a compiled graph without mean groups names --compiled-mean-ablation: test_compiler.py)


def test_slots_come_back_when_traces_end(sstub, hf):
    """More steering traces than the tables have slots (2 x --max-num-seqs + 1 = 65
    here), eight at a time: every one runs, and the last one still steers."""
    vector = np.random.default_rng(5).normal(size=256).astype(np.float32) * 4.0
    request = trace(invoke(PROMPT, iv(write_module=steer(vector))), max_tokens=2, **GREEDY)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: run(sstub, request).tokens(), range(100)))
    ids = hf.encode(PROMPT)
    first = int(hf_steered(hf, ids, 1, lambda rows: rows + torch.from_numpy(vector), len(ids) - 1).argmax())
    assert {tuple(r) for r in results} == {tuple(results[0])} and results[0][0] == first


def test_steering_gated_by_the_text_so_far(sstub, hf):
    """A text condition is decided before each forward pass: steering starts at step k,
    the first whose text so far contains the text of the first k plain tokens."""
    vector = torch.from_numpy(np.random.default_rng(6).normal(size=256).astype(np.float32) * 8.0)
    ids = hf.encode(PROMPT)
    plain = hf.greedy(ids, 8)
    texts = [hf.tokenizer.decode(plain[:k], skip_special_tokens=True) for k in range(8)]
    k = next(k for k in range(3, 8) if len(texts[k]) > len(texts[k - 1]))  # a token that adds text
    gated = iv(when=I.Condition(text_contains=texts[k]), write_module=steer(vector.numpy()))
    tokens = run(sstub, trace(invoke(PROMPT, gated), max_tokens=8, **GREEDY)).tokens()

    from_k = set(range(len(ids) - 1 + k, len(ids) + 8))  # the positions of steps k onwards
    assert tokens == hf_greedy_adding(hf, ids, 8, vector, from_k) != plain


@pytest.mark.parametrize("scenario", sorted(prefix_cache.SCENARIOS))
def test_compiled_writes_and_the_prefix_cache(sstub, hf, scenario):
    prefix_cache.SCENARIOS[scenario](sstub, hf, seed=200 + sorted(prefix_cache.SCENARIOS).index(scenario))
