"""A collection's shards on disk: Parquet (one row per prompt) or safetensors (one tensor per
field, the prompts' rows concatenated, with offsets).

Every field of a prompt is an array [rows, *rest] whose `rest` is the same for all prompts
(rows vary: prompt positions, steps). Parquet stores such a field as a list of its rows per
prompt (list<fixed_size_list<...>> when rest is [width]); safetensors as the concatenation
[sum of rows, *rest] plus `NAME.offsets` [prompts + 1]. The prompts and generated texts
ride along: Parquet columns `prompt` / `text`, safetensors metadata (JSON lists).

A shard is written under a temporary name and renamed when complete, so a file under a
shard's name is always a whole shard (an interrupted write leaves only the temporary file,
which the next run overwrites).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .extras import require

Storage = Literal["parquet", "safetensors"]
SUFFIX: dict[str, str] = {"parquet": ".parquet", "safetensors": ".safetensors"}


@dataclass
class Shard:
    """Some prompts' records: `arrays[name][i]` is prompt i's [rows, *rest] array."""

    first: int  # the index (in the whole dataset) of the first prompt
    prompts: list[str]
    texts: list[str]
    arrays: dict[str, list[np.ndarray[Any, Any]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)


def shard_name(number: int, storage: Storage) -> str:
    return f"shard-{number:05d}{SUFFIX[storage]}"


def write(shard: Shard, path: Path, storage: Storage) -> None:
    """Write to PATH.tmp, then rename over PATH (atomic on one file system)."""
    tmp = path.with_name(path.name + ".tmp")
    if storage == "parquet":
        _write_parquet(shard, tmp)
    else:
        _write_safetensors(shard, tmp)
    os.replace(tmp, path)


def read(path: Path, storage: Storage, first: int) -> Shard:
    return _read_parquet(path, first) if storage == "parquet" else _read_safetensors(path, first)


def read_prompts(path: Path, storage: Storage) -> list[str]:
    """A shard's prompts alone (a resumed run checks them against the dataset's)."""
    if storage == "parquet":
        pq = require("pyarrow.parquet", "collect")
        prompts: list[str] = pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()
        return prompts
    with require("safetensors", "collect").safe_open(str(path), framework="np") as f:
        listed: list[str] = json.loads(f.metadata()["prompts"])
        return listed


def fields_of(shard: Shard) -> dict[str, dict[str, Any]]:
    """Each field's dtype and shape, rows as None: {"layers.1": {"dtype": "float32",
    "shape": [None, 256]}}."""
    out = {}
    for name, arrays in shard.arrays.items():
        sample = arrays[0]
        out[name] = {"dtype": str(sample.dtype), "shape": [None, *sample.shape[1:]]}
    return out


# -- Parquet ------------------------------------------------------------------------------


def _write_parquet(shard: Shard, path: Path) -> None:
    pa = require("pyarrow", "collect")
    pq = require("pyarrow.parquet", "collect")
    columns: dict[str, Any] = {
        "index": pa.array(np.arange(shard.first, shard.first + len(shard), dtype=np.int64)),
        "prompt": pa.array(shard.prompts, pa.string()),
        "text": pa.array(shard.texts, pa.string()),
    }
    for name, arrays in shard.arrays.items():
        columns[name] = _list_column(pa, arrays)
    pq.write_table(pa.table(columns), path)


def _list_column(pa: Any, arrays: list[np.ndarray[Any, Any]]) -> Any:
    """Per prompt a list of rows: its [rows] (scalars) or [rows, width] array."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    flat = np.concatenate([a.reshape(len(a), -1) for a in arrays]) if arrays else np.zeros((0, 1))
    rest = arrays[0].shape[1:]
    if len(rest) > 1:
        raise ValueError(f"a field's rows must be scalars or vectors, got rows of shape {rest}")
    values = pa.array(flat.reshape(-1))
    if rest:
        values = pa.FixedSizeListArray.from_arrays(values, int(rest[0]))
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _read_parquet(path: Path, first: int) -> Shard:
    pa = require("pyarrow", "collect")
    pq = require("pyarrow.parquet", "collect")
    table = pq.read_table(path)
    shard = Shard(first, table.column("prompt").to_pylist(), table.column("text").to_pylist())
    for name in table.column_names:
        if name in ("index", "prompt", "text"):
            continue
        column = table.column(name).combine_chunks()
        offsets = column.offsets.to_numpy()
        values = column.flatten()
        if pa.types.is_fixed_size_list(values.type):  # rows are vectors
            flat = values.flatten().to_numpy(zero_copy_only=False).reshape(-1, values.type.list_size)
        else:
            flat = values.to_numpy(zero_copy_only=False)
        base = offsets[0]
        shard.arrays[name] = [flat[a - base:b - base] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    return shard


# -- safetensors --------------------------------------------------------------------------


def _write_safetensors(shard: Shard, path: Path) -> None:
    st = require("safetensors.numpy", "collect")
    tensors: dict[str, np.ndarray[Any, Any]] = {
        "index": np.arange(shard.first, shard.first + len(shard), dtype=np.int64)
    }
    for name, arrays in shard.arrays.items():
        tensors[name] = np.ascontiguousarray(np.concatenate(arrays))
        tensors[f"{name}.offsets"] = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
    metadata = {"prompts": json.dumps(shard.prompts), "texts": json.dumps(shard.texts)}
    st.save_file(tensors, str(path), metadata=metadata)


def _read_safetensors(path: Path, first: int) -> Shard:
    with require("safetensors", "collect").safe_open(str(path), framework="np") as f:
        meta: Mapping[str, str] = f.metadata()
        shard = Shard(first, json.loads(meta["prompts"]), json.loads(meta["texts"]))
        names = sorted(k for k in f.keys() if k != "index" and not k.endswith(".offsets"))
        for name in names:
            flat, offsets = f.get_tensor(name), f.get_tensor(f"{name}.offsets")
            shard.arrays[name] = [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    return shard
