"""Activation patching across invokes, at run time: an invoke whose writes take another
invoke's read enters the engine only once that read's values exist on the worker.

The worker keeps a source's values (patch_store.py) before it sends the step's record,
so the record's arrival here is the proof: a target waits until each source it
patches from has reported the step it needs (compiler: PatchWait). A source that fails
or ends before that step releases its waiters with an error, never a hang.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .errors import FailedPrecondition
from .patching import PatchWait


@dataclass
class _Progress:
    reached: int = -1  # the last step whose record arrived
    ended: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class InvokeGates:
    """Each source invoke's progress, and waits on it."""

    def __init__(self, waits: tuple[PatchWait, ...]) -> None:
        self.waits: dict[int, list[PatchWait]] = {}
        for w in waits:
            self.waits.setdefault(w.invoke, []).append(w)
        self._progress = {w.source: _Progress() for w in waits}

    def tracks(self, invoke: int) -> bool:
        """Whether `invoke` is a source others wait on."""
        return invoke in self._progress

    def reached(self, invoke: int, step: int) -> None:
        progress = self._progress.get(invoke)
        if progress is not None and step > progress.reached:
            progress.reached = step
            progress.changed.set()

    def ended(self, invoke: int) -> None:
        """The source's requests are done (finished, stopped or failed)."""
        progress = self._progress.get(invoke)
        if progress is not None:
            progress.ended = True
            progress.changed.set()

    async def wait(self, invoke: int) -> None:
        """Return once every source `invoke` patches from has reached the step it needs."""
        for w in self.waits.get(invoke, ()):
            progress = self._progress[w.source]
            while progress.reached < w.step:
                if progress.ended:
                    raise FailedPrecondition(
                        f"{w.what} needs invoke {w.source}'s step {w.step}, but invoke {w.source} ended "
                        f"before it (its last step with the read: {progress.reached})"
                    )
                progress.changed.clear()
                await progress.changed.wait()
