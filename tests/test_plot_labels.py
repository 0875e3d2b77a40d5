"""tracewire.plot's figures name what the read covered, in the model's numbers: attention's
`layer` / `head` are the model's layer and head numbers (one not read is refused naming it),
the logit lens's rows are the layers it read and its columns the tokens it read at each
position (the prompt's, then the drawn ones), by default. On real reads from the eager
session server, checked on the matplotlib objects (tick labels, the image, the title)."""

from __future__ import annotations

import numpy as np
import pytest
import tracewire as tw
import tracewire.plot as plot
from tracewire.tracing import LensRead, PatternRead

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(eager):
    with tw.Client(eager.target, timeout=300) as c:
        yield c


def ticks(axis) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels()]


def shown(client: tw.Client, ids) -> list[str]:
    """Token ids as the figures write them (newlines escaped)."""
    return [client.tokenizer.decode(int(t)).replace("\n", "\\n").replace("\t", "\\t") for t in ids]


@pytest.fixture(scope="module")
def traced(client):
    with client.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        pattern = tracer.iter[0].attention([1, 3], heads=[2, 0], positions="prompt", top_k=0).save()
        single = tracer.iter[0].attention(2, positions="prompt", top_k=0).save()
        lens = tracer.iter[0].logit_lens([1, 2], positions="prompt", top_k=1).save()
        new = tracer.all().logit_lens([0, 3], top_k=1).save()
    return tracer, pattern.value, single.value, lens.value, new


def test_attention_takes_the_models_layer_and_head_numbers(client, traced):
    tracer, pattern, _, _, _ = traced
    assert isinstance(pattern, PatternRead)
    assert (pattern.layers, pattern.heads) == ((1, 3), (2, 0))
    fig = plot.attention(pattern, layer=3, head=0, decode=client.tokenizer.decode)
    ax = fig.axes[0]
    matrix = ax.images[0].get_array()
    # layer 3 is the read's second layer, head 0 its second head
    np.testing.assert_allclose(np.ma.filled(matrix, 0.0), np.tril(pattern.weights[1, :, 1]), atol=1e-6)
    assert ax.get_title() == "attention, layer 3, head 0"
    assert not np.allclose(pattern.weights[0, :, 1], pattern.weights[1, :, 1])  # another layer draws another image
    # the keys and queries are the prompt's tokens, by default (the sequence as the server tokenized it)
    prompt_ids = tracer.invokes[0].result.prompt_token_ids
    assert prompt_ids == client.tokenizer.encode(PROMPT)
    assert ticks(ax.xaxis) == shown(client, prompt_ids)
    assert ticks(ax.yaxis) == shown(client, prompt_ids)


def test_attention_refuses_a_layer_or_head_it_did_not_read_naming_it(traced):
    _, pattern, _, _, _ = traced
    with pytest.raises(tw.InvalidArgument, match=r"^layer 0 was not read: this pattern holds layers 1, 3") as e:
        plot.attention(pattern, layer=0, head=0)
    assert e.value.field == "layer"
    with pytest.raises(tw.InvalidArgument, match=r"^layer: this pattern holds layers \[1, 3\]; choose one") as e:
        plot.attention(pattern, head=0)  # two layers: which one is the caller's to say
    assert e.value.field == "layer"
    with pytest.raises(tw.InvalidArgument, match=r"^head 1 was not read: this pattern holds heads 2, 0") as e:
        plot.attention(pattern, layer=1, head=1)
    assert e.value.field == "head"


def test_attention_of_one_layer_needs_no_layer(client, traced):
    _, _, single, _, _ = traced
    assert single.layers == (2,) and single.heads == ()  # all heads, in order
    fig = plot.attention(single, head=3)
    assert fig.axes[0].get_title() == "attention, layer 2, head 3"
    np.testing.assert_allclose(np.ma.filled(fig.axes[0].images[0].get_array(), 0.0), np.tril(single.weights[0, :, 3]),
                               atol=1e-6)
    assert plot.attention(single, layer=2).axes[0].get_title() == "attention, layer 2, head 0"
    with pytest.raises(tw.InvalidArgument, match="^layer 0 was not read") as e:
        plot.attention(single, layer=0)
    assert e.value.field == "layer"
    # without decode the keys are the token ids; tokens= still names them as given
    assert ticks(plot.attention(single).axes[0].xaxis) == [f"#{t}" for t in client.tokenizer.encode(PROMPT)]
    assert ticks(plot.attention(single, tokens=list("abcde")).axes[0].xaxis) == list("abcde")


def test_a_hand_made_pattern_counts_its_layers_from_0(traced):
    _, pattern, _, _, _ = traced
    bare = tw.AttentionPattern(pattern.weights, pattern.keys, pattern.positions)
    assert plot.attention(bare, layer=1, head=1).axes[0].get_title() == "attention, layer 1, head 1"
    assert plot.attention(bare, layer=3, head=0, layers=[1, 3], heads=[2, 0]).axes[0].get_title() == \
        "attention, layer 3, head 0"


def test_the_lens_labels_rows_with_its_layers_and_columns_with_the_prompts_tokens(client, traced):
    tracer, _, _, lens, _ = traced
    assert isinstance(lens, LensRead)
    prompt_ids = tracer.invokes[0].result.prompt_token_ids
    assert lens.layers == (1, 2)
    assert lens.positions == tuple(range(len(prompt_ids)))
    assert lens.input_ids == tuple(prompt_ids)
    fig = plot.logit_lens(lens, decode=client.tokenizer.decode)
    ax = fig.axes[0]
    assert ticks(ax.yaxis) == ["1", "2"]
    assert ticks(ax.xaxis) == shown(client, client.tokenizer.encode(PROMPT))
    assert ax.get_xlabel() == "input token"
    # no decode: the tokens as ids, as the cells show them
    assert ticks(plot.logit_lens(lens).axes[0].xaxis) == [f"#{t}" for t in prompt_ids]
    # given labels win
    given = plot.logit_lens(lens, layers=[10, 20], tokens=[str(i) for i in range(len(prompt_ids))])
    assert ticks(given.axes[0].yaxis) == ["10", "20"]
    assert ticks(given.axes[0].xaxis) == [str(i) for i in range(len(prompt_ids))]


def test_the_new_token_lens_names_the_token_each_step_read(client, traced):
    """Step 0 reads the prompt's last token, step s the token drawn at step s - 1."""
    tracer, _, _, _, new = traced
    prompt_ids = tracer.invokes[0].result.prompt_token_ids
    drawn = tracer.invokes[0].result.outputs[0].token_ids
    assert new.steps == [0, 1, 2]
    read = [prompt_ids[-1], *drawn[:2]]
    for step, value in zip(new.steps, new, strict=True):
        assert value.positions == (len(prompt_ids) - 1 + step,)
        assert value.input_ids == (read[step],)
        fig = plot.logit_lens(value, decode=client.tokenizer.decode)
        assert ticks(fig.axes[0].xaxis) == shown(client, [read[step]])
        assert ticks(fig.axes[0].yaxis) == ["0", "3"]
