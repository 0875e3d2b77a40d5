"""Tensor parallelism: a server with --tensor-parallel-size 2 against transformers.

One TP=2 server for the module (eager, vLLM's multiprocessing executor; on the CPU build
each rank is a process pinned to one core through VLLM_CPU_OMP_THREADS_BIND). Every kind
of read, write, stop and condition is compared with transformers on the same weights, not
with a TP=1 run of our own: equal within float32 tolerance, and each step's record exactly
once (every rank runs the hooks; one sends). What cannot be right under tensor parallelism
(heads and neurons, attention patterns: the heads are split across ranks) is refused with
FAILED_PRECONDITION naming the field.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
import tracewire as tw
from conftest import DICTIONARIES, start_server, stop_soon
from safetensors.numpy import load_file
from test_hidden_states import GREEDY, PROMPT, hf_lens, hf_module_outputs, hf_steered, steer
from trace_requests import cmp, f32, invoke, iv, logits, run, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc

ATOL = 1e-4  # float32 on both sides; TP=2 adds the all-reduces' reordered sums
LOGITS_ATOL = 2e-3
TP_ARGS = ("--tensor-parallel-size", "2", "--enforce-eager", "--distributed-executor-backend", "mp")
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (vLLM's CPU backend)
PROBE, SAE = "next-token-class", "res-l2-sae"  # the dictionaries shipped with the model, both on layers.2


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("tp"), *TP_ARGS, "--dictionaries", str(DICTIONARIES), env=TP_ENV)
    yield proc
    stop_soon(proc)


@pytest.fixture(scope="module")
def tstub(tp):
    with grpc.insecure_channel(tp.target) as channel:
        yield service_pb2_grpc.TraceServiceStub(channel)


def once_per_step(result, n, invoke=0):
    """Each step's record arrived exactly once, in order: one rank sends."""
    assert [s.step for s in result.seq(invoke)] == list(range(n))


def test_logits_samples_and_logprobs_at_every_step(tp, tstub, hf):
    with tw.Client(tp.target, timeout=60) as client:
        info = client.model_info()
    assert info.tensor_parallel_size == 2 and info.engine_mode == "eager"
    n, ids = 6, hf.encode(PROMPT)
    result = run(tstub, trace(invoke(PROMPT, iv("raw", read_logits=logits(raw=True)),
                                     iv("top", read_logits=logits(k=5)),
                                     iv("lp", read_logprobs=I.ReadLogprobs(top_k=3)),
                                     iv("s", read_sample=I.ReadSample())), max_tokens=n, **GREEDY))
    tokens = result.tokens()
    assert tokens == hf.greedy(ids, n)
    assert [int(v) for v in result.values("s")] == tokens
    once_per_step(result, n)
    for step in range(n):
        ref = hf.next_logits(ids + tokens[:step])
        np.testing.assert_allclose(result.values("raw")[step], ref.numpy(), atol=LOGITS_ATOL, rtol=1e-4)
        top = torch.topk(ref, 5)
        np.testing.assert_array_equal(result.ids("top")[step], top.indices.numpy())
        np.testing.assert_allclose(result.values("top")[step], top.values.numpy(), atol=LOGITS_ATOL)
        lp = torch.log_softmax(ref, -1)
        lp_ids, lp_vals = result.ids("lp")[step], result.values("lp")[step]
        assert lp_ids[0] == tokens[step] and list(lp_ids[1:]) == torch.topk(lp, 3).indices.tolist()
        np.testing.assert_allclose(lp_vals, lp[torch.from_numpy(lp_ids.astype(np.int64))].numpy(), atol=1e-3)


