"""Logits reads: top-k, chosen ids, full rows and logprobs, batched over a step's rows.

Each read kind is one device computation over every row reading it (rows and blocks
alike), taken from the logits where they stand at the read's stage (raw, before the
writes, processed), each result on its way to the host as one HostBatch the rows point
into. Also the copy of the sampler's row that conditions look at (`capture`).
"""

from __future__ import annotations

import torch

from ..shared import plan as P
from .batch import Block, Captured, PendingLogprobs, Row, Step, Target
from .host import ColumnRow, ColumnRows, HostBatch, on_device, to_host


def _top_k(src: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values and int32 ids of the k largest per row, largest first, on src's
    device. torch.topk on the CPU too: with the one or two threads a CPU worker has, it
    beat numpy's argpartition + argsort at every width and row count measured (1-256
    rows, vocabularies of 2k-152k), by up to 2.5x."""
    top = torch.topk(src, k)
    values = top.values  # (vLLM's sampler works in float32 already: no call to make it so)
    return values if values.dtype == torch.float32 else values.float(), top.indices.to(torch.int32)


def take_rows(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, bool]:
    """These rows of the logits (ascending, each once), and whether that is a view: it
    is when they are one run (every request traced, the common case under load), with
    no index to send to the device; otherwise a gathered copy."""
    first = rows[0]
    if rows[-1] - first + 1 == len(rows):  # ascending and unique: a run
        return logits[first:first + len(rows)], True
    return logits.index_select(0, on_device(rows, logits.device, torch.long)), False


def capture(logits: torch.Tensor, rows: list[Row]) -> list[Captured]:
    """One copy of these rows' logits (in logits order), float32, for conditions on
    them; each row gets a handle into it."""
    src, is_view = take_rows(logits.detach(), [r.index for r in rows])
    batch = src.to(torch.float32, copy=is_view)
    return [Captured(batch, j) for j in range(len(rows))]


# The stages launch_batched serves at each point of the sampler's row.
RAW: frozenset[P.LogitsStage] = frozenset({"raw"})
BEFORE_WRITES: frozenset[P.LogitsStage] = frozenset({"before_writes"})
PROCESSED: frozenset[P.LogitsStage] = frozenset({"processed"})
UNWRITTEN: frozenset[P.LogitsStage] = BEFORE_WRITES | PROCESSED


def _union(targets: list[Target]) -> list[int]:
    """The logits rows the targets read, ascending, each once."""
    if len(targets) == 1 and type(targets[0][0]) is Block:
        return targets[0][0].index  # the common case: ascending already
    return sorted({r for target, _ in targets for r in (target.index if type(target) is Block else (target.index,))})


def launch_batched(step: Step, logits: torch.Tensor, stages: frozenset[P.LogitsStage]) -> None:
    """Launch these stages' logits reads for the step's rows and blocks: one device
    computation per distinct read over all the rows reading it, straight from the
    logits as they are now (nothing is copied first: take_rows), each result on its way
    to the host. Logprobs need the draw: their log_softmax is taken now and finished by
    launch_logprobs."""
    groups: dict[P.LogitsRead, list[Target]] = {}
    for row in step.rows:
        if row.error is None:
            for name, read in row.selected.logits_reads:
                if read.stage in stages:
                    groups.setdefault(read, []).append((row, name))
    for block in step.blocks:
        for name, read in block.ops.logits_reads:
            if read.stage in stages:
                groups.setdefault(read, []).append((block, name))
    for read, targets in groups.items():
        try:
            rows = _union(targets)
            first = rows[0]
            src, is_view = take_rows(logits, rows)
            where = None if is_view else {r: p for p, r in enumerate(rows)}
            if type(read) is P.ReadLogprobs:
                lp = torch.log_softmax(src, dim=-1, dtype=torch.float32)
                step.logprobs.append(PendingLogprobs(read, lp, rows, first, where, targets))
                continue
            assert type(read) is P.ReadLogits
            values, ids = _logits(src, read.top_k, read.token_ids)
            _assign(HostBatch(to_host(values), to_host(ids) if ids is not None else None), targets, first, where)
        except Exception as e:  # noqa: BLE001 - fails the traces reading it
            _fail_targets(targets, e)


def launch_logprobs(step: Step, drawn: torch.Tensor) -> None:
    """[rows, 1 + k] logprobs of the drawn token then the top k, and their ids.
    `drawn`: the step's sampled ids on the device, one per logits row."""
    for pending in step.logprobs:
        lp, rows, first, where, targets = pending.logprobs, pending.rows, pending.first, pending.where, pending.targets
        top_k = pending.read.top_k
        try:
            if where is None:
                ids = drawn[first:first + len(rows)]
            else:
                ids = drawn.index_select(0, on_device(rows, drawn.device, torch.long))
            ids = ids.to(device=lp.device, dtype=torch.long).unsqueeze(1)
            if top_k:
                ids = torch.cat([ids, torch.topk(lp, top_k).indices], dim=1)
            _assign(HostBatch(to_host(lp.gather(1, ids)), to_host(ids.to(torch.int32))), targets, first, where)
        except Exception as e:  # noqa: BLE001 - fails the traces reading it
            _fail_targets(targets, e)


def _assign(batch: HostBatch, targets: list[Target], first: int, where: dict[int, int] | None) -> None:
    """Give each target its rows of the batch, which holds logits rows `first`... (a
    run) or the rows `where` maps to batch rows."""
    for target, name in targets:
        if type(target) is Block:
            index = target.index
            rows = [r - first for r in index] if where is None else [where[r] for r in index]
            target.reads[name] = ColumnRows(batch, rows)
        else:
            target.reads[name] = ColumnRow(batch, target.index - first if where is None else where[target.index])


def _fail_targets(targets: list[Target], error: Exception) -> None:
    for target, _ in targets:
        target.error = target.error or f"{type(error).__name__}: {error}"


def _logits(
    src: torch.Tensor, top_k: int | None, token_ids: tuple[int, ...] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """These logits rows as read: top k, chosen ids, or whole rows (a copy: the
    sampler may change the logits in place); float32, and their ids."""
    if top_k is not None:
        return _top_k(src, top_k)
    if token_ids is not None:
        values = src.index_select(1, on_device(list(token_ids), src.device, torch.long)).float()
        return values, torch.tensor(token_ids, dtype=torch.int32).expand(values.shape[0], -1).contiguous()
    return src.to(torch.float32, copy=True), None
