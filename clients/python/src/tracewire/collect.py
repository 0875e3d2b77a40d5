"""`client.collect(...)` / `tracewire collect`: activations of a dataset, to disk, in shards.

    manifest = client.collect("prompts.jsonl", "acts/", layers=[1, 2], positions="last",
                              logits_top_k=5)
    acts = tracewire.collect.load("acts/")
    acts.field("layers.1")          # one [rows, hidden] array per prompt

Each prompt runs one trace (`client.map`, `concurrency` in flight) whose reads the plan
names; `shard_size` prompts make a shard, written (Parquet or safetensors, shards.py) before
the next shard's prompts are even read, so memory holds one shard however large the
dataset. `manifest.json` says what the collection is: the model and server version
(GetModelInfo), the plan, the sampling parameters, the shards (which prompts each holds)
and the fields' shapes.

Resuming: run the same collection into the same folder again. Shards already there are
checked (their prompts must be the dataset's at that place) and skipped; a shard cut off
mid-write left only a temporary file and is redone. A different plan, model or shard size
is refused, naming what differs, rather than mixing two collections in one folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import shards
from .errors import FailedPrecondition, InvalidArgument, TracewireError
from .mapping import MapOptions, run_map
from .progress import progress_bar
from .prompt_sources import read_prompts
from .rpcs import ModelInfo
from .shards import Shard, Storage
from .tracing import Saved, Tracer

if TYPE_CHECKING:
    from .client import Client

MANIFEST = "manifest.json"
FORMAT = "tracewire-collection/1"
POSITION_KINDS = ("prompt", "last", "new")


@dataclass(frozen=True)
class CollectPlan:
    """What each prompt's trace reads.

    layers: decoder layers whose output (the residual stream) is read, field `layers.L`.
    positions: "prompt" (every prompt position, at step 0: [prompt_len, hidden]), "last"
    (the last prompt position: [1, hidden]), "new" (the new token of every step: [steps,
    hidden]) or a list of prompt positions (negative from the end). mean: average the
    prompt positions on the server ([1, hidden]). logits_top_k: the k largest logits of
    every step (fields `logits.values` [steps, k], `logits.ids`). samples: the token drawn
    at every step (`samples` [steps]). Every prompt also gets `prompt_token_ids`.
    """

    layers: tuple[int, ...] = ()
    positions: str | tuple[int, ...] = "last"
    mean: bool = False
    logits_top_k: int = 0
    samples: bool = False
    max_tokens: int = 1

    def check(self, info: ModelInfo) -> None:
        if isinstance(self.positions, str) and self.positions not in POSITION_KINDS:
            raise InvalidArgument(
                f"positions must be one of {POSITION_KINDS} or a list of prompt positions, got {self.positions!r}",
                field="positions",
            )
        if self.mean and self.positions == "new":
            raise InvalidArgument("mean averages prompt positions; positions='new' has one per step", field="mean")
        bad = [layer for layer in self.layers if not 0 <= layer < info.num_layers]
        if bad:
            raise InvalidArgument(f"layers {bad} out of range: the model has {info.num_layers}", field="layers")
        if self.logits_top_k < 0 or self.max_tokens < 1:
            raise InvalidArgument("logits_top_k must be >= 0 and max_tokens >= 1", field="logits_top_k")
        self.check_readable(info)

    def check_readable(self, info: ModelInfo) -> None:
        """Refuse, before any prompt runs, layers the server cannot read: an eager server
        reads every layer; a compiled one those it keeps read buffers on (--compiled-reads:
        `readable_layers`). "unspecified" (a server older than engine_mode) is let through:
        it cannot say, and refuses what it cannot serve itself."""
        if not self.layers or info.engine_mode in ("eager", "unspecified"):
            return
        unreadable = sorted(set(self.layers) - set(info.readable_layers))
        if not unreadable:
            return
        if not info.readable_layers:
            raise FailedPrecondition(
                f"layer reads need a server started with --enforce-eager, or a compiled one with "
                f"--compiled-reads (on layers {unreadable} at least); this one is {info.engine_mode} "
                "without read buffers (model_info().readable_layers is empty)",
                field="layers",
            )
        raise FailedPrecondition(
            f"layers {unreadable} are not readable on this {info.engine_mode} server: it keeps read buffers "
            f"on layers {sorted(info.readable_layers)} only (--compiled-reads LAYERS); read those, or start "
            "it with --compiled-reads naming these layers too, or with --enforce-eager",
            field="layers",
        )

    def build(self, tracer: Tracer) -> dict[str, Saved]:
        """Add the plan's reads to one prompt's trace."""
        reads: dict[str, Saved] = {}
        for layer in self.layers:
            path = f"layers.{layer}"
            if self.positions == "new":
                reads[path] = tracer.all().module(path).save(path)
            else:
                where = "prompt" if self.positions == "prompt" else [-1] if self.positions == "last" else self.positions
                reads[path] = tracer.iter[0].module(path, positions=where, mean=self.mean).save(path)
        if self.logits_top_k:
            reads["logits"] = tracer.all().logits.top_k(self.logits_top_k).save("logits")
        if self.samples:
            reads["samples"] = tracer.all().samples.save("samples")
        return reads

    def record(self, tracer: Tracer, reads: dict[str, Saved]) -> dict[str, np.ndarray[Any, Any]]:
        """One prompt's fields from its run trace: each [rows, *rest]."""
        result = tracer.result
        assert result is not None
        out: dict[str, np.ndarray[Any, Any]] = {"prompt_token_ids": np.asarray(result.prompt_token_ids, np.int32)}
        for layer in self.layers:
            saved = reads[f"layers.{layer}"]
            rows = np.stack(saved) if self.positions == "new" else np.asarray(saved.value)
            out[f"layers.{layer}"] = rows.reshape(-1, rows.shape[-1]).astype(np.float32, copy=False)
        if self.logits_top_k:
            out["logits.values"] = np.stack([top.values for top in reads["logits"]]).astype(np.float32, copy=False)
            out["logits.ids"] = np.stack([top.ids for top in reads["logits"]]).astype(np.int32, copy=False)
        if self.samples:
            out["samples"] = np.asarray(list(reads["samples"]), np.int32)
        return out

    def to_json(self) -> dict[str, Any]:
        plan = asdict(self)
        plan["layers"] = list(self.layers)
        plan["positions"] = self.positions if isinstance(self.positions, str) else list(self.positions)
        return plan


