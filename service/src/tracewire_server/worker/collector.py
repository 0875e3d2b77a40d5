"""Finishing traced steps off the engine's thread.

The worker's sampler hook launches a step's reads as device work with non-blocking
copies to the host and hands the step to the collector; the collector waits for
those copies, decides the step's conditions and stops, and sends its records.
The engine thread never waits for the device on tracewire's behalf, so a traced
step costs the engine about what its kernels cost.

Steps are finished one at a time, in the order they were submitted (per-sequence
state such as the text so far depends on it). `drain()` waits until every
submitted step is finished: the engine thread calls it before deciding anything
that needs the latest state (a write conditioned on the text so far).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

W = TypeVar("W")

# Steps submitted and not yet finished before submit() waits: bounds host memory
# when finishing is slower than the engine (the engine then slows to match).
MAX_OUTSTANDING = 64


class StepCollector(Generic[W]):
    """`threaded=False` finishes each step inside submit(): for the CPU, where a step's
    values are ready when it is submitted and a second thread would only contend for
    the GIL with the engine."""

    def __init__(self, finish: Callable[[W], None], max_outstanding: int = MAX_OUTSTANDING,
                 threaded: bool = True) -> None:
        self._finish = finish
        self._threaded = threaded
        self._max = max_outstanding
        self._queue: queue.SimpleQueue[W] = queue.SimpleQueue()
        self._outstanding = 0
        self._changed = threading.Condition()
        if threaded:
            threading.Thread(target=self._run, name="tracewire-collector", daemon=True).start()

    def submit(self, work: W) -> None:
        if not self._threaded:
            self._finish_logged(work)
            return
        with self._changed:
            while self._outstanding >= self._max:
                self._changed.wait()
            self._outstanding += 1
        self._queue.put(work)

    def drain(self) -> None:
        with self._changed:
            while self._outstanding:
                self._changed.wait()

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                self._finish_logged(work)
            finally:
                with self._changed:
                    self._outstanding -= 1
                    self._changed.notify_all()

    def _finish_logged(self, work: W) -> None:
        try:
            self._finish(work)
        except Exception:  # noqa: BLE001 - finish reports per-request failures itself
            log.exception("finishing a traced step failed")
