"""Logits writes: force, replace, add, bias, mask (and injected faults), made in place on
the sampler's row after vLLM's processors and before the draw.

Separate from the logits reads: reads are batched over rows, writes go row by row,
each with its own condition decided right there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..shared import plan as P
from .batch import Row
from .conditions import Context, holds
from .host import on_device
from .logits_reads import capture
from .sequences import Sequence


def _operands(seq: Sequence, action: P.Write, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The write's values and ids on the device, built once per request."""
    key = id(action)
    found = seq.operands.get(key)
    if found is None:
        if isinstance(action, (P.ReplaceLogits, P.AddLogits)):
            found = (on_device(np.frombuffer(action.values, "<f4"), device, torch.float32),)
        elif isinstance(action, P.BiasLogits):
            found = (
                on_device(list(action.bias.keys()), device, torch.long),
                on_device(np.asarray(list(action.bias.values()), np.float32), device, torch.float32),
            )
        elif isinstance(action, P.MaskLogits):
            found = (on_device(list(action.token_ids), device, torch.long),)
        else:
            found = ()
        seq.operands[key] = found
    return found


def apply_write(action: P.Write, row: torch.Tensor, seq: Sequence, fault_injection: bool) -> None:
    if isinstance(action, P.ForceSample):
        # Only the forced token stays finite: greedy and random sampling (any
        # temperature, top-k, top-p) must then draw it.
        row.fill_(float("-inf"))
        row[action.token_id] = 0.0
    elif isinstance(action, P.ReplaceLogits):
        row.copy_(_operands(seq, action, row.device)[0])
    elif isinstance(action, P.AddLogits):
        row.add_(_operands(seq, action, row.device)[0])
    elif isinstance(action, P.BiasLogits):
        ids, vals = _operands(seq, action, row.device)
        row.index_add_(0, ids, vals.to(row.dtype))
    elif isinstance(action, P.MaskLogits):
        row.index_fill_(0, _operands(seq, action, row.device)[0], float("-inf"))
    elif isinstance(action, P.InjectFault):
        if fault_injection:
            raise RuntimeError(action.message)
    else:
        raise TypeError(f"unknown write {type(action).__name__}")


def write_and_capture(rows: list[Row], logits: torch.Tensor, drain: Callable[[], None], fault_injection: bool) -> None:
    """Make the rows' logits writes in place (each request's failure fails its trace
    only), and keep a copy of the sampler's row for the rows whose conditions look at it."""
    for row in rows:
        if not row.selected.logits_writes:
            continue
        try:
            wrote = False
            ctx = Context(row, before_draw=True)
            if any(op.condition is not None for op in row.selected.logits_writes):
                # Conditions see the row as vLLM made it, before any of our writes (a
                # LOGITS_STAGE_BEFORE_WRITES read): captured before the first write,
                # whatever order the writes come in.
                drain()  # the text so far includes every finished step
                (row.processed,) = capture(logits, [row])
            for op in row.selected.logits_writes:
                if holds(op.condition, ctx):
                    apply_write(op.action, logits[row.index], row.seq, fault_injection)
                    wrote = True
            if wrote:
                row.processed = None  # captured again below, after the writes
        except Exception as e:  # noqa: BLE001 - fails this request's trace only
            row.error = f"{type(e).__name__}: {e}"
    wanted = [r for r in rows if r.selected.needs_processed and r.processed is None and r.error is None]
    if wanted:
        for row, captured in zip(wanted, capture(logits, wanted), strict=True):
            row.processed = captured
