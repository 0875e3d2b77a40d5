"""Room in the worker's patch store, taken by a patching trace before it starts.

The worker keeps patch sources' values until their trace ends (worker/patch_store.py),
in a store of fixed size (--patch-store-bytes). Were traces admitted without counting,
one client's exports could fill it and another's patch would find its operand gone. So
each trace's worst case (CompiledTrace.patch_bytes: every exported read's whole rows at
every step it selects) is taken here when the trace starts, and given back only when the
worker answers that it released the trace: what the worker holds never passes what was
admitted, and the store never has to drop a live trace's values.

A trace that does not fit now is refused with RESOURCE_EXHAUSTED naming the read that
needs the most room (retry when other patching traces end); one that could never fit
says so. With --frontends N every frontend admits against its 1/N share of the store
(each counts only its own traces). Single-threaded: the event loop's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ResourceExhausted


@dataclass
class PatchRoom:
    capacity: int  # this frontend's share of the worker's store, bytes
    held: int = 0
    _traces: dict[str, int] = field(default_factory=dict)  # trace key -> bytes admitted

    def admit(self, trace: str, nbytes: int, source: str) -> None:
        """Take `nbytes` for `trace`, or refuse; `source` names the largest exported read
        ("invokes[0].interventions[1] (read 'clean')") for the message."""
        if nbytes > self.capacity:
            raise ResourceExhausted(
                f"the trace's patch sources could keep up to {nbytes} bytes on the worker ({source} the "
                f"largest: whole rows x selected steps), more than this server's patch store holds "
                f"({self.capacity} bytes, --patch-store-bytes); read fewer steps or positions in the sources"
            )
        if self.held + nbytes > self.capacity:
            raise ResourceExhausted(
                f"the worker's patch store holds {self.held} of its {self.capacity} bytes for other traces "
                f"and this trace's patch sources could keep {nbytes} more ({source} the largest; "
                "--patch-store-bytes); retry when other patching traces end"
            )
        self._traces[trace] = self._traces.get(trace, 0) + nbytes
        self.held += nbytes

    def free(self, trace: str) -> int:
        """Give back what `trace` took (the worker released it); the bytes freed."""
        nbytes = self._traces.pop(trace, 0)
        self.held -= nbytes
        return nbytes

    def holds(self, trace: str) -> bool:
        return trace in self._traces
