"""buf's plugin for tracewire.v1's Python code: _pb2.py, _pb2.pyi and _pb2_grpc.py.

buf.gen.yaml (the repository root) runs it as a local plugin, with the venv's python3 first
on PATH. It hands the files buf compiled to the protoc inside grpcio-tools, pinned in the
root pyproject.toml's dev extras: the compiler the committed code has always come from, and
the only one here that holds the grpc_python generator (buf's protoc_builtin can run python
and pyi, not grpc_python, and there is no protoc binary to point it at).

Its output is byte for byte what `python -m grpc_tools.protoc -I proto --python_out ...`
writes from the .proto sources, with one step to get there: buf fills in every field's
json_name, while protoc compiling sources leaves the ones the .proto does not set empty, and
the _pb2 modules embed the serialized descriptor. The defaults are dropped again here (an
explicit json_name that spells the default goes too: the same name either way).

The package is wholly generated (buf's `clean` removes the directory first), so the plugin
also writes its __init__.py and the PEP 561 marker py.typed.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from grpc_tools import protoc

GENERATORS = ("python", "pyi", "grpc_python")


def default_json_name(field_name: str) -> str:
    """protoc's lowerCamelCase of a field name (ToJsonName): "token_ids" -> "tokenIds"."""
    head, *rest = field_name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def drop_default_json_names(fields: Iterable[descriptor_pb2.FieldDescriptorProto]) -> None:
    for field in fields:
        if field.json_name == default_json_name(field.name):
            field.ClearField("json_name")


def every_field(messages: Iterable[descriptor_pb2.DescriptorProto]) -> Iterator[descriptor_pb2.FieldDescriptorProto]:
    for message in messages:
        yield from message.field
        yield from message.extension
        yield from every_field(message.nested_type)


def as_protoc_reads_sources(request: plugin_pb2.CodeGeneratorRequest) -> descriptor_pb2.FileDescriptorSet:
    """The request's files as protoc holds them after compiling the sources: the files to
    generate with their source-retention options (the generator strips those itself), no
    json_name that the sources do not set."""
    with_source_options = {f.name: f for f in request.source_file_descriptors}
    files = descriptor_pb2.FileDescriptorSet()
    for proto in request.proto_file:
        file = files.file.add()
        file.CopyFrom(with_source_options.get(proto.name, proto))
        drop_default_json_names([*every_field(file.message_type), *file.extension])
    return files


def generate(request: plugin_pb2.CodeGeneratorRequest) -> plugin_pb2.CodeGeneratorResponse:
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL,
    )
    with tempfile.TemporaryDirectory() as tmp:
        descriptors, out = Path(tmp, "descriptors.binpb"), Path(tmp, "out")
        descriptors.write_bytes(as_protoc_reads_sources(request).SerializeToString())
        out.mkdir()
        status = protoc.main([
            "grpc_tools.protoc",
            f"--descriptor_set_in={descriptors}",
            *(f"--{generator}_out={out}" for generator in GENERATORS),
            *request.file_to_generate,
        ])
        if status != 0:
            response.error = f"grpc_tools.protoc exited with status {status} (its message is above)"
            return response
        files = {p.relative_to(out).as_posix(): p.read_text(encoding="utf-8")
                 for p in sorted(out.rglob("*")) if p.is_file()}
    for package in sorted({name.rpartition("/")[0] for name in files}):
        files.setdefault(f"{package}/__init__.py", "")
        files.setdefault(f"{package}/py.typed", "")
    for name, content in files.items():
        response.file.add(name=name, content=content)
    return response


def main() -> None:
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    sys.stdout.buffer.write(generate(request).SerializeToString())


if __name__ == "__main__":
    main()
