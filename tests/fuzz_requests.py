"""Random requests for the fuzz test, generated from the message descriptors.

Two generators, both seeded (random.Random), so a seed reproduces a run exactly:

- `RequestFuzzer.message`: any field of a message may be set, to values that stress
  validation: edges of the vocabulary and of int32, NaN and infinities, empty and odd
  strings, unknown enum values, nested messages, repeated fields of a few or a few dozen
  entries.
- `RequestFuzzer.plausible`: messages shaped like real ones, so that validation is passed
  often enough to reach the deep checks (the plan's shapes, the units of a module, patch
  references, dictionaries) and the engine: one member per oneof, valid enum values, and
  the values of a field taken by its NAME from a table built from the served model
  (`Plausible`: GetModelInfo's modules and sizes, ListDictionaries' names) holding
  in-range values and the edges just outside them. A field the table does not know gets
  small values. Then `plant_reference` puts a reference to another invoke's read
  (fields `invoke` and `name` together: activation patching) into a share of them, and
  `link_references` points most references at a read that exists.

Neither generator names a message type: a new field or message is fuzzed as it comes.
Values that would make a *valid* request expensive (max_tokens, n) are drawn from small
or plainly invalid values: the fuzz test checks statuses, not throughput.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor, message_factory

FD = descriptor.FieldDescriptor
_INTS = (0, 1, 2, 3, -1, 7, 100, 511, 512, 2047, 2048, 2**31 - 1, -(2**31), 10**6)
_FLOATS = (0.0, 1.0, -1.0, 0.5, 2.0, 1e-9, 1e30, -1e30, float("nan"), float("inf"), float("-inf"))
_STRINGS = ("", "a", "The capital of France is", ".", "\x00", "é漢字🙂", "(a+)+b", "(a)\\1", "[",
            "layers.1", "layers.99", "embed_tokens", "norm", "tiny", "x" * 2000, "<|endoftext|>")
# Fields whose values decide how much a valid request costs: drawn from these only.
_CHEAP = {
    "max_tokens": (-1, 0, 1, 2, 4, 8, 2**31 - 1),
    "min_tokens": (-1, 0, 1, 3, 100),
    "n": (-1, 0, 1, 2, 3, 300, 2**31 - 1),
    "logprobs": (-2, -1, 0, 1, 5, 10**6),
    "prompt_logprobs": (-2, -1, 0, 1, 5, 10**6),
    "stream_interval_ms": (0, 10, 5000, -1),
}
PROMPTS = ("The capital of France is", "Once upon a time", "Water boils at", "a")


class RequestFuzzer:
    def __init__(self, seed: int, vocab_size: int, plausible: Plausible | None = None) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab_size
        self.table = plausible
        self.wild = 0  # wild values the plausible message being built may still get

    # -- anything goes -----------------------------------------------------------------

    def message(self, desc: descriptor.Descriptor, depth: int = 0) -> Any:
        msg = message_factory.GetMessageClass(desc)()
        for field_ in desc.fields:
            if self.rng.random() > (0.5 if depth < 4 else 0.15):
                continue
            try:
                self._set(msg, field_, depth)
            except (ValueError, TypeError):
                pass  # a value this field's type refuses on the client side: skip it
        return msg

    def _set(self, msg: Any, field_: FD, depth: int) -> None:
        if _is_map(field_):
            target = getattr(msg, field_.name)
            key_f, value_f = field_.message_type.fields_by_name["key"], field_.message_type.fields_by_name["value"]
            for _ in range(self._count()):
                target[self._scalar(key_f)] = self._scalar(value_f)
            return
        if field_.is_repeated:
            items = getattr(msg, field_.name)
            for _ in range(self._count()):
                if field_.type == FD.TYPE_MESSAGE:
                    items.add().CopyFrom(self.message(field_.message_type, depth + 1))
                else:
                    items.append(self._scalar(field_))
            return
        if field_.type == FD.TYPE_MESSAGE:
            getattr(msg, field_.name).CopyFrom(self.message(field_.message_type, depth + 1))
        else:
            setattr(msg, field_.name, self._scalar(field_))

    def _count(self) -> int:
        return self.rng.choice((0, 1, 1, 2, 3, self.rng.randint(0, 40)))

    def _scalar(self, field_: FD) -> Any:
        rng = self.rng
        if field_.name in _CHEAP:
            return rng.choice(_CHEAP[field_.name])
        t = field_.type
        if t == FD.TYPE_BOOL:
            return rng.random() < 0.5
        if t == FD.TYPE_ENUM:
            values = [v.number for v in field_.enum_type.values]
            return rng.choice(values + [len(values), 99, -1])
        if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            return rng.choice(_FLOATS + (rng.uniform(-10, 10),))
        if t == FD.TYPE_STRING:
            return rng.choice(_STRINGS + ("".join(chr(rng.randint(32, 0x2FF)) for _ in range(rng.randint(1, 12))),))
        if t == FD.TYPE_BYTES:
            n = rng.choice((0, 1, 4, 4 * self.vocab, 1024, rng.randint(0, 64)))
            return struct.pack(f"<{n // 4}f", *(rng.uniform(-3, 3) for _ in range(n // 4))) + bytes(n % 4)
        value = rng.choice(_INTS + (rng.randint(0, self.vocab - 1), rng.randint(-10, 600)))
        if t in (FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_FIXED32, FD.TYPE_FIXED64):
            value = abs(value)
        return value

    # -- shaped like a real request ----------------------------------------------------

    def plausible(self, desc: descriptor.Descriptor, depth: int = 0) -> Any:
        """A message shaped like a real one: each oneof gets one member (or, rarely, none),
        message fields are set more often than not near the top, scalars less often (unset
        is valid for most), and scalars come from the table by field name (`Plausible`),
        else small values. A top-level message may hold up to two wild values."""
        if depth == 0:
            self.wild = self.rng.choice((0, 0, 1, 1, 1, 2))
        msg = message_factory.GetMessageClass(desc)()
        rng = self.rng
        chosen: set[str] = set()
        wanted = self.table.wanted if self.table else frozenset()
        for oneof in desc.oneofs:
            if _synthetic(oneof):
                continue
            members = [f for f in oneof.fields if depth < 7 or f.type != FD.TYPE_MESSAGE or not f.message_type.fields]
            if members and not self._spend(0.05):  # (none: refused when the oneof is required)
                chosen.add(rng.choice(members).name)
        for field_ in desc.fields:
            oneof = field_.containing_oneof
            if oneof is not None and not _synthetic(oneof):
                if field_.name not in chosen:
                    continue
            elif field_.name in wanted or (field_.type == FD.TYPE_MESSAGE and depth == 0):
                if self._spend(0.05):
                    continue
            elif self.table and field_.name in self.table.rare:
                if rng.random() > 0.1:
                    continue
            elif rng.random() > ((0.9 if depth < 2 else 0.6) if field_.type == FD.TYPE_MESSAGE else 0.3):
                continue
            try:
                self._set_plausible(msg, field_, depth)
            except (ValueError, TypeError):
                pass
        self._fit(msg, desc)
        self._coherent_tensor(msg, desc)
        return msg

    def _fit(self, msg: Any, desc: descriptor.Descriptor) -> None:
        """Fields that name one thing fitted to each other, by their names: a `module`
        beside a `dictionary` is that dictionary's module (or unset), one beside `units` a
        unit-addressed module, a tensor beside a `module` of that module's shape; siblings
        in a repeated field get distinct `name`s. Mostly: the rest stays as drawn."""
        table, rng, names = self.table, self.rng, desc.fields_by_name
        if table is None:
            return
        if "module" in names and names["module"].type == FD.TYPE_STRING:
            if "dictionary" in names and rng.random() < 0.85:
                msg.module = table.module_of.get(msg.dictionary, "") if rng.random() < 0.6 else ""
            elif "units" in names and msg.HasField("units") and table.unit_modules and rng.random() < 0.85:
                msg.module = rng.choice(table.unit_modules)
            shape = table.shape_of.get(msg.module)
            for fd, value in msg.ListFields():
                if shape and fd.message_type is not None and {"shape", "data"} <= set(fd.message_type.fields_by_name):
                    if rng.random() < 0.7:
                        del value.shape[:]
                        value.shape.extend(shape[-1:] if rng.random() < 0.5 else shape)
                        self._coherent_tensor(value, fd.message_type)
        for fd, value in msg.ListFields():
            if fd.is_repeated and fd.message_type is not None and "name" in fd.message_type.fields_by_name:
                seen: set[str] = set()
                for item in value:
                    if item.name in seen and rng.random() < 0.9:
                        item.name = next((n for n in table.values.get("name", ()) if n and n not in seen),
                                         f"{item.name}-{len(seen)}")
                    seen.add(item.name)

    def _set_plausible(self, msg: Any, field_: FD, depth: int) -> None:
        rng = self.rng
        if _is_map(field_):
            target = getattr(msg, field_.name)
            key_f, value_f = field_.message_type.fields_by_name["key"], field_.message_type.fields_by_name["value"]
            for _ in range(rng.choice((1, 1, 2, 3))):
                # (a map's keys and values are those of the map's own name: logit_bias' token ids)
                target[self._plausible_scalar(key_f, field_.name)] = self._plausible_scalar(value_f)
            return
        if field_.is_repeated:
            items = getattr(msg, field_.name)
            whole = self.table.sequences.get(field_.name) if self.table else None
            if whole:
                items.extend(rng.choice(whole))
                return
            count = 0 if self._spend(0.03) else rng.choice((1, 1, 1, 2, 2, 3, 4) if depth < 3 else (1, 1, 2, 3))
            for _ in range(count):
                if field_.type == FD.TYPE_MESSAGE:
                    items.add().CopyFrom(self.plausible(field_.message_type, depth + 1))
                else:
                    items.append(self._plausible_scalar(field_))
            if field_.type != FD.TYPE_MESSAGE and not self._spend(0.1):  # (ids, layers: mostly distinct)
                distinct = list(dict.fromkeys(items))
                del items[:]
                items.extend(distinct)
            return
        if field_.type == FD.TYPE_MESSAGE:
            getattr(msg, field_.name).CopyFrom(self.plausible(field_.message_type, depth + 1))
        else:
            setattr(msg, field_.name, self._plausible_scalar(field_))

    def _plausible_scalar(self, field_: FD, name: str = "") -> Any:
        """A valid value for a field of this name; while the message's budget of wild
        values lasts (`self.wild`), now and then an edge instead."""
        rng = self.rng
        name = name or field_.name
        table = self.table
        if self._spend(0.12):
            edges = table.edges.get(name) if table else None
            return rng.choice(edges) if edges and rng.random() < 0.8 else self._scalar(field_)
        values = table.values.get(name) if table else None
        if values:
            return rng.choice(values)
        t = field_.type
        if t == FD.TYPE_BOOL:
            return rng.random() < 0.5
        if t == FD.TYPE_ENUM:
            numbers = [v.number for v in field_.enum_type.values]
            return rng.choice(numbers[1:] or numbers)  # (unspecified: as good as unset)
        if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            return rng.choice((0.0, 0.5, 1.0, -1.0, 2.0))
        if t == FD.TYPE_STRING:
            return rng.choice(PROMPTS)
        if t == FD.TYPE_BYTES:
            return bytes(rng.randint(0, 16))
        return rng.choice((0, 1, 2, 3))

    def _spend(self, chance: float) -> bool:
        """Whether to make one wild choice here (`chance`, while the budget lasts)."""
        if self.wild > 0 and self.rng.random() < chance:
            self.wild -= 1
            return True
        return False

    def _coherent_tensor(self, msg: Any, desc: descriptor.Descriptor) -> None:
        """A message with a dtype, a shape and data (a tensor) mostly gets data of its
        shape's size: float32 values of a plausible scale."""
        fields = desc.fields_by_name
        if not {"dtype", "shape", "data"} <= set(fields) or self.rng.random() < 0.15:
            return
        dtypes = fields["dtype"].enum_type
        if dtypes is not None and self.rng.random() < 0.85:
            msg.dtype = dtypes.values_by_name.get("DTYPE_FLOAT32", dtypes.values[0]).number
        count = math.prod(msg.shape) if all(0 <= s < 1 << 16 for s in msg.shape) else 0
        if count <= 1 << 16:
            msg.data = struct.pack(f"<{count}f", *(self.rng.uniform(-2, 2) for _ in range(count)))

    def stream(self, desc: descriptor.Descriptor) -> list[Any]:
        """The messages of a plausible client stream: the first sets its oneof's first
        member (a header), the later ones the other members (chunks); bytes fields named
        in the table's `files` carry consecutive slices of one plausible file."""
        rng = self.rng
        self.wild = rng.choice((0, 0, 1, 1, 2))
        oneof = next((o for o in desc.oneofs if not _synthetic(o)), None)
        if oneof is None:
            return [self.plausible(desc) for _ in range(rng.choice((0, 1, 2, 3)))]
        first, *later = oneof.fields
        data = rng.choice(self.table.files) if self.table and self.table.files else bytes(rng.randint(0, 64))
        cuts = sorted(rng.sample(range(1, len(data)), min(rng.choice((0, 1, 2, 5)), max(len(data) - 1, 0))))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        if rng.random() < 0.1:
            pieces = pieces[: rng.randrange(len(pieces) + 1)]  # cut short
        msgs = [self._with_member(desc, first)] if rng.random() < 0.95 else []
        for piece in pieces:
            member = rng.choice(later) if later else first
            msg = message_factory.GetMessageClass(desc)()
            if member.type == FD.TYPE_BYTES:
                setattr(msg, member.name, piece)
            else:
                msg = self._with_member(desc, member)
            msgs.append(msg)
        if rng.random() < 0.05:
            msgs.insert(rng.randrange(len(msgs) + 1), self._with_member(desc, first))  # a second header
        return msgs

    def _with_member(self, desc: descriptor.Descriptor, member: FD) -> Any:
        msg = message_factory.GetMessageClass(desc)()
        if member.type == FD.TYPE_MESSAGE:
            getattr(msg, member.name).CopyFrom(self.plausible(member.message_type, 1))
        else:
            setattr(msg, member.name, self._plausible_scalar(member))
        return msg

    def raw_body(self, valid: bytes) -> bytes:
        """Bytes that are not a valid message, or barely: corrupt, truncated, random, or
        nested past protobuf's recursion limit."""
        rng = self.rng
        kind = rng.randrange(4)
        if kind == 0 and valid:
            data = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            return bytes(data)
        if kind == 1 and valid:
            return valid[: rng.randrange(len(valid))]
        if kind == 2:
            return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return nested_conditions(rng.choice((90, 99, 101, 150, 400)))


