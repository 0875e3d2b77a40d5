"""The Trace RPC against transformers on the same weights.

Tolerances: logits within 2e-3 absolute + 1e-4 relative (float32 on both sides;
vLLM's CPU kernels and transformers' differ in summation order); logprobs
within 1e-3.
"""

from __future__ import annotations

import concurrent.futures
import re
import time

import numpy as np
import pytest
import torch
from trace_requests import cmp, f32, invoke, iv, logits, run, steps, trace
from tracewire.v1 import intervention_pb2 as I

PROMPT = "The capital of France is"
ATOL, RTOL = 2e-3, 1e-4
GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_per_step_logits_equal_transformers(stub, hf):
    result = run(stub, trace(invoke(PROMPT, iv("raw", read_logits=logits(raw=True)),
                                    iv("seen", read_logits=logits()),
                                    iv("tok", read_sample=I.ReadSample())),
                             max_tokens=6, **GREEDY))
    ids = hf.encode(PROMPT)
    raws, seens, toks = result.values("raw"), result.values("seen"), result.values("tok")
    assert len(raws) == len(seens) == len(toks) == 6
    for step, (raw, seen, tok) in enumerate(zip(raws, seens, toks, strict=True)):
        ref = hf.next_logits(ids).numpy()
        assert raw.shape == ref.shape
        np.testing.assert_allclose(raw, ref, atol=ATOL, rtol=RTOL, err_msg=f"step {step}")
        np.testing.assert_array_equal(seen, raw)  # greedy, no penalties: nothing changes
        assert tok.shape == () and int(tok) == int(ref.argmax())  # greedy draws the argmax
        assert result.seq()[step].token_id == int(tok)
        ids.append(int(tok))
    assert result.tokens() == hf.greedy(hf.encode(PROMPT), 6)


def test_step_results_stream_text_and_order(stub, hf):
    started = time.time_ns()
    result = run(stub, trace(invoke(PROMPT), max_tokens=8, **GREEDY))
    steps_seen = result.seq()
    assert [s.step for s in steps_seen] == list(range(8))
    # engine_time: when the server got each step's token, in order, within the call
    times = [s.engine_time.ToNanoseconds() for s in steps_seen]
    assert started <= times[0] and times == sorted(times) and times[-1] <= time.time_ns()
    out = result.invokes[0].outputs[0]
    assert "".join(s.text_delta for s in steps_seen) == out.text
    assert out.text == hf.tokenizer.decode(hf.greedy(hf.encode(PROMPT), 8),
                                           skip_special_tokens=True)
    kinds = [ev.WhichOneof("event") for ev in result.events]
    assert kinds[-2:] == ["invoke_result", "end"] and set(kinds[:-2]) == {"steps"}
    assert sum(len(ev.steps.results) for ev in result.events if ev.HasField("steps")) == 8
    assert result.end.usage.generated_tokens == 8 and not result.end.warnings


def test_top_k_and_chosen_ids_and_logprobs(stub, hf):
    paris = hf.encode(" Paris")[0]
    result = run(stub, trace(invoke(PROMPT, iv("top", read_logits=logits(k=5, raw=True)),
                                    iv("some", read_logits=logits(ids=[paris, 3, 7], raw=True)),
                                    iv("lp", read_logprobs=I.ReadLogprobs(top_k=3))),
                             max_tokens=3, **GREEDY))
    ids = hf.encode(PROMPT)
    for step in range(3):
        ref = hf.next_logits(ids)
        top = torch.topk(ref, 5)
        np.testing.assert_array_equal(result.ids("top")[step], top.indices.numpy())
        np.testing.assert_allclose(result.values("top")[step], top.values.numpy(), atol=ATOL)
        np.testing.assert_array_equal(result.ids("some")[step], [paris, 3, 7])
        np.testing.assert_allclose(result.values("some")[step], ref[[paris, 3, 7]].numpy(),
                                   atol=ATOL, rtol=RTOL)
        lp = torch.log_softmax(ref, -1)
        drawn = result.seq()[step].token_id
        lp_ids, lp_vals = result.ids("lp")[step], result.values("lp")[step]
        assert lp_ids[0] == drawn and list(lp_ids[1:]) == torch.topk(lp, 3).indices.tolist()
        np.testing.assert_allclose(lp_vals, lp[torch.from_numpy(lp_ids.astype(np.int64))].numpy(), atol=1e-3)
        ids.append(drawn)


