"""The server pool's rules (server_pool.py), against a fake start: what it starts ahead, in
what order, how many at once, and what a taker gets."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import eventually
from server_pool import ServerPool, ServerSpec, plan_of

A, B, C = ServerSpec("a"), ServerSpec("b"), ServerSpec("c")


class FakeStart:
    """Records each start; a start of a spec in `hold` blocks until released; one in
    `fail` raises."""

    def __init__(self, fail: tuple[ServerSpec, ...] = ()) -> None:
        self.started: list[str] = []
        self.fail = fail
        self.release = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, spec: ServerSpec, directory: Path, owner: str) -> object:
        with self.lock:
            self.started.append(spec.name)
        self.release.wait(10)
        if spec in self.fail:
            raise RuntimeError(f"{spec.name} refused to start")
        return SimpleNamespace(name=spec.name, directory=directory, owner=owner)


def _item(nodeid: str, *specs: ServerSpec) -> object:
    marks = [SimpleNamespace(args=specs)] if specs else []
    return SimpleNamespace(nodeid=nodeid, iter_markers=lambda name: marks if name == "servers" else [])


def test_the_plan_is_the_order_of_first_use_with_its_file() -> None:
    items = [_item("tests/x.py::t1", B), _item("tests/x.py::t2", B, A), _item("tests/y.py::t1", C, A)]
    plan = plan_of(items, lambda item: [])  # type: ignore[arg-type]
    assert [(spec.name, owner) for spec, owner in plan] == [("b", "tests/x.py"), ("a", "tests/x.py"),
                                                           ("c", "tests/y.py")]
    session = plan_of(items, lambda item: [C])  # type: ignore[arg-type]
    assert [spec.name for spec, _ in session] == ["c", "b", "a"]  # the session's fixtures first


def test_at_most_ahead_started_and_not_taken(tmp_path: Path) -> None:
    start = FakeStart()
    pool = ServerPool([(A, "f"), (B, "f"), (C, "f")], start, tmp_path, ahead=1)
    pool.fill()
    start.release.set()
    assert eventually(lambda: start.started == ["a"], 5.0)
    assert pool.take(A, "f").name == "a"
    assert eventually(lambda: start.started == ["a", "b"], 5.0)  # taking one starts the next
    assert pool.take(B, "f").directory == tmp_path / "b"
    assert pool.take(C, "f").name == "c"
    assert start.started == ["a", "b", "c"]  # each once
    assert pool.close() == []


def test_a_spec_taken_before_its_turn_starts_there_and_is_not_started_again(tmp_path: Path) -> None:
    start = FakeStart()
    start.release.set()
    pool = ServerPool([(A, "f"), (B, "f")], start, tmp_path, ahead=1)
    pool.fill()
    assert pool.take(B, "g").owner == "g"  # not reached yet: started by the taker
    assert pool.take(A, "f").name == "a"
    assert sorted(start.started) == ["a", "b"]
    unplanned = ServerSpec("unplanned")
    assert pool.take(unplanned, "h").name == "unplanned"
    with pytest.raises(AssertionError, match="taken twice"):
        pool.take(A, "f")


def test_a_failed_start_is_raised_to_its_taker_only(tmp_path: Path) -> None:
    start = FakeStart(fail=(A,))
    start.release.set()
    pool = ServerPool([(A, "f"), (B, "f")], start, tmp_path, ahead=2)
    pool.fill()
    with pytest.raises(RuntimeError, match="a refused to start"):
        pool.take(A, "f")
    assert pool.take(B, "f").name == "b"
    assert pool.waited.keys() == {"a", "b"}


def test_close_hands_back_the_servers_nobody_took(tmp_path: Path) -> None:
    start = FakeStart()
    start.release.set()
    pool = ServerPool([(A, "f"), (B, "f"), (C, "f")], start, tmp_path, ahead=2)
    pool.fill()
    assert sorted(s.name for s in pool.close()) == ["a", "b"]  # started ahead, never taken
    pool.fill()
    assert "c" not in start.started  # nothing starts once closed

