"""Per-tenant quotas (with --auth-tokens): what one tenant may hold of the server at once.

- calls in flight (`--tenant-max-calls`): taken when a call is admitted;
- sequences in flight (`--tenant-max-sequences`): a call's engine requests (prompts or
  invokes times n), taken once they are known, before anything reaches the engine;
- read bytes per minute (`--tenant-read-bytes-per-minute`): a trace is charged the
  worst case of its reads when it is admitted (the bound --max-read-bytes checks: reads x
  selected steps x sequences), over a sliding minute. Charging the bound, not what was
  streamed, keeps the check before any work is done and the rate a hard ceiling; a trace
  that stops early has paid for steps it did not run;
- patch-store bytes held (`--tenant-patch-store-bytes`): a patching trace's worst case
  of what the worker keeps for it (CompiledTrace.patch_bytes), held while the call runs,
  so one tenant cannot take the whole store (frontend/patch_room.py) from the others.

A refusal is RESOURCE_EXHAUSTED naming the quota's flag. What a call holds is given back
when it ends, however it ends (`TenantCall.close`, from the servicer's `finally`); read
bytes are spent, not held, and age out of the window. 0 means unlimited. Counts are per
server process: with --frontends N each frontend keeps its own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import ResourceExhausted

WINDOW_SECONDS = 60.0


@dataclass(frozen=True)
class TenantQuotas:
    """Each tenant's limits; 0: unlimited."""

    max_calls: int = 32
    max_sequences: int = 256
    read_bytes_per_minute: int = 0
    patch_store_bytes: int = 0


@dataclass
class _TenantState:
    calls: int = 0
    sequences: int = 0
    # (time, bytes) charges within the last WINDOW_SECONDS, oldest first.
    reads: deque[tuple[float, int]] = field(default_factory=deque)
    read_bytes: int = 0  # the sum of `reads`
    patch_bytes: int = 0  # of the worker's patch store, over the tenant's calls


class TenantLedger:
    """What every tenant holds right now. Single-threaded: the event loop's."""

    def __init__(self, quotas: TenantQuotas, clock: Callable[[], float] = time.monotonic) -> None:
        self.quotas = quotas
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}

    def open_call(self, tenant: str) -> TenantCall:
        state = self._tenants.setdefault(tenant, _TenantState())
        limit = self.quotas.max_calls
        if limit and state.calls >= limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {state.calls} calls in flight, its quota "
                f"(--tenant-max-calls {limit}); retry when one ends"
            )
        state.calls += 1
        return TenantCall(self, tenant, state)

    def held(self, tenant: str) -> tuple[int, int]:
        """(calls, sequences) the tenant holds now."""
        state = self._tenants.get(tenant)
        return (state.calls, state.sequences) if state else (0, 0)

    def _expire(self, state: _TenantState) -> None:
        horizon = self._clock() - WINDOW_SECONDS
        while state.reads and state.reads[0][0] <= horizon:
            state.read_bytes -= state.reads.popleft()[1]

    def _release(self, tenant: str, state: _TenantState, sequences: int, patch_bytes: int) -> None:
        state.calls -= 1
        state.sequences -= sequences
        state.patch_bytes -= patch_bytes
        self._expire(state)
        if not state.calls and not state.reads:
            del self._tenants[tenant]  # a tenant that comes and goes leaves nothing behind


class TenantCall:
    """One admitted call's hold on its tenant's quotas; `close` gives it back (idempotent)."""

    def __init__(self, ledger: TenantLedger | None, tenant: str, state: _TenantState | None) -> None:
        self._ledger = ledger
        self.tenant = tenant
        self._state = state
        self._sequences = 0
        self._patch_bytes = 0
        self._open = True

    @classmethod
    def unmetered(cls) -> TenantCall:
        """A call on a server without --auth-tokens: nothing to count."""
        return cls(None, "", None)

    def reserve_sequences(self, count: int) -> None:
        """Hold `count` more engine requests for this call, or refuse them all."""
        ledger, state = self._ledger, self._state
        if ledger is None or state is None:
            return
        limit = ledger.quotas.max_sequences
        if limit and state.sequences + count > limit:
            raise ResourceExhausted(
                f"tenant {self.tenant!r} would have {state.sequences + count} sequences in flight "
                f"({count} in this call), over its quota (--tenant-max-sequences {limit})"
            )
        state.sequences += count
        self._sequences += count

    def hold_patch_bytes(self, nbytes: int, source: str) -> None:
        """Hold `nbytes` of the worker's patch store for this call, or refuse; `source`
        names the exported read that keeps the most."""
        ledger, state = self._ledger, self._state
        if ledger is None or state is None or nbytes <= 0:
            return
        limit = ledger.quotas.patch_store_bytes
        if limit and state.patch_bytes + nbytes > limit:
            raise ResourceExhausted(
                f"tenant {self.tenant!r} would hold {state.patch_bytes + nbytes} bytes of the worker's patch "
                f"store ({nbytes} for this trace's patch sources, {source} the largest), over its quota "
                f"(--tenant-patch-store-bytes {limit})"
            )
        state.patch_bytes += nbytes
        self._patch_bytes += nbytes

    def charge_reads(self, nbytes: int) -> None:
        """Spend `nbytes` of the tenant's read budget for the current minute, or refuse."""
        ledger, state = self._ledger, self._state
        if ledger is None or state is None or nbytes <= 0:
            return
        limit = ledger.quotas.read_bytes_per_minute
        if not limit:
            return
        ledger._expire(state)
        if nbytes > limit:
            raise ResourceExhausted(
                f"the trace's reads could return up to {nbytes} bytes, more than tenant "
                f"{self.tenant!r} may read in a minute (--tenant-read-bytes-per-minute {limit})"
            )
        if state.read_bytes + nbytes > limit:
            raise ResourceExhausted(
                f"tenant {self.tenant!r} has read {state.read_bytes} of its {limit} bytes for "
                f"this minute and the trace could read {nbytes} more "
                f"(--tenant-read-bytes-per-minute {limit}); retry later"
            )
        state.reads.append((ledger._clock(), nbytes))
        state.read_bytes += nbytes

    def close(self) -> None:
        if self._open and self._ledger is not None and self._state is not None:
            self._ledger._release(self.tenant, self._state, self._sequences, self._patch_bytes)
        self._open = False
