"""The Python SDK's trace API, async client and CLI against the real server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import tracewire as tw

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_saved_reads_match_transformers(client, hf):
    with client.trace(PROMPT, max_tokens=5, **GREEDY) as tracer:
        logits = tracer.all().logits.save()
        raw_top = tracer.iter[1:4].logits.raw.top_k(3).save()
        chosen = tracer.iter[[0, 2]].logits.select([5, 9]).save()
        drawn = tracer.all().samples.save()
        lp = tracer.iter[0].logprobs(top_k=2).save()
    ids = hf.encode(PROMPT)
    expected = hf.greedy(ids, 5)
    assert list(drawn) == expected == tracer.result.outputs[0].token_ids
    assert logits.steps == [0, 1, 2, 3, 4] and raw_top.steps == [1, 2, 3] and chosen.steps == [0, 2]
    for step, row in enumerate(logits):
        ref = hf.next_logits(ids + expected[:step])
        np.testing.assert_allclose(row, ref.numpy(), atol=2e-3, rtol=1e-4)
        if step in raw_top.steps:
            top = raw_top[raw_top.steps.index(step)]
            assert isinstance(top, tw.TopK) and top.ids.tolist() == torch.topk(ref, 3).indices.tolist()
        if step in chosen.steps:
            np.testing.assert_allclose(chosen[chosen.steps.index(step)], ref[[5, 9]].numpy(), atol=2e-3)
    ref_lp = torch.log_softmax(hf.next_logits(ids), -1)
    assert lp.value.token_id == expected[0]
    assert lp.value.logprob == pytest.approx(float(ref_lp[expected[0]]), abs=1e-3)
    assert list(lp.value.top) == torch.topk(ref_lp, 2).indices.tolist()


def test_writes_through_the_sdk(client, hf):
    ids = hf.encode(PROMPT)
    ref = hf.next_logits(ids)
    first, second = torch.topk(ref, 2).indices.tolist()
    with client.trace(PROMPT, max_tokens=1, **GREEDY) as t:
        t.iter[0].logits.mask(first)
    assert t.result.outputs[0].token_ids == [second]
    with client.trace(PROMPT, max_tokens=2, **GREEDY) as t:
        t.all().logits.bias({42: 100.0})
    assert t.result.outputs[0].token_ids == [42, 42]
    vector = np.zeros(ref.shape[0], dtype=np.float32)
    vector[7] = 100.0
    with client.trace(PROMPT, max_tokens=1, **GREEDY) as t:
        t.iter[0].logits += vector
    assert t.result.outputs[0].token_ids == [7]
    row = np.full(ref.shape[0], -5.0, dtype=np.float32)
    row[11] = 5.0
    with client.trace(PROMPT, max_tokens=1, **GREEDY) as t:
        t.iter[0].logits = row
        seen = t.iter[0].logits.save()
    assert t.result.outputs[0].token_ids == [11]
    np.testing.assert_array_equal(seen.value, row)


def test_conditions_and_stops(client, hf):
    ids = hf.encode(PROMPT)
    greedy = hf.greedy(ids, 12)
    period = client.tokenizer.encode(".")[0]
    with client.trace(PROMPT, max_tokens=12, **GREEDY) as t:
        t.stop(when=tw.sampled_in(period) | tw.text_contains("zzz"))
    assert t.result.outputs[0].token_ids == greedy[: greedy.index(period) + 1]
    with client.trace(PROMPT, max_tokens=12, **GREEDY) as t:
        t.stop(step=1)
    assert t.result.outputs[0].token_ids == greedy[:2]
    with client.trace(PROMPT, max_tokens=6, **GREEDY) as t:
        t.all().when(~tw.argmax_in(greedy[0]) & (tw.entropy() >= 0.0)).samples = 3
    assert t.result.outputs[0].token_ids[0] == greedy[0]  # argmax was greedy[0]: not forced
    assert 3 in t.result.outputs[0].token_ids[1:]
    with pytest.raises(TypeError, match="evaluated on the server"):
        if tw.prob() > 0.5:
            pass


def test_n_and_invokes(client):
    with client.trace(PROMPT, temperature=1.0, seed=0, max_tokens=4, n=3) as t:
        drawn = t.all().samples.save()
    assert len(drawn) == 3
    for seq, out in zip(drawn, t.result.outputs, strict=True):
        assert list(seq) == out.token_ids and seq.steps == [0, 1, 2, 3]
    with client.trace(max_tokens=4, **GREEDY) as t:
        with t.invoke(PROMPT) as a:
            a_ids = a.all().samples.save()
        with t.invoke("The capital of Japan is", max_tokens=2) as b:
            b_ids = b.all().samples.save()
    assert list(a_ids) == a.result.outputs[0].token_ids and len(a_ids) == 4
    assert list(b_ids) == b.result.outputs[0].token_ids and len(b_ids) == 2
    assert [inv.result for inv in t.invokes] == [a.result, b.result]


def test_streaming_fills_saved_values_as_it_goes(client):
    tracer = client.trace(PROMPT, max_tokens=6, **GREEDY)
    drawn = tracer.all().samples.save()
    seen = []
    for step in client.stream_trace(tracer):
        seen.append((step.step, step.token_id))
        assert list(drawn)[-1] == step.token_id == step.values[drawn.name]
    assert [s for s, _ in seen] == list(range(6))
    assert "".join(s.text for s in []) == ""
    texts = [s.text for s in client.stream_trace(PROMPT, max_tokens=6, **GREEDY)]
    assert "".join(texts) == tracer.result.outputs[0].text


def test_unreached_steps_warn(client):
    with pytest.warns(tw.TraceWarning, match="selected step 9"):
        with client.trace(PROMPT, max_tokens=12, **GREEDY) as t:
            t.iter[[0, 9]].samples.save()
            t.stop(step=3)
    assert t.warnings and "ended at step 3" in t.warnings[0]


def test_trace_warnings_point_at_the_callers_line(client, server):
    """However a trace is run, its TraceWarning names this file (the user's code), not the
    SDK's: `with` exit, `.run()`, iterating `stream_trace`, and the async client's
    `async with` and `async for`."""

    def build(tracer):
        tracer.iter[[0, 6]].samples.save()
        tracer.stop(step=1)
        return tracer

    def caught(run):
        with pytest.warns(tw.TraceWarning, match="selected step 6") as record:
            run()
        return [(w.filename, w.lineno) for w in record if issubclass(w.category, tw.TraceWarning)]

    def with_exit():
        with build(client.trace(PROMPT, max_tokens=8, **GREEDY)):
            pass

    async def async_runs():
        async with tw.AsyncClient(server.target, timeout=120) as aclient:
            async with build(aclient.trace(PROMPT, max_tokens=8, **GREEDY)):
                pass

    async def async_stream():
        async with tw.AsyncClient(server.target, timeout=120) as aclient:
            async for _ in aclient.stream_trace(build(aclient.trace(PROMPT, max_tokens=8, **GREEDY))):
                pass

    ways = {
        "with": with_exit,
        "run": lambda: build(client.trace(PROMPT, max_tokens=8, **GREEDY)).run(),
        "stream_trace": lambda: list(client.stream_trace(build(client.trace(PROMPT, max_tokens=8, **GREEDY)))),
        "async with": lambda: asyncio.run(async_runs()),
        "async for": lambda: asyncio.run(async_stream()),
    }
    for way, run in ways.items():
        places = caught(run)
        assert places and all(filename == __file__ for filename, _ in places), (way, places)


def test_client_side_errors_are_raised_before_sending(client):
    with pytest.raises(tw.InvalidArgument, match="Did you mean 'temperature'"):
        client.trace(PROMPT, temprature=0.0)
    with pytest.raises(tw.InvalidArgument, match="max_tokens is 4"):
        with client.trace(PROMPT, max_tokens=4) as t:
            t.iter[4:].samples.save()
    with pytest.raises(tw.InvalidArgument, match="stop < start"):
        client.trace(PROMPT).iter[3:1]
    with pytest.raises(tw.InvalidArgument, match="no prompt of its own"):
        client.trace(max_tokens=3).all()
    with client.trace(PROMPT, max_tokens=1) as t:
        pass
    with pytest.raises(tw.InvalidArgument, match="already run"):
        t.all().samples.save()


def test_server_errors_come_back_typed(client):
    with pytest.raises(tw.InvalidArgument) as info:
        with client.trace(PROMPT, max_tokens=3) as t:
            t.all().logits.top_k(10**6).save()
    assert info.value.field == "invokes[0].interventions[0].read_logits.top_k.k"
    with pytest.raises(tw.FailedPrecondition) as refused:
        with client.trace(PROMPT, max_tokens=3) as t:
            # a clamp the compiled graph does not compute (at most 8 features a write)
            t.all().model.layers[2].output.clamp_feature("res-l2-sae", list(range(9)), 1.0)
    assert "invokes[0].interventions[0].write_dictionary.features: " in str(refused.value)


def test_async_client(server, hf):
    async def main():
        async with tw.AsyncClient(server.target, timeout=120) as client:
            (out,) = await client.generate(PROMPT, max_tokens=4, **GREEDY)
            ids = await client.tokenizer.encode(PROMPT)
            text = await client.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
            async with client.trace(PROMPT, max_tokens=4, **GREEDY) as tracer:
                drawn = tracer.all().samples.save()
            streamed = [s.token_id async for s in client.stream_trace(PROMPT, max_tokens=4, **GREEDY)]
            deltas = [u async for u in client.generate_stream(PROMPT, max_tokens=4, **GREEDY)]
            info = await client.model_info()
            return out, ids, text, list(drawn), tracer.result, streamed, deltas, info

    out, ids, text, drawn, result, streamed, deltas, info = asyncio.run(main())
    expected = hf.greedy(hf.encode(PROMPT), 4)
    assert ids == hf.encode(PROMPT)
    assert out.outputs[0].token_ids == drawn == streamed == result.outputs[0].token_ids == expected
    assert text == out.outputs[0].text == "".join(c.text for u in deltas for c in u.output.outputs)
    assert info.vocab_size == 2048


def _cli(server, *args):
    return subprocess.run([sys.executable, "-m", "tracewire.cli", "--target", server.target, *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_trace_json_and_table(server, hf):
    greedy = hf.greedy(hf.encode(PROMPT), 5)
    run = _cli(server, "trace", PROMPT, "--top-k", "3", "--max-tokens", "5", "--temperature", "0",
               "-s", "ignore_eos=true", "--json")
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    steps, final = lines[:-1], lines[-1]
    assert [s["token_id"] for s in steps] == greedy
    ref = torch.softmax(hf.next_logits(hf.encode(PROMPT)), -1)
    assert steps[0]["p"] == pytest.approx(float(ref[greedy[0]]), abs=1e-3)
    assert [t["token_id"] for t in steps[0]["top"]] == torch.topk(ref, 3).indices.tolist()
    assert final["text"] == hf.tokenizer.decode(greedy, skip_special_tokens=True)
    table = _cli(server, "trace", PROMPT, "--max-tokens", "3", "--temperature", "0")
    assert table.returncode == 0 and "' Paris'" in table.stdout and "step" in table.stdout.splitlines()[0]


def test_cli_generate_tokenize_and_errors(server):
    gen = _cli(server, "generate", PROMPT, "--max-tokens", "2", "--temperature", "0")
    assert gen.returncode == 0 and "' Paris.'" in gen.stdout
    tok = _cli(server, "tokenize", " Berlin", "--json")
    assert json.loads(tok.stdout)["tokens"] == [" Berlin"]
    bad = _cli(server, "generate", PROMPT, "-s", "top_p=7")
    assert bad.returncode == 1 and "INVALID_ARGUMENT (field sampling_params.top_p)" in bad.stderr