@dataclass(frozen=True)
class ShardWritten:
    """What `on_shard` hears after each shard: its number, file and prompts [first, first + count)."""

    number: int
    path: Path
    first: int
    count: int
    skipped: bool  # already there from an earlier run


@dataclass
class Manifest:
    """manifest.json: what the collection is and where its prompts are."""

    storage: Storage
    model: str
    server_version: str
    vllm_version: str
    engine_mode: str
    plan: dict[str, Any]
    sampling: dict[str, Any]
    shard_size: int
    source: str | None
    shards: list[dict[str, Any]] = field(default_factory=list)
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    count: int | None = None  # prompts, once complete
    complete: bool = False

    # What must match for a folder's shards to be resumed into.
    IDENTITY = ("storage", "model", "plan", "sampling", "shard_size")

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        if data.get("format") != FORMAT:
            raise InvalidArgument(f"not a tracewire collection manifest (format {data.get('format')!r})",
                                  field="output")
        return cls(**{k: v for k, v in data.items() if k != "format"})

    def save(self, folder: Path) -> None:
        tmp = folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, folder / MANIFEST)

    def check_resumable(self, earlier: Manifest) -> None:
        for name in self.IDENTITY:
            if getattr(self, name) != getattr(earlier, name):
                raise InvalidArgument(
                    f"the output folder holds another collection: its {name} is {getattr(earlier, name)!r}, "
                    f"this run's {getattr(self, name)!r} (use a new folder, or delete that one)",
                    field="output",
                )


class CollectError(TracewireError):
    """A prompt's trace failed: its shard was not written (running again redoes it)."""


def collect(
    client: Client,
    prompts: Iterable[str] | str | os.PathLike[str],
    output: str | os.PathLike[str],
    plan: CollectPlan,
    *,
    storage: Storage = "parquet",
    shard_size: int = 256,
    column: str | None = None,
    options: MapOptions | None = None,
    on_shard: Callable[[ShardWritten], None] | None = None,
    sampling: dict[str, Any] | None = None,
) -> Manifest:
    """See the module's docstring; `client.collect` is the front door."""
    if storage not in shards.SUFFIX:
        raise InvalidArgument(f"storage must be 'parquet' or 'safetensors', got {storage!r}", field="storage")
    if shard_size < 1:
        raise InvalidArgument(f"shard_size must be >= 1, got {shard_size}", field="shard_size")
    sampling = {"temperature": 0.0, **(sampling or {}), "max_tokens": plan.max_tokens}
    _check_json(sampling)
    options = options or MapOptions()
    info = client.model_info()
    plan.check(info)
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    source = str(prompts) if isinstance(prompts, (str, os.PathLike)) else None
    manifest = Manifest(storage, info.model, info.server_version, info.vllm_version, info.engine_mode,
                        plan.to_json(), sampling, shard_size, source)
    earlier = _earlier(folder)
    if earlier is not None:
        manifest.check_resumable(earlier)
        manifest.fields = earlier.fields
    texts = read_prompts(prompts, column) if isinstance(prompts, (str, os.PathLike)) else _strings(prompts)
    total = len(prompts) if isinstance(prompts, (list, tuple)) else None
    bar = progress_bar(total, enabled=options.progress, desc="collect")
    quiet = MapOptions(options.concurrency, options.retries, progress=False)
    count = 0
    try:
        for number, chunk in enumerate(_chunks(texts, shard_size)):
            path = folder / shards.shard_name(number, storage)
            skipped = path.exists()
            if skipped:
                _check_shard(path, storage, chunk, count)
                if not manifest.fields:
                    manifest.fields = shards.fields_of(shards.read(path, storage, count))
            else:
                shard = _run_shard(client, chunk, count, plan, quiet, sampling)
                shards.write(shard, path, storage)
                manifest.fields = manifest.fields or shards.fields_of(shard)
            manifest.shards = [s for s in manifest.shards if s["file"] != path.name]
            manifest.shards.append({"file": path.name, "first": count, "count": len(chunk)})
            manifest.save(folder)
            if on_shard is not None:
                on_shard(ShardWritten(number, path, count, len(chunk), skipped))
            count += len(chunk)
            bar.update(len(chunk))
    finally:
        bar.close()
    manifest.count, manifest.complete = count, True
    manifest.save(folder)
    return manifest


