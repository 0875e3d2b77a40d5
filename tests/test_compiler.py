"""The plan compiler on its own (frontend/compiler.py): hand-built tracewire.v1 requests,
the tiny model's tokenizer and its limits written out, no engine and no server.

Every error compile_trace / check_sequences raise is asserted with its class, the field
path it names and its key words; the plans it builds with their structure; the read-bytes
bound with its arithmetic. Not reachable, so not tested: `action`'s final "unknown action"
(every member of Intervention.action has its branch above it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import pytest
from conftest import MODEL
from trace_requests import cmp, f32, invoke, iv, logits, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import trace_pb2
from tracewire_server.frontend.compiler import CompiledTrace, check_sequences, compile_trace
from tracewire_server.frontend.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, TracewireError
from tracewire_server.shared import plan as P
from tracewire_server.shared.limits import ModelLimits

VOCAB, HIDDEN, LAYERS = 2048, 256, 4  # models/tracewire-tiny
MODULES = frozenset(
    {"embed_tokens", "norm"}
    | {f"layers.{i}{part}" for i in range(LAYERS) for part in ("", ".self_attn", ".mlp")}
)
# The engines the server runs: eager (module hooks), compiled, compiled with steering tables.
EAGER = ModelLimits(vocab_size=VOCAB, max_model_len=512, max_logprobs=20, hidden_size=HIDDEN,
                    num_layers=LAYERS, modules=MODULES, module_interventions=True)
COMPILED = dataclasses.replace(EAGER, module_interventions=False)
STEERING = dataclasses.replace(COMPILED, steerable_layers=frozenset({0, 1}))
READING = dataclasses.replace(COMPILED, readable_layers=frozenset({0, 2}))
MODULES = dataclasses.replace(COMPILED, readable_modules=frozenset({"embed_tokens", "layers.1.mlp", "norm"}),
                              steerable_modules=frozenset({"embed_tokens", "layers.1.self_attn", "norm"}))

PROMPT = list(range(10, 18))  # 8 tokens: positions are checked against it
F = "invokes[0].interventions[0]"
BIG = 1 << 40  # a server read cap no test reaches


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


def compile_(request, limits: ModelLimits = EAGER, max_read_bytes: int = BIG, **kw) -> CompiledTrace:
    return compile_trace(request, limits, tokenizer(), "t", max_read_bytes, **kw)


def one(*interventions, limits: ModelLimits = EAGER, **sampling) -> CompiledTrace:
    """One invoke of PROMPT with these interventions."""
    return compile_(trace(invoke(PROMPT, *interventions, **sampling)), limits)


def ops(*interventions, **kw) -> tuple[P.Op, ...]:
    return one(*interventions, **kw).ops_by_invoke[0]


def renamed(*interventions: I.Intervention) -> tuple[I.Intervention, ...]:
    """The interventions with distinct names (r0, r1, ...) where they have one."""
    for j, intervention in enumerate(interventions):
        if intervention.name:
            intervention.name = f"r{j}"
    return interventions


def refused(error: type[TracewireError], field: str | None, *words: str, call) -> TracewireError:
    """`call()` raises `error` naming `field` (InvalidArgument's field; the message's lead
    for the others, which carry no field of their own) with `words` in its message."""
    with pytest.raises(error) as info:
        call()
    e = info.value
    if isinstance(e, InvalidArgument):
        assert e.field == field, e.message
    elif field is not None:
        assert e.message.startswith(f"{field}: "), e.message
    for word in words:
        assert word in e.message, (word, e.message)
    return e


def invalid(request_or_iv, field: str, *words: str, limits: ModelLimits = EAGER, **kw) -> None:
    """An intervention (compiled as the only one of PROMPT) or a whole request is refused
    with INVALID_ARGUMENT naming `field`."""
    request = request_or_iv if not isinstance(request_or_iv, I.Intervention) else trace(invoke(PROMPT, request_or_iv))
    refused(InvalidArgument, field, *words, call=lambda: compile_(request, limits, **kw))


def precondition(intervention: I.Intervention, field: str, *words: str, limits: ModelLimits) -> str:
    request = trace(invoke(PROMPT, intervention))
    return refused(FailedPrecondition, field, *words, call=lambda: compile_(request, limits)).message


def tokens(*ids: int) -> I.TokenSet:
    return I.TokenSet(token_ids=list(ids))


def threshold(op: str, value: float) -> I.Threshold:
    return I.Threshold(comparison=cmp(op), value=value)


# -- sequence counts ----------------------------------------------------------


def test_check_sequences_names_the_field_that_went_over():
    check_sequences(2, "prompts", 2, "sampling_params.n", 4)  # at the cap
    refused(InvalidArgument, "prompts", "5 entries", "at most 4", "--max-sequences",
            call=lambda: check_sequences(5, "prompts", 1, "sampling_params.n", 4))
    refused(InvalidArgument, "sampling_params.n", "n = 3 x 2 entries is 6 sequences", "at most 4",
            call=lambda: check_sequences(2, "prompts", 3, "sampling_params.n", 4))


def test_a_trace_has_at_least_one_invoke_and_at_most_the_cap():
    invalid(trace(), "invokes", "at least one invoke is required")
    invalid(trace(*[invoke(PROMPT)] * 3), "invokes", "3 entries", "at most 2", max_sequences=2)
    assert len(compile_(trace(*[invoke(PROMPT)] * 2), max_sequences=2).invokes) == 2


def test_the_invokes_n_summed_is_capped_naming_where_n_came_from():
    # the invoke's own n
    invalid(trace(invoke(PROMPT), invoke(PROMPT, n=2)), "invokes[1].sampling_params.n",
            "ask for 3 sequences by invoke 1", "at most 2 per request", max_sequences=2)
    # the trace's n, inherited by every invoke
    invalid(trace(invoke(PROMPT), invoke(PROMPT), n=2), "sampling_params.n",
            "ask for 4 sequences by invoke 1", max_sequences=3)
    # n < 1 is not counted here: the sampling check names it
    invalid(trace(invoke(PROMPT, n=0)), "invokes[0].sampling_params.n", "must be >= 1")
    compiled = compile_(trace(invoke(PROMPT, n=1), invoke(PROMPT), n=2), max_sequences=3)
    assert [len(i.sequences) for i in compiled.invokes] == [1, 2]


# -- what the compiler takes from prompts and sampling ------------------------


def test_prompt_and_sampling_errors_name_the_message_the_value_came_from():
    invalid(trace(invoke(PROMPT), invoke("")), "invokes[1].prompt.text", "must not be empty")
    invalid(trace(invoke([1, VOCAB])), "invokes[0].prompt.token_ids.ids[1]", "outside the vocabulary")
    invalid(trace(invoke([1] * 512)), "invokes[0].prompt", "prompt is 512 tokens", "max_model_len is 512")
    # the trace's values are checked first, even where an invoke overrides them
    invalid(trace(invoke(PROMPT, temperature=0.5), temperature=-1), "sampling_params.temperature", ">= 0")
    invalid(trace(invoke(PROMPT, temperature=-1)), "invokes[0].sampling_params.temperature", ">= 0")
    # max_tokens that does not fit after the prompt: the message it was set in
    invalid(trace(invoke(PROMPT), max_tokens=505), "sampling_params.max_tokens",
            "505 tokens after the 8 of invokes[0].prompt", "at most 504")
    invalid(trace(invoke(PROMPT, max_tokens=505), max_tokens=4), "invokes[0].sampling_params.max_tokens",
            "at most 504")
    assert one(max_tokens=504).invokes[0].max_tokens == 504
    # unset: vLLM's 16, or what the prompt leaves
    assert one().invokes[0].max_tokens == 16
    assert compile_(trace(invoke([1] * 500))).invokes[0].max_tokens == 12


def test_invoke_sampling_replaces_the_traces_field_by_field():
    compiled = compile_(trace(invoke(PROMPT, stop=["b"], seed=3), stop=["a", "c"], temperature=0.5,
                              logit_bias={5: 1.0}))
    (sequence,) = compiled.invokes[0].sequences
    assert sequence.sampling["stop"] == ["b"]  # replaced, not extended
    assert sequence.sampling["temperature"] == 0.5 and sequence.sampling["seed"] == 3
    assert sequence.sampling["logit_bias"] == {5: 1.0}


def test_a_text_prompt_is_tokenized_by_the_encoder():
    compiled = compile_(trace(invoke("The capital of France is")))
    assert compiled.invokes[0].prompt.token_ids == tokenizer().encode("The capital of France is")
    assert compiled.invokes[0].prompt.text == "The capital of France is"


# -- options ------------------------------------------------------------------


def test_options():
    invalid(trace(invoke(PROMPT), options=trace_pb2.TraceOptions(max_read_bytes=-1)),
            "options.max_read_bytes", "must be >= 0")
    invalid(trace(invoke(PROMPT), options=trace_pb2.TraceOptions(stream_interval_ms=1001)),
            "options.stream_interval_ms", "must be <= 1000, got 1001")
    default = one()
    assert (default.stream_every_step, default.stream_interval_s) == (True, 0.0)
    chosen = compile_(trace(invoke(PROMPT), options=trace_pb2.TraceOptions(
        stream_every_step=False, stream_interval_ms=1000)))
    assert (chosen.stream_every_step, chosen.stream_interval_s) == (False, 1.0)


# -- the read-bytes bound -------------------------------------------------------

ROW = 4 * HIDDEN  # one position of a module's output, float32

# (intervention, bytes one sequence's read returns at most), with max_tokens 10, PROMPT 8 tokens
READ_BYTES = {
    "sample, every step": (iv("r", read_sample=I.ReadSample()), 4 * 10),
    "logprobs top 5": (iv("r", read_logprobs=I.ReadLogprobs(top_k=5)), 8 * 6 * 10),
    "logits top 3, steps [2, 5)": (iv("r", steps(start=2, stop=5), read_logits=logits(k=3)), 8 * 3 * 3),
    "logits of 2 ids at steps {0, 9, 50}": (
        iv("r", steps(at=[0, 9, 50]), read_logits=logits(ids=[1, 2])), 8 * 2 * 2),
    "full logits from step 20": (iv("r", steps(start=20), read_logits=logits()), 0),
    "full logits": (iv("r", read_logits=logits()), 4 * VOCAB * 10),
    "module, new tokens": (iv("r", read_module=I.ReadModule(module="layers.1")), ROW * 10),
    "module, the prompt": (
        iv("r", read_module=I.ReadModule(module="layers.1", positions=I.Positions(all_prompt=I.AllPrompt()))),
        ROW * 8),
    "module, 2 prompt positions": (
        iv("r", read_module=I.ReadModule(module="layers.1", positions=I.Positions(
            prompt_list=I.PositionList(positions=[0, -1, 0])))), ROW * 2),
    "module, all": (
        iv("r", read_module=I.ReadModule(module="layers.1", positions=I.Positions(all=I.AllPositions()))),
        ROW * 8 + ROW * 9),
    "lens top 5 of 2 layers": (iv("r", read_logit_lens=I.ReadLogitLens(layers=[0, 1], top_k=5)), 2 * 8 * 5 * 10),
    "lens full rows, the prompt": (
        iv("r", read_logit_lens=I.ReadLogitLens(layers=[0, 1], positions=I.Positions(all_prompt=I.AllPrompt()))),
        8 * 2 * 4 * VOCAB),
    "lens full rows, all": (
        iv("r", read_logit_lens=I.ReadLogitLens(layers=[0], positions=I.Positions(all=I.AllPositions()))),
        8 * 4 * VOCAB + 9 * 4 * VOCAB),
    "a write": (iv(write_logits=I.WriteLogits(mask=tokens(3))), 0),
}


@pytest.mark.parametrize("case", list(READ_BYTES))
def test_read_bytes_bound(case):
    intervention, expected = READ_BYTES[case]
    assert one(intervention, max_tokens=10).read_bytes_bound == expected
    # per sequence, summed over invokes
    request = trace(invoke(PROMPT, intervention, n=2), invoke(PROMPT, intervention), max_tokens=10)
    assert compile_(request).read_bytes_bound == 3 * expected


def test_reads_over_the_budget_are_resource_exhausted():
    request = trace(invoke(PROMPT, iv("r", read_logits=logits())), max_tokens=10)  # 81920 bytes
    bound = 4 * VOCAB * 10
    assert compile_(request, max_read_bytes=bound).read_bytes_bound == bound  # at the cap
    refused(ResourceExhausted, None, f"up to {bound} bytes", f"over the limit of {bound - 1} bytes",
            "options.max_read_bytes", f"server cap {bound - 1} bytes", "--max-read-bytes",
            call=lambda: compile_(request, max_read_bytes=bound - 1))
    # the request's own budget, when lower than the server's cap
    request.options.max_read_bytes = bound - 1
    refused(ResourceExhausted, None, f"over the limit of {bound - 1} bytes", f"server cap {BIG} bytes",
            call=lambda: compile_(request))
    # a higher one is capped to the server's
    request.options.max_read_bytes = 2 * bound
    refused(ResourceExhausted, None, f"over the limit of {bound - 1} bytes",
            call=lambda: compile_(request, max_read_bytes=bound - 1))


def test_the_lens_work_of_one_step_is_bounded():
    """A trace's logit-lens reads put at most max_lens_rows streams (layers x positions x
    sequences) through lm_head at one step: summed over reads and invokes, refused naming
    the invoke where the sum went over."""
    limits = dataclasses.replace(EAGER, lens_work=VOCAB * HIDDEN * 40)
    assert limits.max_lens_rows == 40 and EAGER.max_lens_rows > 1000

    def lens(name: str, layers: list[int], positions: I.Positions | None = None) -> I.Intervention:
        return iv(name, read_logit_lens=I.ReadLogitLens(layers=layers, positions=positions, top_k=5))

    prompt = I.Positions(all_prompt=I.AllPrompt())
    every = lens("a", [0, 1, 2, 3], prompt)  # 4 layers x the prompt's 8 positions: 32 streams
    assert compile_(trace(invoke(PROMPT, every)), limits).ops_by_invoke[0][0].name == "a"
    # new-token reads count one position; "all" its prompt's at step 0
    compile_(trace(invoke(PROMPT, every, lens("b", [0, 1, 2, 3]), lens("c", [0, 1, 2, 3]))), limits)
    words = ("logit-lens", "over this model's limit of 40", "fewer layers or prompt positions")
    invalid(trace(invoke(PROMPT, every, lens("b", [0, 1, 2, 3], I.Positions(all=I.AllPositions())))),
            "invokes[0].interventions", "up to 64 residual streams", *words, limits=limits)
    invalid(trace(invoke(PROMPT, every, n=2)), "invokes[0].interventions", "up to 64", *words, limits=limits)
    invalid(trace(invoke(PROMPT, every), invoke(PROMPT, lens("a", [0, 1], prompt))),
            "invokes[1].interventions", "up to 48", *words, limits=limits)


# -- interventions: names, steps, actions -------------------------------------


def test_names():
    invalid(iv(read_sample=I.ReadSample()), f"{F}.name", "reads need a name")
    invalid(trace(invoke(PROMPT, iv("a", read_sample=I.ReadSample()), iv("b", stop=I.Stop()),
                         iv("a", stop=I.Stop()))),
            "invokes[0].interventions[2].name", "duplicate name 'a' (also invokes[0].interventions[0])")
    # unnamed writes and stops are named by their index
    assert [op.name for op in ops(iv(stop=I.Stop()), iv("s", read_sample=I.ReadSample()), iv(stop=I.Stop()))] == [
        "#0", "s", "#2"]


def test_step_selectors():
    stop = {"stop": I.Stop()}
    invalid(iv(sel=steps(start=-1), **stop), f"{F}.steps.range.start", "must be >= 0, got -1")
    invalid(iv(sel=steps(start=3, stop=2), **stop), f"{F}.steps.range.stop", "must be >= start (3), got 2")
    invalid(iv(sel=steps(at=[1, -2]), **stop), f"{F}.steps.list.steps[1]", "must be >= 0, got -2")
    invalid(iv(sel=steps(at=[]), **stop), f"{F}.steps.list.steps", "must not be empty")
    chosen = ops(iv(sel=steps(start=2, stop=5), **stop), iv(sel=steps(start=3), **stop),
                 iv(sel=steps(start=3, stop=3), **stop), iv(sel=steps(at=[4, 1, 4]), **stop),
                 iv(sel=steps(), **stop), iv(**stop))
    assert [op.steps for op in chosen] == [
        P.StepSet(start=2, stop=5), P.StepSet(start=3), P.StepSet(start=3, stop=3),
        P.StepSet(steps=frozenset({1, 4})), P.StepSet(), P.StepSet()]


def test_an_intervention_sets_an_action():
    invalid(iv("x"), f"{F}.action", "set one action")


@pytest.mark.parametrize("stage, expected", [
    (I.LOGITS_STAGE_UNSPECIFIED, "processed"), (I.LOGITS_STAGE_PROCESSED, "processed"),
    (I.LOGITS_STAGE_RAW, "raw"), (I.LOGITS_STAGE_BEFORE_WRITES, "before_writes")])
def test_logits_reads(stage, expected):
    def read(**selection: Any) -> P.Action:
        return ops(iv("r", read_logits=I.ReadLogits(stage=stage, **selection)))[0].action

    assert read() == P.ReadLogits(expected)
    assert read(full=I.FullRow()) == P.ReadLogits(expected)
    assert read(top_k=I.TopK(k=VOCAB)) == P.ReadLogits(expected, top_k=VOCAB)
    assert read(token_ids=tokens(7, 3, 7)) == P.ReadLogits(expected, token_ids=(7, 3, 7))


def test_token_ids_and_top_k_are_checked_against_the_vocabulary():
    invalid(iv("r", read_logits=logits(k=0)), f"{F}.read_logits.top_k.k", f"must be in [1, {VOCAB}]", "got 0")
    invalid(iv("r", read_logits=logits(k=VOCAB + 1)), f"{F}.read_logits.top_k.k", f"got {VOCAB + 1}")
    invalid(iv("r", read_logits=logits(ids=[])), f"{F}.read_logits.token_ids.token_ids", "must not be empty")
    invalid(iv("r", read_logits=logits(ids=[1, VOCAB])), f"{F}.read_logits.token_ids.token_ids[1]",
            f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})")
    invalid(iv("r", read_logprobs=I.ReadLogprobs(top_k=-1)), f"{F}.read_logprobs.top_k", f"must be in [0, {VOCAB}]")
    assert ops(iv("r", read_logprobs=I.ReadLogprobs()))[0].action == P.ReadLogprobs(0)
    invalid(iv(force_sample=I.ForceSample(token_id=-1)), f"{F}.force_sample.token_id", "token id -1 is outside")
    assert ops(iv(force_sample=I.ForceSample(token_id=VOCAB - 1)))[0].action == P.ForceSample(VOCAB - 1)
    assert ops(iv("s", read_sample=I.ReadSample()), iv(stop=I.Stop()))[1].action == P.Stop()


def test_logits_writes():
    w = f"{F}.write_logits"
    invalid(iv(write_logits=I.WriteLogits()), f"{w}.op", "set replace, add, bias or mask")
    invalid(iv(write_logits=I.WriteLogits(add=f32([1.0] * 10))), f"{w}.add.shape",
            f"expected a vector of {VOCAB} elements, got shape [10]")
    invalid(iv(write_logits=I.WriteLogits(replace=f32([math.nan] * VOCAB))), f"{w}.replace.data", "NaN")
    invalid(iv(write_logits=I.WriteLogits(bias=I.TokenBias())), f"{w}.bias.bias", "must not be empty")
    invalid(iv(write_logits=I.WriteLogits(bias=I.TokenBias(bias={5: math.inf}))), f"{w}.bias.bias[5]",
            "must be finite")
    invalid(iv(write_logits=I.WriteLogits(bias=I.TokenBias(bias={VOCAB: 1.0}))), f"{w}.bias.bias[{VOCAB}]",
            "outside the vocabulary")
    invalid(iv(write_logits=I.WriteLogits(mask=tokens())), f"{w}.mask.token_ids", "must not be empty")
    invalid(iv(write_logits=I.WriteLogits(mask=tokens(1, -1))), f"{w}.mask.token_ids[1]", "outside")

    values = np.arange(VOCAB, dtype=np.float32) / 7
    written = [op.action for op in ops(
        iv(write_logits=I.WriteLogits(add=f32(values))), iv(write_logits=I.WriteLogits(replace=f32(values))),
        iv(write_logits=I.WriteLogits(bias=I.TokenBias(bias={5: -2.5}))),
        iv(write_logits=I.WriteLogits(mask=tokens(9, 3))))]
    assert written == [P.AddLogits(values.astype("<f4").tobytes()), P.ReplaceLogits(values.astype("<f4").tobytes()),
                       P.BiasLogits({5: -2.5}), P.MaskLogits((9, 3))]


# -- module reads and writes --------------------------------------------------


def test_module_reads_name_known_modules():
    e = refused(InvalidArgument, f"{F}.read_module.module", "unknown module 'layers.9'", "GetModelInfo",
                call=lambda: one(iv("r", read_module=I.ReadModule(module="layers.9"))))
    # the first eight, in model order
    assert "(embed_tokens, layers.0, layers.0.mlp, layers.0.self_attn, layers.1, layers.1.mlp, " \
           "layers.1.self_attn, layers.2, ...)" in e.message
    assert ops(iv("r", read_module=I.ReadModule(module="layers.2.mlp", reduction=I.REDUCTION_MEAN)))[0].action == \
        P.ReadModule("layers.2.mlp", P.Positions(), mean=True)


@pytest.mark.parametrize("limits", [EAGER, COMPILED, STEERING, READING],
                         ids=["eager", "compiled", "compiled_steering", "compiled_reads"])
@pytest.mark.parametrize(("intervention", "field", "words"), [
    (iv("r", read_module=I.ReadModule(module="layers.99")), f"{F}.read_module.module", "unknown module 'layers.99'"),
    (iv("r", read_module=I.ReadModule(module="layers.0.nope")), f"{F}.read_module.module", "unknown module"),
    (iv(write_module=I.WriteModule(module="layers.99", zero=I.ZeroAblation())), f"{F}.write_module.module",
     "unknown module 'layers.99'"),
    (iv("r", read_logit_lens=I.ReadLogitLens(layers=[99])), f"{F}.read_logit_lens.layers[0]", "outside [0, 4)"),
    (iv("r", read_attention_pattern=I.ReadAttentionPattern(layers=[99])), f"{F}.read_attention_pattern.layers[0]",
     "outside [0, 4)"),
])
def test_an_address_that_does_not_exist_is_the_same_invalid_argument_on_every_engine_kind(
        intervention, field, words, limits):
    # (what the server cannot serve is FAILED_PRECONDITION only for addresses that exist)
    invalid(intervention, field, words, limits=limits)


def test_positions_are_checked_against_the_prompt():
    def read(positions: I.Positions) -> I.Intervention:
        return iv("r", read_module=I.ReadModule(module="layers.0", positions=positions))

    p = f"{F}.read_module.positions"
    invalid(read(I.Positions(prompt_range=I.PositionRange(start=9))), f"{p}.prompt_range.start",
            "9 is outside the prompt's 8 positions")
    invalid(read(I.Positions(prompt_range=I.PositionRange(start=0, stop=-9))), f"{p}.prompt_range.stop",
            "-9 is outside")
    invalid(read(I.Positions(prompt_range=I.PositionRange(start=5, stop=5))), f"{p}.prompt_range",
            "selects no prompt position")
    invalid(read(I.Positions(prompt_range=I.PositionRange(start=-1, stop=2))), f"{p}.prompt_range",
            "selects no prompt position")
    invalid(read(I.Positions(prompt_list=I.PositionList())), f"{p}.prompt_list.positions", "must not be empty")
    invalid(read(I.Positions(prompt_list=I.PositionList(positions=[0, 8]))), f"{p}.prompt_list.positions[1]",
            "8 is outside the prompt's 8 positions")
    invalid(read(I.Positions(prompt_list=I.PositionList(positions=[-9]))), f"{p}.prompt_list.positions[0]",
            "outside")
    chosen = [op.action.positions for op in ops(*renamed(
        read(I.Positions(prompt_range=I.PositionRange(start=-8, stop=8))),
        read(I.Positions(prompt_range=I.PositionRange(start=2))),
        read(I.Positions(prompt_list=I.PositionList(positions=[-8, 7]))),
        read(I.Positions(all_prompt=I.AllPrompt())), read(I.Positions(all=I.AllPositions())),
        read(I.Positions(new_token=I.NewToken())), read(I.Positions()), iv("r", read_module=I.ReadModule(
            module="layers.0"))))]
    assert chosen == [P.Positions("prompt_range", start=-8, stop=8), P.Positions("prompt_range", start=2),
                      P.Positions("prompt_list", items=(-8, 7)), P.Positions("all_prompt"), P.Positions("all"),
                      P.Positions(), P.Positions(), P.Positions()]


def test_logit_lens():
    lens = f"{F}.read_logit_lens"
    invalid(iv("r", read_logit_lens=I.ReadLogitLens()), f"{lens}.layers", "name at least one layer")
    invalid(iv("r", read_logit_lens=I.ReadLogitLens(layers=[0, 4])), f"{lens}.layers[1]",
            "layer 4 is outside [0, 4)")
    invalid(iv("r", read_logit_lens=I.ReadLogitLens(layers=[-5])), f"{lens}.layers[0]", "layer -5")
    invalid(iv("r", read_logit_lens=I.ReadLogitLens(layers=[0], top_k=VOCAB + 1)), f"{lens}.top_k",
            f"must be in [0, {VOCAB}]")
    (op,) = ops(iv("r", read_logit_lens=I.ReadLogitLens(layers=[-1, 0], top_k=5)))
    assert op.action == P.ReadLogitLens((3, 0), P.Positions(), 5)
    # lm_head is split across tensor-parallel ranks: the workers gather it (test_parallel)
    (op,) = ops(iv("r", read_logit_lens=I.ReadLogitLens(layers=[0], top_k=5)),
                limits=dataclasses.replace(EAGER, tensor_parallel_size=2))
    assert op.action == P.ReadLogitLens((0,), P.Positions(), 5)


def test_module_writes():
    w = f"{F}.write_module"

    def write(**fields: Any) -> I.Intervention:
        return iv(write_module=I.WriteModule(**{"module": "layers.1", **fields}))

    invalid(write(), f"{w}.op", "set add, replace, zero, mean, patch or add_read")
    invalid(write(module="lm_head", zero=I.ZeroAblation()), f"{w}.module", "unknown module 'lm_head'")
    invalid(write(add=f32([1.0] * (HIDDEN + 1))), f"{w}.add.shape", f"a vector of {HIDDEN} elements")
    invalid(write(replace=f32([math.inf] * HIDDEN)), f"{w}.replace.data", "NaN or infinity")
    invalid(write(zero=I.ZeroAblation(), scale=math.nan), f"{w}.scale", "must be finite")

    vector = np.linspace(-1, 1, HIDDEN, dtype=np.float32)
    written = [op.action for op in ops(
        write(add=f32(vector), scale=2.0), write(replace=f32(vector)),
        write(module="layers.0.mlp", zero=I.ZeroAblation()),
        write(mean=I.MeanAblation(), positions=I.Positions(all_prompt=I.AllPrompt())))]
    assert written == [P.WriteModule("layers.1", P.Positions(), "add", vector.astype("<f4").tobytes(), 2.0),
                       P.WriteModule("layers.1", P.Positions(), "replace", vector.astype("<f4").tobytes(), 1.0),
                       P.WriteModule("layers.0.mlp", P.Positions(), "zero"),
                       P.WriteModule("layers.1", P.Positions("all_prompt"), "mean")]


def test_module_interventions_on_a_compiled_engine_are_a_failed_precondition():
    lens = iv("r", read_logit_lens=I.ReadLogitLens(layers=[0]))
    read = iv("r", read_module=I.ReadModule(module="layers.0"))
    zero = iv(write_module=I.WriteModule(module="layers.0", zero=I.ZeroAblation()))
    for intervention, field in ((read, f"{F}.read_module"), (lens, f"{F}.read_logit_lens"),
                                (zero, f"{F}.write_module")):
        message = precondition(intervention, field, "module hooks do not run inside compiled", "--enforce-eager",
                               limits=COMPILED)
        assert "--compiled-steering" in message  # a way to serve some writes there
        if intervention is not zero:  # steering tables serve writes, never reads
            message = precondition(intervention, field, "--enforce-eager", limits=STEERING)
            assert "--compiled-steering" not in message
    # an unknown module is the request's error on any engine
    invalid(iv(write_module=I.WriteModule(module="nope", zero=I.ZeroAblation())), f"{F}.write_module.module",
            "unknown module 'nope'", limits=COMPILED)


def test_compiled_reads_serve_their_layers_and_name_the_field_they_refuse():
    r, lens = f"{F}.read_module", f"{F}.read_logit_lens"

    def read(module: str) -> I.Intervention:
        return iv("r", read_module=I.ReadModule(module=module))

    precondition(read("layers.1"), f"{r}.module", "residual streams on layers 0, 2 only, not on 'layers.1'",
                 "--compiled-reads LAYERS", limits=READING)
    precondition(read("layers.0.mlp"), f"{r}.module", "module outputs in read buffers on no module, not "
                 "'layers.0.mlp'", "--compiled-module-reads LAYERS, or --enforce-eager", limits=READING)
    precondition(iv("l", read_logit_lens=I.ReadLogitLens(layers=[0, -3])), f"{lens}.layers[1]",
                 "not on 'layers.1'", limits=READING)  # (-3 of 4 layers: layers.1)
    precondition(iv(write_module=I.WriteModule(module="layers.0", zero=I.ZeroAblation())), f"{F}.write_module",
                 "--enforce-eager", "--compiled-steering", limits=READING)  # buffers serve reads, never writes
    actions = [op.action for op in ops(read("layers.2"), iv("l", read_logit_lens=I.ReadLogitLens(layers=[0, -2])),
                                       limits=READING)]
    assert actions == [P.ReadModule("layers.2", P.Positions()), P.ReadLogitLens((0, 2), P.Positions(), 0)]
    message = precondition(read("layers.0"), r, "--enforce-eager", limits=COMPILED)
    assert "--compiled-reads" in message  # a plain compiled engine names the way to serve it


def test_compiled_module_buffers_and_tables_serve_their_modules_and_name_the_flag_elsewhere():
    def read(module: str) -> I.Intervention:
        return iv(module, read_module=I.ReadModule(module=module))

    def write(module: str) -> I.Intervention:
        return iv(write_module=I.WriteModule(module=module, zero=I.ZeroAblation()))

    actions = [op.action for op in ops(read("norm"), read("layers.1.mlp"), write("layers.1.self_attn"),
                                       write("embed_tokens"), limits=MODULES)]
    assert [a.module for a in actions] == ["norm", "layers.1.mlp", "layers.1.self_attn", "embed_tokens"]
    precondition(read("layers.1.self_attn"), f"{F}.read_module.module",
                 "module outputs in read buffers of embed_tokens, layers.1.mlp, norm only, not 'layers.1.self_attn'",
                 "--compiled-module-reads", limits=MODULES)
    precondition(write("layers.1.mlp"), f"{F}.write_module.module",
                 "write tables for module outputs of embed_tokens, layers.1.self_attn, norm only, not 'layers.1.mlp'",
                 "--compiled-module-steering", limits=MODULES)


def test_compiled_steering_serves_add_replace_zero_on_its_layers():
    w = f"{F}.write_module"

    def write(module: str = "layers.1", **op: Any) -> I.Intervention:
        return iv(write_module=I.WriteModule(module=module, **(op or {"zero": I.ZeroAblation()})))

    precondition(write("layers.0.mlp"), f"{w}.module", "write tables for module outputs on no module, not "
                 "'layers.0.mlp'", "--compiled-module-steering LAYERS", limits=STEERING)
    precondition(write("layers.3"), f"{w}.module", "steering tables on layers 0, 1 only, not on 'layers.3'",
                 "--compiled-steering LAYERS", limits=STEERING)
    precondition(write(mean=I.MeanAblation()), f"{w}.op", "takes no mean ablations (--compiled-mean-ablation",
                 limits=STEERING)
    means = dataclasses.replace(STEERING, compiled_means=True)
    assert [op.action.edit for op in ops(write(mean=I.MeanAblation()), limits=means)] == ["mean"]
    no_op = iv(write_module=I.WriteModule(module="layers.1"))
    precondition(no_op, f"{w}.op", "not None", limits=STEERING)
    vector = f32(np.ones(HIDDEN))
    assert [op.action.edit for op in ops(
        write(zero=I.ZeroAblation()), write("layers.0", add=vector), write(replace=vector), limits=STEERING)] == [
        "zero", "add", "replace"]


# -- conditions ---------------------------------------------------------------


def test_conditions_compile_to_their_plan_form():
    condition = I.Condition(all_of=I.Conditions(conditions=[
        I.Condition(text_contains="Paris"),
        I.Condition(any_of=I.Conditions(conditions=[
            I.Condition(argmax_in=tokens(3, 4, 3)), I.Condition(text_matches=r"\d+")])),
        I.Condition(**{"not": I.Condition(entropy=threshold("<", 0.5))}),
        I.Condition(token_probability=I.TokenProbability(token_id=7, threshold=threshold(">=", 0.25))),
    ]))
    (op,) = ops(iv("r", when=condition, read_sample=I.ReadSample()))
    assert op.condition == P.AllOf((
        P.TextContains("Paris"), P.AnyOf((P.ArgmaxIn(frozenset({3, 4})), P.TextMatches(r"\d+"))),
        P.Not(P.Entropy("<", 0.5)), P.TokenProbability(7, ">=", 0.25)))
    drawn = ops(iv("r", when=I.Condition(sampled_in=tokens(1)), read_sample=I.ReadSample()),
                iv("p", when=I.Condition(token_probability=I.TokenProbability(threshold=threshold(">", 0.5))),
                   read_sample=I.ReadSample()))
    assert [op.condition for op in drawn] == [P.SampledIn(frozenset({1})), P.TokenProbability(None, ">", 0.5)]
    assert ops(iv("r", read_sample=I.ReadSample()))[0].condition is None


def bad_condition(condition: I.Condition, path: str, *words: str) -> None:
    """A stop gated by `condition` is refused, naming the condition's field `path` below it."""
    invalid(iv(when=condition, stop=I.Stop()), f"{F}.condition{path}", *words)