def link_references(request: Any, rng: random.Random, share: float = 0.8) -> None:
    """Point messages that reference another part of the same request by the pair of
    fields `invoke` (an index into the request's `invokes`) and `name` (an intervention's
    name there) at one that exists, for `share` of them; half of those at a read made to
    match: the source turned into a module read of the referencing message's module
    (the enclosing message's `module`) at the same positions. Field names only: a message
    type that follows the same convention is linked too."""
    invokes = getattr(request, "invokes", None) if "invokes" in request.DESCRIPTOR.fields_by_name else None
    if invokes is None or len(invokes) < 2:
        return
    for i, invoke in enumerate(invokes):
        for holder, ref in _references(invoke, None):
            if rng.random() >= share:
                continue
            others = [j for j in range(len(invokes)) if j != i and len(invokes[j].interventions)]
            if not others:
                continue
            j = rng.choice(others)
            source = rng.choice(invokes[j].interventions)
            if not source.name:
                source.name = f"ref{j}"
            ref.invoke, ref.name = j, source.name
            module = getattr(holder, "module", "") if holder is not None else ""
            if module and rng.random() < 0.6 and "read_module" in source.DESCRIPTOR.fields_by_name:
                source.read_module.module = module
                if holder.HasField("positions"):
                    source.read_module.positions.CopyFrom(holder.positions)
                else:
                    source.read_module.ClearField("positions")
                source.read_module.ClearField("reduction")
                if rng.random() < 0.7:
                    del ref.positions[:]
                if rng.random() < 0.7:
                    source.ClearField("condition")