def test_forced_token_continues_like_transformers(stub, hf):
    berlin = hf.encode(" Berlin")[0]
    result = run(stub, trace(invoke(PROMPT, iv(sel=steps(at=[0]),
                                               force_sample=I.ForceSample(token_id=berlin))),
                             max_tokens=8, **GREEDY))
    ids = hf.encode(PROMPT)
    assert result.tokens() == [berlin] + hf.greedy(ids + [berlin], 7)
    assert result.invokes[0].outputs[0].text.startswith(" Berlin")


def test_forced_token_under_sampling(stub, hf):
    berlin = hf.encode(" Berlin")[0]
    result = run(stub, trace(invoke(PROMPT, iv(sel=steps(stop=3),
                                               force_sample=I.ForceSample(token_id=berlin))),
                             max_tokens=4, temperature=1.5, top_p=0.9, seed=3))
    assert result.tokens()[:3] == [berlin] * 3


def test_stop_at_step_two_returns_three_ids(stub, hf):
    result = run(stub, trace(invoke(PROMPT, iv("ids", read_sample=I.ReadSample()),
                                    iv(sel=steps(at=[2]), stop=I.Stop())),
                             max_tokens=32, **GREEDY))
    expected = hf.greedy(hf.encode(PROMPT), 3)
    assert result.tokens() == expected
    assert [int(v) for v in result.values("ids")] == expected
    out = result.invokes[0].outputs[0]
    assert out.finish_reason == 1  # FINISH_REASON_STOP
    assert out.text == hf.tokenizer.decode(expected, skip_special_tokens=True)
    assert result.seq()[-1].stopped and len(result.seq()) == 3


@pytest.mark.parametrize("condition_name", ["sampled_in", "text_contains", "text_matches"])
def test_stop_on_what_the_model_wrote(stub, hf, condition_name):
    greedy = hf.greedy(hf.encode(PROMPT), 12)
    period = hf.encode(".")[0]
    assert period in greedy
    first = greedy.index(period)
    when = {
        "sampled_in": I.Condition(sampled_in=I.TokenSet(token_ids=[period])),
        "text_contains": I.Condition(text_contains="."),
        "text_matches": I.Condition(text_matches=r"[.!?]$"),
    }[condition_name]
    result = run(stub, trace(invoke(PROMPT, iv(when=when, stop=I.Stop())),
                             max_tokens=12, **GREEDY))
    assert result.tokens() == greedy[: first + 1]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_conditions_see_the_text_the_client_is_sent(stub, hf, skip_special_tokens):
    """A special token forced at step 2 is in the streamed text only with
    skip_special_tokens=False; text conditions decode the same way, so a stop on its text
    fires exactly then (and a read gated on it is kept exactly then), and never without."""
    eos = hf.tokenizer.eos_token_id
    special = hf.tokenizer.decode([eos])
    result = run(stub, trace(invoke(
        PROMPT,
        iv(sel=steps(at=[2]), force_sample=I.ForceSample(token_id=eos)),
        iv("gated", when=I.Condition(text_matches=re.escape(special) + "$"), read_sample=I.ReadSample()),
        iv(when=I.Condition(text_contains=special), stop=I.Stop()),
    ), max_tokens=6, skip_special_tokens=skip_special_tokens, **GREEDY))
    deltas = [s.text_delta for s in result.seq()]
    streamed = ["".join(deltas[: k + 1]) for k in range(len(deltas))]
    if skip_special_tokens:
        assert len(deltas) == 6 and not any(special in text for text in streamed)
        assert result.values("gated") == []
    else:
        assert special in deltas[2] and special not in streamed[1]
        assert len(deltas) == 3 and result.seq()[-1].stopped
        assert [int(v) for v in result.values("gated")] == [eos]
        assert [s.step for s in result.seq() if "gated" in s.values] == [2]


