"""Values on their way from the device to the host, and small operands the other way.

A step's reads are launched as device work with non-blocking copies to the host
(`to_host`); the collector converts them once the step's copies are done. A batched
read is one HostBatch for all its rows, each row pointing into it (a ColumnRow); a
read computed for one row is a HostRead. Separate from the reads themselves because
the logits reads, the module reads and the outgoing message all hold these.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from ..shared.sidechannel import ReadResult, token_read
from ..shared.tensors import RawTensor

# A batched read of at most this many bytes (top-20 of 256 rows: 40 KB) goes whole to
# every frontend reading any of its rows; larger ones (full logits rows) are cut per
# frontend, so none is sent what it does not read.
WHOLE_COLUMN_BYTES = 256 << 10


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a tensor this step computed, valid after StepWork.wait(). On a GPU
    a non-blocking copy into pinned memory: the engine never waits for values it does
    not need itself. On the CPU the tensor itself (callers pass tensors they own)."""
    if t.device.type == "cpu":
        return t
    # One call (each torch call lets go of the GIL, which a busy engine thread then waits
    # to get back): a non-blocking copy off the device lands in pinned memory.
    return t.to("cpu", non_blocking=True)


def on_device(values: np.ndarray | list[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small operand on `device` without waiting for the device: a blocking copy from
    pageable memory would synchronize it, a non-blocking one from pinned memory does not."""
    if isinstance(values, np.ndarray) and not values.flags.writeable:
        values = values.copy()  # torch wants writable memory (frombuffer over plan bytes is not)
    if device.type == "cpu":
        return torch.as_tensor(values, dtype=dtype)
    # (torch.tensor(..., pin_memory=True) refuses numpy arrays: a pinned copy, then over)
    return torch.as_tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


class HostBatch:
    """Host arrays of one read kind for several rows, valid once the step's copies are
    done (StepWork.wait). Viewed as numpy here, on the engine thread (the view keeps
    the host tensor alive): torch's .numpy() lets go of the GIL, and every time the
    collector thread lets go of it, it waits to get it back from a busy engine thread."""

    __slots__ = ("_whole", "ids", "positions", "values")

    def __init__(self, values: torch.Tensor, ids: torch.Tensor | None) -> None:
        self.values: np.ndarray = values.numpy()
        self.ids: np.ndarray | None = ids.numpy() if ids is not None else None
        # A column's token positions, a row per row (a block's logit lens; else None).
        self.positions: np.ndarray | None = None
        self._whole: ReadResult | None = None

    @classmethod
    def of_arrays(cls, values: np.ndarray, ids: np.ndarray | None, positions: np.ndarray | None = None) -> HostBatch:
        """Over numpy views of a host copy several reads share (one copy off the device
        for all of them, each a view of its part: slicing numpy costs a fraction of
        slicing a tensor, and one copy launch replaces one per read)."""
        batch = cls.__new__(cls)
        batch.values, batch.ids, batch.positions, batch._whole = values, ids, positions, None
        return batch

    @property
    def rows(self) -> int:
        return int(self.values.shape[0])

    @property
    def small(self) -> bool:
        """Small enough to send whole to every frontend reading any of its rows: cheaper
        than cutting each one its rows (Python per row, on the collector's GIL time)."""
        return self.values.nbytes + (self.ids.nbytes if self.ids is not None else 0) <= WHOLE_COLUMN_BYTES

    def column(self, rows: list[int] | None = None) -> ReadResult:
        """These rows (None: all) at once, as sent: the server hands each trace its row.
        All of them are converted once, however many frontends they go to."""
        values, ids, positions = self.values, self.ids, self.positions
        if rows is None:
            if self._whole is None:
                self._whole = ReadResult(RawTensor.from_numpy(values),
                                         RawTensor.from_numpy(ids) if ids is not None else None,
                                         RawTensor.from_numpy(positions) if positions is not None else None)
            return self._whole
        return ReadResult(RawTensor.rows_of(values, rows), RawTensor.rows_of(ids, rows) if ids is not None else None,
                          RawTensor.rows_of(positions, rows) if positions is not None else None)


@dataclass
class HostRead:
    """One row's read on its way to the host (a module or logit-lens read, or the
    drawn sample); batched reads are ColumnRows instead."""

    batch: HostBatch | None  # None: the drawn token itself (known after the wait)
    positions: list[int] | None = None

    def result(self, token: int) -> ReadResult:
        if self.batch is None:
            return token_read(token)
        whole = self.batch.column()
        if self.positions is None:
            return whole
        return ReadResult(whole.values, whole.token_ids, RawTensor.from_numpy(np.asarray(self.positions, np.int32)))


# (msgspec structs, not NamedTuples: made per traced row and read, and a struct costs
# what a tuple does to make, a NamedTuple several times that. No cycles: no GC.)
class ColumnRow(msgspec.Struct, gc=False):
    """One row's read as a row of a read batched over several rows."""

    batch: HostBatch
    row: int


class ColumnRows(msgspec.Struct, gc=False):
    """Rows of a read batched over several rows (a block's, one per block row; or
    those a frontend reads)."""

    batch: HostBatch
    rows: list[int]


# A read launched for one row: its own value, or its row of a batch.
Launched = HostRead | ColumnRow


def scalar(launched: Launched) -> float:
    """The first value of a one-value read (a dictionary condition's), once on the host."""
    if isinstance(launched, ColumnRow):
        return float(launched.batch.values[launched.row].reshape(-1)[0])
    assert launched.batch is not None
    return float(launched.batch.values.reshape(-1)[0])
SAMPLE = HostRead(None)
