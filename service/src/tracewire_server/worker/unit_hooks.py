"""Unit hooks: attention heads and MLP neurons, in the forward pass (eager engines).

A unit-addressed module (plan.unit_kind) is a module's *input* viewed as units per
token: layers.L.self_attn.heads is o_proj's input as [heads, head_dim] (the heads'
outputs before they are mixed), layers.L.mlp.act is down_proj's input as
[intermediate] (the MLP's neurons). So these are forward PRE-hooks on o_proj and
down_proj (runner.unit_modules() finds them); the per-pass planning is
module_hooks.py's (the same Wants and Edits, keyed by these paths). Writes change the
input in place before o_proj / down_proj read it; reads copy out whole rows, and at
the step's sample `select_units` cuts the chosen units (or the top-k) out of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from ..shared import plan as P
from .host import on_device
from .sequences import Sequence


class UnitEdit(Protocol):
    """module_hooks.Edit, structurally: a request's write at these flat token rows, and
    (patch / add_read) the source's stored rows for them."""

    rows: list[int]
    write: P.WriteModule
    seq: Sequence
    operand: torch.Tensor | None


def as_units(value: torch.Tensor, unit_width: int) -> torch.Tensor:
    """[tokens, units * unit_width] -> [tokens, units, unit_width] for heads (a view:
    edits through it reach the module's input); neurons (width 1) stay [tokens, units]."""
    return value.view(value.shape[0], -1, unit_width) if unit_width > 1 else value


def edit_units(value: torch.Tensor, unit_width: int, edits: Iterable[UnitEdit]) -> None:
    """Apply unit writes in place on a module input [tokens, units * unit_width]: only
    the chosen units of the chosen rows change."""
    view = as_units(value, unit_width)
    for e in edits:
        write, seq = e.write, e.seq
        row_index = on_device(e.rows, view.device, torch.long)
        if write.units is None:
            unit_index = torch.arange(view.shape[1], device=view.device)
        else:
            unit_index = on_device(list(write.units), view.device, torch.long)
        where = (row_index[:, None], unit_index[None, :])
        block = view[where]  # [rows, units(, unit_width)]: a copy
        if e.operand is not None:  # patch / add_read: the source's same units, row for row
            source = as_units(e.operand.reshape(len(e.rows), -1), unit_width)
            taken = source.index_select(1, unit_index).to(device=view.device, dtype=block.dtype)
            new = taken if write.edit == "patch" else block + write.scale * taken
        elif write.edit == "add":
            new = block + _operand(seq, write, unit_width, view)
        elif write.edit == "replace":
            new = _operand(seq, write, unit_width, view).expand_as(block)
        elif write.edit == "zero":
            new = torch.zeros_like(block)
        else:  # mean over the selected positions, per unit
            new = block.mean(0, keepdim=True).expand_as(block)
        view.index_put_(where, new.to(view.dtype))


def _operand(seq: Sequence, write: P.WriteModule, unit_width: int, like: torch.Tensor) -> torch.Tensor:
    """The write's operand (Sequence.write_vector), shaped to broadcast over
    [rows, units(, unit_width)]: heads [units or 1, head_dim], neurons [units]."""
    vector = seq.write_vector(write, like)
    return vector.view(-1, unit_width) if unit_width > 1 else vector


def take_rows(value: torch.Tensor, unit_width: int, index: torch.Tensor) -> torch.Tensor:
    """The rows module reads want, as float32 units: [rows, units(, unit_width)] (a copy:
    the activation buffer is reused by the next pass)."""
    return as_units(value.detach(), unit_width).index_select(0, index).to(torch.float32)


def select_units(values: torch.Tensor, module: str,
                 units: P.Units | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A unit read's value from gathered rows [..., units(, head_dim)] of `module`: the
    chosen units, or (neurons) the top-k largest, largest first, with their ids as
    int32; every unit when the read chose none."""
    if units is None:
        return values, None
    axis = -2 if P.unit_kind(module) == "heads" else -1
    if units.top_k is not None:
        top = torch.topk(values, units.top_k, dim=axis)
        return top.values, top.indices.to(torch.int32)
    assert units.ids is not None
    index = on_device(list(units.ids), values.device, torch.long)
    return values.index_select(values.dim() + axis, index), None