def test_stop_on_probability_and_entropy(stub, hf):
    ids = hf.encode(PROMPT)
    greedy = hf.greedy(ids, 10)
    probs, entropies = [], []
    for k in range(10):
        lp = torch.log_softmax(hf.next_logits(ids + greedy[:k]), -1)
        probs.append(float(lp[greedy[k]].exp()))
        entropies.append(float(-(lp.exp() * lp).sum()))
    # The first step whose drawn token has probability below the median.
    threshold = float(np.median(probs))
    first_low = next(k for k, p in enumerate(probs) if p < threshold)
    when = I.Condition(token_probability=I.TokenProbability(
        threshold=I.Threshold(comparison=cmp("<"), value=threshold)))
    result = run(stub, trace(invoke(PROMPT, iv(when=when, stop=I.Stop())), max_tokens=10, **GREEDY))
    assert result.tokens() == greedy[: first_low + 1]

    e_threshold = float(np.median(entropies))
    first_high = next(k for k, e in enumerate(entropies) if e > e_threshold)
    when = I.Condition(entropy=I.Threshold(comparison=cmp(">"), value=e_threshold))
    result = run(stub, trace(invoke(PROMPT, iv(when=when, stop=I.Stop())), max_tokens=10, **GREEDY))
    assert result.tokens() == greedy[: first_high + 1]


def test_conditional_force_only_when_argmax_is_paris(stub, hf):
    paris, berlin = hf.encode(" Paris")[0], hf.encode(" Berlin")[0]
    ids = hf.encode(PROMPT)
    assert hf.greedy(ids, 1) == [paris]
    force = iv(when=I.Condition(argmax_in=I.TokenSet(token_ids=[paris])),
               force_sample=I.ForceSample(token_id=berlin))
    result = run(stub, trace(invoke(PROMPT, force), invoke("The capital of Japan is", force),
                             max_tokens=4, **GREEDY))
    assert result.tokens(0) == [berlin] + hf.greedy(ids + [berlin], 3)
    japan = hf.encode("The capital of Japan is")
    assert result.tokens(1) == hf.greedy(japan, 4)  # never argmax Paris: untouched


def test_logit_writes_match_reference(stub, hf):
    ids = hf.encode(PROMPT)
    ref = hf.next_logits(ids)
    first, second = torch.topk(ref, 2).indices.tolist()
    vocab = ref.shape[0]
    # mask the argmax: the runner-up is drawn
    masked = run(stub, trace(invoke(PROMPT, iv(sel=steps(at=[0]), write_logits=I.WriteLogits(
        mask=I.TokenSet(token_ids=[first])))), max_tokens=1, **GREEDY))
    assert masked.tokens() == [second]
    # per-token bias on a chosen token makes it win
    target = 42
    bias = float(ref[first] - ref[target]) + 5.0
    biased = run(stub, trace(invoke(PROMPT, iv("seen", sel=steps(at=[0]), read_logits=logits(
        ids=[target])), iv(sel=steps(at=[0]), write_logits=I.WriteLogits(
            bias=I.TokenBias(bias={target: bias})))), max_tokens=1, **GREEDY))
    assert biased.tokens() == [target]
    np.testing.assert_allclose(biased.values("seen")[0], [float(ref[target]) + bias], atol=ATOL)
    # add a vector: equivalent to the bias above
    vector = np.zeros(vocab, dtype=np.float32)
    vector[target] = bias
    added = run(stub, trace(invoke(PROMPT, iv(sel=steps(at=[0]), write_logits=I.WriteLogits(
        add=f32(vector)))), max_tokens=1, **GREEDY))
    assert added.tokens() == [target]
    # replace the row at every step: the sampler draws from ours
    row = np.full(vocab, -10.0, dtype=np.float32)
    row[7] = 10.0
    replaced = run(stub, trace(invoke(PROMPT, iv("seen", read_logits=logits()), iv(
        write_logits=I.WriteLogits(replace=f32(row)))), max_tokens=3, **GREEDY))
    assert replaced.tokens() == [7, 7, 7]
    np.testing.assert_array_equal(replaced.values("seen")[1], row)