def plant_reference(request: Any, fuzz: RequestFuzzer, chance: float = 0.35) -> None:
    """With `chance`, in a request of several invokes, make one of an invoke's entries
    (its interventions) hold a reference (a message with `invoke` and `name`: the paths
    to one come from the descriptor, e.g. write_module.patch), so that link_references
    has one to point at a read of another invoke. The entry is kept simple around it
    (mostly no condition, every step, the new token, every unit): a reference is refused
    for any of those that its source does not match, which the random ones test."""
    rng = fuzz.rng
    invokes = getattr(request, "invokes", None) if "invokes" in request.DESCRIPTOR.fields_by_name else None
    if invokes is None or len(invokes) < 2 or rng.random() >= chance:
        return
    invoke = rng.choice(invokes)
    lists = [fd for fd in invoke.DESCRIPTOR.fields if fd.is_repeated and fd.message_type is not None
             and not _is_map(fd) and _reference_paths(fd.message_type)]
    if not lists:
        return
    entries = getattr(invoke, rng.choice(lists).name)
    entry = rng.choice(entries) if len(entries) and rng.random() < 0.7 else entries.add()
    path = rng.choice(_reference_paths(entry.DESCRIPTOR))
    holder = entry
    for name in path[:-1]:
        child = getattr(holder, name)
        child.CopyFrom(fuzz.plausible(child.DESCRIPTOR, 2))
        holder = child
    getattr(holder, path[-1]).SetInParent()  # (the oneof's member: the others are cleared)
    for msg, names in ((entry, ("condition", "steps")), (holder, ("positions", "units"))):
        for name in names:
            if name in msg.DESCRIPTOR.fields_by_name and rng.random() < 0.7:
                msg.ClearField(name)


