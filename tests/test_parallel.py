"""Tensor and pipeline parallelism: a server with --tensor-parallel-size 2, and one with
--pipeline-parallel-size 2, against transformers.

One server per setting for the module (eager, vLLM's multiprocessing executor; on the CPU
build each rank is a process pinned to one core through VLLM_CPU_OMP_THREADS_BIND). Every
kind of read, write, stop and condition is compared with transformers on the same weights,
not with a TP=1 run of our own: equal within float32 tolerance, and each step's record
exactly once (under pipeline parallelism each stage sends its part: layers 0-1 of the tiny
model's 4 are on the first stage, 2-3 on the last, which draws). What cannot be right is
refused with FAILED_PRECONDITION naming the field: under tensor parallelism heads, neurons
and attention patterns (split across the ranks); under pipeline parallelism what needs the
last stage (lm_head, the sample) on the first stage's layers.
"""

from __future__ import annotations

from typing import NamedTuple

import grpc
import numpy as np
import pytest
import torch
import tracewire as tw
from conftest import DICTIONARIES, MODEL, stop_soon, take
from safetensors.numpy import load_file
from server_pool import ServerSpec, servers
from test_attention_patterns import hf_attentions
from test_dictionaries import register
from test_heads_neurons import READ_ATOL, hf_inputs
from test_hidden_states import GREEDY, PROMPT, hf_lens, hf_module_outputs, hf_steered, steer
from trace_requests import cmp, f32, invoke, iv, logits, run, steps, trace
from tracewire.v1 import dictionary_pb2 as D
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc
from tracewire_server.shared.limits import LENS_WORK
from transformers import AutoModelForCausalLM

ATOL = 1e-4  # float32 on both sides; the ranks add all-reduces' reordered sums
LOGITS_ATOL = 2e-3
PROBE, SAE = "next-token-class", "res-l2-sae"  # the dictionaries shipped with the model, both on layers.2
ONE_CORE_EACH = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # (vLLM's CPU backend: a core per rank)


class Setting(NamedTuple):
    """A parallel setting and the modules its tests address (under pipeline parallelism
    the logit lens reads the last stage's layers: layers.2 and layers.3)."""

    flags: tuple[str, ...]
    lens: tuple[int, ...]  # logit-lens layers at prompt positions
    step_lens: int  # the layer logit-lensed at each new token


READS = ("embed_tokens", "layers.0", "layers.1.self_attn", "layers.2.mlp", "layers.3", "norm")  # every position
SETTINGS = {
    "tp2": Setting(("--tensor-parallel-size", "2"), (0, -1), 1),
    "pp2": Setting(("--pipeline-parallel-size", "2"), (2, -1), 2),
}


class Parallel(NamedTuple):
    name: str
    setting: Setting
    target: str
    stub: service_pb2_grpc.TraceServiceStub


# the eager server of each setting (`par`), and the compiled TP=2 one
EAGER_SPECS = {name: ServerSpec(name, (*setting.flags, "--enforce-eager", "--distributed-executor-backend", "mp",
                                       "--dictionaries", str(DICTIONARIES)), env=ONE_CORE_EACH)
               for name, setting in SETTINGS.items()}
COMPILED_TP2 = ServerSpec("tp2-compiled", ("--tensor-parallel-size", "2", "--compiled-reads", "--compiled-steering",
                                           "--compiled-unit-reads", "--compiled-unit-steering",
                                           "--compiled-module-reads", "--compiled-module-steering",
                                           "--compiled-mean-ablation",
                                           "--distributed-executor-backend", "mp"),
                          env=ONE_CORE_EACH)
pytestmark = servers(*EAGER_SPECS.values())


@pytest.fixture(scope="module", params=list(SETTINGS))
def par(request):
    setting = SETTINGS[request.param]
    proc = take(EAGER_SPECS[request.param])
    try:
        with grpc.insecure_channel(proc.target) as channel:
            yield Parallel(request.param, setting, proc.target, service_pb2_grpc.TraceServiceStub(channel))
    finally:
        stop_soon(proc)