def test_processed_logits_include_sampling_bias(stub, hf):
    target = 42
    result = run(stub, trace(invoke(PROMPT, iv("raw", read_logits=logits(ids=[target], raw=True)),
                                    iv("seen", read_logits=logits(ids=[target]))),
                             max_tokens=1, logit_bias={target: 3.0}, **GREEDY))
    raw, seen = result.values("raw")[0][0], result.values("seen")[0][0]
    assert seen == pytest.approx(raw + 3.0, abs=1e-5)
    assert raw == pytest.approx(float(hf.next_logits(hf.encode(PROMPT))[target]), abs=ATOL)


def test_logits_stages_around_a_forced_token_and_a_bias_write(stub, hf):
    """Three reads of the same step: RAW is transformers' row; BEFORE_WRITES is vLLM's
    processing (the request's logit_bias) without the trace's writes; PROCESSED has the
    writes on top (a forced token: 0 at its id, -inf elsewhere; a bias write: added).
    Write conditions decide from BEFORE_WRITES: with the force listed first, argmax_in /
    token_probability still see the model's own row, not the forced one."""
    paris, berlin = hf.encode(" Paris")[0], hf.encode(" Berlin")[0]
    sampling_bias, target = {7: 3.0}, 42
    ids = hf.encode(PROMPT)
    before0 = hf.next_logits(ids)
    before0[7] += 3.0
    assert int(before0.argmax()) == paris
    p_paris = float(torch.softmax(before0, -1)[paris])
    prob = lambda op, value: I.Condition(token_probability=I.TokenProbability(  # noqa: E731
        token_id=paris, threshold=I.Threshold(comparison=cmp(op), value=value)))
    bias = lambda amounts: I.WriteLogits(bias=I.TokenBias(bias=amounts))  # noqa: E731
    at0, at1 = steps(at=[0]), steps(at=[1])
    result = run(stub, trace(invoke(
        PROMPT,
        iv("raw", read_logits=logits(raw=True)),
        iv("before", read_logits=I.ReadLogits(stage=I.LOGITS_STAGE_BEFORE_WRITES, full=I.FullRow())),
        iv("before_top", read_logits=I.ReadLogits(stage=I.LOGITS_STAGE_BEFORE_WRITES, top_k=I.TopK(k=3))),
        iv("processed", read_logits=logits()),
        iv(sel=at0, force_sample=I.ForceSample(token_id=berlin)),
        # after the force, conditions on the written row would see argmax berlin, p(paris) 0
        iv(sel=at0, when=I.Condition(argmax_in=I.TokenSet(token_ids=[paris])), write_logits=bias({berlin: 2.5})),
        iv(sel=at0, when=prob(">", p_paris - 0.01), write_logits=bias({berlin: 0.25})),
        iv(sel=at0, when=prob(">", p_paris + 0.01), write_logits=bias({berlin: 100.0})),
        iv(sel=at1, write_logits=bias({target: 50.0})),
    ), max_tokens=3, logit_bias=sampling_bias, **GREEDY))
    assert result.tokens()[:2] == [berlin, target]
    raws, befores, processed = result.values("raw"), result.values("before"), result.values("processed")
    prefix = list(ids)
    for step in range(3):
        raw, before, seen = raws[step], befores[step], processed[step]
        np.testing.assert_allclose(raw, hf.next_logits(prefix).numpy(), atol=ATOL, rtol=RTOL, err_msg=f"step {step}")
        expected_before = raw.copy()
        expected_before[7] += 3.0  # vLLM's logit_bias: processing, not a tracewire write
        np.testing.assert_allclose(before, expected_before, atol=1e-5, err_msg=f"step {step}")
        top = np.argsort(-before, kind="stable")[:3]
        np.testing.assert_array_equal(result.ids("before_top")[step], top)
        np.testing.assert_allclose(result.values("before_top")[step], before[top], atol=1e-6)
        if step == 0:
            expected = np.full_like(raw, -np.inf)
            expected[berlin] = 2.75  # forced (0), then the two biases whose conditions held
            np.testing.assert_array_equal(seen, expected)
        elif step == 1:
            expected = before.copy()
            expected[target] += 50.0
            np.testing.assert_allclose(seen, expected, atol=1e-5)
        else:
            np.testing.assert_array_equal(seen, before)  # no writes: the same row
        prefix.append(result.tokens()[step])