def test_condition_errors_name_the_leaf():
    empty = I.Intervention(name="x", read_sample=I.ReadSample())
    empty.condition.SetInParent()
    invalid(empty, f"{F}.condition", "set one condition kind")
    bad_condition(I.Condition(**{"not": I.Condition()}), ".not", "set one condition kind")
    bad_condition(I.Condition(any_of=I.Conditions(conditions=[I.Condition(text_contains="a"), I.Condition()])),
                  ".any_of.conditions[1]", "set one condition kind")
    bad_condition(I.Condition(all_of=I.Conditions()), ".all_of.conditions", "must not be empty")
    bad_condition(I.Condition(any_of=I.Conditions()), ".any_of.conditions", "must not be empty")
    bad_condition(I.Condition(sampled_in=tokens()), ".sampled_in.token_ids", "must not be empty")
    bad_condition(I.Condition(argmax_in=tokens(0, VOCAB)), ".argmax_in.token_ids[1]", "outside the vocabulary")
    probability = I.TokenProbability(token_id=VOCAB, threshold=threshold(">", 0))
    bad_condition(I.Condition(token_probability=probability), ".token_probability.token_id", "outside the vocabulary")
    bad_condition(I.Condition(token_probability=I.TokenProbability(token_id=1)),
                  ".token_probability.threshold.comparison", "set a comparison")
    bad_condition(I.Condition(entropy=I.Threshold(value=1.0)), ".entropy.comparison", "set a comparison")
    bad_condition(I.Condition(entropy=threshold(">", math.inf)), ".entropy.value", "must be finite")
    bad_condition(I.Condition(token_probability=I.TokenProbability(threshold=threshold(">", math.nan))),
                  ".token_probability.threshold.value", "must be finite")


