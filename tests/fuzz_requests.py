"""Random requests for the fuzz test, generated from the message descriptors.

Every field of a request message may be set, to values that stress validation: edges of
the vocabulary and of int32, NaN and infinities, empty and odd strings, unknown enum
values, nested messages, repeated fields of a few or a few dozen entries. Generation is
seeded (random.Random), so a seed reproduces a run exactly. Values that would make a
*valid* request expensive (max_tokens, n) are drawn from small or plainly invalid values:
the fuzz test checks statuses, not throughput.
"""

from __future__ import annotations

import random
import struct
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


class RequestFuzzer:
    def __init__(self, seed: int, vocab_size: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab_size

    def message(self, desc: descriptor.Descriptor, depth: int = 0) -> Any:
        msg = message_factory.GetMessageClass(desc)()
        for field in desc.fields:
            if self.rng.random() > (0.5 if depth < 4 else 0.15):
                continue
            try:
                self._set(msg, field, depth)
            except (ValueError, TypeError):
                pass  # a value this field's type refuses on the client side: skip it
        return msg

    def _set(self, msg: Any, field: FD, depth: int) -> None:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            target = getattr(msg, field.name)
            key_f, value_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            for _ in range(self._count()):
                target[self._scalar(key_f)] = self._scalar(value_f)
            return
        if field.is_repeated:
            items = getattr(msg, field.name)
            for _ in range(self._count()):
                if field.type == FD.TYPE_MESSAGE:
                    items.add().CopyFrom(self.message(field.message_type, depth + 1))
                else:
                    items.append(self._scalar(field))
            return
        if field.type == FD.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(self.message(field.message_type, depth + 1))
        else:
            setattr(msg, field.name, self._scalar(field))

    def _count(self) -> int:
        return self.rng.choice((0, 1, 1, 2, 3, self.rng.randint(0, 40)))

    def _scalar(self, field: FD) -> Any:
        rng = self.rng
        if field.name in _CHEAP:
            return rng.choice(_CHEAP[field.name])
        t = field.type
        if t == FD.TYPE_BOOL:
            return rng.random() < 0.5
        if t == FD.TYPE_ENUM:
            values = [v.number for v in field.enum_type.values]
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
