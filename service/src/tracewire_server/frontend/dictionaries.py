"""The dictionaries the server holds (probes, SAEs), as this frontend knows them.

The engine's worker holds the weights (worker/dictionaries.py) and is the truth: the
registry keeps a cache of its DictionaryInfos, so the compiler's `lookup` is a dict read
on the compile path. Every register / delete made through this frontend updates the
cache as it happens. With --frontends N the others change the worker too: a frontend
that is `shared` refreshes its cache from the worker (one collective_rpc, coalesced
between concurrent callers) before it answers a list, changes a name, or compiles a
trace naming a dictionary it has not cached or has not refreshed for REFRESH_AFTER_S. A
trace compiled against a stale generation fails in the worker, naming the dictionary,
never reads another one.

Registering and deleting are serialized per frontend (one lock), so the room left
under --max-dictionary-bytes is exact here; the operator's dictionaries
(--dictionaries, owner "") do not count against it and no client can replace or
delete them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol

import msgspec

from ..shared.dictionary_spec import DictionaryInfo, decode_info, encode_info
from .errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted

log = logging.getLogger(__name__)

# How long a shared frontend trusts its cache of a name a trace mentions.
REFRESH_AFTER_S = 1.0
# A load reads the file and copies it to the device (on the workers' loader threads).
WORKER_TIMEOUT_S = 120.0
LOAD_POLL_S = 0.05
DEFAULT_MAX_BYTES = 1 << 30


class WorkerDictionaries(Protocol):
    """The worker's three dictionary RPCs (worker/extension.py)."""

    async def load(self, info: DictionaryInfo, path: Path) -> DictionaryInfo | tuple[str, str]:
        """The completed info, or (field, message) when the file is bad."""

    async def delete(self, name: str) -> int:
        """Device bytes freed (0: none held)."""

    async def held(self) -> list[DictionaryInfo]: ...