def test_text_conditions_are_bounded():
    bad_condition(I.Condition(text_contains=""), ".text_contains", "must not be empty")
    bad_condition(I.Condition(text_contains="x" * 1025), ".text_contains", "1025 characters; at most 1024")
    longest = I.Condition(text_contains="x" * 1024)
    assert ops(iv(when=longest, stop=I.Stop()))[0].condition == P.TextContains("x" * 1024)
    bad_condition(I.Condition(text_matches="x" * 1025), ".text_matches", "at most 1024")
    bad_condition(I.Condition(text_matches="(a"), ".text_matches",
                  "not a regular expression RE2 can run in linear time", "missing )")
    bad_condition(I.Condition(text_matches=r"(a)\1"), ".text_matches", "invalid escape")  # backreferences
    # over RE2's memory budget (MAX_PATTERN_MEMORY)
    bad_condition(I.Condition(text_matches=r"\pL{1000}"), ".text_matches", "pattern too large")


def test_writes_are_gated_only_by_what_exists_before_they_act():
    c = f"{F}.condition"
    zero = {"write_module": I.WriteModule(module="layers.0", zero=I.ZeroAblation())}
    mask = {"write_logits": I.WriteLogits(mask=tokens(1))}
    # module writes: before this step's logits, so text conditions only
    invalid(iv(when=I.Condition(argmax_in=tokens(1)), **zero), c, "only text conditions")
    invalid(iv(when=I.Condition(all_of=I.Conditions(conditions=[
        I.Condition(text_contains="a"), I.Condition(entropy=threshold(">", 1))])), **zero), c, "only text conditions")
    (op,) = ops(iv(when=I.Condition(any_of=I.Conditions(conditions=[
        I.Condition(text_contains="a"), I.Condition(**{"not": I.Condition(text_matches="b")})])), **zero))
    assert op.condition == P.AnyOf((P.TextContains("a"), P.Not(P.TextMatches("b"))))
    # logits writes: before the draw, so no drawn token
    invalid(iv(when=I.Condition(sampled_in=tokens(1)), **mask), c, "cannot use the drawn token")
    invalid(iv(when=I.Condition(**{"not": I.Condition(token_probability=I.TokenProbability(
        threshold=threshold(">", 0.5)))}), force_sample=I.ForceSample(token_id=1)), c, "cannot use the drawn token")
    assert ops(iv(when=I.Condition(token_probability=I.TokenProbability(token_id=2, threshold=threshold(">", 0.5))),
                  **mask))[0].condition == P.TokenProbability(2, ">", 0.5)
    # stop acts after the draw
    assert ops(iv(when=I.Condition(sampled_in=tokens(1)), stop=I.Stop()))[0].condition == P.SampledIn(frozenset({1}))


