"""Where the hooks' time goes (TRACEWIRE_HOOK_TIMES): a diagnostic, off unless asked for.

Separate from the hooks it times: it prints on its own period and keeps its own lock
(the engine thread and the collector thread both add to it).
"""

from __future__ import annotations

import os
import sys
import threading
import time

# Set to a number of seconds (e.g. `TRACEWIRE_HOOK_TIMES=10 make bench`): every worker
# prints where its hooks' time went over each such period, to find what bounds a
# trace's throughput. On the CPU the collector runs on the engine's thread, so its
# time is counted in both.
HOOK_TIMES_ENV = "TRACEWIRE_HOOK_TIMES"

class HookTimes:
    """Seconds the hooks spent on the engine's thread and on the collector thread."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.engine_s = self.collector_s = self.wait_s = 0.0
        self.steps = self.rows = 0
        self._since = time.perf_counter()
        self._lock = threading.Lock()

    def add(self, engine_s: float = 0.0, collector_s: float = 0.0, wait_s: float = 0.0,
            steps: int = 0, rows: int = 0) -> None:
        with self._lock:
            self.engine_s += engine_s
            self.collector_s += collector_s
            self.wait_s += wait_s
            self.steps += steps
            self.rows += rows
            now = time.perf_counter()
            if now - self._since < self.period_s or not self.steps:
                return
            elapsed, self._since = now - self._since, now
            print(
                f"tracewire hook times pid {os.getpid()}: {self.steps} traced steps in {elapsed:.1f} s "
                f"({self.rows / self.steps:.0f} rows/step); per step: engine thread "
                f"{1e3 * self.engine_s / self.steps:.3f} ms, collector {1e3 * self.collector_s / self.steps:.3f} ms "
                f"(+{1e3 * self.wait_s / self.steps:.3f} ms waiting for the device); step interval "
                f"{1e3 * elapsed / self.steps:.3f} ms",
                file=sys.stderr, flush=True,
            )
            self.engine_s = self.collector_s = self.wait_s = 0.0
            self.steps = self.rows = 0
