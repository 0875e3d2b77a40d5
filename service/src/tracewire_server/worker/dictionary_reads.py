"""Dictionary reads: a probe's outputs or an SAE's features on the module rows gathered.

The module hooks gather a dictionary read's rows like a module read's (module_reads.py
joins them at the step's sample); here every row reading one dictionary this step goes
through it in one batch (one matmul for all of them), and each read then takes what it
asked for: every value, the top k with their ids, chosen features, or the
reconstruction error. New-token reads with the same selection travel to the host as one
column; reads of prompt positions as a value each.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..shared import plan as P
from .batch import Row
from .dictionaries import Dictionaries, Dictionary
from .host import ColumnRow, HostBatch, HostRead, on_device, to_host


class DictionaryWant(NamedTuple):
    """One row's dictionary read of this step, with the module rows it gathered."""

    row: Row
    name: str
    read: P.ReadDictionary
    values: torch.Tensor  # [positions, hidden] float32
    positions: list[int] | None  # None: the new token's row (it joins a column)


def launch_dictionary_reads(wants: list[DictionaryWant], dictionaries: Dictionaries) -> None:
    """Compute and launch every dictionary read of the step, a batch per dictionary."""
    # By name and generation: a trace still running against a replaced generation fails
    # alone, not the traces reading the current one in the same step.
    by_dictionary: dict[P.DictRef, list[DictionaryWant]] = {}
    for want in wants:
        by_dictionary.setdefault(want.read.dictionary, []).append(want)
    for ref, group in by_dictionary.items():
        try:
            _launch(group, dictionaries.get(ref))
        except Exception as e:  # noqa: BLE001 - fails the traces reading it, only those
            for want in group:
                want.row.error = want.row.error or f"{type(e).__name__}: {e}"


def _launch(group: list[DictionaryWant], dictionary: Dictionary) -> None:
    x = torch.cat([want.values for want in group])
    values = dictionary.values(x)  # [rows, size]: one matmul for every row reading it
    errors = dictionary.reconstruction_error(x, values) if any(w.read.error for w in group) else None
    columns: dict[tuple[int | None, tuple[int, ...] | None, bool], list[tuple[DictionaryWant, int]]] = {}
    offset = 0
    for want in group:
        n = want.values.shape[0]
        if want.positions is None:
            key = (want.read.top_k, want.read.features, want.read.error)
            columns.setdefault(key, []).append((want, offset))
        else:
            chosen, ids = _select(want.read, values[offset:offset + n], errors, offset)
            want.row.reads[want.name] = HostRead(_batch(chosen, ids), positions=want.positions)
        offset += n
    for members in columns.values():
        # (on_device: a pageable copy to a GPU would wait for the forward pass)
        index = on_device([start for _, start in members], values.device, torch.long)
        read = members[0][0].read
        chosen, ids = _select(read, values.index_select(0, index), errors, index)
        batch = _batch(chosen, ids)
        for j, (want, _) in enumerate(members):
            want.row.reads[want.name] = ColumnRow(batch, j)


def _select(read: P.ReadDictionary, values: torch.Tensor, errors: torch.Tensor | None,
            rows: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What `read` returns of its rows' values: (values, ids for top-k). `rows` locates
    them in `errors` (the start of a run, or an index)."""
    if read.error:
        assert errors is not None
        if isinstance(rows, int):
            return errors[rows:rows + values.shape[0]], None
        return errors.index_select(0, rows), None
    if read.top_k is not None:
        top = torch.topk(values, read.top_k, dim=-1)
        return top.values, top.indices.to(torch.int32)
    if read.features is not None:
        return values.index_select(1, on_device(list(read.features), values.device, torch.long)), None
    return values, None


def _batch(values: torch.Tensor, ids: torch.Tensor | None) -> HostBatch:
    return HostBatch(to_host(values.contiguous()), to_host(ids.contiguous()) if ids is not None else None)
