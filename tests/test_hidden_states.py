"""Module reads against transformers' forward hooks on the same weights.

Module hooks only fire in eager engine steps, so these tests use the session's eager
server (conftest's `eager`: --enforce-eager and a small --max-num-batched-tokens, forcing
long prompts through chunked prefill). Tolerance: 1e-4 absolute (float32 on both sides).
"""

from __future__ import annotations

import grpc
import numpy as np
import prefix_cache
import pytest
import torch
import tracewire as tw
from trace_requests import invoke, iv, run, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc

PROMPT = "The capital of France is"
ATOL = 1e-4
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def estub(eager):
    with grpc.insecure_channel(eager.target) as channel:
        yield service_pb2_grpc.TraceServiceStub(channel)


def test_model_info_says_eager(eager):
    with tw.Client(eager.target, timeout=60) as client:
        info = client.model_info()
    assert info.engine_mode == "eager" and info.steerable_layers == []


def hf_module_outputs(hf, ids):
    """{path: [positions, hidden]} from forward hooks on the transformers model."""
    model = hf.model.model
    found, handles = {}, []

    def keep(path):
        def hook(module, args, output):
            found[path] = (output[0] if isinstance(output, tuple) else output)[0].detach().clone()
        return hook

    modules = {"embed_tokens": model.embed_tokens, "norm": model.norm}
    for i, layer in enumerate(model.layers):
        modules.update({f"layers.{i}": layer, f"layers.{i}.mlp": layer.mlp, f"layers.{i}.self_attn": layer.self_attn})
    for path, module in modules.items():
        handles.append(module.register_forward_hook(keep(path)))
    try:
        with torch.no_grad():
            hf.model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return {k: v.numpy() for k, v in found.items()}


def prompt_read(module, **positions):
    sel = I.Positions(**positions) if positions else I.Positions(all_prompt=I.AllPrompt())
    return I.ReadModule(module=module, positions=sel)


def test_every_module_at_every_prompt_position(estub, hf):
    paths = ["embed_tokens", "layers.0", "layers.0.self_attn", "layers.2.mlp", "layers.3", "norm"]
    result = run(estub, trace(invoke(PROMPT, *[iv(p, read_module=prompt_read(p)) for p in paths]),
                              max_tokens=2, **GREEDY))
    ref = hf_module_outputs(hf, hf.encode(PROMPT))
    for path in paths:
        (value,) = result.values(path)
        assert value.shape == ref[path].shape, path
        np.testing.assert_allclose(value, ref[path], atol=ATOL, err_msg=path)
        positions = result.seq()[0].values[path].positions
        assert list(np.frombuffer(positions.data, "<i4")) == list(range(len(hf.encode(PROMPT))))


def test_layer_reads_at_each_generated_step(estub, hf):
    result = run(estub, trace(invoke(PROMPT, iv("h", read_module=I.ReadModule(module="layers.2")),
                                     iv("last", read_module=I.ReadModule(module="layers.3"))),
                              max_tokens=4, **GREEDY))
    ids = hf.encode(PROMPT)
    tokens = result.tokens()
    assert tokens == hf.greedy(ids, 4)
    for step in range(4):
        ref = hf_module_outputs(hf, ids + tokens[:step])
        np.testing.assert_allclose(result.values("h")[step], ref["layers.2"][-1], atol=ATOL)
        np.testing.assert_allclose(result.values("last")[step], ref["layers.3"][-1], atol=ATOL)


def test_position_selections_and_mean(estub, hf):
    ids = hf.encode(PROMPT)
    ref = hf_module_outputs(hf, ids)["layers.1"]
    result = run(estub, trace(invoke(
        PROMPT,
        iv("range", read_module=prompt_read("layers.1", prompt_range=I.PositionRange(start=1, stop=-1))),
        iv("list", read_module=prompt_read("layers.1", prompt_list=I.PositionList(positions=[-1, 0]))),
        iv("mean", read_module=I.ReadModule(module="layers.1", positions=I.Positions(all_prompt=I.AllPrompt()),
                                            reduction=I.REDUCTION_MEAN)),
        iv("all", read_module=I.ReadModule(module="layers.1", positions=I.Positions(all=I.AllPositions()))),
    ), max_tokens=2, **GREEDY))
    np.testing.assert_allclose(result.values("range")[0], ref[1:-1], atol=ATOL)
    np.testing.assert_allclose(result.values("list")[0], ref[[0, len(ids) - 1]], atol=ATOL)
    np.testing.assert_allclose(result.values("mean")[0], ref.mean(0), atol=ATOL)
    assert len(result.values("mean")) == 1  # prompt reads happen once, at step 0
    prompt_rows, new_token = result.values("all")
    np.testing.assert_allclose(prompt_rows, ref, atol=ATOL)
    step1 = hf_module_outputs(hf, ids + result.tokens()[:1])["layers.1"][-1]
    np.testing.assert_allclose(new_token, step1, atol=ATOL)


