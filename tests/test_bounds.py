"""Request bounds on their own (frontend/bounds.py): the descriptor walk over hand-built
messages, no server. test_request_bounds.py checks that the server applies them."""

from __future__ import annotations

import pytest
from trace_requests import invoke, iv, logits, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2, tensor_pb2
from tracewire_server.frontend.bounds import (
    DEFAULT_CHARS,
    DEFAULT_ITEMS,
    MAX_DEPTH,
    MAX_DETOKENIZE_IDS,
    MAX_STOP_STRINGS,
    RequestBounds,
)
from tracewire_server.frontend.errors import InvalidArgument
from tracewire_server.shared.limits import ModelLimits

TINY = ModelLimits(vocab_size=2048, max_model_len=512, max_logprobs=20, num_layers=4)  # models/tracewire-tiny
BOUNDS = RequestBounds.of(TINY)
F = "invokes[0].interventions[0]"


def refused(message, field: str, *words: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        BOUNDS.check(message)
    assert info.value.field == field, info.value.message
    for word in words:
        assert word in info.value.description, (word, info.value.description)


def nested_not(depth: int) -> I.Condition:
    condition = I.Condition(text_contains="x")
    for _ in range(depth):
        condition = I.Condition(**{"not": condition})
    return condition


def test_bounds_come_from_the_model():
    assert (BOUNDS.context, BOUNDS.vocab, BOUNDS.layers) == (512, 2048, 4)
    assert RequestBounds.of(ModelLimits(vocab_size=8, max_model_len=16, max_logprobs=0)).layers == 1  # layers unknown


def test_a_request_within_its_bounds_passes():
    BOUNDS.check(trace(
        invoke([1] * 511, iv("n" * DEFAULT_CHARS, steps(at=range(512)), read_logits=logits(ids=list(range(2048)))),
               iv("lens", when=nested_not(MAX_DEPTH - 3), read_logit_lens=I.ReadLogitLens(layers=[0, 1, 2, 3]))),
        invoke("long text " * 1000, *[iv(stop=I.Stop())] * (DEFAULT_ITEMS - 2)),
        stop=["s" * DEFAULT_CHARS] * MAX_STOP_STRINGS, logit_bias={t: 1.0 for t in range(2048)}))


@pytest.mark.parametrize("case, request_, field, words", [
    ("repeated, default bound", trace(*[invoke("a")] * (DEFAULT_ITEMS + 1)), "invokes",
     ("1025 entries; at most 1024",)),
    ("steps: the context", trace(invoke("a", iv(sel=steps(at=range(513)), stop=I.Stop()))),
     f"{F}.steps.list.steps", ("513 entries; at most 512",)),
    ("token ids: the context", trace(invoke([1] * 513)), "invokes[0].prompt.token_ids.ids", ("at most 512",)),
    ("token set: the vocabulary", trace(invoke("a", iv(when=I.Condition(argmax_in=I.TokenSet(token_ids=[1] * 2049)),
                                                        stop=I.Stop()))),
     f"{F}.condition.argmax_in.token_ids", ("2049 entries; at most 2048",)),
    ("map: the vocabulary", trace(invoke("a"), logit_bias={t: 0.0 for t in range(2049)}),
     "sampling_params.logit_bias", ("at most 2048",)),
    ("layers: the model's", trace(invoke("a", iv("l", read_logit_lens=I.ReadLogitLens(layers=[0] * 5)))),
     f"{F}.read_logit_lens.layers", ("5 entries; at most 4",)),
    ("pattern layers: the model's", trace(invoke("a", iv("p", read_attention_pattern=I.ReadAttentionPattern(
        layers=[0] * 5)))), f"{F}.read_attention_pattern.layers", ("5 entries; at most 4",)),
    ("stop strings", trace(invoke("a", stop=["x"] * 65)), "invokes[0].sampling_params.stop", ("at most 64",)),
    ("a stop string", trace(invoke("a"), stop=["x", "y" * 1025]), "sampling_params.stop[1]",
     ("1025 characters; at most 1024",)),
    ("a name", trace(invoke("a", iv("n" * 1025, stop=I.Stop()))), f"{F}.name", ("1025 characters",)),
    ("a tensor's dimensions", trace(invoke("a", iv(write_logits=I.WriteLogits(add=tensor_pb2.Tensor(shape=[1] * 9))))),
     f"{F}.write_logits.add.shape", ("9 entries; at most 8",)),
    ("nesting", trace(invoke("a", iv(when=nested_not(MAX_DEPTH - 2), stop=I.Stop()))),
     f"{F}.condition" + ".not" * (MAX_DEPTH - 2), (f"nested more than {MAX_DEPTH} deep",)),
    ("an enum value the proto lacks", trace(invoke("a", iv("r", read_logits=I.ReadLogits(stage=7)))),
     f"{F}.read_logits.stage", ("unknown LogitsStage value 7", "LOGITS_STAGE_RAW")),
    ("an enum in a repeated message", trace(invoke("a", iv(when=I.Condition(all_of=I.Conditions(conditions=[
        I.Condition(text_contains="a"), I.Condition(entropy=I.Threshold(comparison=42))])), stop=I.Stop()))),
     f"{F}.condition.all_of.conditions[1].entropy.comparison", ("unknown Comparison value 42",)),
    ("detokenize ids", service_pb2.DetokenizeRequest(token_ids=[1] * (MAX_DETOKENIZE_IDS + 1)), "token_ids",
     (f"at most {MAX_DETOKENIZE_IDS}",)),
])
def test_bounds(case, request_, field, words):
    refused(request_, field, *words)


def test_text_to_tokenize_is_bounded_by_the_byte_cap_alone():
    BOUNDS.check(service_pb2.TokenizeRequest(text="a" * 100_000))
