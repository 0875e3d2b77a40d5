"""Activation patching in the plan compiler (frontend/patching.py): writes whose operand is
another invoke's read, resolved across the trace's invokes, every bad reference refused
naming its field; and the plain data the frontend and the worker act on (resolved rows,
exports, waits, the salt, the read-bytes bound). No engine, no server.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_compiler import BIG, COMPILED, EAGER, HIDDEN, PROMPT, STEERING, compile_
from test_compiler_units import EAGER as UNITS
from test_compiler_units import NEURONS
from trace_requests import invoke, iv, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire_server.frontend.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tracewire_server.frontend.patching import PatchWait
from tracewire_server.shared import plan as P

W = "invokes[1].interventions[0]"
PATCH = f"{W}.write_module.patch"


def prompt_read(name: str = "clean", module: str = "layers.1", **kw: Any) -> I.Intervention:
    sel = I.Positions(**kw) if kw else I.Positions(all_prompt=I.AllPrompt())
    return iv(name, read_module=I.ReadModule(module=module, positions=sel))


def new_token_read(name: str = "clean", sel=None, **kw: Any) -> I.Intervention:
    return iv(name, sel, read_module=I.ReadModule(module="layers.1", **kw))


def patch(where=None, sel=None, op: str = "patch", module: str = "layers.1", **ref: Any) -> I.Intervention:
    """A write at positions `where` taking invoke 0's read "clean" (or `ref`'s)."""
    w = I.WriteModule(module=module, **{op: I.ReadRef(**{"invoke": 0, "name": "clean", **ref})})
    if where is not None:
        w.positions.CopyFrom(where)
    return iv("", sel, write_module=w)


def at(*positions: int) -> I.Positions:
    return I.Positions(prompt_list=I.PositionList(positions=list(positions)))


def two(source: list[I.Intervention], target: list[I.Intervention], source_kw=None, **kw: Any):
    return trace(invoke(PROMPT, *source, **(source_kw or {})), invoke(PROMPT[:6], *target), **kw)


def invalid(request, field: str, *words: str, limits=EAGER) -> None:
    with pytest.raises(InvalidArgument) as info:
        compile_(request, limits)
    assert info.value.field == field, info.value.message
    for word in words:
        assert word in info.value.message, (word, info.value.message)


def test_a_prompt_position_patch_resolves_rows_exports_and_a_wait_for_step_0():
    compiled = compile_(two([prompt_read()], [patch(at(2, -1), positions=[3, -1])], max_tokens=3))
    write = compiled.ops_by_invoke[1][0].action
    assert write == P.WriteModule("layers.1", at_positions(2, -1), "patch",
                                  ref=P.ReadRef("t", 0, "clean", (3, -1), (3, 7)))
    assert compiled.waits == (PatchWait(1, 0, 0, compiled.waits[0].what),)
    assert "invoke 1's patch of layers.1 from invoke 0's read 'clean'" in compiled.waits[0].what
    source = compiled.invokes[0].sequences[0].plan
    assert source.exports == {"clean"} and source.trace == "t" and source.invoke == 0
    assert compiled.invokes[1].sequences[0].plan.exports == frozenset()
    assert compiled.keeps_values and compiled.key == "t"
    # the reference carries the trace's key: no other trace's request shares the target's KV blocks
    other = compile_trace_keyed(two([prompt_read()], [patch(at(2, -1), positions=[3, -1])], max_tokens=3), "u")
    assert compiled.invokes[1].cache_salt and other.invokes[1].cache_salt != compiled.invokes[1].cache_salt


def at_positions(*p: int) -> P.Positions:
    return P.Positions("prompt_list", items=p)


def compile_trace_keyed(request, key: str):
    from test_compiler import tokenizer
    from tracewire_server.frontend.compiler import compile_trace

    return compile_trace(request, EAGER, tokenizer(), key, BIG)


def test_all_rows_in_order_and_add_read_with_its_scale():
    compiled = compile_(two([prompt_read(prompt_range=I.PositionRange(start=0, stop=3))],
                            [patch(I.Positions(prompt_range=I.PositionRange(start=1, stop=4)), op="add_read")]))
    write = compiled.ops_by_invoke[1][0].action
    assert write.edit == "add_read" and write.ref.rows == (0, 1, 2) and write.scale == 1.0


def test_a_new_token_patch_waits_for_the_last_step_it_takes():
    compiled = compile_(two([new_token_read()], [patch(sel=steps(start=1, stop=3))], max_tokens=5))
    assert [(w.invoke, w.source, w.step) for w in compiled.waits] == [(1, 0, 2)]
    # open-ended: the target's last step (its max_tokens)
    compiled = compile_(two([new_token_read()], [patch()], max_tokens=4))
    assert compiled.waits[0].step == 3


def test_chains_wait_in_turn_and_exports_are_per_source():
    request = trace(invoke(PROMPT, prompt_read()),
                    invoke(PROMPT, prompt_read("mid"), patch(I.Positions(all_prompt=I.AllPrompt()))),
                    invoke(PROMPT, patch(I.Positions(all_prompt=I.AllPrompt()), invoke=1, name="mid")))
    compiled = compile_(request)
    assert [(w.invoke, w.source) for w in compiled.waits] == [(1, 0), (2, 1)]
    assert [inv.sequences[0].plan.exports for inv in compiled.invokes] == [{"clean"}, {"mid"}, frozenset()]


def test_bad_references_are_invalid_naming_the_field():
    all_prompt = I.Positions(all_prompt=I.AllPrompt())
    invalid(two([prompt_read()], [patch(all_prompt, invoke=2)]), f"{PATCH}.invoke", "invoke 2 does not exist")
    invalid(two([prompt_read()], [patch(all_prompt, invoke=-1)]), f"{PATCH}.invoke", "must be >= 0")
    invalid(two([prompt_read()], [patch(all_prompt, invoke=1)]), f"{PATCH}.invoke", "its own invoke")
    invalid(two([prompt_read()], [patch(all_prompt, name="")]), f"{PATCH}.name", "name the source")
    invalid(two([prompt_read()], [patch(all_prompt, name="nope")]), f"{PATCH}.name", "no intervention named 'nope'")
    invalid(two([prompt_read()], [patch(all_prompt)], source_kw={"n": 2}), f"{PATCH}.invoke", "n = 2")
    mean = iv("clean", read_module=I.ReadModule(module="layers.1", positions=I.Positions(all_prompt=I.AllPrompt()),
                                                reduction=I.REDUCTION_MEAN))
    invalid(two([mean], [patch(all_prompt)]), f"{PATCH}.name", "mean-reduced")
    logits_read = iv("clean", read_logits=I.ReadLogits(top_k=I.TopK(k=3)))
    invalid(two([logits_read], [patch(all_prompt)]), f"{PATCH}.name", "not a read_module")
    conditional = iv("clean", when=I.Condition(text_contains="x"),
                     read_module=I.ReadModule(module="layers.1", positions=all_prompt))
    invalid(two([conditional], [patch(all_prompt)]), f"{PATCH}.name", "has a condition")
    # counts: 8 source rows, a 6-token target
    invalid(two([prompt_read()], [patch(all_prompt)]), f"{W}.write_module.positions", "selects 6 positions",
            "takes 8 rows")
    invalid(two([prompt_read()], [patch(at(0), positions=[0, 1])]), f"{PATCH}.positions", "selects 1", "2 rows")
    invalid(two([prompt_read()], [patch(at(0), positions=[8])]), f"{PATCH}.positions[0]", "outside invoke 0's prompt")
    invalid(two([prompt_read(prompt_list=I.PositionList(positions=[1]))], [patch(at(0), positions=[2])]),
            f"{PATCH}.positions[0]", "not one invoke 0's 'clean' reads")
    # prompt positions need the source's prompt rows at step 0
    invalid(two([new_token_read()], [patch(at(0))]), f"{PATCH}.name", "does not read prompt positions")
    invalid(two([prompt_read()], [patch(at(0), positions=[1], sel=steps(at=[1]))]), f"{W}.steps", "must include 0")
    # the new token needs the source's new-token row at each of the write's steps
    invalid(two([prompt_read()], [patch()]), f"{PATCH}.name", "does not read the new token")
    invalid(two([new_token_read(sel=steps(start=0, stop=2))], [patch()], max_tokens=4), f"{W}.steps",
            "step 2", "does not reach or select")
    invalid(two([new_token_read()], [patch(positions=[1])]), f"{PATCH}.positions", "leave positions unset")
    invalid(trace(invoke(PROMPT, new_token_read(), max_tokens=2), invoke(PROMPT, patch(), max_tokens=4)),
            f"{W}.steps", "step 2")
    # a patch takes prompt positions or the new token, not both
    invalid(two([prompt_read()], [patch(I.Positions(all=I.AllPositions()))]), f"{W}.write_module.positions",
            "not both")


def test_cycles_are_refused_naming_the_write_that_closes_them():
    all_prompt = I.Positions(all_prompt=I.AllPrompt())
    a = [prompt_read("a"), patch(all_prompt, invoke=1, name="b")]
    b = [prompt_read("b"), patch(all_prompt, invoke=0, name="a")]
    with pytest.raises(InvalidArgument) as info:
        compile_(trace(invoke(PROMPT, *a), invoke(PROMPT, *b)))
    assert info.value.field in ("invokes[0].interventions[1].write_module.patch.invoke",
                                "invokes[1].interventions[1].write_module.patch.invoke")
    assert "cycle (invoke 0 -> invoke 1 -> invoke 0" in info.value.message


def test_patches_need_an_eager_engine():
    request = two([prompt_read()], [patch(at(0), positions=[1])])
    for limits in (COMPILED, STEERING):
        with pytest.raises(FailedPrecondition):
            compile_(request, limits)


def test_the_kept_rows_count_against_the_read_bytes_budget():
    request = two([prompt_read()], [patch(at(0), positions=[1])], max_tokens=2)
    plain = compile_(trace(invoke(PROMPT, prompt_read()), invoke(PROMPT[:6]), max_tokens=2))
    compiled = compile_(request)
    row_bytes = 8 * 4 * HIDDEN  # 8 prompt positions of float32 [hidden]
    assert plain.read_bytes_bound == row_bytes
    assert compiled.read_bytes_bound == 2 * row_bytes  # streamed, and kept on the worker
    assert plain.patch_bytes == 0 and not plain.keeps_values
    # the room the trace takes in the worker's patch store (frontend/patch_room.py)
    assert compiled.patch_bytes == row_bytes
    assert compiled.patch_source == "invokes[0].interventions[0] (read 'clean')"
    with pytest.raises(ResourceExhausted):
        compile_(request, max_read_bytes=2 * row_bytes - 1)


def test_the_patch_store_room_is_every_sources_whole_rows_at_every_step_and_names_the_largest():
    # invoke 0: a prompt read (8 rows of [hidden]) and a read of one neuron of the new
    # token at 3 steps (kept whole: every neuron, whichever it returns); invoke 2: one
    # prompt row
    neurons = iv("neurons", read_module=I.ReadModule(
        module="layers.1.mlp.act", units=I.UnitSelection(ids=I.UnitIds(ids=[0]))))
    request = trace(
        invoke(PROMPT, prompt_read(), neurons),
        invoke(PROMPT[:6], patch(at(0), positions=[1]),
               iv("", write_module=I.WriteModule(module="layers.1.mlp.act",
                                                 patch=I.ReadRef(invoke=0, name="neurons")))),
        invoke(PROMPT, prompt_read("one", prompt_list=I.PositionList(positions=[2]))),
        invoke(PROMPT[:6], patch(at(1), invoke=2, name="one")),
        max_tokens=3)
    compiled = compile_(request, UNITS)
    assert compiled.patch_bytes == 8 * 4 * HIDDEN + 3 * 4 * NEURONS + 1 * 4 * HIDDEN
    assert compiled.patch_source == "invokes[0].interventions[0] (read 'clean')"
    assert compiled.read_bytes_bound == compiled.patch_bytes + 8 * 4 * HIDDEN + 3 * 4 + 4 * HIDDEN
