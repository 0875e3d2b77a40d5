"""RegisterDictionary: a header, then a safetensors file in chunks, checked step by step
so each mistake is found as early as it can be and names its field.

1. the first message is the header: the name, the spec against the model, and whether
   the caller may take the name (before a byte of the file is read);
2. the chunks, into a private temporary file, within the room left for uploads
   (upload_file.py);
3. the file's header against the spec (shapes, dtype), then every value finite;
4. the worker loads it (dictionaries.py), which checks the room again under its lock.

The temporary file is removed however the call ends. Parsing and checking the file run
in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from tracewire.v1 import dictionary_pb2

from ..shared.dictionary_spec import DictionaryError, DictionaryInfo, check_spec, check_tensors
from .dictionaries import DictionaryRegistry, new_generation
from .dictionary_file import check_finite, read_tensors
from .dictionary_messages import info_from_spec, with_owner
from .engine import ModelDescription
from .errors import InvalidArgument
from .upload_file import UploadFile


async def register_upload(
    messages: AsyncIterator[dictionary_pb2.RegisterDictionaryRequest],
    owner: str,
    registry: DictionaryRegistry,
    model: ModelDescription,
) -> DictionaryInfo:
    header = await _header(messages)
    info = _checked_spec(header, model)
    await registry.check_name(info.name, owner, header.replace)
    with UploadFile(registry.room(owner, info.name if header.replace else "")) as upload:
        await upload.receive(messages)
        info = await asyncio.to_thread(_checked_file, info, upload.path, model.hidden_size)
        return await registry.register(with_owner(info, owner, new_generation()), upload.path, header.replace)


async def _header(messages: AsyncIterator[dictionary_pb2.RegisterDictionaryRequest]) -> dictionary_pb2.DictionaryHeader:
    first = await anext(messages, None)
    if first is None or first.WhichOneof("part") != "header":
        raise InvalidArgument("header", "the stream's first message must be the header (name and spec), "
                              f"{'not a chunk' if first is not None else 'and the stream was empty'}")
    return first.header


def _checked_spec(header: dictionary_pb2.DictionaryHeader, model: ModelDescription) -> DictionaryInfo:
    try:
        info = info_from_spec(header.name, header.spec)
        check_spec(info, {m.path: m.output_size for m in model.modules}, model.hidden_size)
    except DictionaryError as e:
        raise InvalidArgument(f"header.{e.field}", e.message) from None
    return info


def _checked_file(info: DictionaryInfo, path: Path, hidden_size: int) -> DictionaryInfo:
    try:
        completed = check_tensors(info, read_tensors(path), hidden_size)
        check_finite(path)
    except DictionaryError as e:
        # spec.* fields came in the header; tensors.* and file in the chunks
        raise InvalidArgument(f"header.{e.field}" if e.field.startswith("spec.") else e.field, e.message) from None
    return completed
