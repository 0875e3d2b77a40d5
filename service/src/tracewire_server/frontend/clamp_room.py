"""Room in a compiled engine's dictionary clamp columns, taken by a trace before it starts.

A compiled layer table holds limits.CLAMP_COLUMNS feature columns for dictionary clamps
and ablations (shared/steering.py): one per (dictionary, feature, value) clamped at once.
Were traces admitted without counting, one client's clamps could take every column and
another's clamp would fail mid-trace. So each trace's clamped features at each module are
taken here when it starts (an upper bound: traces clamping the same feature to the same
value share a column on the worker) and given back when it ends. A trace that does not fit
now is refused with RESOURCE_EXHAUSTED naming the module (retry when other clamping traces
end); one that could never fit says so. With --frontends N every frontend admits against
its 1/N share. Single-threaded: the event loop's.

The worker gives a column back when the last request using it ends, a step after the
trace's end may reach here; a trace admitted in between whose columns are all still held
fails saying so (steering.SlotPlanner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ResourceExhausted


@dataclass
class ClampRoom:
    capacity: int  # this frontend's share of each module's columns
    held: dict[str, int] = field(default_factory=dict)  # module -> columns taken
    _traces: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)

    def admit(self, trace: str, needs: tuple[tuple[str, int], ...]) -> None:
        """Take `needs` ((module, columns) each) for `trace`, or refuse, taking nothing."""
        for module, count in needs:
            if count > self.capacity:
                raise ResourceExhausted(
                    f"the trace clamps {count} features of {module}'s dictionaries, more than this server's "
                    f"compiled graph clamps there at once ({self.capacity}); clamp fewer features per trace, or "
                    "use an eager server (--enforce-eager)")
            if self.held.get(module, 0) + count > self.capacity:
                raise ResourceExhausted(
                    f"{module}'s dictionary clamp columns hold {self.held.get(module, 0)} of {self.capacity} "
                    f"features for other traces and this trace clamps {count} more; retry when other clamping "
                    "traces end")
        for module, count in needs:
            self.held[module] = self.held.get(module, 0) + count
        self._traces[trace] = self._traces.get(trace, ()) + needs

    def free(self, trace: str) -> None:
        for module, count in self._traces.pop(trace, ()):
            self.held[module] -= count
            if not self.held[module]:
                del self.held[module]