def dictionary_np(name, x):
    """dictionary.proto's arithmetic in numpy on the shipped weights (the probe: sigmoid;
    the SAE: ReLU after subtracting the decoder bias)."""
    w = load_file(str(DICTIONARIES / f"{name}.safetensors"))
    x = x.astype(np.float64)
    if name == PROBE:
        return 1 / (1 + np.exp(-(x @ w["W"].T + w["b"])))
    return np.maximum((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"], 0)


def test_module_reads_logit_lens_and_dictionaries(tstub, hf):
    n, ids = 3, hf.encode(PROMPT)
    paths = ["embed_tokens", "layers.0", "layers.1.self_attn", "layers.2.mlp", "layers.3", "norm"]
    prompt = I.Positions(all_prompt=I.AllPrompt())
    result = run(tstub, trace(invoke(
        PROMPT, *[iv(p, read_module=I.ReadModule(module=p, positions=prompt)) for p in paths],
        iv("new", read_module=I.ReadModule(module="layers.2")),
        iv("lens", read_logit_lens=I.ReadLogitLens(layers=[0, -1], positions=prompt, top_k=5)),
        iv("step_lens", read_logit_lens=I.ReadLogitLens(layers=[1], top_k=0)),
        iv("probe", read_dictionary=I.ReadDictionary(dictionary=PROBE)),
        iv("sae_top", read_dictionary=I.ReadDictionary(dictionary=SAE, top_k=I.TopK(k=5))),
        iv("sae_chosen", read_dictionary=I.ReadDictionary(
            dictionary=SAE, positions=I.Positions(prompt_list=I.PositionList(positions=[0, -1])),
            features=I.UnitIds(ids=[7, 3]))),
    ), max_tokens=n, **GREEDY))
    tokens = result.tokens()
    assert tokens == hf.greedy(ids, n)
    once_per_step(result, n)
    ref = hf_module_outputs(hf, ids)
    for path in paths:  # prompt positions, at step 0 only
        (value,) = result.values(path)
        np.testing.assert_allclose(value, ref[path], atol=ATOL, err_msg=path)
    # the logit lens: every rank's slice of the vocab-parallel lm_head, gathered
    (lens,), (lens_ids,) = result.values("lens"), result.ids("lens")
    assert lens.shape == (2, len(ids), 5)
    for k, layer in enumerate([0, 3]):
        top = torch.topk(hf_lens(hf, ref[f"layers.{layer}"]), 5, dim=-1)
        np.testing.assert_array_equal(lens_ids[k], top.indices.numpy())
        np.testing.assert_allclose(lens[k], top.values.numpy(), atol=1e-3)
    (chosen,) = result.values("sae_chosen")
    np.testing.assert_allclose(chosen, dictionary_np(SAE, ref["layers.2"][[0, -1]])[:, [7, 3]], atol=2e-4)
    for step in range(n):  # the new token of each step
        streams = hf_module_outputs(hf, ids + tokens[:step])
        np.testing.assert_allclose(result.values("new")[step], streams["layers.2"][-1], atol=ATOL)
        row = result.values("step_lens")[step]
        assert row.shape == (1, 1, hf.model.config.vocab_size)
        np.testing.assert_allclose(row[0], hf_lens(hf, streams["layers.1"][-1:]).numpy(), atol=1e-3)
        x = streams["layers.2"][-1:]
        np.testing.assert_allclose(result.values("probe")[step], dictionary_np(PROBE, x)[0], atol=2e-4)
        every = dictionary_np(SAE, x)[0]
        np.testing.assert_allclose(result.values("sae_top")[step], np.sort(every)[::-1][:5], atol=2e-4, rtol=1e-4)
        np.testing.assert_array_equal(np.sort(result.ids("sae_top")[step]), np.sort(np.argsort(-every)[:5]))


def test_module_and_logits_writes(tstub, hf):
    """A steering add (every step), a zero ablation at prompt positions, a bias write and a
    forced token: three invokes of one trace, each against its transformers run."""
    n, ids = 5, hf.encode(PROMPT)
    vector = np.random.default_rng(0).normal(size=hf.model.config.hidden_size).astype(np.float32)
    zero = I.WriteModule(module="layers.0", positions=I.Positions(prompt_list=I.PositionList(positions=[1, 2])),
                         zero=I.ZeroAblation())
    plain = hf.next_logits(ids)
    target, berlin = int(torch.topk(plain, 2).indices[1]), hf.encode(" Berlin")[0]
    bias = float(plain.max() - plain[target]) + 5.0
    raw = iv("raw", read_logits=logits(raw=True))
    result = run(tstub, trace(
        invoke(PROMPT, iv(write_module=steer(vector, scale=4.0)), raw),
        invoke(PROMPT, iv(write_module=zero), raw),
        invoke(PROMPT, iv("seen", sel=steps(at=[0]), read_logits=logits(ids=[target])),
               iv(sel=steps(at=[0]), write_logits=I.WriteLogits(bias=I.TokenBias(bias={target: bias}))),
               iv(sel=steps(at=[1]), force_sample=I.ForceSample(token_id=berlin))),
        max_tokens=n, **GREEDY))
    for k in range(3):
        once_per_step(result, n, k)
    # steering: layers.1 + 4 v at each new token
    tokens, seq = result.tokens(0), list(ids)
    assert tokens != hf.greedy(ids, n)  # the vector changes the continuation
    for step in range(n):
        ref = hf_steered(hf, seq, 1, lambda rows: rows + 4.0 * torch.from_numpy(vector), len(ids) - 1)
        np.testing.assert_allclose(result.values("raw", 0)[step], ref.numpy(), atol=LOGITS_ATOL, rtol=1e-4)
        assert tokens[step] == int(ref.argmax())
        seq.append(tokens[step])
    # zero ablation of layers.0 at prompt positions 1 and 2 (the prefill only)
    def zero_12(module, args, output):
        hidden = output[0].clone() if isinstance(output, tuple) else output.clone()
        hidden[0, 1:3] = 0
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = hf.model.model.layers[0].register_forward_hook(zero_12)
    try:
        with torch.no_grad():
            ablated = hf.model(torch.tensor([ids])).logits[0, -1].float()
    finally:
        handle.remove()
    np.testing.assert_allclose(result.values("raw", 1)[0], ablated.numpy(), atol=LOGITS_ATOL, rtol=1e-4)
    assert not np.allclose(result.values("raw", 1)[0], plain.numpy(), atol=1e-2)
    # the bias makes the runner-up win at step 0; step 1 is forced; then greedy again
    assert result.tokens(2) == [target, berlin] + hf.greedy(ids + [target, berlin], n - 2)
    np.testing.assert_allclose(result.values("seen", 2)[0], [float(plain[target]) + bias], atol=LOGITS_ATOL)


def test_stops_and_conditions(tstub, hf):
    """A stop at a step, a stop on a drawn token, a read on a dictionary condition and a
    force on an argmax condition, each at the steps transformers says."""
    n, ids = 8, hf.encode(PROMPT)
    greedy = hf.greedy(ids, n)
    period, paris, berlin = hf.encode(".")[0], hf.encode(" Paris")[0], hf.encode(" Berlin")[0]
    assert period in greedy and greedy[0] == paris
    probe = np.array([dictionary_np(PROBE, hf_module_outputs(hf, ids + greedy[:s])["layers.2"][-1:])[0, 0]
                      for s in range(n)])
    threshold = float(np.median(probe))
    assert 0 < (probe > threshold).sum() < n  # the condition goes both ways
    above = I.Condition(dictionary_value=I.DictionaryThreshold(
        dictionary=PROBE, feature=0, threshold=I.Threshold(comparison=cmp(">"), value=threshold)))
    result = run(tstub, trace(
        invoke(PROMPT, iv(sel=steps(at=[2]), stop=I.Stop())),
        invoke(PROMPT, iv(when=I.Condition(sampled_in=I.TokenSet(token_ids=[period])), stop=I.Stop())),
        invoke(PROMPT, iv("s", when=above, read_sample=I.ReadSample())),
        invoke(PROMPT, iv(when=I.Condition(argmax_in=I.TokenSet(token_ids=[paris])),
                          force_sample=I.ForceSample(token_id=berlin))),
        max_tokens=n, **GREEDY))
    assert result.tokens(0) == greedy[:3] and result.seq(0)[-1].stopped
    first = greedy.index(period)
    assert result.tokens(1) == greedy[: first + 1] and result.seq(1)[-1].stopped
    assert [s.step for s in result.seq(2) if "s" in s.values] == [s for s in range(n) if probe[s] > threshold]
    once_per_step(result, n, 2)
    forced = result.tokens(3)
    assert forced[0] == berlin and forced == [berlin] + hf.greedy(ids + [berlin], n - 1)


@pytest.mark.parametrize("intervention, field, why", [
    (I.Intervention(name="h", read_module=I.ReadModule(module="layers.1.self_attn.heads")),
     "read_module.module", "tensor parallelism splits"),
    (I.Intervention(write_module=I.WriteModule(module="layers.1.mlp.act", units=I.UnitIds(ids=[1]), add=f32([1.0]))),
     "write_module.module", "tensor parallelism splits"),
    (I.Intervention(name="p", read_attention_pattern=I.ReadAttentionPattern(layers=[0])),
     "read_attention_pattern", "tensor_parallel_size 2"),
])
def test_what_tensor_parallelism_splits_is_refused(tstub, intervention, field, why):
    """Heads and neurons are split across the ranks (o_proj's / down_proj's inputs), and
    so are the attention heads patterns are computed from: refused, never a rank's part."""
    with pytest.raises(grpc.RpcError) as info:
        run(tstub, trace(invoke(PROMPT, intervention), max_tokens=1))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"interventions[0].{field}" in info.value.details() and why in info.value.details()