def test_n_three_gives_three_sequences_with_their_own_steps(stub):
    result = run(stub, trace(invoke(PROMPT, iv("tok", read_sample=I.ReadSample())),
                             max_tokens=6, n=3, temperature=1.0, seed=0, ignore_eos=True))
    outs = result.invokes[0].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    for s in range(3):
        toks = [int(v) for v in result.values("tok", sequence=s)]
        assert toks == list(outs[s].token_ids) and len(toks) == 6
        assert [st.step for st in result.seq(sequence=s)] == list(range(6))
    assert len({tuple(o.token_ids) for o in outs}) > 1  # sampled independently


def test_two_invokes_behave_like_two_separate_runs(stub, client):
    result = run(stub, trace(invoke(PROMPT, temperature=0.0),
                             invoke(PROMPT, temperature=1.5, seed=1), max_tokens=8))
    (cold,) = client.generate(PROMPT, temperature=0.0, max_tokens=8)
    (hot,) = client.generate(PROMPT, temperature=1.5, seed=1, max_tokens=8)
    assert result.tokens(0) == cold.outputs[0].token_ids
    assert result.tokens(1) == hot.outputs[0].token_ids
    assert result.invokes[1].outputs[0].text == hot.outputs[0].text


def test_selector_beyond_the_end_warns(stub):
    result = run(stub, trace(invoke(PROMPT, iv("late", sel=steps(at=[1, 9]),
                                               read_sample=I.ReadSample())), max_tokens=4, **GREEDY))
    assert len(result.values("late")) == 1  # step 1 ran, step 9 did not
    (warning,) = result.end.warnings
    assert warning.code == "STEP_NOT_REACHED" and warning.intervention == "late"
    assert "step 9" in warning.message and "ended at step 3" in warning.message


def test_concurrent_traces_equal_their_solo_runs(stub, hf):
    berlin, target = hf.encode(" Berlin")[0], 42
    writer = trace(invoke(PROMPT, iv(sel=steps(at=[0]), force_sample=I.ForceSample(token_id=berlin)),
                          iv(sel=steps(start=2, stop=4), write_logits=I.WriteLogits(
                              bias=I.TokenBias(bias={target: 50.0}))),
                          iv("w", read_logits=logits(k=4))), max_tokens=10, **GREEDY)
    reader = trace(invoke("The capital of Japan is", iv("r", read_logits=logits(raw=True))),
                   max_tokens=10, **GREEDY)
    solo_w, solo_r = run(stub, writer), run(stub, reader)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(run, stub, req) for req in [writer, reader] * 3]
        results = [f.result() for f in futures]
    for k, res in enumerate(results):
        solo = solo_w if k % 2 == 0 else solo_r
        name = "w" if k % 2 == 0 else "r"
        assert res.tokens() == solo.tokens()
        for a, b in zip(res.values(name), solo.values(name), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4)
    assert solo_w.tokens()[0] == berlin and solo_w.tokens()[2:4] == [target, target]
    assert solo_r.tokens() == hf.greedy(hf.encode("The capital of Japan is"), 10)


def test_same_read_twice_and_other_reads_in_one_step_batch(stub, hf):
    """One trace reads the same raw top-k under two names while others read other top-ks
    in the same engine steps: every name gets its own sequence's row of the batch."""
    twice = trace(invoke(PROMPT, iv("a", read_logits=logits(k=5, raw=True)),
                         iv("b", read_logits=logits(k=5, raw=True))), max_tokens=4, **GREEDY)
    other = trace(invoke("Once upon a time", iv("c", read_logits=logits(k=3, raw=True))), max_tokens=4, **GREEDY)
    same_k = trace(invoke("One, two, three,", iv("d", read_logits=logits(k=5, raw=True))), max_tokens=4, **GREEDY)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(run, stub, req) for req in [twice, other, same_k] * 2]
        results = [f.result() for f in futures]
    for k, res in enumerate(results):
        prompt, names = [(PROMPT, "ab"), ("Once upon a time", "c"), ("One, two, three,", "d")][k % 3]
        ids = hf.encode(prompt)
        for step in range(4):
            ref = torch.topk(hf.next_logits(ids), 3 if names == "c" else 5)
            for name in names:
                np.testing.assert_array_equal(res.ids(name)[step], ref.indices.numpy(), err_msg=f"{name} {step}")
                np.testing.assert_allclose(res.values(name)[step], ref.values.numpy(), atol=2e-3)
            ids.append(res.seq()[step].token_id)