# -- the compiled trace -------------------------------------------------------


def test_without_interventions_there_is_no_plan():
    compiled = one(temperature=0.0)
    (inv,) = compiled.invokes
    assert (inv.index, inv.key, inv.max_tokens, inv.skip_special_tokens, inv.cache_salt) == (0, "t/0", 16, True, None)
    (sequence,) = inv.sequences
    assert sequence.plan is None and sequence.sampling == {"temperature": 0.0}
    assert compiled.ops_by_invoke == ((),) and compiled.read_bytes_bound == 0


def test_sequences_fan_out_with_their_seeds_and_plans():
    read = iv("top", steps(start=1, stop=3), read_logits=logits(k=2, raw=True))
    compiled = compile_(trace(invoke(PROMPT), invoke(PROMPT, read, n=3, seed=7, skip_special_tokens=False),
                              max_tokens=4), route=2)
    first, second = compiled.invokes
    assert [s.plan for s in first.sequences] == [None]
    assert second.key == "t/1" and not second.skip_special_tokens
    assert [(s.invoke_index, s.sequence_index, s.sampling["seed"]) for s in second.sequences] == [
        (1, 0, 7), (1, 1, 8), (1, 2, 9)]
    op = P.Op("top", P.StepSet(start=1, stop=3), None, P.ReadLogits("raw", top_k=2))
    assert compiled.ops_by_invoke == ((), (op,))
    for s, sequence in enumerate(second.sequences):
        plan = P.SequencePlan(key=f"t/1/{s}", ops=(op,), route=2, skip_special_tokens=False)
        assert sequence.plan == plan
        # the plan travels to the worker in SamplingParams.extra_args
        assert P.decode_plan(sequence.sampling["extra_args"][P.EXTRA_ARGS_KEY]) == plan
    assert compiled.read_bytes_bound == 3 * 8 * 2 * 2
    # no seed: none invented
    assert "seed" not in compile_(trace(invoke(PROMPT, n=2))).invokes[0].sequences[1].sampling