def _earlier(folder: Path) -> Manifest | None:
    path = folder / MANIFEST
    if not path.exists():
        return None
    return Manifest.from_json(json.loads(path.read_text(encoding="utf-8")))


def _check_json(sampling: dict[str, Any]) -> None:
    try:
        json.dumps(sampling)
    except TypeError as e:
        raise InvalidArgument(f"collect's sampling parameters go into manifest.json and must be JSON: {e}",
                              field="sampling") from e


def _strings(prompts: Iterable[Any]) -> Iterator[str]:
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise InvalidArgument(f"prompt {i}: collect takes text prompts, got {type(prompt).__name__}",
                                  field="prompts")
        yield prompt


def _chunks(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _check_shard(path: Path, storage: Storage, chunk: list[str], first: int) -> None:
    if shards.read_prompts(path, storage) != chunk:
        raise InvalidArgument(
            f"{path.name} holds other prompts than the dataset's {first}..{first + len(chunk) - 1}: "
            "the dataset changed since it was written (use a new folder)",
            field="prompts",
        )


def _run_shard(client: Client, chunk: list[str], first: int, plan: CollectPlan, options: MapOptions,
               sampling: dict[str, Any]) -> Shard:
    def build(tracer: Tracer) -> tuple[Tracer, dict[str, Saved]]:
        return tracer, plan.build(tracer)

    items = run_map(client, chunk, build, options, sampling)
    failed = items.errors
    if failed:
        item = failed[0]
        raise CollectError(
            f"prompt {first + item.index} ({item.prompt!r}) failed after {item.attempts} attempt(s): "
            f"{type(item.error).__name__}: {item.error} ({len(failed)} of this shard's {len(chunk)} failed; "
            "its shard was not written, running again resumes here)"
        ) from item.error
    shard = Shard(first, list(chunk), [])
    for tracer, reads in items.values():
        result = tracer.result
        assert result is not None
        shard.texts.append(result.outputs[0].text)
        for name, array in plan.record(tracer, reads).items():
            shard.arrays.setdefault(name, []).append(array)
    return shard


@dataclass
class Collection:
    """A collection read back: `manifest`, and per field one array per prompt."""

    folder: Path
    manifest: Manifest

    def shards(self) -> Iterator[Shard]:
        """The shards in order, one in memory at a time."""
        for entry in self.manifest.shards:
            yield shards.read(self.folder / entry["file"], self.manifest.storage, entry["first"])

    def field(self, name: str) -> list[np.ndarray[Any, Any]]:
        """Every prompt's array of one field, in dataset order (all in memory)."""
        if name not in self.manifest.fields and name not in ("prompt_token_ids",):
            raise InvalidArgument(f"no field {name!r}; the collection has {sorted(self.manifest.fields)}", field="name")
        return [array for shard in self.shards() for array in shard.arrays[name]]

    def prompts(self) -> list[str]:
        return [p for shard in self.shards() for p in shard.prompts]

    def texts(self) -> list[str]:
        return [t for shard in self.shards() for t in shard.texts]


def load(folder: str | os.PathLike[str]) -> Collection:
    """A collection written by `collect` (complete or not: the shards written so far)."""
    path = Path(folder)
    manifest = _earlier(path)
    if manifest is None:
        raise InvalidArgument(f"{str(path)!r} has no {MANIFEST}: not a collection", field="folder")
    manifest.shards.sort(key=lambda s: int(s["first"]))
    return Collection(path, manifest)


__all__ = ["CollectError", "CollectPlan", "Collection", "Manifest", "ShardWritten", "collect", "load"]