def test_chunked_prefill_and_prefix_cache_give_the_same_reads(estub, hf):
    """A 300-token prompt runs in 64-token chunks; the second run would hit the prefix
    cache, which prompt reads must not skip."""
    text = " ".join(["The capital of France is Paris."] * 50)
    ids = hf.encode(text)
    assert 64 * 3 < len(ids) < 500
    ref = hf_module_outputs(hf, ids)["layers.2"]
    for _ in range(2):
        result = run(estub, trace(invoke(ids, iv("h", read_module=prompt_read("layers.2"))), max_tokens=1, **GREEDY))
        (value,) = result.values("h")
        np.testing.assert_allclose(value, ref, atol=5e-4)


def test_concurrent_module_reads_stay_in_their_rows(estub, hf):
    import concurrent.futures

    prompts = [PROMPT, "The capital of Japan is", "Once upon a time", "Monday, Tuesday,"]

    def one(p):
        read = iv("h", read_module=I.ReadModule(module="layers.1"))
        return run(estub, trace(invoke(p, read), max_tokens=3, **GREEDY))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, prompts))
    for p, res in zip(prompts, results, strict=True):
        ids = hf.encode(p)
        for step, value in enumerate(res.values("h")):
            ref = hf_module_outputs(hf, ids + res.tokens()[:step])["layers.1"][-1]
            np.testing.assert_allclose(value, ref, atol=ATOL, err_msg=f"{p} step {step}")


def test_sdk_module_reads(eager, hf):
    client = tw.Client(eager.target, timeout=120)
    with client.trace(PROMPT, max_tokens=3, **GREEDY) as tracer:
        prompt_rows = tracer.iter[0].module("layers.3", positions="prompt").save()
        new = tracer.all().module("layers.3").save()
    ids = hf.encode(PROMPT)
    np.testing.assert_allclose(prompt_rows.value, hf_module_outputs(hf, ids)["layers.3"], atol=ATOL)
    assert len(new) == 3 and new[0].shape == (hf.model.config.hidden_size,)


def test_sdk_read_shapes_follow_one_rule_per_read(eager, hf):
    """Module reads: "new" and mean=True give [hidden] at every step; any other positions
    give [positions, hidden] at every step ("all": the prompt's rows at step 0, then the
    new token's as [1, hidden]). The logit lens is a TopK of [layers, positions, k]
    whatever top_k (top_k=0: k = vocab, ids the vocabulary in order)."""
    client = tw.Client(eager.target, timeout=120)
    hidden, vocab = hf.model.config.hidden_size, hf.model.config.vocab_size
    ids = hf.encode(PROMPT)
    with client.trace(PROMPT, max_tokens=3, **GREEDY) as tracer:
        every = tracer.all().module("layers.2", positions="all").save()
        listed = tracer.iter[0].module("layers.2", positions=[0, -1]).save()
        new = tracer.all().module("layers.2").save()
        mean = tracer.iter[0].module("layers.2", positions="prompt", mean=True).save()
        full_lens = tracer.all().logit_lens([1, 3], positions="all", top_k=0).save()
        top_lens = tracer.all().logit_lens([1, 3], positions="all", top_k=2).save()
    assert [v.shape for v in every] == [(len(ids), hidden), (1, hidden), (1, hidden)]
    np.testing.assert_allclose(every[1][0], new[1], atol=ATOL)
    assert listed.value.shape == (2, hidden) and mean.value.shape == (hidden,)
    assert [v.shape for v in new] == [(hidden,)] * 3
    for full, top in zip(full_lens, top_lens, strict=True):
        assert isinstance(full, tw.TopK) and isinstance(top, tw.TopK)
        positions = full.values.shape[1]
        assert full.values.shape == full.ids.shape == (2, positions, vocab)
        assert top.values.shape == top.ids.shape == (2, positions, 2)
        np.testing.assert_array_equal(full.ids[1, -1], np.arange(vocab))
        np.testing.assert_allclose(np.take_along_axis(full.values, top.ids.astype(np.int64), -1), top.values, atol=1e-6)
    assert [lens.values.shape[1] for lens in full_lens] == [len(ids), 1, 1]


