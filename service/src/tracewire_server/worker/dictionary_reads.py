"""Dictionary reads: a probe's outputs or an SAE's features on the module rows gathered.

The module hooks gather a dictionary read's rows like a module read's (module_reads.py
joins them at the step's sample); here the new-token rows reading one dictionary with the
same selection go through it in one batch (one matmul for all of them) and travel to the
host as one column; reads of prompt positions go one by one, as a value each. Each takes
what it asked for: every value, the top k with their ids, chosen features, or the
reconstruction error. Many rows go a bounded chunk at a time (Dictionary.chunks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..shared import plan as P
from .batch import Row
from .dictionaries import Dictionaries, Dictionary
from .host import ColumnRow, HostBatch, HostRead, on_device, to_host

# What a read returns of its rows: values, and ids for a top k.
Selected = tuple[torch.Tensor, torch.Tensor | None]


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
    """New-token reads with the same selection: one computation over all their rows, to
    the host as one column. Prompt reads: one each."""
    columns: dict[tuple[int | None, tuple[int, ...] | None, bool], list[DictionaryWant]] = {}
    for want in group:
        if want.positions is None:
            columns.setdefault((want.read.top_k, want.read.features, want.read.error), []).append(want)
        else:
            chosen, ids = _computed(want.read, dictionary, want.values)
            want.row.reads[want.name] = HostRead(_batch(chosen, ids), positions=want.positions)
    for wants in columns.values():
        batch = column(wants[0].read, dictionary, torch.cat([want.values for want in wants]))
        for j, want in enumerate(wants):
            want.row.reads[want.name] = ColumnRow(batch, j)


def column(read: P.ReadDictionary, dictionary: Dictionary, x: torch.Tensor) -> HostBatch:
    """`read` of rows x (a row each: new tokens), on its way to the host as one batch."""
    return _batch(*_computed(read, dictionary, x))


def _computed(read: P.ReadDictionary, dictionary: Dictionary, x: torch.Tensor) -> Selected:
    """What `read` returns of rows x, [rows, ...]: a bounded chunk of rows at a time
    (Dictionary.chunks), so no read holds [rows, size] float32 for a long prompt's rows."""
    parts = [_select(read, dictionary, chunk) for chunk in dictionary.chunks(x)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts]), None if parts[0][1] is None else torch.cat([p[1] for p in parts])


def _select(read: P.ReadDictionary, dictionary: Dictionary, x: torch.Tensor) -> Selected:
    """What `read` returns of rows x: (values, ids for top-k)."""
    values = dictionary.values(x)  # [rows, size]: one matmul for the rows
    if read.error:
        return dictionary.reconstruction_error(x, values), None
    if read.top_k is not None:
        top = torch.topk(values, read.top_k, dim=-1)
        return top.values, top.indices.to(torch.int32)
    if read.features is not None:
        return values.index_select(1, on_device(list(read.features), values.device, torch.long)), None
    return values, None


def _batch(values: torch.Tensor, ids: torch.Tensor | None) -> HostBatch:
    return HostBatch(to_host(values.contiguous()), to_host(ids.contiguous()) if ids is not None else None)
