"""Decoder-layer reads on a compiled engine (--compiled-reads), against transformers.

conftest's `graph` server runs vLLM compiled (torch.compile on the CPU; on a GPU also
CUDA graphs) with read buffers and steering tables on layers 0-2: the graph copies each
of those layers' residual stream into a buffer, and the host takes the rows its reads
select after the pass (shared/read_buffers.py). Every value is checked against the
same quantity computed from transformers' forward hooks on the same weights, and once
against the eager server (the same trace, the same values). Tolerance as the eager
tests': 1e-4 (float32 on both sides), 2e-4 for dictionaries.
"""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import numpy as np
import pytest
import torch
import tracewire as tw
from conftest import DICTIONARIES
from safetensors.numpy import load_file
from test_heads_neurons import hf_inputs
from test_hidden_states import GREEDY, PROMPT, hf_lens, hf_module_outputs, prompt_read, steer
from trace_requests import invoke, iv, run, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc

ATOL = 1e-4
RAW_LOGITS = I.ReadLogits(stage=I.LOGITS_STAGE_RAW, full=I.FullRow())


@pytest.fixture(scope="module")
def gstub(graph):
    with grpc.insecure_channel(graph.target) as channel:
        yield service_pb2_grpc.TraceServiceStub(channel)


@pytest.fixture(scope="module")
def bstub(bare):
    with grpc.insecure_channel(bare.target) as channel:
        yield service_pb2_grpc.TraceServiceStub(channel)


def test_model_info_lists_the_readable_layers(graph):
    with tw.Client(graph.target, timeout=60) as client:
        info = client.model_info()
    assert info.engine_mode == "compiled_steering"
    assert info.readable_layers == [0, 1, 2] and info.steerable_layers == [0, 1, 2]
    assert info.unit_readable_layers == [0, 1, 2]


def test_layer_reads_at_every_step_and_at_prompt_positions(gstub, hf):
    result = run(gstub, trace(invoke(
        PROMPT,
        iv("new", read_module=I.ReadModule(module="layers.2")),
        iv("prompt", read_module=prompt_read("layers.0")),
        iv("mean", read_module=I.ReadModule(module="layers.1", positions=I.Positions(all_prompt=I.AllPrompt()),
                                            reduction=I.REDUCTION_MEAN)),
        iv("listed", read_module=prompt_read("layers.1", prompt_list=I.PositionList(positions=[-1, 0]))),
    ), max_tokens=4, **GREEDY))
    ids = hf.encode(PROMPT)
    tokens = result.tokens()
    assert tokens == hf.greedy(ids, 4)
    ref = hf_module_outputs(hf, ids)
    np.testing.assert_allclose(result.values("prompt")[0], ref["layers.0"], atol=ATOL)
    np.testing.assert_allclose(result.values("mean")[0], ref["layers.1"].mean(0), atol=ATOL)
    np.testing.assert_allclose(result.values("listed")[0], ref["layers.1"][[0, len(ids) - 1]], atol=ATOL)  # ascending
    for step in range(4):
        step_ref = hf_module_outputs(hf, ids + tokens[:step])["layers.2"][-1]
        np.testing.assert_allclose(result.values("new")[step], step_ref, atol=ATOL, err_msg=f"step {step}")


def test_a_long_prompt_is_read_across_its_chunks(gstub, hf):
    """64-token passes: a 300-token prompt's rows come from five forward passes' buffers."""
    ids = hf.encode(" ".join(["The capital of France is Paris."] * 50))
    assert 64 * 3 < len(ids) < 500
    result = run(gstub, trace(invoke(ids, iv("h", read_module=prompt_read("layers.1"))), max_tokens=1, **GREEDY))
    np.testing.assert_allclose(result.values("h")[0], hf_module_outputs(hf, ids)["layers.1"], atol=5e-4)