def test_reads_of_prompt_positions_skip_the_prefix_cache():
    def sampling(positions: I.Positions | None) -> dict[str, Any]:
        read = I.ReadModule(module="layers.0")
        if positions is not None:
            read.positions.CopyFrom(positions)
        return one(iv("r", read_module=read)).invokes[0].sequences[0].sampling

    assert "skip_reading_prefix_cache" not in sampling(None)
    assert "skip_reading_prefix_cache" not in sampling(I.Positions(new_token=I.NewToken()))
    for positions in (I.Positions(all_prompt=I.AllPrompt()), I.Positions(all=I.AllPositions()),
                      I.Positions(prompt_list=I.PositionList(positions=[1]))):
        assert sampling(positions)["skip_reading_prefix_cache"] is True
    lens = iv("r", read_logit_lens=I.ReadLogitLens(layers=[0], positions=I.Positions(all_prompt=I.AllPrompt())))
    assert one(lens).invokes[0].sequences[0].sampling["skip_reading_prefix_cache"] is True


def test_module_writes_salt_the_kv_cache():
    zero = iv(write_module=I.WriteModule(module="layers.0", zero=I.ZeroAblation()))
    salt = one(zero).invokes[0].cache_salt
    assert salt is not None and salt.startswith("tracewire:")
    assert one(zero).invokes[0].cache_salt == salt  # identical requests share their blocks
    assert compile_(trace(invoke(PROMPT + [1], zero))).invokes[0].cache_salt != salt
    assert one(zero, skip_special_tokens=False).invokes[0].cache_salt != salt
    assert one(iv(write_logits=I.WriteLogits(mask=tokens(1)))).invokes[0].cache_salt is None


