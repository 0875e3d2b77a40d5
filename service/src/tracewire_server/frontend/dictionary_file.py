"""A dictionary's safetensors file, read without loading it: the tensors its header names
(name -> dtype, shape) and whether every value is finite.

The format is an 8-byte little-endian header length, that many bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then
the data. Parsed here rather than with the safetensors package so the frontend judges a
file from its header alone, in bounded memory, and checks values by their bit patterns
(numpy has no bfloat16). Blocking file I/O: callers run it in a thread.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..shared.dictionary_spec import SAFETENSORS_DTYPES, DictionaryError

# A dictionary's header is a few hundred bytes (a handful of tensors); safetensors itself
# allows 100 MB, which nothing here needs.
MAX_HEADER_BYTES = 1 << 20
_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
# Exponent bits all set: inf or NaN, per storage dtype (read as unsigned integers).
_NON_FINITE: dict[str, tuple[np.dtype[Any], int]] = {
    "F32": (np.dtype("<u4"), 0x7F800000),
    "F16": (np.dtype("<u2"), 0x7C00),
    "BF16": (np.dtype("<u2"), 0x7F80),
}
# Values checked per slice: bounds the memory of the check, not the file's size.
_CHECK_ITEMS = 1 << 22

Tensors = dict[str, tuple[str, tuple[int, ...]]]


class _Entry:
    __slots__ = ("dtype", "shape", "begin", "end")

    def __init__(self, dtype: str, shape: tuple[int, ...], begin: int, end: int) -> None:
        self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end


def header_length(prefix: bytes) -> int:
    """The JSON header's length from the file's first 8 bytes, or DictionaryError."""
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise DictionaryError("file", f"the safetensors header claims {length} bytes; at most "
                              f"{MAX_HEADER_BYTES} (is this a safetensors file?)")
    return int(length)


def read_tensors(path: Path) -> Tensors:
    """The tensors of the file at `path` (name -> (dtype as in DTYPES, shape)), checked
    to be a well-formed safetensors file whose data covers exactly the tensors; else
    DictionaryError naming "file" or the tensor."""
    return {name: (SAFETENSORS_DTYPES[e.dtype], e.shape) for name, e in _entries(path).items()}


def check_finite(path: Path) -> None:
    """DictionaryError naming the first tensor holding a NaN or an infinity."""
    entries = _entries(path)
    with open(path, "rb") as f:
        offset = 8 + header_length(f.read(8))
        for name, e in entries.items():
            kind, mask = _NON_FINITE[e.dtype]
            count = (e.end - e.begin) // kind.itemsize
            for start in range(0, count, _CHECK_ITEMS):
                n = min(_CHECK_ITEMS, count - start)
                f.seek(offset + e.begin + start * kind.itemsize)
                bits = np.frombuffer(f.read(n * kind.itemsize), dtype=kind)
                bad = np.flatnonzero((bits & mask) == mask)
                if bad.size:
                    raise DictionaryError(f"tensors.{name}", f"value {start + int(bad[0])} (flat index) is "
                                          "NaN or infinite; every value must be finite")


def _entries(path: Path) -> dict[str, _Entry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        return _parse(f, size)


def _parse(f: BinaryIO, size: int) -> dict[str, _Entry]:
    prefix = f.read(8)
    if len(prefix) < 8:
        raise DictionaryError("file", f"{size} bytes: too short for a safetensors file")
    length = header_length(prefix)
    if 8 + length > size:
        raise DictionaryError("file", f"the header claims {length} bytes, the file has {size - 8} after its length")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DictionaryError("file", f"the safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise DictionaryError("file", "the safetensors header is not a JSON object")
    entries: dict[str, _Entry] = {}
    for name, raw in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(name, raw)
    _check_layout(entries, size - 8 - length)
    return entries


def _entry(name: str, raw: object) -> _Entry:
    field = f"tensors.{name}"
    if not isinstance(raw, dict):
        raise DictionaryError(field, "not a tensor entry")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if dtype not in _ITEM_BYTES:
        raise DictionaryError(field, f"dtype {dtype}: expected one of {', '.join(SAFETENSORS_DTYPES.values())}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise DictionaryError(field, f"shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise DictionaryError(field, f"data_offsets {offsets!r}: expected [begin, end]")
    count = 1
    for d in shape:
        count *= d
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != count * _ITEM_BYTES[dtype]:
        raise DictionaryError(field, f"data_offsets {offsets} do not hold {count} {dtype} values")
    return _Entry(dtype, tuple(shape), begin, end)


def _check_layout(entries: dict[str, _Entry], data_bytes: int) -> None:
    """The tensors tile the data exactly: no overlap, no gap, nothing past the end."""
    at = 0
    for name, e in sorted(entries.items(), key=lambda item: item[1].begin):
        if e.begin != at:
            raise DictionaryError(f"tensors.{name}", f"starts at byte {e.begin} of the data, expected {at}")
        at = e.end
    if at != data_bytes:
        raise DictionaryError("file", f"the tensors hold {at} bytes of data, the file {data_bytes}")