def test_logit_lens_top_k_at_every_step(gstub, hf):
    ids = hf.encode(PROMPT)
    lens = I.ReadLogitLens(layers=[0, 2], top_k=5)
    prompt_lens = I.ReadLogitLens(layers=[1], positions=I.Positions(all_prompt=I.AllPrompt()), top_k=3)
    reads = [iv("lens", read_logit_lens=lens), iv("prompt", read_logit_lens=prompt_lens)]
    result = run(gstub, trace(invoke(PROMPT, *reads), max_tokens=3, **GREEDY))
    tokens = result.tokens()
    (prompt_values,), (prompt_ids,) = result.values("prompt"), result.ids("prompt")
    ref = hf_lens(hf, hf_module_outputs(hf, ids)["layers.1"])  # [positions, vocab]
    top = torch.topk(ref, 3, dim=-1)
    np.testing.assert_array_equal(prompt_ids[0], top.indices.numpy())
    np.testing.assert_allclose(prompt_values[0], top.values.numpy(), atol=ATOL)
    for step in range(3):
        outputs = hf_module_outputs(hf, ids + tokens[:step])
        for k, layer in enumerate([0, 2]):
            want = torch.topk(hf_lens(hf, outputs[f"layers.{layer}"][-1:]), 5, dim=-1)
            np.testing.assert_array_equal(result.ids("lens")[step][k], want.indices.numpy())
            np.testing.assert_allclose(result.values("lens")[step][k], want.values.numpy(), atol=ATOL)


def test_a_read_sees_the_steering_write_on_its_layer(gstub, hf):
    """The buffers' hooks run after the tables' on the same layer: a read of layers.1
    sees layers.1's write (as on an eager engine), and layers.2 what follows from it."""
    vector = np.random.default_rng(11).normal(size=hf.model.config.hidden_size).astype(np.float32) * 4.0
    result = run(gstub, trace(invoke(PROMPT, iv(write_module=steer(vector)),
                                     iv("l1", read_module=I.ReadModule(module="layers.1")),
                                     iv("l2", read_module=I.ReadModule(module="layers.2"))),
                              max_tokens=3, **GREEDY))
    ids, tokens = hf.encode(PROMPT), result.tokens()
    assert tokens != hf.greedy(ids, 3)  # the write changes the continuation
    for step in range(3):
        ref = _hf_steered_outputs(hf, ids + tokens[:step], torch.from_numpy(vector), start=len(ids) - 1)
        np.testing.assert_allclose(result.values("l1")[step], ref["layers.1"][-1], atol=ATOL)
        np.testing.assert_allclose(result.values("l2")[step], ref["layers.2"][-1], atol=ATOL)


