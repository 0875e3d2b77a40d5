"""Where the suite's time goes: wall time per test file and the servers each file started.

A pytest plugin (conftest's `pytest_plugins`). Engines starting are most of the suite's
time, so every `start_server` is recorded here with the file that asked for it and how
long it took to become SERVING, and how long that file's tests waited for it (less when
the server pool started it in the background while other tests ran: server_pool.py); the
terminal summary lists the files by wall time (setup, call and teardown of their tests,
session fixtures counted where they were first set up), and TRACEWIRE_TEST_TIMES=path
writes the same as JSON, for the CI log and closing notes.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest


@dataclass
class FileTime:
    seconds: float = 0.0
    tests: int = 0
    server_starts: int = 0
    start_seconds: float = 0.0
    # of which the tests waited (the rest overlapped other tests)
    waited_seconds: float = 0.0
    # the flags of each server this file started, in order
    servers: list[str] = field(default_factory=list)


_files: dict[str, FileTime] = defaultdict(FileTime)


def current_file() -> str:
    """The test file running now (pytest's PYTEST_CURRENT_TEST: 'tests/x.py::test (call)')."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.split("::", 1)[0] or "(outside a test)"


def record_start(flags: list[str], seconds: float, file: str | None = None) -> None:
    """A server became SERVING `seconds` after it was spawned (conftest's start_server),
    for `file` (by default the one running now: a start on the pool's thread names it)."""
    entry = _files[file or current_file()]
    entry.server_starts += 1
    entry.start_seconds += seconds
    entry.servers.append(" ".join(flags))


def record_wait(file: str, seconds: float) -> None:
    """`file`'s test waited `seconds` for a server it took from the pool."""
    _files[file].waited_seconds += seconds


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _files[report.nodeid.split("::", 1)[0]]
    entry.seconds += report.duration
    if report.when == "call":
        entry.tests += 1


_session_start = time.monotonic()


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not _files:
        return
    rows = sorted(_files.items(), key=lambda kv: -kv[1].seconds)
    starts = sum(f.server_starts for f in _files.values())
    start_seconds = sum(f.start_seconds for f in _files.values())
    write = terminalreporter.write_line
    terminalreporter.section("time per test file")
    waited = sum(f.waited_seconds for f in _files.values())
    write(f"{'seconds':>8} {'tests':>5} {'starts':>6} {'start s':>8} {'waited s':>8}  file")
    for name, f in rows:
        write(f"{f.seconds:8.1f} {f.tests:5d} {f.server_starts:6d} {f.start_seconds:8.1f} "
              f"{f.waited_seconds:8.1f}  {name}")
    write(f"{sum(f.seconds for f in _files.values()):8.1f} {sum(f.tests for f in _files.values()):5d} "
          f"{starts:6d} {start_seconds:8.1f} {waited:8.1f}  in all "
          f"({time.monotonic() - _session_start:.0f} s wall)")
    out = os.environ.get("TRACEWIRE_TEST_TIMES")
    if out:
        Path(out).write_text(json.dumps({name: asdict(f) for name, f in rows}, indent=1) + "\n")
