"""The patch store: values of module reads that other invokes' writes take as operands
(activation patching), kept on the device in the worker, per trace.

A source request's read marked exported in its plan (SequencePlan.exports) puts its
rows here at the step's sample, before that step's record is sent; the frontend starts
a target's requests only after that record (frontend/trace.py), so a target's write
always finds its operand. Values stay until the trace ends: the frontend releases the
trace (`tracewire_release`, extension.py) on success, error or cancel, and a preempted
target that recomputes its prefill finds them again meanwhile. A release that never
comes (a frontend that died) cannot leak without limit: past `max_bytes` the oldest
traces go, and a target of theirs fails saying so.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import NamedTuple

import torch

log = logging.getLogger(f"vllm.{__name__}")

MAX_BYTES_ENV = "TRACEWIRE_PATCH_STORE_BYTES"
DEFAULT_MAX_BYTES = 4 << 30


class StoreSize(NamedTuple):
    traces: int
    entries: int
    bytes: int


class PatchStore:
    def __init__(self, max_bytes: int | None = None) -> None:
        env = os.environ.get(MAX_BYTES_ENV)
        self.max_bytes = max_bytes if max_bytes is not None else int(env) if env else DEFAULT_MAX_BYTES
        # trace -> (invoke, read name, step) -> [rows, width] float32, oldest trace first
        self._traces: OrderedDict[str, dict[tuple[int, str, int], torch.Tensor]] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()  # (bounded: for messages only)
        self.bytes = 0

    def put(self, trace: str, invoke: int, name: str, step: int, rows: torch.Tensor) -> None:
        entries = self._traces.setdefault(trace, {})
        old = entries.get((invoke, name, step))
        if old is not None:  # (a step seen again: keep the latest)
            self.bytes -= _size(old)
        entries[(invoke, name, step)] = rows
        self.bytes += _size(rows)
        while self.bytes > self.max_bytes and len(self._traces) > 1:
            self._evict_oldest()

    def get(self, trace: str, invoke: int, name: str, step: int) -> torch.Tensor:
        """The rows, or a RuntimeError saying why they are not here (the target fails)."""
        found = self._traces.get(trace, {}).get((invoke, name, step))
        if found is not None:
            return found
        if trace in self._evicted:
            raise RuntimeError(f"invoke {invoke}'s {name!r} was dropped from the worker's patch store (over "
                               f"{self.max_bytes} bytes held, {MAX_BYTES_ENV}); run fewer patching traces at once")
        raise RuntimeError(f"invoke {invoke}'s {name!r} has no value at step {step} on the worker")

    def release(self, trace: str) -> int:
        """Forget a trace's values; the bytes freed."""
        entries = self._traces.pop(trace, None)
        freed = sum(_size(t) for t in entries.values()) if entries else 0
        self.bytes -= freed
        return freed

    def size(self) -> StoreSize:
        return StoreSize(len(self._traces), sum(len(e) for e in self._traces.values()), self.bytes)

    def _evict_oldest(self) -> None:
        trace, _ = next(iter(self._traces.items()))
        freed = self.release(trace)
        self._evicted[trace] = None
        while len(self._evicted) > 1024:
            self._evicted.popitem(last=False)
        log.warning("patch store over %d bytes: dropped trace %s (%d bytes) never released", self.max_bytes,
                    trace, freed)


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
