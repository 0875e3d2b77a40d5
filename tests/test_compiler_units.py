"""The plan compiler on unit reads and writes (frontend/units.py): attention heads of
layers.L.self_attn.heads and MLP neurons of layers.L.mlp.act, hand-built requests, the
tiny model's limits written out, no engine (tests/test_compiler.py's approach).

Every refusal is asserted with its class, the field path it names and its key words;
the plans with their units; the read-bytes bound with its arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
from conftest import MODEL
from trace_requests import f32, invoke, iv, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire_server.frontend.compiler import CompiledTrace, compile_trace
from tracewire_server.frontend.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, TracewireError
from tracewire_server.shared import plan as P
from tracewire_server.shared.limits import ModelLimits

VOCAB, HIDDEN, LAYERS, HEADS, HEAD_DIM, NEURONS = 2048, 256, 4, 4, 64, 640  # models/tracewire-tiny
MODULES = frozenset(
    {"embed_tokens", "norm"}
    | {f"layers.{i}{part}" for i in range(LAYERS)
       for part in ("", ".self_attn", ".mlp", ".self_attn.heads", ".mlp.act")}
)
EAGER = ModelLimits(vocab_size=VOCAB, max_model_len=512, max_logprobs=20, hidden_size=HIDDEN,
                    num_layers=LAYERS, modules=MODULES, module_interventions=True,
                    num_attention_heads=HEADS, head_dim=HEAD_DIM, intermediate_size=NEURONS)
COMPILED = dataclasses.replace(EAGER, module_interventions=False)
STEERING = dataclasses.replace(COMPILED, steerable_layers=frozenset({0, 1}))
TP2 = dataclasses.replace(EAGER, tensor_parallel_size=2)

PROMPT = list(range(10, 18))  # 8 tokens
F = "invokes[0].interventions[0]"
HEADS_PATH, ACT = "layers.1.self_attn.heads", "layers.2.mlp.act"


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


def compile_(*interventions, limits: ModelLimits = EAGER, max_read_bytes: int = 1 << 40) -> CompiledTrace:
    return compile_trace(trace(invoke(PROMPT, *interventions), max_tokens=4), limits, tokenizer(), "t",
                         max_read_bytes)


def action(intervention, **kw) -> P.Action:
    return compile_(intervention, **kw).ops_by_invoke[0][0].action


def refused(error: type[TracewireError], field: str, *words: str, intervention, **kw) -> None:
    with pytest.raises(error) as info:
        compile_(intervention, **kw)
    e = info.value
    if isinstance(e, InvalidArgument):
        assert e.field == field, e.message
    else:
        assert e.message.startswith(f"{field}: "), e.message
    for word in words:
        assert word in e.message, (word, e.message)


def read(module=HEADS_PATH, *, ids=None, top_k=None, **positions) -> I.Intervention:
    r = I.ReadModule(module=module, positions=I.Positions(**positions) if positions else None)
    if ids is not None:
        r.units.ids.ids.extend(ids)
    if top_k is not None:
        r.units.top_k.k = top_k
    return iv("r", read_module=r)


def write(module=HEADS_PATH, *, ids=None, **op) -> I.Intervention:
    w = I.WriteModule(module=module, **op)
    if ids is not None:
        w.units.ids.extend(ids)
    return iv(write_module=w)


def test_unit_reads_compile_to_units():
    assert action(read(ids=[2, 0])) == P.ReadModule(HEADS_PATH, P.Positions(), units=P.Units(ids=(2, 0)))
    assert action(read(ACT, top_k=5)) == P.ReadModule(ACT, P.Positions(), units=P.Units(top_k=5))
    assert action(read(ACT)) == P.ReadModule(ACT, P.Positions())  # every neuron


def test_unit_writes_compile_with_their_operands():
    w = action(write(ids=[3], zero=I.ZeroAblation()))
    assert (w.module, w.edit, w.units) == (HEADS_PATH, "zero", (3,))
    w = action(write(ids=[0, 1], add=f32(np.ones((2, HEAD_DIM))), scale=2.0))
    assert (w.edit, w.units, w.scale, len(w.vector)) == ("add", (0, 1), 2.0, 4 * 2 * HEAD_DIM)
    w = action(write(replace=f32(np.ones(HEAD_DIM))))  # one [head_dim] for every head
    assert (w.units, len(w.vector)) == (None, 4 * HEAD_DIM)
    w = action(write(ACT, ids=[7, 9], replace=f32([1.0, 2.0])))
    assert np.frombuffer(w.vector, "<f4").tolist() == [1.0, 2.0]


def test_read_bounds_count_the_chosen_units():
    prompt = dict(all_prompt=I.AllPrompt())
    assert compile_(read(ids=[0, 1])).read_bytes_bound == 4 * 4 * 2 * HEAD_DIM  # 4 steps x 2 heads
    assert compile_(read(ACT, top_k=10, **prompt)).read_bytes_bound == 8 * 10 * len(PROMPT)
    assert compile_(read(ACT)).read_bytes_bound == 4 * 4 * NEURONS
    bound = compile_(read(**prompt)).read_bytes_bound
    assert bound == 4 * HEADS * HEAD_DIM * len(PROMPT)
    with pytest.raises(ResourceExhausted) as info:
        compile_(read(**prompt), max_read_bytes=bound - 1)
    assert f"up to {bound} bytes" in info.value.message


@pytest.mark.parametrize(("intervention", "field", "words"), [
    (read(ids=[4]), f"{F}.read_module.units.ids.ids[0]", ["outside the 4 attention heads"]),
    (read(ids=[-1]), f"{F}.read_module.units.ids.ids[0]", ["outside"]),
    (read(ids=[1, 2, 1]), f"{F}.read_module.units.ids.ids[2]", ["duplicate id 1"]),
    (read(ids=[]), f"{F}.read_module.units.ids.ids", ["must not be empty"]),
    (read(ACT, ids=[640]), f"{F}.read_module.units.ids.ids[0]", ["outside the 640 MLP neurons"]),
    (read(top_k=2), f"{F}.read_module.units.top_k", ["neurons"]),
    (read(ACT, top_k=0), f"{F}.read_module.units.top_k.k", ["[1, 640]"]),
    (read(ACT, top_k=641), f"{F}.read_module.units.top_k.k", ["[1, 640]"]),
    (read("layers.1", ids=[0]), f"{F}.read_module.units", ["no units", "self_attn.heads"]),
    (read("layers.1.mlp", top_k=3), f"{F}.read_module.units", ["no units"]),
    (read("layers.4.self_attn.heads"), f"{F}.read_module.module", ["unknown module"]),
    (read("layers.1.self_attn.head"), f"{F}.read_module.module", ["unknown module"]),
    (write("layers.1", ids=[0], zero=I.ZeroAblation()), f"{F}.write_module.units", ["no units"]),
    (write(ids=[9], zero=I.ZeroAblation()), f"{F}.write_module.units.ids[0]", ["outside"]),
    (write(ids=[0, 0], zero=I.ZeroAblation()), f"{F}.write_module.units.ids[1]", ["duplicate"]),
    (write(ids=[0, 1], add=f32(np.ones((3, HEAD_DIM)))), f"{F}.write_module.add.shape", ["[2, 64] or [64]"]),
    (write(replace=f32(np.ones(HIDDEN))), f"{F}.write_module.replace.shape", ["[4, 64] or [64]"]),
    (write(ACT, ids=[1, 2], replace=f32([1.0])), f"{F}.write_module.replace.shape", ["[2]"]),
    (write(ACT, ids=[1], add=f32([np.nan])), f"{F}.write_module.add.data", ["NaN"]),
    (write(ACT, ids=[1], add=f32([1.0]), scale=float("inf")), f"{F}.write_module.scale", ["finite"]),
    (write(ACT), f"{F}.write_module.op", ["set add"]),
])
def test_bad_units_are_invalid_argument_naming_the_field(intervention, field, words):
    refused(InvalidArgument, field, *words, intervention=intervention)


def test_units_are_refused_where_they_cannot_be_right():
    # tensor parallel splits heads and neurons across ranks
    refused(FailedPrecondition, f"{F}.read_module.module", "tensor parallel", "--tensor-parallel-size 1",
            intervention=read(ids=[0]), limits=TP2)
    refused(FailedPrecondition, f"{F}.write_module.module", "tensor parallel",
            intervention=write(ACT, ids=[0], zero=I.ZeroAblation()), limits=TP2)
    # compiled engines: no module hooks, and decoder layers' steering tables write no units
    refused(FailedPrecondition, f"{F}.read_module", "--enforce-eager", intervention=read(ids=[0]), limits=COMPILED)
    refused(FailedPrecondition, f"{F}.write_module.module", "heads and MLP neurons on no layer",
            "--compiled-unit-steering", intervention=write(ids=[0], zero=I.ZeroAblation()), limits=STEERING)


def test_a_compiled_engine_with_unit_tables_writes_the_units_of_their_layers_only():
    units = dataclasses.replace(COMPILED, unit_steerable_layers=frozenset({1}))  # --compiled-unit-steering 1
    assert units.engine_mode == "compiled_steering"
    (op,) = compile_(write(ids=[2], zero=I.ZeroAblation()), limits=units).ops_by_invoke[0]
    assert op.action == P.WriteModule(HEADS_PATH, P.Positions(), "zero", units=(2,))
    refused(FailedPrecondition, f"{F}.write_module.module", "on layers 1 only", "--compiled-unit-steering",
            intervention=write(ACT, ids=[0], zero=I.ZeroAblation()), limits=units)
    refused(FailedPrecondition, f"{F}.write_module.op", "takes no mean ablations", "--compiled-mean-ablation",
            intervention=write(ids=[0], mean=I.MeanAblation()), limits=units)
    refused(FailedPrecondition, f"{F}.write_module.module", "steering tables on no layer", "--compiled-steering",
            intervention=iv(write_module=I.WriteModule(module="layers.1", zero=I.ZeroAblation())), limits=units)


def test_a_compiled_engine_with_unit_buffers_reads_the_units_of_their_layers_only():
    units = dataclasses.replace(COMPILED, unit_readable_layers=frozenset({1, 2}))  # --compiled-unit-reads 1,2
    neurons = read(ACT, top_k=3)
    neurons.name = "n"
    heads, top = compile_(read(ids=[2, 0]), neurons, limits=units).ops_by_invoke[0]
    assert heads.action.module == HEADS_PATH and heads.action.units == P.Units(ids=(2, 0))
    assert top.action.module == ACT and top.action.units == P.Units(top_k=3)
    refused(FailedPrecondition, f"{F}.read_module.module", "on layers 1, 2 only", "--compiled-unit-reads",
            intervention=read("layers.3.mlp.act", ids=[0]), limits=units)
    # a layer's residual stream needs --compiled-reads; unit writes, a steering table or eager
    refused(FailedPrecondition, f"{F}.read_module.module", "residual streams on no layer", "--compiled-reads",
            intervention=read("layers.1"), limits=units)
    refused(FailedPrecondition, f"{F}.write_module", "--enforce-eager",
            intervention=write(ids=[0], zero=I.ZeroAblation()), limits=units)


def test_fuzzed_unit_interventions_compile_or_get_a_status():
    """Random ReadModule / WriteModule messages (fuzz_requests' generator) on the unit paths:
    each compiles or raises a TracewireError, never anything else."""
    import random

    from fuzz_requests import RequestFuzzer

    fuzz = RequestFuzzer(24, VOCAB)
    rng = random.Random(24)
    compiled = 0
    for _ in range(400):
        kind = rng.choice(("read_module", "write_module"))
        message = fuzz.message((I.ReadModule if kind == "read_module" else I.WriteModule).DESCRIPTOR)
        message.module = rng.choice((HEADS_PATH, ACT, "layers.0.self_attn.heads", "layers.3.mlp.act", "layers.1"))
        intervention = iv("r", **{kind: message}) if kind == "read_module" else iv(**{kind: message})
        try:
            compile_(intervention)
            compiled += 1
        except TracewireError:
            pass
    assert compiled > 0  # (some of them are valid: the generator reaches the compiled paths)