class EngineDictionaries:
    """WorkerDictionaries over vLLM's collective_rpc: every worker (tensor-parallel ranks)
    does the same; rank 0 answers. Shielded: cancelling vLLM's utility future would break
    its output handler if the answer came late (engine.py's _release_trace)."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    async def _call(self, method: str, *args: Any) -> list[Any]:
        call = asyncio.ensure_future(self._llm.collective_rpc(method, args=args))
        return list(await asyncio.wait_for(asyncio.shield(call), WORKER_TIMEOUT_S))

    async def load(self, info: DictionaryInfo, path: Path) -> DictionaryInfo | tuple[str, str]:
        """Start the load on every worker (each reads and copies on a thread of its own, never
        on the engine's: worker/dictionaries.py's Loads), then poll until each has finished."""
        await self._call("tracewire_dictionary_load", encode_info(info), str(path))
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        pending: dict[int, tuple[bytes, str, str]] = {}
        while time.monotonic() < deadline:
            await asyncio.sleep(LOAD_POLL_S)
            answers = await self._call("tracewire_dictionary_loaded", info.name, info.generation)
            for rank, (done, data, field, message) in enumerate(answers):
                if done:
                    pending[rank] = (data, field, message)
            if len(pending) == len(answers):
                for data, field, message in pending.values():
                    if not data:
                        return field, message
                return decode_info(pending[0][0])
        raise TimeoutError(f"the engine did not load dictionary {info.name!r} within {WORKER_TIMEOUT_S:.0f} s")

    async def delete(self, name: str) -> int:
        return int((await self._call("tracewire_dictionary_delete", name))[0])

    async def held(self) -> list[DictionaryInfo]:
        return [decode_info(data) for data in (await self._call("tracewire_dictionaries"))[0]]


class DictionaryRegistry:
    def __init__(self, worker: WorkerDictionaries, *, max_upload_bytes: int = DEFAULT_MAX_BYTES,
                 shared: bool = False) -> None:
        self._worker = worker
        self.max_upload_bytes = max_upload_bytes
        self.shared = shared
        self._cache: dict[str, DictionaryInfo] = {}
        self._refreshed = 0.0  # time.monotonic() of the last refresh
        self._refresh: asyncio.Future[None] | None = None
        self._changes = asyncio.Lock()
        self._changing: set[str] = set()  # names a register / delete here is changing now

    # -- reading ---------------------------------------------------------------------

    def lookup(self, name: str) -> DictionaryInfo | None:
        """The dictionary of that name as last known here (the compiler's question)."""
        return self._cache.get(name)

    def unchanged(self, name: str, generation: int) -> bool:
        """Whether `name` still holds `generation`, with no register or delete of it under
        way here (the worker changes its weights before this cache learns of it)."""
        held = self._cache.get(name)
        return held is not None and held.generation == generation and name not in self._changing

    def all(self) -> list[DictionaryInfo]:
        return sorted(self._cache.values(), key=lambda info: info.name)

    async def prefetch(self, names: Collection[str]) -> None:
        """Before compiling a trace naming `names`: on a shared engine, refresh the cache
        when one is unknown here or the cache is older than REFRESH_AFTER_S. A lone
        frontend's cache is the truth: nothing to do."""
        if not self.shared or not names:
            return
        if all(name in self._cache for name in names) and time.monotonic() - self._refreshed < REFRESH_AFTER_S:
            return
        await self.refresh()

    async def current(self) -> list[DictionaryInfo]:
        """Every dictionary, fresh from the worker on a shared engine."""
        if self.shared:
            await self.refresh()
        return self.all()

    async def refresh(self) -> None:
        """The cache from the worker's list; concurrent callers share one call."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._fetch())
        await asyncio.shield(self._refresh)

    async def _fetch(self) -> None:
        started = time.monotonic()
        held = await self._worker.held()
        self._cache = {info.name: info for info in held}
        self._refreshed = started

    # -- changing --------------------------------------------------------------------

    def room(self, owner: str, replacing: str = "") -> int:
        """Device bytes uploads may still take; a dictionary `owner` replaces is not counted."""
        used = sum(info.device_bytes for info in self._cache.values()
                   if info.owner and not (info.name == replacing and info.owner == owner))
        return max(self.max_upload_bytes - used, 0)

    async def check_name(self, name: str, owner: str, replace: bool) -> None:
        """Whether `owner` may register `name`: before an upload is read, and again
        (under the lock) before it is loaded."""
        if self.shared:
            await self.refresh()
        self._may_take(name, owner, replace)

    def _may_take(self, name: str, owner: str, replace: bool) -> None:
        held = self._cache.get(name)
        if held is None:
            return
        if not replace:
            raise AlreadyExists(f"header.name: a dictionary named {name!r} is registered"
                                f"{' by the operator' if not held.owner else ''}; delete it first, "
                                "register under another name, or set replace to replace your own")
        if not held.owner:
            raise PermissionDenied(f"header.name: {name!r} is the operator's dictionary (--dictionaries); "
                                   "clients cannot replace it")
        if held.owner != owner:
            raise PermissionDenied(f"header.name: {name!r} belongs to another client; only its owner "
                                   "may replace it")

    async def register(self, info: DictionaryInfo, path: Path, replace: bool) -> DictionaryInfo:
        """Load an upload (info complete: owner, generation, sizes from its file) on the
        worker. ALREADY_EXISTS / PERMISSION_DENIED / RESOURCE_EXHAUSTED as `check_name`
        and `room` say; INVALID_ARGUMENT naming the tensor when the worker refuses the file."""
        async with self._changes:
            if self.shared:
                await self.refresh()
            self._may_take(info.name, info.owner, replace)
            room = self.room(info.owner, info.name if replace else "")
            if info.device_bytes > room:
                raise ResourceExhausted(
                    f"chunk: the dictionary takes {info.device_bytes} bytes on the device, {room} of the "
                    f"server's {self.max_upload_bytes} for uploads are left (--max-dictionary-bytes)")
            self._changing.add(info.name)
            try:
                return await self._load(info, path)
            finally:
                self._changing.discard(info.name)

    async def load_operator(self, info: DictionaryInfo, path: Path) -> DictionaryInfo:
        """One of --dictionaries' (owner ""), at start; the worker's refusal as DictionaryError."""
        async with self._changes:
            return await self._load(info, path)

    async def _load(self, info: DictionaryInfo, path: Path) -> DictionaryInfo:
        loaded = await self._worker.load(info, path)
        if isinstance(loaded, tuple):
            raise InvalidArgument(*loaded)
        # The worker fills in what only it knows (device bytes as held); the rest is ours.
        loaded = msgspec.structs.replace(loaded, owner=info.owner, generation=info.generation)
        self._cache[info.name] = loaded
        return loaded

    async def delete(self, name: str, owner: str) -> int:
        """Device bytes freed; NOT_FOUND, or PERMISSION_DENIED for another's or the operator's."""
        async with self._changes:
            if self.shared:
                await self.refresh()
            held = self._cache.get(name)
            if held is None:
                raise NotFound(f"name: no dictionary named {name!r} (ListDictionaries lists them)")
            if not held.owner:
                raise PermissionDenied(f"name: {name!r} is the operator's dictionary (--dictionaries); "
                                       "clients cannot delete it")
            if held.owner != owner:
                raise PermissionDenied(f"name: {name!r} belongs to another client; only its owner may delete it")
            self._changing.add(name)
            try:
                freed = await self._worker.delete(name)
                self._cache.pop(name, None)
            finally:
                self._changing.discard(name)
            return freed


def new_generation() -> int:
    """Unique across the frontends of one engine (nanoseconds since the epoch)."""
    return time.time_ns()
