"""The patch store's room on its own, no server: the frontend's admission (patch_room.py)
and the worker's store (worker/patch_store.py) never dropping a live trace's values."""

from __future__ import annotations

import pytest
import torch
from tracewire_server.frontend.errors import ResourceExhausted
from tracewire_server.frontend.patch_room import PatchRoom
from tracewire_server.worker.patch_store import PatchStore

SOURCE = "invokes[0].interventions[1] (read 'clean')"


def test_a_trace_that_does_not_fit_now_is_refused_naming_the_read_and_admitted_once_room_is_freed():
    room = PatchRoom(1000)
    room.admit("a", 600, SOURCE)
    with pytest.raises(ResourceExhausted) as info:
        room.admit("b", 500, SOURCE)
    message = str(info.value)
    assert "holds 600 of its 1000 bytes" in message and "500 more" in message
    assert SOURCE in message and "--patch-store-bytes" in message and "retry" in message
    assert room.held == 600 and not room.holds("b")  # the refusal took nothing
    room.admit("c", 400, SOURCE)  # exactly the room left
    assert room.free("a") == 600
    room.admit("b", 500, SOURCE)
    assert room.held == 900
    assert room.free("a") == 0  # a second free gives nothing back twice
    assert room.free("b") == 500 and room.free("c") == 400 and room.held == 0


def test_a_trace_larger_than_the_whole_store_is_refused_as_never_fitting():
    room = PatchRoom(1000)
    with pytest.raises(ResourceExhausted, match=r"more than this server's patch store holds \(1000 bytes"):
        room.admit("a", 1001, SOURCE)
    assert room.held == 0
    with pytest.raises(ResourceExhausted, match="more than this server's patch store holds"):
        PatchRoom(0).admit("a", 1, SOURCE)  # --patch-store-bytes 0: no patching at all


def rows(n: int) -> torch.Tensor:
    return torch.ones(n, 4, dtype=torch.float32)  # n rows of 16 bytes


def test_the_worker_store_refuses_a_put_past_its_size_and_keeps_every_other_traces_values():
    store = PatchStore(max_bytes=64)
    store.put("old", 0, "clean", 0, rows(2))  # 32 bytes
    store.put("new", 0, "clean", 0, rows(2))  # 64: full
    store.put("new", 0, "clean", 1, rows(1))  # over: refused, nothing dropped
    assert torch.equal(store.get("old", 0, "clean", 0), rows(2))  # the oldest is still there
    assert torch.equal(store.get("new", 0, "clean", 0), rows(2))
    with pytest.raises(RuntimeError, match=r"did not fit in the worker's patch store \(64 bytes"):
        store.get("new", 0, "clean", 1)
    assert store.size() == (2, 2, 64)
    store.put("new", 0, "clean", 0, rows(2))  # the same step again replaces: no growth, fits
    assert store.release("old") == 32 and store.release("new") == 32
    assert store.size() == (0, 0, 0)
    with pytest.raises(RuntimeError, match="has no value at step 1"):  # released: no stale refusal
        store.get("new", 0, "clean", 1)
