"""The operator's dictionaries: `--dictionaries DIR`, NAME.json (a DictionarySpec in
protobuf's JSON form) beside NAME.safetensors for each.

Read in two passes so a mistake costs as little as possible: `read_directory` when the
flags are parsed (the files pair up, specs parse, names are valid, the safetensors
headers are well formed, every value is finite), before any engine starts; and
`check_against_model` once the engine describes the model (the module exists with the
hidden size, the tensors' shapes fit). Either refuses to start with one line naming the
file and the field (`DirectoryError`, a SystemExit).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format
from tracewire.v1 import dictionary_pb2

from ..shared.dictionary_spec import DictionaryError, DictionaryInfo, check_spec, check_tensors
from .dictionary_file import Tensors, check_finite, read_tensors
from .dictionary_messages import info_from_spec

FLAG = "--dictionaries"


class DirectoryError(SystemExit):
    def __init__(self, path: Path, field: str, message: str) -> None:
        super().__init__(f"tracewire: {FLAG} {path}: {field + ': ' if field else ''}{message}")


@dataclass(frozen=True)
class OperatorDictionary:
    info: DictionaryInfo  # from its spec: sizes not yet known
    spec_path: Path
    weights: Path
    tensors: Tensors


def read_directory(directory: Path) -> tuple[OperatorDictionary, ...]:
    if not directory.is_dir():
        raise DirectoryError(directory, "", "not a directory")
    specs = {p.stem: p for p in directory.glob("*.json")}
    weights = {p.stem: p for p in directory.glob("*.safetensors")}
    for stem in sorted(weights.keys() - specs.keys()):
        raise DirectoryError(weights[stem], "", f"has no spec: write {stem}.json beside it (a DictionarySpec)")
    return tuple(_read_one(specs[stem], weights.get(stem)) for stem in sorted(specs))


def _read_one(spec_path: Path, weights: Path | None) -> OperatorDictionary:
    if weights is None:
        raise DirectoryError(spec_path, "", f"has no weights: {spec_path.stem}.safetensors is missing")
    spec = dictionary_pb2.DictionarySpec()
    try:
        json_format.Parse(spec_path.read_text(), spec)
    except (json_format.ParseError, UnicodeDecodeError) as e:
        reason = " ".join(str(e).split())  # (protobuf's message spans lines)
        raise DirectoryError(spec_path, "", f"not a DictionarySpec in protobuf JSON: {reason}") from None
    try:
        info = info_from_spec(spec_path.stem, spec)
    except DictionaryError as e:
        raise DirectoryError(spec_path, e.field, e.message) from None
    try:
        tensors = read_tensors(weights)
        check_finite(weights)
    except DictionaryError as e:
        raise DirectoryError(weights, e.field, e.message) from None
    return OperatorDictionary(info, spec_path, weights, tensors)


def check_against_model(d: OperatorDictionary, modules: dict[str, int], hidden_size: int) -> DictionaryInfo:
    """The dictionary's info completed from its file, or DirectoryError naming the spec's
    field (in NAME.json) or the tensor (in NAME.safetensors)."""
    try:
        check_spec(d.info, modules, hidden_size)
    except DictionaryError as e:
        raise DirectoryError(d.spec_path, e.field, e.message) from None
    try:
        return check_tensors(d.info, d.tensors, hidden_size)
    except DictionaryError as e:
        raise DirectoryError(d.spec_path if e.field.startswith("spec.") else d.weights, e.field, e.message) from None
