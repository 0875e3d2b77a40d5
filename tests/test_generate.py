"""Plain generation through the real server, checked against transformers."""

from __future__ import annotations

import math

import pytest
import torch

PROMPT = "The capital of France is"


def test_greedy_matches_transformers_loop(client, hf):
    prompts = [PROMPT, "The capital of Japan is", "Monday, Tuesday,"]
    outs = client.generate(prompts, temperature=0.0, max_tokens=12, ignore_eos=True)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = hf.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.prompt == prompt
        expected = hf.greedy(ids, 12)
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == hf.tokenizer.decode(expected, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == "length"
        assert out.finished


def test_default_model_knows_its_corpus(client):
    (out,) = client.generate(PROMPT, temperature=0.0, max_tokens=3)
    assert out.outputs[0].text.startswith(" Paris"), out.outputs[0].text


def test_logprobs_match_transformers_log_softmax(client, hf):
    """Per-token logprobs (top-3, rank, decoded token) vs log_softmax of HF logits.

    Tolerance: 1e-3 absolute in logprob (float32 on both sides; kernels differ).
    """
    (out,) = client.generate(PROMPT, temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    ids = hf.encode(PROMPT)
    total = 0.0
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        ref = torch.log_softmax(hf.next_logits(ids), dim=-1)
        top = torch.topk(ref, 3)
        assert token in position
        # greedy: the drawn token is the top one, so the dict holds exactly the top 3
        assert list(position) == top.indices.tolist()
        for rank, (tid, lp) in enumerate(position.items(), start=1):
            assert lp.rank == rank
            assert lp.logprob == pytest.approx(float(ref[tid]), abs=1e-3)
            assert lp.decoded_token == hf.tokenizer.decode([tid])
        total += float(ref[token])
        ids.append(token)
    assert completion.cumulative_logprob == pytest.approx(total, abs=4e-3)


def test_prompt_logprobs_match_transformers(client, hf):
    (out,) = client.generate(PROMPT, temperature=0.0, max_tokens=1, prompt_logprobs=2)
    ids = hf.encode(PROMPT)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    with torch.no_grad():
        logits = hf.model(torch.tensor([ids])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry is not None
        actual = ids[pos]
        assert entry[actual].logprob == pytest.approx(float(ref[pos - 1, actual]), abs=1e-3)
        top2 = torch.topk(ref[pos - 1], 2).indices.tolist()
        assert set(top2) <= set(entry)


def test_seeded_sampling_repeats_and_seeds_differ(client):
    kw = dict(temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True)
    a = client.generate(PROMPT, seed=7, **kw)[0].outputs[0].token_ids
    b = client.generate(PROMPT, seed=7, **kw)[0].outputs[0].token_ids
    others = {tuple(client.generate(PROMPT, seed=s, **kw)[0].outputs[0].token_ids)
              for s in (1, 2, 3)}
    assert a == b
    assert len(others | {tuple(a)}) > 1


def test_n_returns_n_sequences(client):
    (out,) = client.generate(PROMPT, n=3, temperature=1.0, seed=0, max_tokens=8)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) > 0 for c in out.outputs)


def test_stop_string_ends_generation_like_vllm(client, hf):
    ids = hf.encode(PROMPT)
    full = hf.tokenizer.decode(hf.greedy(ids, 12), skip_special_tokens=True)
    stop = full.strip().split()[1]  # a word that greedy decoding will produce
    kw = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    (out,) = client.generate(PROMPT, stop=[stop], **kw)
    c = out.outputs[0]
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop
    assert stop not in c.text  # vLLM strips the stop string by default
    assert full.startswith(c.text)
    (kept,) = client.generate(PROMPT, stop=[stop], include_stop_str_in_output=True, **kw)
    assert kept.outputs[0].text.endswith(stop)


def test_stop_token_ids_end_generation(client, hf):
    ids = hf.encode(PROMPT)
    greedy = hf.greedy(ids, 8)
    stop_token = greedy[2]
    (out,) = client.generate(PROMPT, temperature=0.0, max_tokens=8, stop_token_ids=[stop_token],
                             ignore_eos=True)
    c = out.outputs[0]
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop_token
    first = greedy.index(stop_token)
    assert c.token_ids == greedy[: first + 1]  # the stop token id is kept in the ids


def test_stream_deltas_concatenate_to_generate(client):
    prompts = [PROMPT, "The capital of Japan is"]
    kw = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    unary = client.generate(prompts, **kw)
    texts = ["", ""]
    ids: list[list[int]] = [[], []]
    updates = 0
    finished = [False, False]
    for update in client.generate_stream(prompts, **kw):
        updates += 1
        for c in update.output.outputs:
            texts[update.prompt_index] += c.text
            ids[update.prompt_index] += c.token_ids
        finished[update.prompt_index] |= update.output.finished
    assert updates >= 2 * 5  # several deltas per prompt, not one final blob
    assert finished == [True, True]
    for i in range(2):
        assert texts[i] == unary[i].outputs[0].text
        assert ids[i] == unary[i].outputs[0].token_ids


def test_prompt_forms_agree(client):
    ids = client.tokenizer.encode(PROMPT)
    kw = dict(temperature=0.0, max_tokens=4)
    texts = {
        client.generate(p, **kw)[0].outputs[0].text
        for p in (PROMPT, ids, {"prompt_token_ids": ids}, {"prompt": PROMPT}, client.tokenizer(PROMPT))
    }
    assert len(texts) == 1


def test_cumulative_logprob_is_finite_with_sampling(client):
    (out,) = client.generate(PROMPT, temperature=0.7, seed=3, max_tokens=5, logprobs=0)
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    assert c.cumulative_logprob is not None and math.isfinite(c.cumulative_logprob)
    assert c.cumulative_logprob == pytest.approx(
        sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs, strict=True)), abs=1e-4
    )
