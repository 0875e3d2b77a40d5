"""Unit selections of the unit-addressed modules, validated: attention heads of
layers.L.self_attn.heads and MLP neurons of layers.L.mlp.act (plan.unit_kind).

Kept apart from interventions.py because it is one concept (which units, and the
operand shapes they imply) that read_module and write_module both use; every error
names the field path.
"""

from __future__ import annotations

from typing import Any

from tracewire.v1 import intervention_pb2 as ipb

from ..shared import plan as P
from ..shared.limits import ModelLimits
from .errors import FailedPrecondition, InvalidArgument
from .tensors import float_tensor

_NAMES = {"heads": "attention heads", "neurons": "MLP neurons"}


def require_units(limits: ModelLimits, module: str, field: str) -> None:
    """Unit modules need their units whole on one rank: tensor parallel splits them."""
    if P.unit_kind(module) and limits.tensor_parallel_size > 1:
        raise FailedPrecondition(
            f"{field}: {module!r} addresses {_NAMES[P.unit_kind(module) or 'heads']}, which "
            f"tensor parallelism splits across this server's {limits.tensor_parallel_size} ranks; "
            "unit reads and writes need --tensor-parallel-size 1"
        )


def _count(limits: ModelLimits, module: str) -> int:
    return P.module_shape(module, limits)[0]


def unit_ids(limits: ModelLimits, module: str, ids: Any, field: str) -> tuple[int, ...]:
    """Chosen units: not empty, in range, no duplicates."""
    if not len(ids):
        raise InvalidArgument(field, "must not be empty")
    count, seen = _count(limits, module), {}
    what = _NAMES[P.unit_kind(module) or "heads"]
    for k, unit in enumerate(ids):
        if not 0 <= unit < count:
            raise InvalidArgument(f"{field}[{k}]", f"{unit} is outside the {count} {what} [0, {count}) of {module!r}")
        if unit in seen:
            raise InvalidArgument(f"{field}[{k}]", f"duplicate id {unit} (also [{seen[unit]}])")
        seen[unit] = k
    return tuple(ids)


def _no_units(module: str, field: str) -> InvalidArgument:
    return InvalidArgument(
        field,
        f"{module!r} has no units to select: units address layers.L.self_attn.heads "
        "(attention heads) and layers.L.mlp.act (MLP neurons)",
    )


def read_units(limits: ModelLimits, r: ipb.ReadModule, field: str) -> P.Units | None:
    """ReadModule.units -> the plan's Units (None: every unit, or an ordinary module)."""
    if not r.HasField("units"):
        return None
    kind = P.unit_kind(r.module)
    if kind is None:
        raise _no_units(r.module, f"{field}.units")
    which = r.units.WhichOneof("kind")
    if which == "ids":
        return P.Units(ids=unit_ids(limits, r.module, r.units.ids.ids, f"{field}.units.ids.ids"))
    if which == "top_k":
        if kind != "neurons":
            raise InvalidArgument(f"{field}.units.top_k", "top_k selects MLP neurons (layers.L.mlp.act), not heads")
        k, count = r.units.top_k.k, _count(limits, r.module)
        if not 1 <= k <= count:
            raise InvalidArgument(f"{field}.units.top_k.k", f"must be in [1, {count}] (the neurons), got {k}")
        return P.Units(top_k=k)
    raise InvalidArgument(f"{field}.units", "set ids or top_k")


def write_units(limits: ModelLimits, w: ipb.WriteModule, field: str) -> tuple[int, ...] | None:
    """WriteModule.units -> the chosen unit ids (None: every unit, or an ordinary module)."""
    if not w.HasField("units"):
        return None
    if P.unit_kind(w.module) is None:
        raise _no_units(w.module, f"{field}.units")
    return unit_ids(limits, w.module, w.units.ids, f"{field}.units.ids")


def unit_operand(limits: ModelLimits, w: ipb.WriteModule, units: tuple[int, ...] | None, op: str,
                 field: str) -> bytes:
    """An add / replace operand of a unit write: [units, head_dim] or [head_dim] for
    heads, [units] for neurons (units: the chosen ones, or all of them)."""
    shape = P.module_shape(w.module, limits)
    count = len(units) if units is not None else shape[0]
    if P.unit_kind(w.module) == "heads":
        shapes = [(count, shape[1]), (shape[1],)]
    else:
        shapes = [(count,)]
    return float_tensor(getattr(w, op), shapes, f"{field}.{op}").astype("<f4").tobytes()