def test_bad_module_reads(estub, stub):
    with pytest.raises(grpc.RpcError) as info:
        run(estub, trace(invoke(PROMPT, iv("h", read_module=I.ReadModule(module="layers.99")))))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invokes[0].interventions[0].read_module.module" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        run(estub, trace(invoke(PROMPT, iv("h", read_module=prompt_read(
            "layers.0", prompt_list=I.PositionList(positions=[2, 50]))))))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "read_module.positions.prompt_list.positions[1]" in info.value.details()
    # The session server runs compiled: a module that does not exist is the same error there
    # (what its graph does not keep is refused naming the flag: test_compiled_modules.py).
    with pytest.raises(grpc.RpcError) as compiled:
        run(stub, trace(invoke(PROMPT, iv("h", read_module=I.ReadModule(module="layers.99")))))
    assert compiled.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert compiled.value.details() == info_eager_unknown(estub)


def info_eager_unknown(estub):
    with pytest.raises(grpc.RpcError) as info:
        run(estub, trace(invoke(PROMPT, iv("h", read_module=I.ReadModule(module="layers.99")))))
    return info.value.details()


def hf_lens(hf, stream):
    with torch.no_grad():
        logits = hf.model.lm_head(hf.model.model.norm(torch.from_numpy(stream)))
    return torch.log_softmax(logits.float(), -1)


def test_logit_lens_equals_norm_and_lm_head_on_transformers_states(estub, hf):
    ids = hf.encode(PROMPT)
    lens = I.ReadLogitLens(layers=[0, 2, -1], positions=I.Positions(all_prompt=I.AllPrompt()), top_k=5)
    step_lens = I.ReadLogitLens(layers=[1], top_k=0)
    result = run(estub, trace(invoke(PROMPT, iv("lens", read_logit_lens=lens), iv("step", read_logit_lens=step_lens)),
                              max_tokens=3, **GREEDY))
    ref = hf_module_outputs(hf, ids)
    (values,), (token_ids,) = result.values("lens"), result.ids("lens")
    assert values.shape == token_ids.shape == (3, len(ids), 5)
    for k, layer in enumerate([0, 2, 3]):
        expected = hf_lens(hf, ref[f"layers.{layer}"])
        top = torch.topk(expected, 5, dim=-1)
        np.testing.assert_array_equal(token_ids[k], top.indices.numpy())
        np.testing.assert_allclose(values[k], top.values.numpy(), atol=1e-3)
    # the last layer's lens at the last position is the model's own next-token logprobs
    final = torch.log_softmax(hf.next_logits(ids), -1)
    np.testing.assert_allclose(values[2, -1], torch.topk(final, 5).values.numpy(), atol=1e-3)
    # full rows at the new token of each step
    for step, row in enumerate(result.values("step")):
        assert row.shape == (1, 1, hf.model.config.vocab_size)
        stream = hf_module_outputs(hf, ids + result.tokens()[:step])["layers.1"][-1:]
        np.testing.assert_allclose(row[0], hf_lens(hf, stream).numpy(), atol=1e-3)


def test_logit_lens_bad_layers(estub):
    with pytest.raises(grpc.RpcError) as info:
        run(estub, trace(invoke(PROMPT, iv("l", read_logit_lens=I.ReadLogitLens(layers=[4])))))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "read_logit_lens.layers[0]" in info.value.details()


