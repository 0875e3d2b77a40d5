"""Attention heads (layers.L.self_attn.heads) and MLP neurons (layers.L.mlp.act) against
transformers' forward PRE-hooks on the same weights: HF's o_proj input is the heads'
output, its down_proj input the neurons'.

The session's eager server (conftest's `eager`: module hooks fire only in eager steps), the real SDK for reads and
writes, the raw stubs for the statuses. Tolerances: reads 1e-4 absolute (float32 on
both sides, as tests/test_hidden_states.py); logits under a write 2e-3 absolute (a
forward pass of float32 kernels that differ between vLLM's CPU build and torch), and
the greedy tokens exactly.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
import tracewire as tw
from trace_requests import f32, invoke, iv, run, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc

PROMPT = "The capital of France is"
READ_ATOL = 1e-4
LOGITS_ATOL = 2e-3
GREEDY = dict(temperature=0.0, ignore_eos=True)
STEPS = 5
HEADS, HEAD_DIM, NEURONS = 4, 64, 640  # models/tracewire-tiny (GQA: 2 KV heads)


@pytest.fixture(scope="module")
def sdk(eager):
    with tw.Client(eager.target, timeout=120) as client:
        yield client


def hf_inputs(hf, ids, edits=None):
    """A full forward over `ids` with PRE-hooks on every layer's o_proj and down_proj:
    {path: [positions, ...] input as the module got it}, after `edits` {path: fn(x)}
    (x: [positions, heads, head_dim] for heads, [positions, neurons] for neurons, a
    copy; the hook feeds fn's result on), and the last position's logits."""
    found, handles, edits = {}, [], edits or {}

    def hook(path, heads):
        def pre(module, args):
            x = args[0][0].clone()
            x = x.view(x.shape[0], HEADS, HEAD_DIM) if heads else x
            if path in edits:
                x = edits[path](x)
            found[path] = x.clone().numpy()
            return (x.reshape(1, x.shape[0], -1),)
        return pre

    for i, layer in enumerate(hf.model.model.layers):
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(hook(f"layers.{i}.self_attn.heads", True)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(hook(f"layers.{i}.mlp.act", False)))
    try:
        with torch.no_grad():
            logits = hf.model(torch.tensor([ids])).logits[0, -1].float().numpy()
    finally:
        for h in handles:
            h.remove()
    return found, logits


def test_model_info_lists_heads_and_neurons_with_shapes(sdk):
    info = sdk.model_info()
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim, info.intermediate_size) == (
        HEADS, 2, HEAD_DIM, NEURONS)
    modules = {m.path: m for m in info.modules}
    for layer in range(info.num_layers):
        heads, act = modules[f"layers.{layer}.self_attn.heads"], modules[f"layers.{layer}.mlp.act"]
        assert (heads.kind, heads.shape, heads.output_size) == ("attention_heads", (HEADS, HEAD_DIM), HEADS * HEAD_DIM)
        assert (act.kind, act.shape, act.output_size) == ("mlp_activation", (NEURONS,), NEURONS)
    assert modules["layers.0"].shape == (256,)


def test_head_reads_at_prompt_positions_and_every_new_token_equal_hf(sdk, hf):
    with sdk.trace(PROMPT, max_tokens=STEPS, **GREEDY) as tracer:
        prompt = tracer.iter[0].module("layers.1.self_attn.heads", positions="prompt").select([2, 0]).save()
        new = tracer.all().model.layers[3].self_attn.heads.output.save()
        one = tracer.all().model.layers[0].self_attn.heads.output.select(1).save()
        mean = tracer.iter[0].module("layers.2.self_attn.heads", positions="prompt", mean=True).select([3]).save()
    ids = hf.encode(PROMPT)
    tokens = tracer.result.outputs[0].token_ids
    assert tokens == hf.greedy(ids, STEPS)
    ref, _ = hf_inputs(hf, ids + tokens[:-1])
    n = len(ids)
    assert prompt[0].shape == (n, 2, HEAD_DIM)
    np.testing.assert_allclose(prompt[0], ref["layers.1.self_attn.heads"][:n][:, [2, 0]], atol=READ_ATOL)
    np.testing.assert_allclose(mean[0], ref["layers.2.self_attn.heads"][:n][:, [3]].mean(0), atol=READ_ATOL)
    assert len(new) == len(one) == STEPS
    for step in range(STEPS):
        assert new[step].shape == (HEADS, HEAD_DIM) and one[step].shape == (1, HEAD_DIM)
        np.testing.assert_allclose(new[step], ref["layers.3.self_attn.heads"][n - 1 + step], atol=READ_ATOL)
        np.testing.assert_allclose(one[step], ref["layers.0.self_attn.heads"][n - 1 + step][[1]], atol=READ_ATOL)


def check_write_against_hf(sdk, hf, write, path, edit):
    """Run `write(view)` at every position of every step with the raw logits read; compare
    each step's logits and greedy token with HF's under `edit` on `path` (all positions)."""
    with sdk.trace(PROMPT, max_tokens=STEPS, **GREEDY) as tracer:
        write(tracer.all().module(path, positions="all"))
        raw = tracer.all().logits.raw.save()
    check_logits(hf, tracer.result.outputs[0].token_ids, raw, {path: edit})


def check_logits(hf, tokens, raw, edits):
    """Each step's logits and greedy token equal HF's under `edits`, and the edits move
    the logits (far more than the tolerance: a write that did nothing fails)."""
    seq = list(hf.encode(PROMPT))
    _, plain = hf_inputs(hf, seq)
    assert np.abs(raw[0] - plain).max() > 50 * LOGITS_ATOL
    for step in range(STEPS):
        _, logits = hf_inputs(hf, seq, edits)
        np.testing.assert_allclose(raw[step], logits, atol=LOGITS_ATOL)
        assert tokens[step] == int(logits.argmax())
        seq.append(tokens[step])


def zero_heads(x, heads=(1, 3)):
    x[:, list(heads)] = 0
    return x


def test_head_zero_ablation_equals_hf(sdk, hf):
    check_write_against_hf(sdk, hf, lambda ref: ref.select([1, 3]).zero(), "layers.1.self_attn.heads", zero_heads)


def test_head_replace_and_add_equal_hf(sdk, hf):
    check_head_replace_and_add(sdk, hf)


def check_head_replace_and_add(sdk, hf):
    """A replace and an add of chosen heads on `sdk`'s server, each against HF's pre-hook
    (test_compiled_steering runs them on the compiled server too)."""
    rng = np.random.default_rng(0)
    vector = rng.normal(size=HEAD_DIM).astype(np.float32) * 3
    per_head = rng.normal(size=(2, HEAD_DIM)).astype(np.float32) * 3

    def replace(x):
        x[:, [0, 2]] = torch.from_numpy(vector)
        return x

    def add(x):
        x[:, [3, 1]] += 2.5 * torch.from_numpy(per_head)
        return x

    check_write_against_hf(sdk, hf, lambda ref: ref.select([0, 2]).replace(vector), "layers.2.self_attn.heads", replace)
    check_write_against_hf(sdk, hf, lambda ref: ref.select([3, 1]).add(per_head, scale=2.5),
                           "layers.0.self_attn.heads", add)


def test_head_mean_ablation_over_the_prompt_equals_hf(sdk, hf):
    ids = hf.encode(PROMPT)
    n = len(ids)
    with sdk.trace(PROMPT, max_tokens=STEPS, **GREEDY) as tracer:
        tracer.iter[0].module("layers.0.self_attn.heads", positions="prompt").select([0, 1, 2, 3]).mean_ablate()
        raw = tracer.all().logits.raw.save()

    def mean(x):  # causal: the prompt's rows do not depend on later tokens
        x[:n] = x[:n].mean(0, keepdim=True)
        return x

    check_logits(hf, tracer.result.outputs[0].token_ids, raw, {"layers.0.self_attn.heads": mean})


def test_neuron_reads_at_ids_and_top_k_equal_hf(sdk, hf):
    with sdk.trace(PROMPT, max_tokens=STEPS, **GREEDY) as tracer:
        chosen = tracer.iter[0].module("layers.2.mlp.act", positions="prompt").select([600, 5, 17]).save()
        top = tracer.all().model.layers[1].mlp.act.output.top_k(8).save()
        top_prompt = tracer.iter[0].module("layers.3.mlp.act", positions=[-2, -1]).top_k(3).save()
        full = tracer.all().model.layers[0].mlp.act.output.save()
        every = tracer.all().module("layers.1.mlp.act", positions="all").select([5, 6]).save()
        every_top = tracer.all().module("layers.3.mlp.act", positions="all").top_k(2).save()
    ids = hf.encode(PROMPT)
    tokens = tracer.result.outputs[0].token_ids
    ref, _ = hf_inputs(hf, ids + tokens[:-1])
    n = len(ids)
    # "all": the prompt's rows at step 0, then the new token's as [1, ...]
    assert [v.shape for v in every] == [(n, 2)] + [(1, 2)] * (STEPS - 1)
    np.testing.assert_allclose(np.concatenate(every), ref["layers.1.mlp.act"][:, [5, 6]], atol=READ_ATOL)
    assert [t.ids.shape for t in every_top] == [(n, 2)] + [(1, 2)] * (STEPS - 1)
    expect = torch.topk(torch.from_numpy(ref["layers.3.mlp.act"]), 2)
    np.testing.assert_array_equal(np.concatenate([t.ids for t in every_top]), expect.indices.numpy())
    np.testing.assert_allclose(chosen[0], ref["layers.2.mlp.act"][:n][:, [600, 5, 17]], atol=READ_ATOL)
    expect = torch.topk(torch.from_numpy(ref["layers.3.mlp.act"][n - 2:n]), 3)
    np.testing.assert_allclose(top_prompt[0].values, expect.values.numpy(), atol=READ_ATOL)
    np.testing.assert_array_equal(top_prompt[0].ids, expect.indices.numpy())
    for step in range(STEPS):
        row = ref["layers.1.mlp.act"][n - 1 + step]
        order = np.argsort(-row)[:8]
        np.testing.assert_array_equal(top[step].ids, order)
        np.testing.assert_allclose(top[step].values, row[order], atol=READ_ATOL)
        np.testing.assert_allclose(full[step], ref["layers.0.mlp.act"][n - 1 + step], atol=READ_ATOL)


def test_neuron_set_zero_and_add_equal_hf(sdk, hf):
    check_neuron_set_zero_and_add(sdk, hf)


def check_neuron_set_zero_and_add(sdk, hf):
    """A set, a zero and an add of chosen neurons on `sdk`'s server, each against HF's
    pre-hook (test_compiled_steering runs them on the compiled server too)."""
    ids = [3, 100, 511]
    values = np.array([8.0, -6.0, 5.0], np.float32)

    def set_(x):
        x[:, ids] = torch.from_numpy(values)
        return x

    many = list(range(1, NEURONS, 4))  # (a few neurons barely move the logits)

    def zero(x):
        x[:, many] = 0
        return x

    def add(x):
        x[:, ids] += 3.0 * torch.from_numpy(values)
        return x

    check_write_against_hf(sdk, hf, lambda ref: ref.select(ids).set(values), "layers.1.mlp.act", set_)
    check_write_against_hf(sdk, hf, lambda ref: ref.select(many).zero(), "layers.1.mlp.act", zero)
    check_write_against_hf(sdk, hf, lambda ref: ref.select(ids).add(values, scale=3.0), "layers.2.mlp.act", add)


def test_bad_unit_requests_are_refused_naming_the_field(eager):
    with grpc.insecure_channel(eager.target) as channel:
        stub = service_pb2_grpc.TraceServiceStub(channel)
        heads = I.ReadModule(module="layers.1.self_attn.heads", units=I.UnitSelection(ids=I.UnitIds(ids=[4])))
        with pytest.raises(grpc.RpcError) as info:
            run(stub, trace(invoke(PROMPT, iv("h", read_module=heads)), max_tokens=1))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invokes[0].interventions[0].read_module.units.ids.ids[0]" in info.value.details()
        write = I.WriteModule(module="layers.1.mlp.act", units=I.UnitIds(ids=[1, 2]), add=f32([1.0]))
        with pytest.raises(grpc.RpcError) as info:
            run(stub, trace(invoke(PROMPT, iv(write_module=write)), max_tokens=1))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invokes[0].interventions[0].write_module.add.shape" in info.value.details()
        # the server goes on serving unit reads
        ok = run(stub, trace(invoke(PROMPT, iv("h", read_module=I.ReadModule(module="layers.1.self_attn.heads"))),
                             max_tokens=1))
        assert ok.values("h")[0].shape == (HEADS, HEAD_DIM)
