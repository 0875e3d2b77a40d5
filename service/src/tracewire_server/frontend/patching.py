"""Activation patching across invokes, at compile time: resolve each write whose operand
is another invoke's read (WriteModule.patch / add_read, a ReadRef) against the trace's
invokes, and say which invoke waits for which.

Per write the intervention compiler (interventions.py) checked what the write alone
shows; here, with every invoke's ops and prompt at hand: the source exists, is not the
writer, has one sequence, holds an unconditional, unreduced module read of that name
of the target module's width, selected at every step the write is (its prompt rows at
step 0, or its new-token row at each step), with as many rows as the write selects; and
no invoke waits on itself through others. The result is plain data: the ops with their
references resolved (rows, the trace key), the reads each source keeps on the worker,
and the waits trace.py gates the invokes' engine requests on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from ..shared import plan as P
from ..shared.limits import ModelLimits
from .errors import InvalidArgument


@dataclass(frozen=True)
class PatchWait:
    """Invoke `invoke`'s engine requests start once invoke `source` has produced the
    record of step `step` (its worker then holds the values of that step and before)."""

    invoke: int
    source: int
    step: int
    what: str  # the write, for messages: "invoke 1's patch of layers.2 from invoke 0's read 'clean'"


@dataclass(frozen=True)
class InvokeDraft:
    """What the resolution needs of one compiled invoke."""

    prompt_len: int
    n: int
    max_tokens: int
    ops: tuple[P.Op, ...]


@dataclass(frozen=True)
class Resolved:
    ops: tuple[tuple[P.Op, ...], ...]  # per invoke, references resolved
    exports: tuple[frozenset[str], ...]  # per invoke: reads its worker keeps for others
    waits: tuple[PatchWait, ...]


def module_width(limits: ModelLimits, path: str) -> int:
    """Values per position of a module's output: [hidden], or a unit address's units
    ([heads, head_dim], [intermediate])."""
    return math.prod(P.module_shape(path, limits))


def resolve_patches(drafts: list[InvokeDraft], limits: ModelLimits, trace_key: str) -> Resolved:
    waits: list[PatchWait] = []
    exports: list[set[str]] = [set() for _ in drafts]
    edges: dict[int, dict[int, str]] = {}  # target -> source -> the write's field
    ops_out: list[tuple[P.Op, ...]] = []
    for i, draft in enumerate(drafts):
        ops = []
        for j, op in enumerate(draft.ops):
            action = op.action
            if isinstance(action, P.WriteModule) and action.ref is not None:
                field = f"invokes[{i}].interventions[{j}]"
                resolved, wait = _resolve(drafts, limits, i, op, action, action.ref, field, trace_key)
                op = msgspec.structs.replace(op, action=resolved)
                exports[action.ref.invoke].add(action.ref.name)
                edges.setdefault(i, {}).setdefault(action.ref.invoke, f"{field}.write_module.{action.edit}.invoke")
                waits.append(wait)
            ops.append(op)
        ops_out.append(tuple(ops))
    _refuse_cycles(edges)
    return Resolved(tuple(ops_out), tuple(frozenset(e) for e in exports), tuple(waits))


def _resolve(
    drafts: list[InvokeDraft], limits: ModelLimits, i: int, op: P.Op, write: P.WriteModule,
    ref: P.ReadRef, field: str, trace_key: str,
) -> tuple[P.WriteModule, PatchWait]:
    f = f"{field}.write_module.{write.edit}"
    if ref.invoke >= len(drafts):
        raise InvalidArgument(f"{f}.invoke", f"invoke {ref.invoke} does not exist (the trace has {len(drafts)})")
    if ref.invoke == i:
        raise InvalidArgument(f"{f}.invoke", "a write cannot take its operand from its own invoke")
    source = drafts[ref.invoke]
    if source.n != 1:
        raise InvalidArgument(f"{f}.invoke", f"invoke {ref.invoke} runs n = {source.n} sequences; a patch "
                              "source must run one (which one's values would it take?)")
    read_op = next((o for o in source.ops if o.name == ref.name), None)
    if read_op is None:
        raise InvalidArgument(f"{f}.name", f"invoke {ref.invoke} has no intervention named {ref.name!r}")
    read = read_op.action
    if not isinstance(read, P.ReadModule):
        raise InvalidArgument(f"{f}.name", f"invoke {ref.invoke}'s {ref.name!r} is not a read_module")
    if read.mean:
        raise InvalidArgument(f"{f}.name", f"invoke {ref.invoke}'s {ref.name!r} is mean-reduced; patch from a "
                              "read of rows")
    if read_op.condition is not None:
        raise InvalidArgument(f"{f}.name", f"invoke {ref.invoke}'s {ref.name!r} has a condition; a patch "
                              "source must be read whenever the write needs it")
    if P.unit_kind(write.module) != P.unit_kind(read.module):
        raise InvalidArgument(f"{f}.name", f"{write.module!r} takes its units from a read of the same kind of "
                              f"address, not of {read.module!r}")
    width, source_width = module_width(limits, write.module), module_width(limits, read.module)
    if width != source_width:
        raise InvalidArgument(f"{f}.name", f"{read.module!r} has {source_width} values a position, "
                              f"{write.module!r} {width}")
    what = (f"invoke {i}'s {write.edit} of {write.module} from invoke {ref.invoke}'s read {ref.name!r} "
            f"({field})")
    if write.positions.kind == "new_token":
        step = _new_token_steps(drafts[i], source, op, read_op, field, f)
        resolved = msgspec.structs.replace(ref, trace=trace_key)
    else:
        step = 0  # prompt positions: the source's prefill
        rows = _prompt_rows(drafts[i], source, op, write, read_op, ref, field, f)
        resolved = msgspec.structs.replace(ref, trace=trace_key, rows=rows)
    return msgspec.structs.replace(write, ref=resolved), PatchWait(i, ref.invoke, step, what)


def _prompt_rows(
    target: InvokeDraft, source: InvokeDraft, op: P.Op, write: P.WriteModule, read_op: P.Op,
    ref: P.ReadRef, field: str, f: str,
) -> tuple[int, ...]:
    """A write at prompt positions: the source's rows of step 0 it takes, in order."""
    read = read_op.action
    assert isinstance(read, P.ReadModule)
    if not op.steps.contains(0):
        raise InvalidArgument(f"{field}.steps", "a write at prompt positions acts at step 0 (the prefill): "
                              "its steps must include 0")
    if read.positions.kind == "new_token" or not read_op.steps.contains(0):
        raise InvalidArgument(f"{f}.name", f"invoke {ref.invoke}'s {ref.name!r} does not read prompt positions "
                              "at step 0, which a write at prompt positions takes")
    available = read.positions.prompt_positions(source.prompt_len)
    if ref.positions:
        rows = []
        for k, p in enumerate(ref.positions):
            if not -source.prompt_len <= p < source.prompt_len:
                raise InvalidArgument(f"{f}.positions[{k}]", f"{p} is outside invoke {ref.invoke}'s prompt of "
                                      f"{source.prompt_len} positions")
            if p % source.prompt_len not in available:
                raise InvalidArgument(f"{f}.positions[{k}]", f"position {p} is not one invoke {ref.invoke}'s "
                                      f"{ref.name!r} reads")
            rows.append(available.index(p % source.prompt_len))
    else:
        rows = list(range(len(available)))
    wanted = len(write.positions.prompt_positions(target.prompt_len))
    if len(rows) != wanted:
        where = f"{f}.positions" if ref.positions else f"{field}.write_module.positions"
        raise InvalidArgument(where, f"the write selects {wanted} positions but takes {len(rows)} rows of "
                              f"invoke {ref.invoke}'s {ref.name!r}")
    return tuple(rows)


