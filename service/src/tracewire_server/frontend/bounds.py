"""Size bounds on a request, checked before any work is done on it.

The gRPC layer caps a request's bytes (--max-request-bytes); inside that, one field can
still ask for work out of proportion to any real use (100k stop strings, a 5M-entry step
list, conditions nested 90 deep). Every repeated field, map and string of a request is
checked here against a bound, and every enum for a value the proto defines (protobuf keeps
unknown values, which would otherwise read as some default), walking the message by its
descriptors (so a field added to the proto is covered without a word here), with
INVALID_ARGUMENT naming the field. The
walk only takes lengths of scalar lists: its cost is the number of messages in the request,
which the bounds themselves keep small.

Bounds that depend on the model (token lists: its context; token sets: its vocabulary)
come from ModelLimits; the rest are fixed, generous for any real request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor

from ..shared.limits import ModelLimits
from .errors import InvalidArgument

DEFAULT_ITEMS = 1024  # a repeated field or map not named below
DEFAULT_CHARS = 1024  # a string not named below (names, module paths, stop strings, ...)
MAX_DEPTH = 32  # messages nested in messages (conditions in conditions)
MAX_STOP_STRINGS = 64
MAX_DETOKENIZE_IDS = 1 << 20

# Bounded by the model: field full name -> what bounds it.
_CONTEXT = "context"  # the model's max_model_len (token ids of one sequence, steps, positions)
_VOCAB = "vocab"  # the vocabulary size (sets and maps of token ids)
_LAYERS = "layers"
_MODEL_ITEMS = {
    "tracewire.v1.TokenIds.ids": _CONTEXT,
    "tracewire.v1.StepList.steps": _CONTEXT,
    "tracewire.v1.PositionList.positions": _CONTEXT,
    "tracewire.v1.TokenSet.token_ids": _VOCAB,
    "tracewire.v1.TokenBias.bias": _VOCAB,
    "tracewire.v1.SamplingParams.logit_bias": _VOCAB,
    "tracewire.v1.SamplingParams.allowed_token_ids": _VOCAB,
    "tracewire.v1.SamplingParams.stop_token_ids": _VOCAB,
    "tracewire.v1.ReadLogitLens.layers": _LAYERS,
    "tracewire.v1.ReadAttentionPattern.layers": _LAYERS,
}
_FIXED_ITEMS = {
    "tracewire.v1.SamplingParams.stop": MAX_STOP_STRINGS,
    "tracewire.v1.SamplingParams.bad_words": MAX_STOP_STRINGS,
    "tracewire.v1.DetokenizeRequest.token_ids": MAX_DETOKENIZE_IDS,
    "tracewire.v1.Tensor.shape": 8,  # tensors.py says why
}
# Strings bounded by the request's byte cap alone: prompt text is tokenized (off the
# event loop) and its token count checked against the model's context afterwards.
_UNBOUNDED_CHARS = frozenset({"tracewire.v1.Prompt.text", "tracewire.v1.TokenizeRequest.text"})


@dataclass(frozen=True)
class RequestBounds:
    context: int
    vocab: int
    layers: int

    @classmethod
    def of(cls, limits: ModelLimits) -> RequestBounds:
        return cls(limits.max_model_len, limits.vocab_size, max(1, limits.num_layers))

    def items(self, field: descriptor.FieldDescriptor) -> int:
        kind = _MODEL_ITEMS.get(field.full_name)
        if kind is not None:
            return int(getattr(self, kind))
        return _FIXED_ITEMS.get(field.full_name, DEFAULT_ITEMS)

    def check(self, message: Any) -> None:
        """INVALID_ARGUMENT naming the first field over its bound."""
        self._check(message, "", 0)

    def _check(self, message: Any, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise InvalidArgument(path, f"messages nested more than {MAX_DEPTH} deep")
        for field, value in message.ListFields():  # only the fields set: cheap
            name = f"{path}.{field.name}" if path else field.name
            if field.is_repeated:
                self._check_items(field, value, name, depth)
            elif field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
                self._check(value, name, depth + 1)
            elif field.type == descriptor.FieldDescriptor.TYPE_STRING:
                self._check_chars(field, value, name)
            elif field.type == descriptor.FieldDescriptor.TYPE_ENUM:
                _check_enum(field, value, name)

    def _check_items(self, field: descriptor.FieldDescriptor, value: Any, name: str, depth: int) -> None:
        bound = self.items(field)
        if len(value) > bound:
            raise InvalidArgument(name, f"{len(value)} entries; at most {bound}")
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            return  # maps in requests hold scalars
        if field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
            for i, item in enumerate(value):
                self._check(item, f"{name}[{i}]", depth + 1)
        elif field.type == descriptor.FieldDescriptor.TYPE_STRING:
            for i, item in enumerate(value):
                self._check_chars(field, item, f"{name}[{i}]")

    @staticmethod
    def _check_chars(field: descriptor.FieldDescriptor, value: str, name: str) -> None:
        if len(value) > DEFAULT_CHARS and field.full_name not in _UNBOUNDED_CHARS:
            raise InvalidArgument(name, f"{len(value)} characters; at most {DEFAULT_CHARS}")


def _check_enum(field: descriptor.FieldDescriptor, value: int, name: str) -> None:
    if value not in field.enum_type.values_by_number:
        known = ", ".join(v.name for v in field.enum_type.values)
        raise InvalidArgument(name, f"unknown {field.enum_type.name} value {value}; one of {known}")