def _reference_paths(desc: descriptor.Descriptor, depth: int = 0) -> list[tuple[str, ...]]:
    """Field paths from `desc` to a message with an int `invoke` and a string `name`."""
    if depth > 2:
        return []
    paths: list[tuple[str, ...]] = []
    for fd in desc.fields:
        if fd.message_type is None or fd.is_repeated:
            continue
        names = fd.message_type.fields_by_name
        if "invoke" in names and "name" in names:
            paths.append((fd.name,))
        else:
            paths += [(fd.name, *rest) for rest in _reference_paths(fd.message_type, depth + 1)]
    return paths


def _references(msg: Any, holder: Any) -> list[tuple[Any, Any]]:
    """(enclosing message, message) for each message under `msg` with an int `invoke` and
    a string `name`."""
    found = []
    for fd, value in msg.ListFields():
        if fd.type != FD.TYPE_MESSAGE or _is_map(fd):
            continue
        for item in value if fd.is_repeated else (value,):
            names = item.DESCRIPTOR.fields_by_name
            if "invoke" in names and "name" in names and names["name"].type == FD.TYPE_STRING:
                found.append((msg, item))
            found += _references(item, msg)
    return found


@dataclass
class Plausible:
    """Plausible values by field name, for the served model: `values` holds valid ones
    for scalars (and the elements of repeated scalars), `edges` the invalid ones next to
    them (out of range by one, negative, unknown names); `sequences` repeated fields
    drawn whole (shapes); `files` the chunks of an upload stream; `wanted` the fields set
    whenever their message is, `rare` those set now and then only."""

    values: dict[str, Sequence[Any]]
    edges: dict[str, Sequence[Any]] = field(default_factory=dict)
    sequences: dict[str, Sequence[Sequence[int]]] = field(default_factory=dict)
    files: Sequence[bytes] = ()
    # fields a real request sets whenever their message is there (unset is refused, or costly)
    wanted: frozenset[str] = frozenset()
    # fields set now and then only (most requests leave them unset: set, they need others)
    rare: frozenset[str] = frozenset()
    # what names name: a dictionary's module, the unit-addressed modules, a module's shape
    module_of: dict[str, str] = field(default_factory=dict)
    unit_modules: Sequence[str] = ()
    shape_of: dict[str, tuple[int, ...]] = field(default_factory=dict)