def _new_token_steps(
    target: InvokeDraft, source: InvokeDraft, op: P.Op, read_op: P.Op, field: str, f: str
) -> int:
    """A write at the new token takes the source's row of the same step: every step it
    selects (up to the target's max_tokens) must be one the source reads. The last such
    step is what the target waits for."""
    read = read_op.action
    assert isinstance(read, P.ReadModule)
    if read.positions.kind != "new_token":
        raise InvalidArgument(f"{f}.name", f"{read_op.name!r} does not read the new token, which a write at "
                              "the new token takes (step s from the source's step s)")
    last = -1
    for step in _selected(op.steps, target.max_tokens):
        if not read_op.steps.contains(step) or step >= source.max_tokens:
            raise InvalidArgument(f"{field}.steps", f"the write acts at step {step}, which the source read "
                                  f"{read_op.name!r} does not reach or select")
        last = step
    if last < 0:
        raise InvalidArgument(f"{field}.steps", "selects no step before max_tokens")
    return last


def _selected(steps: P.StepSet, max_tokens: int) -> list[int]:
    if steps.steps is not None:
        return sorted(s for s in steps.steps if s < max_tokens)
    stop = max_tokens if steps.stop is None else min(steps.stop, max_tokens)
    return list(range(steps.start, stop))


def _refuse_cycles(edges: dict[int, dict[int, str]]) -> None:
    """An invoke that waits, through patch sources, on itself could never start."""
    state: dict[int, int] = {}  # 1: on the current path, 2: done

    def visit(node: int, path: list[int]) -> None:
        state[node] = 1
        for source, field in edges.get(node, {}).items():
            if state.get(source) == 1:
                here = path + [node]
                cycle = here[here.index(source):] + [source]
                chain = " -> ".join(f"invoke {k}" for k in cycle)
                raise InvalidArgument(field, f"patches form a cycle ({chain} patches from the next): no "
                                      "invoke in it could start")
            if source not in state:
                visit(source, path + [node])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
