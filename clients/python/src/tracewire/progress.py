"""A progress bar for long runs (map, collect): tqdm's when it is importable and stderr is a
terminal, else none. tqdm is not a dependency of the SDK: a run never needs it."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Protocol


class Progress(Protocol):
    def update(self, n: int = 1) -> Any: ...

    def close(self) -> Any: ...


class _Silent:
    def update(self, n: int = 1) -> None:
        return None

    def close(self) -> None:
        return None


def progress_bar(total: int | None, *, enabled: bool | None, desc: str) -> Progress:
    """A bar counting to `total` (None: unknown). `enabled`: None shows one only on a
    terminal with tqdm installed, False never, True whenever tqdm is installed (a log
    file then gets tqdm's lines)."""
    if enabled is False or (enabled is None and not sys.stderr.isatty()):
        return _Silent()
    try:
        tqdm = importlib.import_module("tqdm")
    except ImportError:
        return _Silent()
    bar: Progress = tqdm.tqdm(total=total, desc=desc, unit="prompt", file=sys.stderr)
    return bar
