"""mkdocs hook: the contract's reference (every RPC, message, field and enum of
proto/tracewire/v1, with the proto's own comments) generated into the page that holds the
marker, so the reference is never out of step with the contract.

The committed Python code (contract/python) is compiled without source info, so it has
no comments: the descriptors come from grpcio-tools' protoc run on proto/ with
--include_source_info, the same compiler `make proto` uses.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

from google.protobuf import descriptor_pb2
from markdown_table import cell, table

MARKER = "<!-- generated: contract reference -->"
ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
PACKAGE = "tracewire.v1"

FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    FDP.TYPE_DOUBLE: "double", FDP.TYPE_FLOAT: "float", FDP.TYPE_INT64: "int64",
    FDP.TYPE_UINT64: "uint64", FDP.TYPE_INT32: "int32", FDP.TYPE_FIXED64: "fixed64",
    FDP.TYPE_FIXED32: "fixed32", FDP.TYPE_BOOL: "bool", FDP.TYPE_STRING: "string",
    FDP.TYPE_BYTES: "bytes", FDP.TYPE_UINT32: "uint32", FDP.TYPE_SFIXED32: "sfixed32",
    FDP.TYPE_SFIXED64: "sfixed64", FDP.TYPE_SINT32: "sint32", FDP.TYPE_SINT64: "sint64",
}
# FileDescriptorProto / DescriptorProto field numbers, as SourceCodeInfo paths use them.
_MESSAGE, _ENUM, _SERVICE = 4, 5, 6
_FIELD, _NESTED, _NESTED_ENUM, _ONEOF = 2, 3, 4, 8
_VALUE, _METHOD = 2, 2


def on_page_markdown(markdown: str, **_: object) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render(descriptor_set()))


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    files = sorted(str(p.relative_to(PROTO)) for p in (PROTO / "tracewire" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "contract.binpb"
        include = resources.files("grpc_tools") / "_proto"
        # protoc in a child process: grpc_tools.protoc.main keeps state between calls.
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"-I{include}",
                        "--include_source_info", f"--descriptor_set_out={out}", *files],
                       check=True, cwd=ROOT)
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def anchor(full_name: str) -> str:
    """The page anchor of a message or enum named relative to the package: TraceRequest,
    ReadModule.Units -> readmodule-units."""
    return full_name.removeprefix(f".{PACKAGE}.").lower().replace(".", "-")


class _Comments:
    def __init__(self, file: descriptor_pb2.FileDescriptorProto) -> None:
        self._by_path = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}

    def __call__(self, *path: int) -> str:
        return self._by_path.get(path, "").strip()


def render(fds: descriptor_pb2.FileDescriptorSet) -> str:
    files = [f for f in fds.file if f.package == PACKAGE]
    maps = {f".{PACKAGE}.{name}": entry for f in files for name, entry in _map_entries(f)}
    out: list[str] = []
    for file in files:
        comments = _Comments(file)
        for s, service in enumerate(file.service):
            out.append(f"## Service `{service.name}` {{ #{service.name.lower()} }}\n")
            out.append(f"{PACKAGE}.{service.name}, in `{file.name}`. {cell(comments(_SERVICE, s))}\n")
            rows = []
            for m, method in enumerate(service.method):
                request = ("stream " if method.client_streaming else "") + _link(method.input_type)
                response = ("stream " if method.server_streaming else "") + _link(method.output_type)
                rows.append([f"`{method.name}`", request, response, cell(comments(_SERVICE, s, _METHOD, m))])
            out.append(table(["RPC", "request", "response", "what"], rows))
    out.append("## Messages and enums\n")
    for file in files:
        comments = _Comments(file)
        out.append(f"### `{file.name}`\n")
        for i, message in enumerate(file.message_type):
            _message(out, comments, message, message.name, (_MESSAGE, i), maps)
        for i, enum in enumerate(file.enum_type):
            _enum(out, comments, enum, enum.name, (_ENUM, i))
    return "\n".join(out)


def _map_entries(file: descriptor_pb2.FileDescriptorProto):
    def walk(message: descriptor_pb2.DescriptorProto, prefix: str):
        for nested in message.nested_type:
            name = f"{prefix}.{nested.name}"
            if nested.options.map_entry:
                yield name, nested
            else:
                yield from walk(nested, name)
    for message in file.message_type:
        yield from walk(message, message.name)


def _message(out: list[str], comments: _Comments, message: descriptor_pb2.DescriptorProto, name: str,
             path: tuple[int, ...], maps: dict[str, descriptor_pb2.DescriptorProto]) -> None:
    if message.options.map_entry:
        return
    out.append(f"#### `{name}` {{ #{anchor(name)} }}\n")
    if text := comments(*path):
        out.append(cell(text) + "\n")
    # proto3 `optional` fields sit in a synthetic oneof of their own: not a real choice.
    real_oneofs = {i for i, f in enumerate(message.field)
                   if f.HasField("oneof_index") and not f.proto3_optional}
    rows = []
    for f, field in enumerate(message.field):
        oneof = message.oneof_decl[field.oneof_index].name if f in real_oneofs else ""
        rows.append([f"`{field.name}`", str(field.number), _type(field, maps),
                     f"`{oneof}`" if oneof else "", cell(comments(*path, _FIELD, f))])
    if rows:
        out.append(table(["field", "number", "type", "oneof", "what"], rows))
    else:
        out.append("No fields.\n")
    for n, nested in enumerate(message.nested_type):
        _message(out, comments, nested, f"{name}.{nested.name}", (*path, _NESTED, n), maps)
    for n, enum in enumerate(message.enum_type):
        _enum(out, comments, enum, f"{name}.{enum.name}", (*path, _NESTED_ENUM, n))


def _enum(out: list[str], comments: _Comments, enum: descriptor_pb2.EnumDescriptorProto, name: str,
          path: tuple[int, ...]) -> None:
    out.append(f"#### enum `{name}` {{ #{anchor(name)} }}\n")
    if text := comments(*path):
        out.append(cell(text) + "\n")
    rows = [[f"`{value.name}`", str(value.number), cell(comments(*path, _VALUE, v))]
            for v, value in enumerate(enum.value)]
    out.append(table(["value", "number", "what"], rows))


def _type(field: descriptor_pb2.FieldDescriptorProto, maps: dict[str, descriptor_pb2.DescriptorProto]) -> str:
    if field.type_name in maps:
        key, value = maps[field.type_name].field
        return f"map&lt;{_type(key, maps)}, {_type(value, maps)}&gt;"
    base = _SCALARS.get(field.type) or _link(field.type_name)
    if field.label == FDP.LABEL_REPEATED:
        return f"repeated {base}"
    if field.proto3_optional:
        return f"optional {base}"
    return base


def _link(type_name: str) -> str:
    if type_name.startswith(f".{PACKAGE}."):
        short = type_name.removeprefix(f".{PACKAGE}.")
        return f"[`{short}`](#{anchor(short)})"
    return f"`{type_name.lstrip('.')}`"
