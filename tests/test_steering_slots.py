"""The compiled steering tables' slot accounting under request churn: many more steering
requests over time than the tables have slots, each slot given back when its request
ends, whatever the worker's own caches do meanwhile. Driven with a stand-in runner, so
hundreds of requests come and go in a second (test_compiled_steering.py checks the
steered values against transformers on a real compiled engine)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from tracewire_server.shared import plan as P
from tracewire_server.shared import steering
from tracewire_server.worker.standin import Sampler, Sender, hooks_over, request, runner

HIDDEN = 8
BATCH = 8  # requests in the engine at once


def _steer(layer: int, value: float) -> P.Op:
    vector = np.full(HIDDEN, value, "<f4").tobytes()
    return P.Op("", P.StepSet(), None, P.WriteModule(f"layers.{layer}", P.Positions(), "add", vector))


def _steering_engine(slots: int = 2 * BATCH + 1):
    """A stand-in runner with steering tables on layers 0 and 1, hooks installed."""
    engine = runner({})
    engine._model_forward = lambda: None
    planned = hooks_over(engine)
    planned.senders[0] = Sender()
    tables = steering.SteeringTables(["layers.0", "layers.1"], slots=slots, max_tokens=4 * BATCH, hidden=HIDDEN,
                                     dtype=torch.float32, device=torch.device("cpu"))
    planned.install_compiled_steering([tables])
    sampler = Sampler()
    planned.install(sampler)
    return engine, planned, tables, sampler


def _join(engine, req_id: str, op: P.Op) -> None:
    state = request(P.encode_plan(P.SequencePlan(key=req_id, ops=(op,))))
    state.output_token_ids = []
    engine.requests[req_id] = state


def _forward(engine) -> None:
    """A forward pass decoding one token of every request (the steering tables filled)."""
    engine.input_batch.req_ids = list(engine.requests)
    # one decode row each, after its 2 prompt tokens and the tokens drawn so far
    engine.input_batch.num_computed_tokens_cpu = np.array([2 + len(s.output_token_ids)
                                                           for s in engine.requests.values()])
    engine.query_start_loc = types.SimpleNamespace(np=np.arange(len(engine.requests) + 1))
    engine._model_forward()


def _draw(engine, sampler) -> None:
    """The draw after that pass: one token more for every request."""
    sampler.forward(torch.zeros(len(engine.requests), 16), None)
    for state in engine.requests.values():
        state.output_token_ids.append(0)


def _decode_pass(engine, sampler) -> None:
    _forward(engine)
    _draw(engine, sampler)


def test_every_slot_comes_back_after_hundreds_of_requests():
    engine, hooks, tables, sampler = _steering_engine()
    ended = 0
    for n in range(400):  # one new request per pass, each lives BATCH passes
        _join(engine, f"r{n}", _steer(n % 2, float(n)))
        if len(engine.requests) > BATCH:
            del engine.requests[next(iter(engine.requests))]  # the oldest ends
            ended += 1
        _forward(engine)
        # each request's row reads its own slot: its vector at its layer, slot 0 at the other
        for row, rid in enumerate(engine.input_batch.req_ids):
            k = int(rid[1:])
            slot = int(tables.slots[row, k % 2])
            assert float(tables.vectors[k % 2, slot, 0]) == float(k) and int(tables.slots[row, 1 - k % 2]) == 0
        _draw(engine, sampler)
    assert ended > 20 * len(tables.vectors[0])  # far more requests than slots came and went
    assert not [s.error for s in hooks.sequences.by_id.values() if s is not None and s.error]
    (planner,) = hooks.steering.planners
    live = sum(len(a) for a in planner.assigned)
    assert live == BATCH  # the requests still in the engine hold one slot each
    assert [len(f) for f in planner.free] == [2 * BATCH - len(a) for a in planner.assigned]


def test_requests_with_the_same_writes_share_a_slot():
    engine, hooks, tables, sampler = _steering_engine(slots=3)  # two slots per layer besides slot 0
    for n in range(3 * BATCH):  # far more requests than slots, two vectors between them
        _join(engine, f"r{n}", _steer(0, 1.0 + n % 2))
    _decode_pass(engine, sampler)
    (planner,) = hooks.steering.planners
    assert not [s.error for s in hooks.sequences.by_id.values() if s is not None and s.error]
    assert len(planner.assigned[0]) == 2 and not planner.free[0]
    for row in range(3 * BATCH):
        slot = int(tables.slots[row, 0])
        assert float(tables.vectors[0, slot, 0]) == 1.0 + row % 2 and int(tables.slots[row, 1]) == 0
    for n in range(3 * BATCH - 1):  # all but one end: the slot of that one's vector stays
        del engine.requests[f"r{n}"]
    _decode_pass(engine, sampler)
    assert list(planner.assigned[0].values()) == [int(tables.slots[0, 0])] and len(planner.free[0]) == 1
    assert float(tables.vectors[0, int(tables.slots[0, 0]), 0]) == 1.0 + (3 * BATCH - 1) % 2
    # a third vector now fits, and the table has no room for a fourth
    _join(engine, "third", _steer(0, 7.0))
    _join(engine, "fourth", _steer(0, 8.0))
    _decode_pass(engine, sampler)
    assert float(tables.vectors[0, int(tables.slots[1, 0]), 0]) == 7.0
    assert "too many distinct steering vectors" in (hooks.sequences.by_id["fourth"].error or "")


def test_an_unchanged_decode_batch_keeps_its_slots_without_planning():
    engine, hooks, tables, sampler = _steering_engine()
    for n in range(BATCH):
        _join(engine, f"r{n}", _steer(n % 2, float(n)))
    (planner,) = hooks.steering.planners
    fills = []
    fill = planner.fill
    planner.fill = lambda *args: (fills.append(args), fill(*args))
    _decode_pass(engine, sampler)
    before = tables.slots.clone()
    for _ in range(5):  # the same requests, one new token each: nothing to plan or copy
        _decode_pass(engine, sampler)
    assert len(fills) == 1 and torch.equal(tables.slots, before)
    del engine.requests["r0"]  # one ends: planned again, its row gone, the others moved up
    _decode_pass(engine, sampler)
    assert len(fills) == 2
    for row, req_id in enumerate(engine.input_batch.req_ids):
        k = int(req_id[1:])
        assert float(tables.vectors[k % 2, int(tables.slots[row, k % 2]), 0]) == float(k)
    assert int(tables.slots[BATCH - 1].abs().sum()) == 0  # the row nobody uses now
    # a prompt chunk that does not reach the new token yet writes nothing, and is planned
    # again in the next pass (which does reach it) even though the requests are the same
    _join(engine, "late", _steer(0, 5.0))
    engine.requests["late"].prompt_token_ids = [1] * 6
    engine.input_batch.req_ids = list(engine.requests)
    engine.input_batch.num_computed_tokens_cpu = np.array([3 + len(s.output_token_ids) for s in
                                                           list(engine.requests.values())[:-1]] + [0])
    engine.query_start_loc = types.SimpleNamespace(np=np.array([*range(BATCH), BATCH + 3]))  # 4 of its 6
    engine._model_forward()
    assert int(tables.slots[BATCH - 1:BATCH + 3, 0].abs().sum()) == 0
    engine.input_batch.num_computed_tokens_cpu[-1] = 4
    engine.query_start_loc = types.SimpleNamespace(np=np.array([*range(BATCH), BATCH + 1]))  # the last 2
    engine._model_forward()
    assert float(tables.vectors[0, int(tables.slots[BATCH, 0]), 0]) == 5.0


def test_unit_tables_compose_what_the_eager_unit_hooks_do():
    """A slot of the heads' / neurons' tables (zero, replace, add, composed in plan order)
    applied as a * input + b gives what the eager pre-hook's edit_units makes of the same
    input, on the chosen units only; slot 0 leaves the input bit for bit."""
    from tracewire_server.worker.unit_hooks import edit_units

    heads, head_dim, neurons = 4, 3, 5
    tables = steering.UnitTables([("layers.0.self_attn.heads", heads * head_dim, head_dim),
                                  ("layers.0.mlp.act", neurons, 1)], slots=4, max_tokens=2,
                                 dtype=torch.float32, device=torch.device("cpu"))
    rng = np.random.default_rng(0)

    def write(path, edit, units, values=None, scale=1.0):
        vector = b"" if values is None else np.asarray(values, "<f4").tobytes()
        return P.WriteModule(path, P.Positions(), edit, vector, scale, units=units)

    def operand(edit):  # as Sequence.write_vector makes it: float32, times the scale for adds
        values = np.frombuffer(edit.vector, "<f4") * (edit.scale if edit.edit == "add" else 1.0)
        return torch.from_numpy(values.copy())

    cases = [
        (0, head_dim, [write("layers.0.self_attn.heads", "zero", (1, 3))]),
        (0, head_dim, [write("layers.0.self_attn.heads", "replace", (2,), rng.normal(size=head_dim)),
                       write("layers.0.self_attn.heads", "add", (0, 2), rng.normal(size=(2, head_dim)), 0.5)]),
        (1, 1, [write("layers.0.mlp.act", "add", (4, 0), rng.normal(size=2), 2.0),
                write("layers.0.mlp.act", "zero", (0,))]),
        (1, 1, [write("layers.0.mlp.act", "replace", None, rng.normal(size=neurons))]),
    ]
    for table, unit_width, edits in cases:
        tables.compose(table, 1, edits, operand)
        x = torch.from_numpy(rng.normal(size=(2, tables.tables(table)[0].shape[1])).astype(np.float32))
        tables.slots[:, table] = 1
        (served,) = tables.apply(table, (x.clone(),))
        expected = x.clone()
        seq = types.SimpleNamespace(write_vector=lambda w, like: operand(w))
        edit_units(expected, unit_width, [types.SimpleNamespace(rows=[0, 1], write=w, seq=seq, operand=None)
                                          for w in edits])
        torch.testing.assert_close(served, expected)
        assert not torch.equal(served, x)  # the write changed something
        tables.slots[:, table] = 0
        (untouched,) = tables.apply(table, (x.clone(),))
        assert torch.equal(untouched, x)


def test_patch_slots_last_one_pass_and_compose_the_sources_rows():
    """A patched row's slot (a vector of its own: the source's row) is one of the tables'
    last `patch_slots`, for one forward pass: when they are all used the next row gets
    None, and begin_pass gives them back. Shared slots never take them."""
    counts = steering.SlotCounts(2)  # 1 + 4 shared + 2 patch slots
    tables = steering.SteeringTables(["layers.0"], slots=counts.total, max_tokens=8, hidden=HIDDEN, dtype=torch.float32,
                                     device=torch.device("cpu"), patch_slots=counts.patch)
    planner = steering.SlotPlanner(tables)
    source = {"patch": torch.arange(HIDDEN, dtype=torch.float32), "add_read": torch.full((HIDDEN,), 0.5)}
    ref = P.ReadRef("t", 0, "clean")
    patch = P.WriteModule("layers.0", P.Positions(), "patch", ref=ref)
    add = P.WriteModule("layers.0", P.Positions(), "add", np.full(HIDDEN, 2, "<f4").tobytes())
    add_read = P.WriteModule("layers.0", P.Positions(), "add_read", scale=0.5, ref=ref)

    def vector(edit: P.WriteModule) -> torch.Tensor:
        return source[edit.edit] if edit.ref is not None else torch.full((HIDDEN,), 2.0)

    shared = [planner.slot(0, f"r{k}", [_steer(0, float(k)).action], vector) for k in range(counts.shared)]
    assert sorted(shared) == [1, 2, 3, 4] and planner.slot(0, "r9", [_steer(0, 9.0).action], vector) is None
    first = planner.patch_slot(0, [add, patch], vector)  # the patch replaces what the add left
    second = planner.patch_slot(0, [patch, add_read], vector)  # the source's row, plus half of another
    assert {first, second} == {5, 6} and planner.patch_slot(0, [patch], vector) is None
    stream = torch.full((HIDDEN,), 7.0)
    for slot, expected in ((first, source["patch"]), (second, source["patch"] + 0.5)):
        out = tables.scales[0, slot] * stream + tables.vectors[0, slot]
        torch.testing.assert_close(out, expected)
    planner.begin_pass()
    assert planner.patch_slot(0, [patch], vector) == 5


def test_mean_groups_average_their_members_only_and_leave_other_rows_bit_for_bit():
    """Packed index entries (steering.pack): rows 1, 3 and 4 are one group (first 1, last 4:
    row 2 lies between them but is not a member), rows 6 and 7 another, after an add in the
    second group's slot; a decoder layer's (hidden, residual) output is averaged as the
    stream (hidden + residual). Every other row is untouched, and without groups the
    tables give what they gave before."""
    tables = steering.SteeringTables(["layers.0", "norm"], slots=4, max_tokens=8, hidden=HIDDEN,
                                     dtype=torch.float32, device=torch.device("cpu"), means=True)
    mean = P.WriteModule("layers.0", P.Positions(), "mean")
    add = P.WriteModule("layers.0", P.Positions(), "add", np.full(HIDDEN, 2, "<f4").tobytes())
    for table in (0, 1):
        tables.compose(table, 1, [mean], lambda e: torch.zeros(HIDDEN))
        tables.compose(table, 2, [add, mean], lambda e: torch.full((HIDDEN,), 2.0))
    entries = [0, steering.pack(1, 1, 4), 0, steering.pack(1, 1, 4), steering.pack(1, 1, 4), 0,
               steering.pack(2, 6, 7), steering.pack(2, 6, 7)]
    tables.slots[:, 0] = torch.tensor(entries)
    tables.slots[:, 1] = torch.tensor(entries)
    gen = torch.Generator().manual_seed(0)
    hidden, residual = torch.randn(8, HIDDEN, generator=gen), torch.randn(8, HIDDEN, generator=gen)
    out, kept = tables.apply(0, (hidden.clone(), residual.clone()))
    stream, new = hidden + residual, out + residual
    torch.testing.assert_close(new[[1, 3, 4]], stream[[1, 3, 4]].mean(0, keepdim=True).expand(3, -1))
    torch.testing.assert_close(new[[6, 7]], (stream[[6, 7]] + 2).mean(0, keepdim=True).expand(2, -1))
    assert torch.equal(out[[0, 2, 5]], hidden[[0, 2, 5]]) and torch.equal(kept, residual)
    normed, _ = tables.apply(1, (hidden.clone(), residual.clone()))  # the final norm: its output alone
    torch.testing.assert_close(normed[[1, 3, 4]], hidden[[1, 3, 4]].mean(0, keepdim=True).expand(3, -1))
    assert torch.equal(normed[[0, 2, 5]], hidden[[0, 2, 5]])
    plain = steering.SteeringTables(["layers.0"], slots=4, max_tokens=8, hidden=HIDDEN, dtype=torch.float32,
                                    device=torch.device("cpu"))
    with pytest.raises(ValueError, match="no mean ablations"):
        plain.compose(0, 1, [mean], lambda e: torch.zeros(HIDDEN))
    assert torch.equal(plain.apply(0, (hidden.clone(), residual.clone()))[0], hidden)