def _hf_steered_outputs(hf, ids, vector, start):
    """hf_module_outputs with `vector` added to layers.1's output at positions >= start."""
    def add(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        hidden[0, start:] += vector
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = hf.model.model.layers[1].register_forward_hook(add)  # before hf_module_outputs' own hooks
    try:
        return hf_module_outputs(hf, ids)
    finally:
        handle.remove()


def _shipped(name):
    spec = json.loads((DICTIONARIES / f"{name}.json").read_text())
    return spec, {k: v.astype(np.float64) for k, v in load_file(DICTIONARIES / f"{name}.safetensors").items()}


def test_probe_and_sae_reads_and_a_probe_condition(gstub, hf):
    """The shipped dictionaries (both on layers.2) against numpy on transformers' stream."""
    probe_spec, probe = _shipped("next-token-class")
    sae_spec, sae = _shipped("res-l2-sae")
    assert probe_spec["module"] == sae_spec["module"] == "layers.2" and sae_spec["subtract_decoder_bias"]
    result = run(gstub, trace(invoke(
        PROMPT,
        iv("probe", read_dictionary=I.ReadDictionary(dictionary="next-token-class")),
        iv("top", read_dictionary=I.ReadDictionary(dictionary="res-l2-sae", top_k=I.TopK(k=4))),
        # a read made only at the steps where the probe says punctuation comes next
        iv("gated", when=I.Condition(dictionary_value=I.DictionaryThreshold(
            dictionary="next-token-class", feature=0, threshold=I.Threshold(comparison=I.COMPARISON_GREATER,
                                                                           value=0.5))),
           read_module=I.ReadModule(module="layers.0")),
    ), max_tokens=6, **GREEDY))
    ids, tokens = hf.encode(PROMPT), result.tokens()
    fired = []
    for step in range(6):
        stream = hf_module_outputs(hf, ids + tokens[:step])["layers.2"][-1].astype(np.float64)
        p = 1 / (1 + np.exp(-(probe["W"] @ stream + probe["b"])))
        np.testing.assert_allclose(result.values("probe")[step], p, atol=2e-4)
        z = np.maximum((stream - sae["b_dec"]) @ sae["W_enc"] + sae["b_enc"], 0)
        want = np.argsort(-z)[:4]
        np.testing.assert_array_equal(result.ids("top")[step], want)
        np.testing.assert_allclose(result.values("top")[step], z[want], atol=2e-4 * max(1, np.abs(z).max()))
        if p[0] > 0.5:
            fired.append(step)
    assert 0 < len(fired) < 6, fired  # the prompt makes the condition hold at some steps only
    assert len(result.values("gated")) == len(fired)


def test_concurrent_traces_take_their_own_rows(graph, gstub, hf):
    """Rows of one pass go to their own traces: the reads, and the logit lens, whose rows
    all go through one lm_head matmul per top_k (two kinds here: top 3 and top 2)."""
    prompts = [PROMPT, "The capital of Japan is", "Once upon a time", "Monday, Tuesday,"]
    layers = ["layers.0", "layers.1", "layers.2", "layers.1"]

    def one(prompt, layer):
        k = 3 if layer == "layers.1" else 2
        reads = [iv("h", read_module=I.ReadModule(module=layer)),
                 iv("lens", read_logit_lens=I.ReadLogitLens(layers=[int(layer[-1])], top_k=k))]
        return run(gstub, trace(invoke(prompt, *reads), max_tokens=3, **GREEDY))

    client = tw.Client(graph.target, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        plain = [pool.submit(client.generate, "Tuesday, Wednesday,", max_tokens=6, **GREEDY) for _ in range(2)]
        results = list(pool.map(one, prompts, layers))
        outs = [f.result()[0] for f in plain]
    for prompt, layer, res in zip(prompts, layers, results, strict=True):
        ids = hf.encode(prompt)
        for step, value in enumerate(res.values("h")):
            ref = hf_module_outputs(hf, ids + res.tokens()[:step])[layer][-1]
            np.testing.assert_allclose(value, ref, atol=ATOL, err_msg=f"{prompt} step {step}")
            want = torch.topk(hf_lens(hf, ref[None]), 3 if layer == "layers.1" else 2, dim=-1)
            np.testing.assert_array_equal(res.ids("lens")[step][0], want.indices.numpy())
            np.testing.assert_allclose(res.values("lens")[step][0], want.values.numpy(), atol=ATOL)
    assert all(o.outputs[0].token_ids == hf.greedy(hf.encode("Tuesday, Wednesday,"), 6) for o in outs)


def test_the_same_trace_reads_the_same_on_the_eager_server(gstub, eager):
    request = trace(invoke(PROMPT, iv("h", read_module=prompt_read("layers.2")),
                           iv("lens", read_logit_lens=I.ReadLogitLens(layers=[1, 2], top_k=4))),
                    max_tokens=3, **GREEDY)
    with grpc.insecure_channel(eager.target) as channel:
        eager_result = run(service_pb2_grpc.TraceServiceStub(channel), request)
    compiled = run(gstub, request)
    assert compiled.tokens() == eager_result.tokens()
    np.testing.assert_allclose(compiled.values("h")[0], eager_result.values("h")[0], atol=ATOL)
    for step in range(3):
        np.testing.assert_array_equal(compiled.ids("lens")[step], eager_result.ids("lens")[step])
        np.testing.assert_allclose(compiled.values("lens")[step], eager_result.values("lens")[step], atol=ATOL)


def test_head_and_neuron_reads_at_prompt_positions_and_every_step_equal_hf_and_the_eager_server(gstub, eager, hf):
    """The unit buffers (--compiled-unit-reads): o_proj's and down_proj's inputs, as HF's
    forward pre-hooks see them (test_heads_neurons' reference), and the eager server's."""
    steps, heads = 4, "layers.1.self_attn.heads"
    request = trace(invoke(
        PROMPT,
        iv("heads_new", read_module=I.ReadModule(module="layers.2.self_attn.heads")),
        iv("heads_prompt", read_module=I.ReadModule(module=heads, positions=I.Positions(all_prompt=I.AllPrompt()),
                                                    units=I.UnitSelection(ids=I.UnitIds(ids=[3, 0])))),
        iv("neurons_top", read_module=I.ReadModule(module="layers.0.mlp.act",
                                                   units=I.UnitSelection(top_k=I.TopK(k=5)))),
        iv("neurons_all", read_module=I.ReadModule(module="layers.2.mlp.act",
                                                   positions=I.Positions(all=I.AllPositions()),
                                                   units=I.UnitSelection(ids=I.UnitIds(ids=[7, 600])))),
        iv("neurons_mean", read_module=I.ReadModule(module="layers.1.mlp.act", reduction=I.REDUCTION_MEAN,
                                                    positions=I.Positions(all_prompt=I.AllPrompt()))),
    ), max_tokens=steps, **GREEDY)
    compiled = run(gstub, request)
    ids = hf.encode(PROMPT)
    tokens = compiled.tokens()
    assert tokens == hf.greedy(ids, steps)
    ref, _ = hf_inputs(hf, ids + tokens[:-1])
    n = len(ids)
    np.testing.assert_allclose(compiled.values("heads_prompt")[0], ref[heads][:n][:, [3, 0]], atol=ATOL)
    np.testing.assert_allclose(compiled.values("neurons_mean")[0], ref["layers.1.mlp.act"][:n].mean(0), atol=ATOL)
    every = compiled.values("neurons_all")
    assert [v.shape for v in every] == [(n, 2)] + [(2,)] * (steps - 1)  # the prompt's rows, then the new token's
    np.testing.assert_allclose(np.vstack(every), ref["layers.2.mlp.act"][:, [7, 600]], atol=ATOL)
    for step in range(steps):
        np.testing.assert_allclose(compiled.values("heads_new")[step], ref["layers.2.self_attn.heads"][n - 1 + step],
                                   atol=ATOL)
        row = ref["layers.0.mlp.act"][n - 1 + step]
        np.testing.assert_array_equal(compiled.ids("neurons_top")[step], np.argsort(-row)[:5])
        np.testing.assert_allclose(compiled.values("neurons_top")[step], np.sort(row)[::-1][:5], atol=ATOL)
    with grpc.insecure_channel(eager.target) as channel:
        eager_result = run(service_pb2_grpc.TraceServiceStub(channel), request)
    assert eager_result.tokens() == tokens
    for name in ("heads_new", "heads_prompt", "neurons_top", "neurons_all", "neurons_mean"):
        for served, expected in zip(compiled.values(name), eager_result.values(name), strict=True):
            np.testing.assert_allclose(served, expected, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("server", ["graph", "eager"])
def test_concurrent_head_and_neuron_reads_at_every_step_as_one_column_equal_hf(server, request, hf):
    """Traces that only read heads or neurons at each new token are block rows: every
    row reading a unit address is one column of its module input, each selection cut
    from it once (worker/module_reads.Column.units). Concurrent traces with different
    prompts and selections (ids, top k, every unit; two sharing one read) each get
    their own rows, on the compiled server's unit buffers and the eager server's hooks."""
    target = request.getfixturevalue(server).target
    steps = 4
    heads = I.ReadModule(module="layers.1.self_attn.heads", units=I.UnitSelection(ids=I.UnitIds(ids=[2, 0])))
    traces = {
        "The capital of France is": [iv("heads", read_module=heads)],
        "Tuesday, Wednesday,": [iv("heads", read_module=heads), iv("top", read_module=I.ReadModule(
            module="layers.2.mlp.act", units=I.UnitSelection(top_k=I.TopK(k=4))))],
        "One, two, three,": [iv("chosen", read_module=I.ReadModule(
            module="layers.0.mlp.act", units=I.UnitSelection(ids=I.UnitIds(ids=[5, 600])))),
            iv("every", read_module=I.ReadModule(module="layers.2.self_attn.heads"))],
    }

    def one(prompt):
        with grpc.insecure_channel(target) as channel:
            return run(service_pb2_grpc.TraceServiceStub(channel), trace(invoke(prompt, *traces[prompt]),
                                                                          max_tokens=steps, **GREEDY))

    with concurrent.futures.ThreadPoolExecutor(len(traces)) as pool:
        results = dict(zip(traces, pool.map(one, traces), strict=True))
    for prompt, res in results.items():
        ids = hf.encode(prompt)
        tokens = res.tokens()
        assert tokens == hf.greedy(ids, steps), prompt
        ref, _ = hf_inputs(hf, ids + tokens[:-1])
        names = {i.name for i in traces[prompt]}
        assert all(len(res.values(name)) == steps for name in names), prompt
        for step in range(steps):
            at = len(ids) - 1 + step
            msg = f"{prompt!r} step {step}"
            if "heads" in names:
                np.testing.assert_allclose(res.values("heads")[step], ref["layers.1.self_attn.heads"][at][[2, 0]],
                                           atol=ATOL, err_msg=msg)
            if "top" in names:
                row = ref["layers.2.mlp.act"][at]
                np.testing.assert_array_equal(res.ids("top")[step], np.argsort(-row)[:4], err_msg=msg)
                np.testing.assert_allclose(res.values("top")[step], np.sort(row)[::-1][:4], atol=ATOL, err_msg=msg)
            if "chosen" in names:
                np.testing.assert_allclose(res.values("chosen")[step], ref["layers.0.mlp.act"][at][[5, 600]],
                                           atol=ATOL, err_msg=msg)
                assert res.values("every")[step].shape == (4, 64)
                np.testing.assert_allclose(res.values("every")[step], ref["layers.2.self_attn.heads"][at],
                                           atol=ATOL, err_msg=msg)


def test_what_the_read_buffers_cannot_read_is_refused_naming_the_field(gstub, bstub):
    cases = [
        (iv("h", read_module=I.ReadModule(module="layers.3")), "read_module.module", "layers 0, 1, 2 only"),
        (iv("h", read_module=I.ReadModule(module="layers.3.mlp")), "read_module.module",
         "'layers.3.mlp' (--compiled-module-reads LAYERS"),
        (iv("h", read_module=I.ReadModule(module="layers.3.self_attn.heads")), "read_module.module",
         "heads and MLP neurons in read buffers on layers 0, 1, 2 only"),
        (iv("h", read_module=I.ReadModule(module="layers.3.mlp.act")), "read_module.module",
         "'layers.3.mlp.act' (--compiled-unit-reads LAYERS"),
        (iv(write_module=I.WriteModule(module="layers.3.mlp.act", zero=I.ZeroAblation())), "write_module.module",
         "'layers.3.mlp.act' (--compiled-unit-steering LAYERS"),
        (iv("l", read_logit_lens=I.ReadLogitLens(layers=[1, -1])), "read_logit_lens.layers[1]",
         "'layers.3' (--compiled-reads LAYERS)"),
        (iv("p", read_attention_pattern=I.ReadAttentionPattern(layers=[3])), "read_attention_pattern.layers[0]",
         "not on layer 3 (--compiled-pattern-reads LAYERS"),
        (iv(write_dictionary=I.WriteDictionary(dictionary="res-l2-sae", features=list(range(9)), clamp=2.0)),
         "write_dictionary.features", "--enforce-eager"),
    ]
    for intervention, field, says in cases:
        with pytest.raises(grpc.RpcError) as info:
            run(gstub, trace(invoke(PROMPT, intervention)))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, field
        assert f"interventions[0].{field}" in info.value.details() and says in info.value.details(), (
            info.value.details())
    # a compiled server without graph hooks names both ways out
    with pytest.raises(grpc.RpcError) as info:
        run(bstub, trace(invoke(PROMPT, iv("h", read_module=I.ReadModule(module="layers.0")))))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enforce-eager" in info.value.details() and "--compiled-reads" in info.value.details()
    assert "--compiled-unit-reads" in info.value.details()


def test_the_default_server_keeps_every_layer_and_reads_and_writes_layer_3_as_hf_and_eager(server, stub, eager, hf):
    """`make serve`'s server (no --compiled-* flag): the tiny model fits --graph-hook-bytes'
    default, so its graph has every kind of hook on every layer, layers.3 (the one the
    `graph` server leaves out) included; ModelInfo says so, and a layer, head and neuron read
    there equal transformers', a neuron zero there the eager server's logits."""
    with tw.Client(server.target, timeout=60) as client:
        info = client.model_info()
    everything = [0, 1, 2, 3]
    assert info.engine_mode == "compiled_steering"
    assert (info.readable_layers, info.steerable_layers) == (everything, everything)
    assert (info.unit_readable_layers, info.unit_steerable_layers) == (everything, everything)
    reads = trace(invoke(
        PROMPT,
        iv("layer", read_module=prompt_read("layers.3")),
        iv("heads", read_module=I.ReadModule(module="layers.3.self_attn.heads",
                                             positions=I.Positions(all_prompt=I.AllPrompt()))),
        iv("neurons", read_module=I.ReadModule(module="layers.3.mlp.act", units=I.UnitSelection(ids=I.UnitIds(
            ids=[5, 100])))),
    ), max_tokens=1, **GREEDY)
    result = run(stub, reads)
    ids = hf.encode(PROMPT)
    np.testing.assert_allclose(result.values("layer")[0], hf_module_outputs(hf, ids)["layers.3"], atol=ATOL)
    ref, _ = hf_inputs(hf, ids)
    np.testing.assert_allclose(result.values("heads")[0], ref["layers.3.self_attn.heads"], atol=ATOL)
    np.testing.assert_allclose(result.values("neurons")[0], ref["layers.3.mlp.act"][-1, [5, 100]], atol=ATOL)
    zeroed = trace(invoke(PROMPT, iv(write_module=I.WriteModule(module="layers.3.mlp.act",
                                                                units=I.UnitIds(ids=list(range(0, 640, 3))),
                                                                zero=I.ZeroAblation())),
                          iv("raw", read_logits=RAW_LOGITS)), max_tokens=3, **GREEDY)
    with grpc.insecure_channel(eager.target) as channel:
        expected = run(service_pb2_grpc.TraceServiceStub(channel), zeroed)
    got = run(stub, zeroed)
    assert got.tokens() == expected.tokens()
    for step in range(3):
        np.testing.assert_allclose(got.values("raw")[step], expected.values("raw")[step], atol=ATOL)
    unwritten = run(stub, trace(invoke(PROMPT, iv("raw", read_logits=RAW_LOGITS)),
                                max_tokens=1, **GREEDY))
    assert not np.allclose(unwritten.values("raw")[0], got.values("raw")[0], atol=1e-3)  # the write did something
