"""A RegisterDictionary stream's chunks, received into a private temporary file.

The limit is checked as the chunks arrive: once the file's first 8 bytes give the
safetensors header's length, every byte after the header is tensor data, which is what
the dictionary will take on the device (its tensors keep their dtype there). The call
stops at the first chunk that would take the data past the room left under
--max-dictionary-bytes, before it is written; nothing is buffered in memory beyond one
chunk. Writes run in a thread, off the event loop. The file is removed however the
call ends (`UploadFile` is a context manager).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any

from ..shared.dictionary_spec import DictionaryError
from .dictionary_file import header_length
from .errors import InvalidArgument, ResourceExhausted


class UploadFile:
    def __init__(self, room: int) -> None:
        self.room = room  # tensor-data bytes the upload may bring
        fd, name = tempfile.mkstemp(prefix="tracewire-dictionary-", suffix=".safetensors")
        self.path = Path(name)  # mode 0600: this user's (the engine's workers) only
        self._file = os.fdopen(fd, "wb")
        self._prefix = b""
        self._header = -1  # the JSON header's length, once known
        self.received = 0

    def __enter__(self) -> UploadFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)

    async def receive(self, messages: AsyncIterator[Any]) -> None:
        """Write every chunk of the stream after its header; INVALID_ARGUMENT naming
        `chunk` for a second header or an empty file, RESOURCE_EXHAUSTED naming it over
        the room."""
        index = 0
        async for message in messages:
            if message.WhichOneof("part") != "chunk":
                raise InvalidArgument(f"chunk[{index}]", "after the header every message must be a chunk of "
                                      "the safetensors file")
            self._admit(message.chunk, index)
            await asyncio.to_thread(self._file.write, message.chunk)
            index += 1
        await asyncio.to_thread(self._file.flush)
        if self.received == 0:
            raise InvalidArgument("chunk", "no file: send the safetensors file's bytes after the header")

    def _admit(self, chunk: bytes, index: int) -> None:
        self.received += len(chunk)
        if self._header < 0 and len(self._prefix) < 8:
            self._prefix += chunk[: 8 - len(self._prefix)]
            if len(self._prefix) == 8:
                try:
                    self._header = header_length(self._prefix)
                except DictionaryError as e:
                    raise InvalidArgument(f"chunk[{index}]", e.message) from None
        # Before the length is known, at most 8 bytes have come: nothing to count yet.
        data = self.received - 8 - self._header if self._header >= 0 else 0
        if data > self.room:
            raise ResourceExhausted(
                f"chunk[{index}]: the upload's tensor data reached {data} bytes; {self.room} bytes are left "
                "for uploaded dictionaries on this server (--max-dictionary-bytes); delete one of yours "
                "or upload a smaller dictionary")
