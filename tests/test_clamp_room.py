"""The compiled engine's dictionary clamp columns on their own, no server: the frontend's
admission (clamp_room.py), the compiler's count of a trace's columns, and the worker's
planner sharing and giving back columns (shared/steering.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tracewire_server.frontend.clamp_room import ClampRoom
from tracewire_server.frontend.compiler import _clamp_columns
from tracewire_server.frontend.errors import ResourceExhausted
from tracewire_server.shared import plan as P
from tracewire_server.shared import steering
from tracewire_server.shared.limits import CLAMP_COLUMNS, ModelLimits


def test_traces_take_columns_per_module_and_give_them_back():
    room = ClampRoom(8)
    room.admit("a", (("layers.1", 5), ("layers.2", 8)))
    with pytest.raises(ResourceExhausted) as info:
        room.admit("b", (("layers.1", 2), ("layers.2", 1)))
    assert "layers.2's dictionary clamp columns hold 8 of 8" in str(info.value) and "retry" in str(info.value)
    assert room.held == {"layers.1": 5, "layers.2": 8}  # the refusal took nothing
    with pytest.raises(ResourceExhausted, match="more than this server's compiled graph clamps there at once"):
        room.admit("c", (("layers.3", 9),))
    room.admit("d", (("layers.1", 3),))  # exactly the room left
    room.free("a")
    room.free("a")  # (twice: nothing more)
    room.admit("b", (("layers.1", 2), ("layers.2", 1)))
    assert room.held == {"layers.1": 5, "layers.2": 1}


def _clamp(module: str, name: str, features: tuple[int, ...], value: float) -> P.Op:
    edit = P.DictionaryEdit(P.DictRef(name, 1, module, 16), features, value)
    return P.Op("", P.StepSet(), None, P.WriteModule(module, P.Positions(), "clamp", dictionary=edit))


def test_a_traces_columns_are_its_distinct_clamped_features_per_module():
    ops = [(_clamp("layers.1", "sae", (1, 2), 3.0), _clamp("layers.1", "sae", (2, 5), 3.0)),
           (_clamp("layers.1", "sae", (1,), 0.0), _clamp("layers.2", "other", (1,), 3.0))]
    compiled = ModelLimits(vocab_size=8, max_model_len=16, max_logprobs=0)
    assert _clamp_columns(ops, compiled) == (("layers.1", 4), ("layers.2", 1))  # (1,3) (2,3) (5,3) (1,0)
    eager = ModelLimits(vocab_size=8, max_model_len=16, max_logprobs=0, module_interventions=True)
    assert _clamp_columns(ops, eager) == ()


def _rows(features: tuple[int, ...], value: float, hidden: int = 4) -> steering.ClampRows:
    n = len(features)
    return steering.ClampRows(torch.ones(n, hidden), torch.zeros(n), torch.zeros(n), torch.ones(n, hidden),
                              value, tuple(("sae", 1, f, value) for f in features))


def test_slots_clamping_the_same_feature_share_its_column_and_the_last_gives_it_back():
    tables = steering.SteeringTables(["layers.0"], slots=8, max_tokens=4, hidden=4, dtype=torch.float32,
                                     device=torch.device("cpu"), clamp_sites=["layers.0"])
    planner = steering.SlotPlanner(tables)
    add = P.WriteModule("layers.0", P.Positions(), "add", np.ones(4, "<f4").tobytes())
    clamp12 = _clamp("layers.0", "sae", (1, 2), 3.0).action
    clamp2 = _clamp("layers.0", "sae", (2,), 3.0).action
    rows = {id(clamp12): _rows((1, 2), 3.0), id(clamp2): _rows((2,), 3.0)}
    first = planner.slot(0, "a", [clamp12], lambda e: torch.zeros(4), lambda e: rows[id(e)])
    second = planner.slot(0, "b", [add, clamp2], lambda e: torch.ones(4), lambda e: rows[id(e)])
    assert first != second
    columns = tables.clamp_columns[0]
    assert columns[first, :2].tolist() == [0, 1]
    assert columns[second, :2].tolist() == [1, CLAMP_COLUMNS]  # feature 2 at 3.0: the same column
    assert columns[first, 2:].eq(CLAMP_COLUMNS).all()  # (the rest: the zero column)
    planner.release("a")
    assert columns[first].eq(CLAMP_COLUMNS).all() and len(planner.free_columns[0]) == CLAMP_COLUMNS - 1
    planner.release("b")
    assert len(planner.free_columns[0]) == CLAMP_COLUMNS and planner.column_of[0] == {}
    with pytest.raises(RuntimeError, match="no dictionary clamp"):
        planner.patch_slot(0, [clamp2], lambda e: torch.zeros(4))