def once_per_step(result, n, invoke=0):
    """Each step's record arrived exactly once, in order (one worker per stage sends)."""
    assert [s.step for s in result.seq(invoke)] == list(range(n))


def test_logits_samples_and_logprobs_at_every_step(par, hf):
    with tw.Client(par.target, timeout=60) as client:
        info = client.model_info()
    assert info.tensor_parallel_size == (2 if par.name == "tp2" else 1) and info.engine_mode == "eager"
    # the stages' layers (the tiny model's 4 over 2 stages), and the lens's bound for its lm_head
    assert info.pipeline_parallel_size == (2 if par.name == "pp2" else 1)
    assert info.stage_first_layers == ([0, 2] if par.name == "pp2" else [0])
    assert info.max_lens_rows == min(LENS_WORK // (info.vocab_size * info.hidden_size), 2**31 - 1)
    n, ids = 6, hf.encode(PROMPT)
    result = run(par.stub, trace(invoke(PROMPT, iv("raw", read_logits=logits(raw=True)),
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


def test_module_reads_logit_lens_and_dictionaries(par, hf):
    n, ids, setting = 3, hf.encode(PROMPT), par.setting
    prompt = I.Positions(all_prompt=I.AllPrompt())
    lensed = f"layers.{setting.step_lens}"
    result = run(par.stub, trace(invoke(
        PROMPT, *[iv(p, read_module=I.ReadModule(module=p, positions=prompt)) for p in READS],
        iv("new0", read_module=I.ReadModule(module="layers.0")),
        iv("new3", read_module=I.ReadModule(module="layers.3")),
        iv("lens", read_logit_lens=I.ReadLogitLens(layers=list(setting.lens), positions=prompt, top_k=5)),
        iv("step_lens", read_logit_lens=I.ReadLogitLens(layers=[setting.step_lens], top_k=0)),
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
    for path in READS:  # prompt positions, at step 0 only
        (value,) = result.values(path)
        np.testing.assert_allclose(value, ref[path], atol=ATOL, err_msg=path)
    # the logit lens (under tensor parallelism: every rank's slice of lm_head, gathered)
    (lens,), (lens_ids,) = result.values("lens"), result.ids("lens")
    assert lens.shape == (2, len(ids), 5)
    for k, layer in enumerate(setting.lens):
        top = torch.topk(hf_lens(hf, ref[f"layers.{layer % 4}"]), 5, dim=-1)
        np.testing.assert_array_equal(lens_ids[k], top.indices.numpy())
        np.testing.assert_allclose(lens[k], top.values.numpy(), atol=1e-3)
    (chosen,) = result.values("sae_chosen")
    np.testing.assert_allclose(chosen, dictionary_np(SAE, ref["layers.2"][[0, -1]])[:, [7, 3]], atol=2e-4)
    for step in range(n):  # the new token of each step
        streams = hf_module_outputs(hf, ids + tokens[:step])
        np.testing.assert_allclose(result.values("new0")[step], streams["layers.0"][-1], atol=ATOL)
        np.testing.assert_allclose(result.values("new3")[step], streams["layers.3"][-1], atol=ATOL)
        row = result.values("step_lens")[step]
        assert row.shape == (1, 1, hf.model.config.vocab_size)
        np.testing.assert_allclose(row[0], hf_lens(hf, streams[lensed][-1:]).numpy(), atol=1e-3)
        x = streams["layers.2"][-1:]
        np.testing.assert_allclose(result.values("probe")[step], dictionary_np(PROBE, x)[0], atol=2e-4)
        every = dictionary_np(SAE, x)[0]
        np.testing.assert_allclose(result.values("sae_top")[step], np.sort(every)[::-1][:5], atol=2e-4, rtol=1e-4)
        np.testing.assert_array_equal(np.sort(result.ids("sae_top")[step]), np.sort(np.argsort(-every)[:5]))


def hf_zeroed(hf, ids, layer):
    """transformers' last-position logits with layer `layer`'s output zeroed at positions 1, 2."""
    def zero(rows):  # (rows from position 0)
        rows = rows.clone()
        rows[1:3] = 0
        return rows

    return hf_steered(hf, ids, layer, zero, 0)


def test_module_and_logits_writes(par, hf):
    """A steering add (every step), a zero ablation at prompt positions, a bias write and a
    forced token: three invokes of one trace, each against its transformers run."""
    n, ids = 5, hf.encode(PROMPT)
    vector = np.random.default_rng(0).normal(size=hf.model.config.hidden_size).astype(np.float32)
    zero = I.WriteModule(module="layers.0", zero=I.ZeroAblation(),
                         positions=I.Positions(prompt_list=I.PositionList(positions=[1, 2])))
    plain = hf.next_logits(ids)
    target, berlin = int(torch.topk(plain, 2).indices[1]), hf.encode(" Berlin")[0]
    bias = float(plain.max() - plain[target]) + 5.0
    raw = iv("raw", read_logits=logits(raw=True))
    result = run(par.stub, trace(
        invoke(PROMPT, iv(write_module=steer(vector, scale=4.0, module="layers.1")), raw),
        invoke(PROMPT, iv(write_module=zero), raw),
        invoke(PROMPT, iv("seen", sel=steps(at=[0]), read_logits=logits(ids=[target])),
               iv(sel=steps(at=[0]), write_logits=I.WriteLogits(bias=I.TokenBias(bias={target: bias}))),
               iv(sel=steps(at=[1]), force_sample=I.ForceSample(token_id=berlin))),
        max_tokens=n, **GREEDY))
    for k in range(3):
        once_per_step(result, n, k)
    # steering: + 4 v at each new token
    tokens, seq = result.tokens(0), list(ids)
    assert tokens != hf.greedy(ids, n)  # the vector changes the continuation
    for step in range(n):
        ref = hf_steered(hf, seq, 1, lambda rows: rows + 4.0 * torch.from_numpy(vector), len(ids) - 1)
        np.testing.assert_allclose(result.values("raw", 0)[step], ref.numpy(), atol=LOGITS_ATOL, rtol=1e-4)
        assert tokens[step] == int(ref.argmax())
        seq.append(tokens[step])
    # zero ablation at prompt positions 1 and 2 (the prefill only)
    zeroed = result.values("raw", 1)[0]
    np.testing.assert_allclose(zeroed, hf_zeroed(hf, ids, 0).numpy(), atol=LOGITS_ATOL, rtol=1e-4)
    assert not np.allclose(zeroed, plain.numpy(), atol=1e-2)
    # the bias makes the runner-up win at step 0; step 1 is forced; then greedy again
    assert result.tokens(2) == [target, berlin] + hf.greedy(ids + [target, berlin], n - 2)
    np.testing.assert_allclose(result.values("seen", 2)[0], [float(plain[target]) + bias], atol=LOGITS_ATOL)


def test_stops_and_conditions(par, hf):
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
    result = run(par.stub, trace(
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


@pytest.mark.parametrize("par", ["pp2"], indirect=True)
def test_heads_neurons_patterns_and_dictionaries_on_both_pipeline_stages(par, hf):
    """Under pipeline parallelism each stage holds its layers' every head and neuron:
    attention patterns and neuron writes on the first stage, head reads on the last, and a
    dictionary of a first-stage layer, equal transformers' (tensor parallelism splits heads
    and neurons: refused, below)."""
    eager = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32, attn_implementation="eager")
    prompt = I.Positions(all_prompt=I.AllPrompt())
    pattern = I.ReadAttentionPattern(layers=[0], positions=I.Positions(all=I.AllPositions()), top_k=0)
    heads = I.ReadModule(module="layers.3.self_attn.heads", positions=prompt,
                         units=I.UnitSelection(ids=I.UnitIds(ids=[2, 0])))
    zero = I.WriteModule(module="layers.1.mlp.act", positions=prompt, units=I.UnitIds(ids=[1, 2]),
                         zero=I.ZeroAblation())
    w = {"W": np.random.default_rng(3).normal(size=(2, 256)).astype(np.float32), "b": np.zeros(2, np.float32)}
    register(par.stub, "early-probe", D.DictionarySpec(kind=D.DICTIONARY_KIND_PROBE, module="layers.1",
                                                       probe_activation=D.PROBE_ACTIVATION_SIGMOID), w)
    result = run(par.stub, trace(invoke(PROMPT, iv("p", read_attention_pattern=pattern), iv("h", read_module=heads),
                                        iv("d", read_dictionary=I.ReadDictionary(dictionary="early-probe"))),
                                 invoke(PROMPT, iv(write_module=zero), iv("raw", read_logits=logits(raw=True))),
                                 max_tokens=3, **GREEDY))
    ids = hf.encode(PROMPT)
    n, tokens = len(ids), result.tokens()
    once_per_step(result, 3)
    ref = hf_attentions(eager, ids + tokens[:-1])[0]  # [heads, T, T]
    np.testing.assert_allclose(result.values("p")[0][0], ref[:, :n, :n].transpose(1, 0, 2), atol=1e-5)
    for s in range(1, 3):
        q = n - 1 + s  # the new token's position
        np.testing.assert_allclose(result.values("p")[s][0, 0], ref[:, q, : q + 1], atol=1e-5)
        x = hf_module_outputs(hf, ids + tokens[:s])["layers.1"][-1].astype(np.float64)
        np.testing.assert_allclose(result.values("d")[s], 1 / (1 + np.exp(-(w["W"] @ x + w["b"]))), atol=2e-4)
    inputs, _ = hf_inputs(hf, ids)
    np.testing.assert_allclose(result.values("h")[0], inputs["layers.3.self_attn.heads"][:, [2, 0]], atol=READ_ATOL)

    def zero_12(x):
        x[:, [1, 2]] = 0
        return x

    _, zeroed = hf_inputs(hf, ids, {"layers.1.mlp.act": zero_12})
    np.testing.assert_allclose(result.values("raw", 1)[0], zeroed, atol=LOGITS_ATOL, rtol=1e-4)
    assert not np.allclose(zeroed, hf.next_logits(ids).numpy(), atol=1e-4)


REFUSED = {
    "tp2": [
        (I.Intervention(name="h", read_module=I.ReadModule(module="layers.1.self_attn.heads")),
         "read_module.module", "tensor parallelism splits"),
        (I.Intervention(write_module=I.WriteModule(module="layers.1.mlp.act", units=I.UnitIds(ids=[1]),
                                                   add=f32([1.0]))),
         "write_module.module", "tensor parallelism splits"),
        (I.Intervention(name="p", read_attention_pattern=I.ReadAttentionPattern(layers=[0])),
         "read_attention_pattern", "tensor_parallel_size 2"),
    ],
    "pp2": [  # what needs the last stage (lm_head, the sample) of the first stage's layers 0 and 1
        (I.Intervention(name="l", read_logit_lens=I.ReadLogitLens(layers=[3, 1])),
         "read_logit_lens.layers", "the logit lens (lm_head) runs on the last pipeline stage"),
        (I.Intervention(name="r", read_module=I.ReadModule(module="layers.0"), condition=I.Condition(
            argmax_in=I.TokenSet(token_ids=[1]))), "condition", "conditions are decided on the last pipeline stage"),
        (I.Intervention(write_module=steer(np.ones(256, np.float32), module="layers.1"), condition=I.Condition(
            text_contains="x")), "condition", "'layers.1' is on stage 0"),
        (I.Intervention(name="p", read_attention_pattern=I.ReadAttentionPattern(layers=[1, 2])),
         "read_attention_pattern.layers", "layers must be on one pipeline stage"),
        (I.Intervention(name="s", read_sample=I.ReadSample(), condition=I.Condition(
            dictionary_value=I.DictionaryThreshold(dictionary="early-probe", feature=0, threshold=I.Threshold(
                comparison=cmp(">"), value=0.5)))),
         "condition", "dictionary 'early-probe''s condition runs on the last pipeline stage"),
    ],
}


def test_what_cannot_be_right_is_refused(par):
    """Tensor parallelism splits heads and neurons across the ranks (o_proj's / down_proj's
    inputs), and the heads patterns are computed from; under pipeline parallelism the first
    stage's layers have no lm_head and no sample. Refused, never a part or nothing."""
    if par.name == "pp2":  # (a probe of layers.1, for the condition on it)
        spec = D.DictionarySpec(kind=D.DICTIONARY_KIND_PROBE, module="layers.1",
                                probe_activation=D.PROBE_ACTIVATION_SIGMOID)
        register(par.stub, "early-probe", spec, {"W": np.ones((1, 256), np.float32), "b": np.zeros(1, np.float32)})
    for intervention, field, why in REFUSED[par.name]:
        with pytest.raises(grpc.RpcError) as info:
            run(par.stub, trace(invoke(PROMPT, intervention), max_tokens=1))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, field
        assert f"interventions[0].{field}" in info.value.details() and why in info.value.details(), \
            info.value.details()


@servers(COMPILED_TP2)
def test_compiled_reads_and_steering_under_tensor_parallel(hf):
    """A compiled TP=2 engine (--compiled-reads --compiled-steering --compiled-unit-*):
    every rank fills its steering tables and read buffers in the graph, the first sends; the
    reads see the write, the lens gathers the vocab-parallel lm_head. Heads and neurons,
    which TP=1 serves from the unit buffers, each rank holds only part of: refused naming
    the field, as on the eager TP=2 engine. Activation patching of layers: each rank keeps
    the source's rows and patches through its own tables. The other modules' outputs (whole
    on every rank: their linears reduce) are read, written and mean-ablated as at TP=1."""
    from test_compiled_modules import check_layer_and_module_means, check_module_outputs, check_module_writes
    from test_compiled_reads import _hf_steered_outputs
    from test_hidden_states import prompt_read
    from test_patching import check_prompt_position_patches

    proc = take(COMPILED_TP2)
    try:
        with grpc.insecure_channel(proc.target) as channel:
            stub = service_pb2_grpc.TraceServiceStub(channel)
            check_prompt_position_patches(stub, hf)
            check_module_outputs(stub, hf)
            check_module_writes(stub, hf)
            check_layer_and_module_means(stub, hf)
        vector = np.random.default_rng(11).normal(size=hf.model.config.hidden_size).astype(np.float32) * 4.0
        with grpc.insecure_channel(proc.target) as channel:
            result = run(service_pb2_grpc.TraceServiceStub(channel), trace(invoke(
                PROMPT, iv("prompt", read_module=prompt_read("layers.0")), iv(write_module=steer(vector)),
                iv("l2", read_module=I.ReadModule(module="layers.2")),
                iv("lens", read_logit_lens=I.ReadLogitLens(layers=[0, 2], top_k=5))), max_tokens=4, **GREEDY))
            refused = {}
            for field, unit in [("read_module", iv("h", read_module=I.ReadModule(module="layers.1.self_attn.heads"))),
                                ("write_module", iv(write_module=I.WriteModule(module="layers.1.mlp.act",
                                                                               zero=I.ZeroAblation())))]:
                with pytest.raises(grpc.RpcError) as info:
                    run(service_pb2_grpc.TraceServiceStub(channel), trace(invoke(PROMPT, unit)))
                refused[field] = info.value
    finally:
        stop_soon(proc)
    for field, error in refused.items():
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, field
        assert f"interventions[0].{field}.module" in error.details() and "--tensor-parallel-size 1" in error.details()
    ids, tokens = hf.encode(PROMPT), result.tokens()
    once_per_step(result, 4)
    np.testing.assert_allclose(result.values("prompt")[0], hf_module_outputs(hf, ids)["layers.0"], atol=ATOL)
    for step in range(4):
        ref = _hf_steered_outputs(hf, ids + tokens[:step], torch.from_numpy(vector), start=len(ids) - 1)
        np.testing.assert_allclose(result.values("l2")[step], ref["layers.2"][-1], atol=ATOL)
        for k, layer in enumerate([0, 2]):
            want = torch.topk(hf_lens(hf, ref[f"layers.{layer}"][-1:]), 5, dim=-1)
            np.testing.assert_array_equal(result.ids("lens")[step][k], want.indices.numpy())
            np.testing.assert_allclose(result.values("lens")[step][k], want.values.numpy(), atol=ATOL)
