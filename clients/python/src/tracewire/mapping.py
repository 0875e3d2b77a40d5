"""`client.map(prompts, trace_fn)`: one trace per prompt, many in flight, results in order.

    results = client.map(prompts, lambda tracer: tracer.all().logits.top_k(5).save(),
                         concurrency=8, temperature=0.0, max_tokens=4)
    for item in results:
        print(item.prompt, item.value if item.ok else item.error)

`trace_fn` gets the `Tracer` of one prompt (`client.trace(prompt, **sampling)`, not yet
run) and adds reads and writes to it, as inside a `with client.trace(...)` block; what it
returns (saved handles, the tracer itself, a dict of them) is the item's value once the
trace has run. A prompt whose trace fails does not stop the others: its item carries the
error. UNAVAILABLE (a server restarting, a replica going away) is retried with a fresh trace
(the builder runs again), other errors are not: they would fail the same way again.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .errors import InvalidArgument, Unavailable
from .progress import progress_bar
from .prompts import PromptLike
from .tracing import Tracer

if TYPE_CHECKING:
    from .aio import AsyncClient, AsyncTracer
    from .client import Client

R = TypeVar("R")

# Backoff before retry n (seconds): 0.25, 0.5, 1, ...
RETRY_BACKOFF = 0.25


@dataclass(frozen=True)
class Item(Generic[R]):
    """One prompt's outcome: `value` (what trace_fn returned, filled) or `error`."""

    index: int
    prompt: PromptLike
    value: R | None
    error: Exception | None
    attempts: int

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> R:
        """The value, or the item's error raised."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]  # None only when trace_fn returned None


class MapResults(list[Item[R]]):
    """The items of a map, in input order."""

    def values(self) -> list[R]:
        """Every item's value; raises the first item's error if any failed."""
        return [item.unwrap() for item in self]

    @property
    def errors(self) -> list[Item[R]]:
        return [item for item in self if not item.ok]


@dataclass(frozen=True)
class MapOptions:
    concurrency: int = 8
    retries: int = 2
    progress: bool | None = None

    def check(self) -> None:
        if self.concurrency < 1:
            raise InvalidArgument(f"concurrency must be >= 1, got {self.concurrency}", field="concurrency")
        if self.retries < 0:
            raise InvalidArgument(f"retries must be >= 0, got {self.retries}", field="retries")


def run_map(
    client: Client,
    prompts: Iterable[PromptLike],
    trace_fn: Callable[[Tracer], R],
    options: MapOptions,
    sampling: dict[str, Any],
) -> MapResults[R]:
    """The sync client's map: a pool of `concurrency` threads, each running one trace at a
    time (grpc's sync channel is thread-safe, and the server batches what is in flight)."""
    options.check()
    listed = _listed(prompts)
    bar = progress_bar(len(listed), enabled=options.progress, desc="traces")
    lock = threading.Lock()

    def one(index: int) -> Item[R]:
        item = _attempts(index, listed[index], lambda p: _run_sync(client, p, trace_fn, sampling), options.retries)
        with lock:
            bar.update(1)
        return item

    try:
        with ThreadPoolExecutor(max_workers=min(options.concurrency, max(len(listed), 1))) as pool:
            return MapResults(pool.map(one, range(len(listed))))
    finally:
        bar.close()


async def run_map_async(
    client: AsyncClient,
    prompts: Iterable[PromptLike],
    trace_fn: Callable[[AsyncTracer], R],
    options: MapOptions,
    sampling: dict[str, Any],
) -> MapResults[R]:
    """The async client's map: at most `concurrency` traces awaited at once."""
    options.check()
    listed = _listed(prompts)
    bar = progress_bar(len(listed), enabled=options.progress, desc="traces")
    gate = asyncio.Semaphore(options.concurrency)

    async def one(index: int) -> Item[R]:
        async with gate:
            item = await _attempts_async(index, listed[index], client, trace_fn, sampling, options.retries)
        bar.update(1)
        return item

    try:
        return MapResults(await asyncio.gather(*(one(i) for i in range(len(listed)))))
    finally:
        bar.close()


def _listed(prompts: Iterable[PromptLike]) -> Sequence[PromptLike]:
    # A lone string is one prompt, not a sequence of one-letter prompts.
    if isinstance(prompts, str):
        raise InvalidArgument("map takes a list of prompts; wrap a single prompt in a list", field="prompts")
    return prompts if isinstance(prompts, Sequence) else list(prompts)


def _run_sync(client: Client, prompt: PromptLike, trace_fn: Callable[[Tracer], R], sampling: dict[str, Any]) -> R:
    tracer = client.trace(prompt, **sampling)
    value = trace_fn(tracer)
    tracer.run()
    return value


def _attempts(index: int, prompt: PromptLike, run: Callable[[PromptLike], R], retries: int) -> Item[R]:
    for attempt in range(1, retries + 2):
        try:
            return Item(index, prompt, run(prompt), None, attempt)
        except Unavailable as e:
            if attempt > retries:
                return Item(index, prompt, None, e, attempt)
            time.sleep(RETRY_BACKOFF * 2 ** (attempt - 1))
        except Exception as e:  # noqa: BLE001 -- collected per item; the run goes on
            return Item(index, prompt, None, e, attempt)
    raise AssertionError("unreachable")


async def _attempts_async(
    index: int,
    prompt: PromptLike,
    client: AsyncClient,
    trace_fn: Callable[[AsyncTracer], R],
    sampling: dict[str, Any],
    retries: int,
) -> Item[R]:
    for attempt in range(1, retries + 2):
        try:
            tracer = client.trace(prompt, **sampling)
            value = trace_fn(tracer)
            await tracer.arun()
            return Item(index, prompt, value, None, attempt)
        except Unavailable as e:
            if attempt > retries:
                return Item(index, prompt, None, e, attempt)
            await asyncio.sleep(RETRY_BACKOFF * 2 ** (attempt - 1))
        except Exception as e:  # noqa: BLE001 -- collected per item; the run goes on
            return Item(index, prompt, None, e, attempt)
    raise AssertionError("unreachable")


__all__ = ["Item", "MapOptions", "MapResults"]