def plausible_values(info: Any, dictionaries: Sequence[Any], names: Sequence[str],
                     files: Sequence[bytes] = ()) -> Plausible:
    """The table for a server, from its GetModelInfo (`info`) and ListDictionaries
    (`dictionaries`); `names`: names the fuzzer may give to what it registers (its own
    prefix), which double as intervention names so that references find them."""
    layers, heads, vocab = info.num_layers, info.num_attention_heads, info.vocab_size
    width, hidden, head_dim = info.intermediate_size, info.hidden_size, info.head_dim
    sizes = sorted({d.size for d in dictionaries} | {3, 16})
    rng = random.Random(0)
    tokens = (0, 1, 2, 100, vocab - 1, *rng.sample(range(vocab), 6))
    shipped = [d.name for d in dictionaries]
    small = (0, 1, 2)
    nan, inf = float("nan"), float("inf")
    return Plausible(
        values={
            # prompts and texts
            "text": PROMPTS,
            "text_contains": (" is", "a", " the", ","),
            "text_matches": (" i[a-z]", "^The", "[a-z]+ ", "s$"),
            "model": (info.model, ""),
            "description": ("", "a probe"),
            "labels": ("x", "next token"),
            "stop": (1, 2, 3, 4),  # (StepRange / PositionRange.stop; SamplingParams.stop is a string)
            "bad_words": (" the", "xyzzy"),
            # addresses
            "module": tuple(m.path for m in info.modules) + tuple(f"layers.{i}" for i in range(layers)),
            "dictionary": (*shipped, *shipped, *names),
            "name": (*names, *shipped, "r"),
            "invoke": (0, 1, 2),
            "layers": tuple(range(-layers, layers)),
            "heads": tuple(range(heads)),
            "ids": (0, 1, 2, 3),  # (attention heads, neurons and prompt token ids alike)
            "features": small, "feature": small,
            "positions": (0, 1, 2, -1, -2),
            "start": (0, 0, 1, 2, -2),
            "steps": (0, 0, 1, 2, 3),
            # sizes and ids
            "k": (1, 2, 3, 5), "top_k": (0, 1, 2, 5), "sae_top_k": (1, 4),
            "token_id": tokens, "token_ids": tokens, "stop_token_ids": tokens, "allowed_token_ids": tokens,
            "logit_bias": tokens, "bias": tokens,
            "max_tokens": (1, 2, 2, 3, 4), "n": (1, 1, 1, 1, 2), "min_tokens": (0, 0, 1),
            "logprobs": (0, 1, 5), "prompt_logprobs": (0, 1),
            "max_read_bytes": (0, 0, 1 << 20, 1 << 40),
            "stream_interval_ms": (0, 0, 10),
            # numbers
            "temperature": (0.0, 0.0, 0.0, 1.0, 0.7), "top_p": (1.0, 0.9), "min_p": (0.0, 0.1),
            "presence_penalty": (0.0, 0.5), "frequency_penalty": (0.0, 0.5), "repetition_penalty": (1.0, 1.1),
            "value": (0.0, 0.5, 1.0, -1.0, 0.9, 3.0),
            "steer": (1.0, -4.0, 0.5, 8.0), "clamp": (0.0, 1.0, 5.0), "scale": (1.0, -1.0, 0.5, 2.0),
            "seed": (0, 1, 42),
        },
        edges={
            "text": ("", "x" * 2000, "\x00"),
            "text_contains": ("", "x" * 1025), "text_matches": ("(", "(a)\\1", "a{1000}", "x" * 1025),
            "model": ("not-the-model",), "labels": ("y" * 300,), "description": ("z" * 1025,),
            "stop": (0, -1, 100), "start": (-1, 5, 100),
            "module": ("layers.99", "layers.-1", f"layers.{layers}", "layers.0.self_attn.nope", "lm_head", ""),
            "dictionary": ("no-such-dictionary", ""), "name": ("", "bad name!", "n" * 65),
            "invoke": (-1, 3, 2**31 - 1),
            "layers": (layers, -layers - 1, 2**31 - 1), "heads": (heads, -1),
            "ids": (-1, heads, width - 1, width, vocab - 1, vocab),
            "features": tuple(s for size in sizes for s in (size - 1, size)) + (-1,),
            "feature": tuple(s for size in sizes for s in (size - 1, size)) + (-1,),
            "positions": (100, -100, 2**31 - 1), "steps": (-1, 100),
            "k": (0, -1, width, width + 1, vocab, vocab + 1, *sizes), "top_k": (-1, width + 1, vocab, vocab + 1),
            "sae_top_k": (0, 16, 17, -1),
            "token_id": (vocab, -1), "token_ids": (vocab, -1), "stop_token_ids": (vocab, -1),
            "allowed_token_ids": (vocab, -1), "logit_bias": (vocab, -1), "bias": (vocab, -1),
            "max_tokens": (0, -1, 2**31 - 1), "n": (0, -1, 33, 300), "min_tokens": (-1, 100),
            "logprobs": (-2, -1, 10**6), "prompt_logprobs": (-2, -1, 10**6),
            "max_read_bytes": (1, -1), "stream_interval_ms": (1001, 5000),
            "temperature": (-1.0, nan, inf), "top_p": (0.0, 1.5, nan), "min_p": (-0.5, 1.5),
            "repetition_penalty": (0.0, -1.0), "value": (nan, inf),
            "steer": (nan, inf), "clamp": (nan, -inf), "scale": (inf, nan, 0.0), "seed": (-1, 2**63 - 1),
        },
        sequences={"shape": ((hidden,), (hidden,), (vocab,), (vocab,), (head_dim,), (2, head_dim), (heads, head_dim),
                             (width,), (1,), (2,), (3,), (), (0,), (-1,), (hidden, 2))},
        files=tuple(files),
        module_of={d.name: d.spec.module for d in dictionaries},
        unit_modules=tuple(m.path for m in info.modules if m.kind in ("attention_heads", "mlp_activation")),
        shape_of={m.path: tuple(m.shape) for m in info.modules},
        wanted=frozenset(("prompt", "prompts", "name", "module", "dictionary", "layers", "features", "feature",
                          "text", "invoke", "k", "token_id", "token_ids", "ids", "positions", "steps",
                          "max_tokens", "kind", "threshold", "comparison", "shape", "data", "dtype", "header",
                          "spec")),
        rare=frozenset(("probe_activation", "sae_activation", "sae_top_k", "labels", "reduction",
                        "model", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "stop")),
    )