def test_tracing_does_not_perturb_seeded_sampling(stub, client, hf):
    """The reference's per-step example: temperature 0.8, top_p 0.95, seed 0, reading the
    logits and the draw at every step. Tokens equal an untraced run with the same seed; each
    step's logits equal transformers' for that prefix; each draw is inside the top-p mass."""
    kw = dict(temperature=0.8, top_p=0.95, seed=0, max_tokens=6)
    result = run(stub, trace(invoke(PROMPT, iv("logits", read_logits=logits()),
                                    iv("drawn", read_sample=I.ReadSample())), **kw))
    (plain,) = client.generate(PROMPT, **kw)
    assert result.tokens() == plain.outputs[0].token_ids
    ids = hf.encode(PROMPT)
    for row, drawn in zip(result.values("logits"), result.values("drawn"), strict=True):
        np.testing.assert_allclose(row, hf.next_logits(ids).numpy(), atol=ATOL, rtol=RTOL)
        probs = torch.softmax(torch.from_numpy(row.copy()) / 0.8, -1)
        order = torch.argsort(probs, descending=True)
        rank = int((order == int(drawn)).nonzero())
        assert float(probs[order[:rank]].sum()) < 0.95  # inside the nucleus
        ids.append(int(drawn))


def test_n_fan_out_matches_vllm_native_n(stub, client):
    kw = dict(temperature=1.0, seed=0, max_tokens=8, n=3)
    result = run(stub, trace(invoke(PROMPT), **kw))
    (native,) = client.generate(PROMPT, **kw)
    assert [list(o.token_ids) for o in result.invokes[0].outputs] == [
        o.token_ids for o in native.outputs]


def test_trace_result_carries_logprobs_like_generate(stub, client):
    kw = dict(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    result = run(stub, trace(invoke(PROMPT), **kw))
    (plain,) = client.generate(PROMPT, **kw)
    out = result.invokes[0].outputs[0]
    assert len(out.logprobs) == 4
    for traced, expected in zip(out.logprobs, plain.outputs[0].logprobs, strict=True):
        assert [e.token_id for e in traced.entries] == list(expected)
        for e in traced.entries:
            assert e.logprob == pytest.approx(expected[e.token_id].logprob, abs=1e-5)
            assert e.decoded_token == expected[e.token_id].decoded_token
    assert out.cumulative_logprob == pytest.approx(plain.outputs[0].cumulative_logprob, abs=1e-4)


def test_token_id_prompts_equal_text_prompts(stub, hf):
    ids = hf.encode(PROMPT)
    result = run(stub, trace(invoke(PROMPT), invoke(ids), max_tokens=4, **GREEDY))
    assert result.tokens(0) == result.tokens(1)
    assert result.invokes[0].prompt == PROMPT and not result.invokes[1].HasField("prompt")
    assert list(result.invokes[1].prompt_token_ids) == ids


def test_stream_interval_coalesces_steps_and_loses_none(client, stub, hf):
    """With a 300 ms stream interval the first step goes out at once and the rest of a
    short generation arrives together: fewer messages, every step, in order."""
    tracer = client.trace(PROMPT, max_tokens=24, **GREEDY).options(stream_interval_ms=300)
    messages = []
    request = tracer.start()
    started = time.monotonic()
    for event in stub.Trace(request, timeout=60):
        messages.append(event)
        list(tracer.handle(event))
    elapsed = time.monotonic() - started
    steps = [s for ev in messages if ev.HasField("steps") for s in ev.steps.results]
    assert [s.step for s in steps] == list(range(24))
    assert [s.token_id for s in steps] == hf.greedy(hf.encode(PROMPT), 24)
    step_messages = sum(ev.HasField("steps") for ev in messages)
    # At most one message per interval after the first, however slow the machine.
    assert step_messages <= 2 + elapsed / 0.3, (step_messages, elapsed)
    assert step_messages < 24
    assert len(messages[0].steps.results) == 1  # nothing to wait for before the first step