def hf_steered(hf, ids, layer, edit, start):
    """Full-forward logits at the last position with `edit(rows)` applied to layer `layer`'s
    output at positions >= start (the positions vLLM processed as new tokens)."""
    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        hidden[0, start:] = edit(hidden[0, start:])
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = hf.model.model.layers[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            return hf.model(torch.tensor([ids])).logits[0, -1].float()
    finally:
        handle.remove()


def steer(vector, scale=1.0, module="layers.1", **positions):
    from trace_requests import f32

    sel = I.Positions(**positions) if positions else I.Positions(new_token=I.NewToken())
    return I.WriteModule(module=module, positions=sel, add=f32(vector), scale=scale)


def test_steering_vector_matches_the_same_hook_in_transformers(estub, hf):
    rng = np.random.default_rng(0)
    vector = rng.normal(size=hf.model.config.hidden_size).astype(np.float32)
    ids = hf.encode(PROMPT)
    result = run(estub, trace(invoke(PROMPT, iv(write_module=steer(vector, scale=4.0)),
                                     iv("raw", read_logits=I.ReadLogits(stage=I.LOGITS_STAGE_RAW, full=I.FullRow()))),
                              max_tokens=6, **GREEDY))
    tokens = result.tokens()
    plain = hf.greedy(ids, 6)
    assert tokens != plain  # the vector changes the continuation
    seq = list(ids)
    for step in range(6):
        ref = hf_steered(hf, seq, 1, lambda rows: rows + 4.0 * torch.from_numpy(vector), len(ids) - 1)
        np.testing.assert_allclose(result.values("raw")[step], ref.numpy(), atol=2e-3, rtol=1e-4)
        assert tokens[step] == int(ref.argmax())  # greedy under steering matches
        seq.append(tokens[step])


def test_a_steered_trace_reading_new_tokens_is_still_steered(estub, hf):
    """Its new-token read makes its row a block's (the read travels as a column); the write
    beside it is still made at every step, as transformers makes it."""
    vector = np.random.default_rng(3).normal(size=hf.model.config.hidden_size).astype(np.float32)
    ids = hf.encode(PROMPT)
    result = run(estub, trace(invoke(PROMPT, iv(write_module=steer(vector, scale=4.0)),
                                     iv("h", read_module=I.ReadModule(module="layers.2"))),
                              max_tokens=6, **GREEDY))
    tokens = result.tokens()
    assert tokens != hf.greedy(ids, 6) and len(result.values("h")) == 6
    seq = list(ids)
    for step in range(6):
        ref = hf_steered(hf, seq, 1, lambda rows: rows + 4.0 * torch.from_numpy(vector), len(ids) - 1)
        assert tokens[step] == int(ref.argmax())
        seq.append(tokens[step])


def test_concurrent_traces_with_different_vectors_equal_their_solo_runs(estub):
    import concurrent.futures

    rng = np.random.default_rng(1)
    vectors = [rng.normal(size=256).astype(np.float32) * s for s in (3.0, -3.0, 6.0)]
    requests = [trace(invoke(PROMPT, iv(write_module=steer(v))), max_tokens=8, **GREEDY) for v in vectors]
    solo = [run(estub, r).tokens() for r in requests]
    assert len({tuple(t) for t in solo}) > 1
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda r: run(estub, r).tokens(), requests * 2))
    assert together == solo * 2


