"""The docs site's generated API reference (docs/hooks/contract_reference.py, which reads
proto/ through protoc for the comments) covers the contract as the server and the SDKs see it:
every RPC, message, field and enum value of the committed tracewire.v1 modules has its entry.
(`make docs` builds the whole site, links checked; this is the part a missing entry would not
break.)"""

from __future__ import annotations

import importlib
import sys

from conftest import ROOT
from google.protobuf import descriptor

sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import contract_reference  # noqa: E402

MODULES = [p.stem for p in (ROOT / "contract" / "python" / "src" / "tracewire" / "v1").glob("*_pb2.py")]


def _messages(messages) -> list[descriptor.Descriptor]:
    """The messages and every message nested in them, map entries left out (a map field's
    type is written as map<K, V>, not as a message of its own)."""
    found = []
    for message in messages:
        if not message.GetOptions().map_entry:
            found += [message, *_messages(message.nested_types)]
    return found


def test_every_rpc_message_field_and_enum_value_has_its_entry():
    text = contract_reference.render(contract_reference.descriptor_set())
    files = [importlib.import_module(f"tracewire.v1.{name}").DESCRIPTOR for name in MODULES]
    assert len(files) >= 8
    for file in files:
        for service in file.services_by_name.values():
            for method in service.methods:
                assert f"| `{method.name}` |" in text, method.full_name
        enums = list(file.enum_types_by_name.values())
        for message in _messages(file.message_types_by_name.values()):
            name = message.full_name.removeprefix("tracewire.v1.")
            section = text.split(f"`{name}` {{ #{contract_reference.anchor(name)} }}", 1)
            assert len(section) == 2, message.full_name
            entry = section[1].split("\n#### ", 1)[0]
            for field in message.fields:
                assert f"| `{field.name}` | {field.number} |" in entry, field.full_name
            enums += message.enum_types
        for enum in enums:
            name = enum.full_name.removeprefix("tracewire.v1.")
            entry = text.split(f"enum `{name}` {{ #{contract_reference.anchor(name)} }}", 1)[1].split("\n#### ", 1)[0]
            for value in enum.values:
                assert f"| `{value.name}` | {value.number} |" in entry, value.full_name