def test_fault_injection_names_only_with_the_flag():
    fault = iv("__fault__:boom", stop=I.Stop())
    assert compile_(trace(invoke(PROMPT, fault)), fault_injection=True).ops_by_invoke[0][0].action == \
        P.InjectFault("boom")
    assert ops(fault)[0].action == P.Stop()
    # the action is still checked first
    invalid(trace(invoke(PROMPT, iv("__fault__:boom"))), f"{F}.action", "set one action", fault_injection=True)


# -- attention patterns -----------------------------------------------------------

# The tiny model's attention: 4 query heads over 2 KV heads (GQA), head_dim 64.
PATTERNS = dataclasses.replace(EAGER, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def pattern(**fields) -> I.Intervention:
    return iv("p", read_attention_pattern=I.ReadAttentionPattern(**fields))


def test_attention_pattern_plan():
    (op,) = ops(pattern(layers=[-1, 1], heads=[3, 2], top_k=5), limits=PATTERNS, max_tokens=10)
    read = op.action
    assert isinstance(read, P.ReadAttentionPattern)
    assert (read.layers, read.heads, read.top_k) == ((3, 1), (3, 2), 5)
    assert read.kv_heads == (1,)  # heads 2 and 3 read KV head 1
    assert (read.head_dim, read.max_len) == (64, len(PROMPT) + 10)
    assert read.positions == P.Positions()
    (op,) = ops(pattern(layers=[0]), limits=PATTERNS)
    assert op.action.heads == (0, 1, 2, 3) and op.action.kv_heads == (0, 1) and op.action.top_k == 0
    # keys come from the prompt at every step: such requests never read the prefix cache
    (seq,) = one(pattern(layers=[0], top_k=1), limits=PATTERNS).invokes[0].sequences
    assert seq.sampling["skip_reading_prefix_cache"] is True


def _scratch(widest: int, max_len: int) -> int:
    """The worker's transient blocks for a pattern read, counted once per trace: 4 float32
    blocks (padded keys, scores, masked scores, softmax) of up to 2**24 elements, one query
    row (its widest of heads or KV heads x head_dim, over max_len keys) at the least."""
    row = widest * max_len
    return 4 * 4 * max(row, min(1 << 24, row * max_len))


def test_attention_pattern_bytes_count_the_key_cache_and_the_scratch():
    keys = 4 * 2 * 1 * 64 * (len(PROMPT) + 10)  # float32 keys of 2 layers x 1 KV head, 18 positions
    scratch = _scratch(64, 18)  # 1 KV head x head_dim 64 is wider than 2 query heads
    top = pattern(layers=[0, 1], heads=[0, 1], top_k=5)
    assert one(top, limits=PATTERNS, max_tokens=10).read_bytes_bound == keys + 10 * 2 * 2 * 8 * 5 + scratch
    # full rows: up to prompt_len + max_tokens keys a row
    full = pattern(layers=[0, 1], heads=[0, 1])
    assert one(full, limits=PATTERNS, max_tokens=10).read_bytes_bound == keys + 10 * 2 * 2 * 4 * 18 + scratch
    # the prompt's rows at step 0 only
    prompt = pattern(layers=[0], heads=[0], top_k=2, positions=I.Positions(all_prompt=I.AllPrompt()))
    assert one(prompt, limits=PATTERNS, max_tokens=10).read_bytes_bound == 4 * 64 * 18 + 8 * 8 * 2 + scratch
    # the key cache alone can exceed the budget: refused up front
    request = trace(invoke(PROMPT, iv("p", steps(at=[0]), read_attention_pattern=I.ReadAttentionPattern(
        layers=[0, 1, 2, 3], top_k=1))), max_tokens=400)
    held = 4 * 4 * 2 * 64 * (len(PROMPT) + 400)
    big = _scratch(2 * 64, len(PROMPT) + 400)
    assert big == 4 * 4 * (1 << 24)  # (a long generation: whole 64 MiB blocks)
    assert compile_(request, PATTERNS).read_bytes_bound == held + 4 * 4 * 8 + big
    refused(ResourceExhausted, None, "over the limit", call=lambda: compile_(request, PATTERNS, held))


def test_pattern_scratch_is_counted_once_per_trace_and_refused_over_the_budget():
    """The blocks are computed one after another and freed: n sequences and two pattern
    reads count the largest block set once; a budget that holds the reads and the key
    caches but not the scratch is refused, naming it."""
    one_read = pattern(layers=[0], heads=[0], top_k=1)
    wide = iv("q", read_attention_pattern=I.ReadAttentionPattern(layers=[1], heads=[0, 1, 2, 3], top_k=1))
    alone = compile_(trace(invoke(PROMPT, one_read), max_tokens=10), PATTERNS).read_bytes_bound
    scratch = _scratch(64, 18)
    reads = alone - scratch  # key cache and values of one sequence
    four = compile_(trace(invoke(PROMPT, one_read), max_tokens=10, n=4), PATTERNS).read_bytes_bound
    assert four == 4 * reads + scratch
    wide_reads = compile_(trace(invoke(PROMPT, wide), max_tokens=10), PATTERNS).read_bytes_bound - _scratch(128, 18)
    both = compile_(trace(invoke(PROMPT, one_read, wide), max_tokens=10), PATTERNS).read_bytes_bound
    assert both == reads + wide_reads + _scratch(128, 18)  # the wider read's blocks, once
    request = trace(invoke(PROMPT, one_read), max_tokens=10)
    refused(ResourceExhausted, None, f"with {scratch} bytes of attention-pattern scratch",
            call=lambda: compile_(request, PATTERNS, reads))
    assert compile_(request, PATTERNS, reads + scratch).read_bytes_bound == reads + scratch


def test_bad_attention_patterns():
    f = f"{F}.read_attention_pattern"
    bad = functools.partial(invalid, limits=PATTERNS)
    bad(pattern(), f"{f}.layers", "name at least one layer")
    bad(pattern(layers=[0, 4]), f"{f}.layers[1]", "layer 4 is outside [0, 4)")
    bad(pattern(layers=[1, -3]), f"{f}.layers[1]", "named twice")
    bad(pattern(layers=[0], heads=[0, 4]), f"{f}.heads[1]", "head 4 is outside [0, 4)")
    bad(pattern(layers=[0], heads=[-1]), f"{f}.heads[0]", "head -1")
    bad(pattern(layers=[0], heads=[2, 1, 2]), f"{f}.heads[2]", "duplicate head 2 (also heads[0])")
    bad(pattern(layers=[0], top_k=-1), f"{f}.top_k", "must be in [0, 512]")
    bad(pattern(layers=[0], top_k=513), f"{f}.top_k", "got 513")
    bad(pattern(layers=[0], positions=I.Positions(prompt_list=I.PositionList(positions=[8]))),
        f"{f}.positions.prompt_list.positions[0]", "outside the prompt's 8 positions")
    # engines that cannot compute them right: refused, never silently wrong
    precondition(pattern(layers=[0]), f, "--enforce-eager",
                 limits=dataclasses.replace(PATTERNS, module_interventions=False))
    precondition(pattern(layers=[0]), f, "tensor_parallel_size 2", limits=dataclasses.replace(
        PATTERNS, attention_patterns_refused="attention patterns need ... tensor_parallel_size 2"))
    precondition(pattern(layers=[0]), f, "attention heads", limits=EAGER)


def test_attention_limits_from_hf_configs():
    from types import SimpleNamespace

    from tracewire_server.frontend.engine import attention_limits

    qwen = SimpleNamespace(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           hidden_size=256)
    assert attention_limits(qwen, 1) == dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                             attention_patterns_refused="")
    assert "tensor_parallel_size 2" in attention_limits(qwen, 2)["attention_patterns_refused"]
    mha = SimpleNamespace(model_type="llama", num_attention_heads=8, hidden_size=512)  # no KV heads, no head_dim
    assert attention_limits(mha, 1)["num_key_value_heads"] == 8 and attention_limits(mha, 1)["head_dim"] == 64
    for config, why in [
        (SimpleNamespace(model_type="falcon", num_attention_heads=8, hidden_size=512, alibi=True), "ALiBi"),
        (SimpleNamespace(model_type="bloom", num_attention_heads=8, hidden_size=512), "ALiBi"),
        (SimpleNamespace(model_type="deepseek_v3", num_attention_heads=8, hidden_size=512, kv_lora_rank=512), "MLA"),
        (SimpleNamespace(model_type="gpt_oss", num_attention_heads=8, hidden_size=512), "sinks"),
        (SimpleNamespace(model_type="t5", num_attention_heads=8, hidden_size=512, is_encoder_decoder=True),
         "encoder-decoder"),
    ]:
        assert why in attention_limits(config, 1)["attention_patterns_refused"], config
