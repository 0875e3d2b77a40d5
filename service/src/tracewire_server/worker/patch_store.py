"""The patch store: values of module reads that other invokes' writes take as operands
(activation patching), kept on the device in the worker, per trace.

A source request's read marked exported in its plan (SequencePlan.exports) puts its
rows here at the step's sample, before that step's record is sent; the frontend starts
a target's requests only after that record (frontend/trace.py), so a target's write
always finds its operand. Values stay until the trace ends: the frontend releases the
trace (`tracewire_release`, extension.py) on success, error or cancel, and a preempted
target that recomputes its prefill finds them again meanwhile.

The store never drops a live trace's values to make room: each frontend admits a
patching trace against its share of `max_bytes` before the trace starts, counting the
trace's worst case (frontend/patch_room.py), and frees that room only when this store
says it released the trace. A put that would still pass `max_bytes` (only possible if a
release was lost, e.g. a frontend died) is refused: the trace that asked for the room
fails its targets saying so, and no other trace loses anything.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import NamedTuple

import torch

from ..shared import plan as P
from ..shared.limits import PATCH_STORE_BYTES_ENV, patch_store_bytes

log = logging.getLogger(f"vllm.{__name__}")


class StoreSize(NamedTuple):
    traces: int
    entries: int
    bytes: int


class PatchStore:
    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = patch_store_bytes() if max_bytes is None else max_bytes
        # trace -> (invoke, read name, step) -> [rows, width] float32
        self._traces: dict[str, dict[tuple[int, str, int], torch.Tensor]] = {}
        self._refused: OrderedDict[str, None] = OrderedDict()  # (bounded: for messages only)
        self.bytes = 0

    def put(self, trace: str, invoke: int, name: str, step: int, rows: torch.Tensor) -> None:
        entries = self._traces.setdefault(trace, {})
        old = entries.get((invoke, name, step))
        grows = _size(rows) - (_size(old) if old is not None else 0)  # (a step seen again: keep the latest)
        if self.bytes + grows > self.max_bytes:
            self._refuse(trace, grows)
            return
        entries[(invoke, name, step)] = rows
        self.bytes += grows

    def get(self, trace: str, invoke: int, name: str, step: int) -> torch.Tensor:
        """The rows, or a RuntimeError saying why they are not here (the target fails)."""
        found = self._traces.get(trace, {}).get((invoke, name, step))
        if found is not None:
            return found
        if trace in self._refused:
            raise RuntimeError(f"invoke {invoke}'s {name!r} did not fit in the worker's patch store "
                               f"({self.max_bytes} bytes, --patch-store-bytes / {PATCH_STORE_BYTES_ENV}): "
                               "room the frontends admitted is held by traces whose release was lost")
        raise RuntimeError(f"invoke {invoke}'s {name!r} has no value at step {step} on the worker")

    def operand(self, write: P.WriteModule, prompt_len: int, step: int, wanted: list[int]) -> torch.Tensor:
        """A patch / add_read's operand: the source's stored rows of step `step` for the
        target positions `wanted` ([len(wanted), width]; a chunked prefill's pass holds some
        of the write's positions: row i of the reference goes to the write's i-th selected
        position). A RuntimeError when they are not here (the target fails)."""
        ref = write.ref
        assert ref is not None
        stored = self.get(ref.trace, ref.invoke, ref.name, step)
        if write.positions.kind == "new_token":
            return stored
        selected = write.positions.prompt_positions(prompt_len)
        rows = ref.rows or tuple(range(stored.shape[0]))
        return stored[[rows[selected.index(p)] for p in wanted]]

    def release(self, trace: str) -> int:
        """Forget a trace's values; the bytes freed."""
        entries = self._traces.pop(trace, None)
        self._refused.pop(trace, None)
        freed = sum(_size(t) for t in entries.values()) if entries else 0
        self.bytes -= freed
        return freed

    def size(self) -> StoreSize:
        return StoreSize(len(self._traces), sum(len(e) for e in self._traces.values()), self.bytes)

    def _refuse(self, trace: str, nbytes: int) -> None:
        if trace not in self._refused:
            log.warning("patch store: %d more bytes for trace %s would pass its %d bytes (holding %d); "
                        "refused (the frontends admit traces against this size: was a release lost?)",
                        nbytes, trace, self.max_bytes, self.bytes)
        self._refused[trace] = None
        while len(self._refused) > 1024:
            self._refused.popitem(last=False)


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
