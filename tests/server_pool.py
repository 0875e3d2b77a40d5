"""Servers started ahead of the tests that take them.

A vLLM engine start is ~45 s on 2 CPU cores and uses about one of them (three processes
importing vLLM one after the other, then the model's trace), so the suite's ~20 starts
were most of its wall time while the other core idled. The pool knows, from the collected
tests, which server configurations (`ServerSpec`) the run will need and in what order,
and keeps up to `ahead` of them starting (or started) in the background while earlier
tests run; a test takes a fresh server that nothing else has touched, exactly as if it
had started it itself, so tests stay independent of order. A spec nobody planned (a test
whose mark is missing, or run alone) starts when taken, as before.

How a test says what it takes: `@servers(SPEC, ...)` (pytest.mark.servers) on the test,
its module (`pytestmark`) or a `pytest.param`; the session fixtures' specs are planned
from the fixtures a test uses (conftest's SESSION_SPECS). Prestarted servers nobody took
are stopped at the session's end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

if TYPE_CHECKING:
    from conftest import ServerProcess

servers = pytest.mark.servers  # @servers(SPEC, ...): the tests take these (planned ahead)


@dataclass(frozen=True)
class Prepared:
    """What a spec's `prepare` made in the server's directory: more flags, how to connect
    (a TLS server's credentials), and where the server's metrics and access log are, for
    the ServerProcess."""

    args: tuple[str, ...] = ()
    credentials: grpc.ChannelCredentials | None = None
    metrics_port: int | None = None
    access_log: Path | None = None


@dataclass(frozen=True, eq=False)
class ServerSpec:
    """One server configuration: what conftest.start_server is given. `prepare(directory)`
    writes the files a start needs (tokens, dictionaries) into its own directory and
    returns the flags naming them; it runs in the pool's thread, so it must not use
    fixtures."""

    name: str
    args: tuple[str, ...] = ()
    own_session: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    prepare: Callable[[Path], Prepared] | None = None


# start(spec, directory, owner) -> ServerProcess: conftest's start_server for one spec;
# owner is the test file charged with the start in the timing table.
Start = Callable[[ServerSpec, Path, str], "ServerProcess"]


def specs_of(item: pytest.Item) -> list[ServerSpec]:
    """The specs an item's `servers` marks name (test, class, module, param)."""
    return [spec for mark in item.iter_markers("servers") for spec in mark.args]


def plan_of(items: Iterable[pytest.Item], session_specs: Callable[[pytest.Item], list[ServerSpec]]
            ) -> list[tuple[ServerSpec, str]]:
    """Every spec the items take, in the order of the first item taking it, with that
    item's file."""
    seen: dict[int, tuple[ServerSpec, str]] = {}
    for item in items:
        for spec in [*session_specs(item), *specs_of(item)]:
            seen.setdefault(id(spec), (spec, item.nodeid.split("::", 1)[0]))
    return list(seen.values())


class ServerPool:
    """Starts the planned specs in order, at most `ahead` of them started and not yet
    taken at a time, each on its own thread; `take` hands a test its spec's server."""

    def __init__(self, plan: list[tuple[ServerSpec, str]], start: Start, directory: Path, ahead: int) -> None:
        self._plan = plan
        self._start = start
        self._directory = directory
        self._ahead = ahead
        self._lock = threading.Lock()
        self._next = 0  # the plan's next spec not started
        self._pending: dict[int, Future[ServerProcess]] = {}  # started, not taken
        self._taken: set[int] = set()
        self._closed = False
        self.waited: dict[str, float] = {}  # spec name -> seconds its taker waited

    def fill(self) -> None:
        """Start planned specs until `ahead` are started and not taken."""
        with self._lock:
            while not self._closed and len(self._pending) < self._ahead and self._next < len(self._plan):
                spec, owner = self._plan[self._next]
                self._next += 1
                if id(spec) not in self._taken:
                    self._pending[id(spec)] = self._spawn(spec, owner)

    def _spawn(self, spec: ServerSpec, owner: str) -> Future[ServerProcess]:
        future: Future[ServerProcess] = Future()

        def run() -> None:
            try:
                future.set_result(self._start(spec, self._directory / spec.name, owner))
            except BaseException as e:  # noqa: BLE001 - handed to the taker, who raises it
                future.set_exception(e)

        threading.Thread(target=run, name=f"start {spec.name}", daemon=True).start()
        return future

    def take(self, spec: ServerSpec, owner: str) -> ServerProcess:
        """The spec's server, prestarted or started now; each spec is taken once (a
        second take is a test bug: two tests would share a server)."""
        with self._lock:
            assert id(spec) not in self._taken, f"server spec {spec.name!r} taken twice"
            self._taken.add(id(spec))
            future = self._pending.pop(id(spec), None)
        waited_from = time.monotonic()
        try:
            if future is None:  # not planned (or not reached yet): start it here
                self.fill()  # (the ones after it go on starting meanwhile)
                return self._start(spec, self._directory / spec.name, owner)
            self.fill()
            return future.result()
        finally:
            self.waited[spec.name] = time.monotonic() - waited_from

    def close(self) -> list[ServerProcess]:
        """Stop starting; the servers started that nobody took (waited for), to stop."""
        with self._lock:
            self._closed = True
            left = list(self._pending.values())
            self._pending.clear()
        untaken = []
        for future in left:
            try:
                untaken.append(future.result())
            except BaseException:  # noqa: BLE001 - nobody asked for it; its start's failure is moot
                pass
        return untaken