def _is_map(field_: FD) -> bool:
    return field_.message_type is not None and field_.message_type.GetOptions().map_entry


def _synthetic(oneof: descriptor.OneofDescriptor) -> bool:
    """proto3 `optional` fields sit in a oneof of their own, named _<field>."""
    return len(oneof.fields) == 1 and oneof.name == f"_{oneof.fields[0].name}"


def _length_delimited(field_number: int, payload: bytes) -> bytes:
    return _varint(field_number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def nested_conditions(depth: int) -> bytes:
    """A TraceRequest whose first intervention's condition is `not` nested `depth` deep,
    encoded by hand (the protobuf library refuses to build one that deep)."""
    from tracewire.v1 import intervention_pb2

    not_field = intervention_pb2.Condition.DESCRIPTOR.fields_by_name["not"].number
    condition = _length_delimited(intervention_pb2.Condition.DESCRIPTOR.fields_by_name["text_contains"].number, b"x")
    for _ in range(depth):
        condition = _length_delimited(not_field, condition)
    intervention = _length_delimited(
        intervention_pb2.Intervention.DESCRIPTOR.fields_by_name["condition"].number, condition)
    intervention += _length_delimited(intervention_pb2.Intervention.DESCRIPTOR.fields_by_name["stop"].number, b"")
    number = _field_numbers()
    invoke = _length_delimited(number["Invoke.prompt"], _length_delimited(number["Prompt.text"], b"a"))
    invoke += _length_delimited(number["Invoke.interventions"], intervention)
    return _length_delimited(number["TraceRequest.invokes"], invoke)


def _field_numbers() -> dict[str, int]:
    from tracewire.v1 import prompt_pb2, service_pb2, trace_pb2

    return {f"{m.DESCRIPTOR.name}.{f}": m.DESCRIPTOR.fields_by_name[f].number for m, f in (
        (trace_pb2.Invoke, "prompt"), (trace_pb2.Invoke, "interventions"),
        (prompt_pb2.Prompt, "text"), (service_pb2.TraceRequest, "invokes"))}