def test_ablation_at_prompt_positions(estub, hf):
    ids = hf.encode(PROMPT)
    zero = I.WriteModule(module="layers.0", positions=I.Positions(prompt_list=I.PositionList(positions=[1, 2])),
                         zero=I.ZeroAblation())
    result = run(estub, trace(invoke(PROMPT, iv(write_module=zero),
                                     iv("raw", read_logits=I.ReadLogits(stage=I.LOGITS_STAGE_RAW, full=I.FullRow()))),
                              max_tokens=1, **GREEDY))

    def hook(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        hidden[0, 1:3] = 0
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = hf.model.model.layers[0].register_forward_hook(hook)
    try:
        with torch.no_grad():
            ref = hf.model(torch.tensor([ids])).logits[0, -1].float()
    finally:
        handle.remove()
    np.testing.assert_allclose(result.values("raw")[0], ref.numpy(), atol=2e-3, rtol=1e-4)
    assert not np.allclose(result.values("raw")[0], hf.next_logits(ids).numpy(), atol=1e-2)


def test_bad_module_writes(estub):
    with pytest.raises(grpc.RpcError) as info:
        run(estub, trace(invoke(PROMPT, iv(write_module=steer(np.zeros(255, np.float32))))))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "write_module.add.shape" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        run(estub, trace(invoke(PROMPT, iv(write_module=steer(np.full(256, np.nan, np.float32))))))
    assert "write_module.add.data" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        run(estub, trace(invoke(PROMPT, iv(when=I.Condition(argmax_in=I.TokenSet(token_ids=[1])),
                                           write_module=steer(np.zeros(256, np.float32))))))
    assert "interventions[0].condition" in info.value.details()


def test_sdk_steering_and_logit_lens(eager, hf):
    client = tw.Client(eager.target, timeout=120)
    vector = np.random.default_rng(2).normal(size=256).astype(np.float32)
    with client.trace(PROMPT, max_tokens=4, **GREEDY) as steered:
        steered.all().module("layers.1").add(vector, scale=4.0)
    with client.trace(PROMPT, max_tokens=4, **GREEDY) as raw_trace:
        raw_trace.all().module("layers.1").add(vector * 4.0)
    assert steered.result.outputs[0].token_ids == raw_trace.result.outputs[0].token_ids
    assert steered.result.outputs[0].token_ids != hf.greedy(hf.encode(PROMPT), 4)
    with client.trace(PROMPT, max_tokens=1, **GREEDY) as tracer:
        lens = tracer.iter[0].logit_lens([3], positions="prompt", top_k=2).save()
        tracer.iter[0].module("layers.0", positions=[0]).zero()
        tracer.iter[0].module("layers.0", positions=[0]).mean_ablate()  # no-op on one position
    assert lens.value.ids.shape == (1, len(hf.encode(PROMPT)), 2)


def test_cli_logit_lens_table(eager, hf):
    import json
    import subprocess
    import sys

    run_cli = subprocess.run([sys.executable, "-m", "tracewire.cli", "--target", eager.target, "lens", PROMPT,
                              "--layers", "1,3", "--json"], capture_output=True, text=True, timeout=120)
    assert run_cli.returncode == 0, run_cli.stderr
    table = json.loads(run_cli.stdout)
    ids = hf.encode(PROMPT)
    assert [p for p in table["positions"]] == [hf.tokenizer.decode([t]) for t in ids]
    final = table["layers"][1]["top"][-1]
    expected = int(hf.next_logits(ids).argmax())
    assert final["token"] == hf.tokenizer.decode([expected])  # the last layer's lens = the model
    text = subprocess.run([sys.executable, "-m", "tracewire.cli", "--target", eager.target, "lens", PROMPT],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and text.stdout.splitlines()[0].startswith("layer")
    assert len(text.stdout.splitlines()) == 1 + hf.model.config.num_hidden_layers


def test_nnsight_style_paths_and_n_sequences(eager, hf):
    client = tw.Client(eager.target, timeout=120)
    with client.trace(PROMPT, max_tokens=3, **GREEDY) as tracer:
        a = tracer.model.layers[3].output.save()
        b = tracer.all().module("layers.3").save()
        mlp = tracer.iter[1].model.layers[0].mlp.output.save()
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    ids = hf.encode(PROMPT)
    step1 = hf_module_outputs(hf, ids + tracer.result.outputs[0].token_ids[:1])["layers.0.mlp"][-1]
    np.testing.assert_allclose(mlp.value, step1, atol=ATOL)
    # n=2 sampled sequences: each reads its own rows
    with client.trace("Once upon a time", max_tokens=3, temperature=2.0, seed=3, n=2, ignore_eos=True) as tracer:
        per_seq = tracer.model.layers[2].output.save()
    story = hf.encode("Once upon a time")
    for seq, out in zip(per_seq, tracer.result.outputs, strict=True):
        for step, value in enumerate(seq):
            ref = hf_module_outputs(hf, story + out.token_ids[:step])["layers.2"][-1]
            np.testing.assert_allclose(value, ref, atol=ATOL)
    assert tracer.result.outputs[0].token_ids != tracer.result.outputs[1].token_ids


def test_module_reads_in_batches_mixed_with_untraced_requests(eager, estub, hf):
    import concurrent.futures

    client = tw.Client(eager.target, timeout=120)
    story = "Once upon a time"

    def traced():
        read = iv("h", read_module=I.ReadModule(module="layers.2"))
        return run(estub, trace(invoke(PROMPT, read), max_tokens=6, **GREEDY))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        plain = [pool.submit(client.generate, story, max_tokens=12, **GREEDY) for _ in range(4)]
        result = pool.submit(traced).result()
        outs = [f.result()[0] for f in plain]
    assert all(o.outputs[0].token_ids == hf.greedy(hf.encode(story), 12) for o in outs)
    ids = hf.encode(PROMPT)
    for step, value in enumerate(result.values("h")):
        ref = hf_module_outputs(hf, ids + result.tokens()[:step])["layers.2"][-1]
        np.testing.assert_allclose(value, ref, atol=ATOL)


@pytest.mark.parametrize("scenario", sorted(prefix_cache.SCENARIOS))
def test_module_writes_and_the_prefix_cache(estub, hf, scenario):
    prefix_cache.SCENARIOS[scenario](estub, hf, seed=100 + sorted(prefix_cache.SCENARIOS).index(scenario))
