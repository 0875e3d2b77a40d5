"""One dtype vocabulary on every side of the wire.

The server (tracewire_server's tensors module), the Python SDK (tracewire.tensors) and the
TypeScript client (clients/ts/src/tensors.ts) each keep one table of tracewire.v1.Dtype:
the name the server gives a dtype, its enum value and its bytes per element. They must
agree with each other and with the proto, and on the dtype tensors are sent in by default
(the server reads write vectors as float32). The TypeScript table is read by compiling
tensors.ts (and what it imports) into a temporary directory and importing it with node:
no dependence on whether, or how recently, clients/ts/dist was built.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from tracewire import tensors as sdk
from tracewire.v1 import tensor_pb2

TS = Path(__file__).resolve().parent.parent / "clients" / "ts"
TSC = TS / "node_modules" / "typescript" / "bin" / "tsc"

Table = dict[int, tuple[str, int]]  # enum value -> (name, bytes per element)


def _server_tensors() -> ModuleType:
    """The server's tensors module: its dtype tables are _NUMPY and _DTYPES."""
    return importlib.import_module("tracewire_server.frontend.tensors")


def _proto_values() -> set[int]:
    return {value for value in tensor_pb2.Dtype.values() if value != tensor_pb2.DTYPE_UNSPECIFIED}


def _server_table(server: ModuleType) -> Table:
    names: dict[str, int] = server._DTYPES
    numpy: dict[int, np.dtype[Any]] = server._NUMPY
    assert sorted(names.values()) == sorted(numpy), "the server's name and numpy tables cover different dtypes"
    return {value: (name, numpy[value].itemsize) for name, value in names.items()}


def _sdk_table() -> Table:
    return {value: (d.name, d.itemsize) for value, d in sdk.DTYPES.items()}


_TS_DUMP = """
const m = await import(process.argv[1]);
const dtypes = Object.entries(m.DTYPES).map(([value, d]) => [Number(value), d.name, d.itemSize]);
const generated = Object.entries(m.Dtype).filter(([, v]) => typeof v === "number");
console.log(JSON.stringify({ dtypes, default: m.DEFAULT_DTYPE, generated }));
"""


@pytest.fixture(scope="module")
def ts_tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    node = shutil.which("node")
    if node is None or not TSC.exists():
        pytest.skip("the TypeScript client's toolchain is not installed (node, clients/ts/node_modules)")
    out = tmp_path_factory.mktemp("ts-tensors")
    # The compiled module imports @bufbuild/protobuf etc.: resolvable from out/ through this link.
    (out / "node_modules").symlink_to(TS / "node_modules", target_is_directory=True)
    (out / "package.json").write_text('{"type": "module"}')
    compiled = subprocess.run(
        [node, str(TSC), str(TS / "src" / "tensors.ts"), "--outDir", str(out), "--rootDir", str(TS),
         "--module", "NodeNext", "--moduleResolution", "NodeNext", "--target", "ES2022",
         "--lib", "ES2022,DOM", "--types", "node", "--strict", "--skipLibCheck"],
        capture_output=True, text=True, timeout=300, cwd=TS,
    )
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    dumped = subprocess.run(
        [node, "--input-type=module", "-e", _TS_DUMP, (out / "src" / "tensors.js").as_uri()],
        capture_output=True, text=True, timeout=60,
    )
    assert dumped.returncode == 0, dumped.stderr
    return dict(json.loads(dumped.stdout))


def test_server_and_sdk_tables_agree_with_the_proto() -> None:
    server = _server_tensors()
    assert set(_sdk_table()) == _proto_values()
    assert _server_table(server) == _sdk_table()
    for value, d in sdk.DTYPES.items():  # the same bytes read the same way
        assert server._NUMPY[value] == d.numpy, d.name


def test_typescript_table_agrees(ts_tables: dict[str, Any]) -> None:
    ts: Table = {value: (name, size) for value, name, size in ts_tables["dtypes"]}
    assert ts == _sdk_table() == _server_table(_server_tensors())
    generated = {f"DTYPE_{name}": value for name, value in ts_tables["generated"]}
    assert generated == dict(tensor_pb2.Dtype.items()), "clients/ts/src/gen is not generated from this proto"


def test_one_default_dtype(ts_tables: dict[str, Any]) -> None:
    assert ts_tables["default"] == sdk.DEFAULT_DTYPE.value
    # The server has no default of its own: it reads every write vector as float32.
    server = _server_tensors()
    sent = sdk.from_numpy([1.0, 2.0])
    assert sent.dtype == sdk.DEFAULT_DTYPE.value
    assert server.float_vector(sent, 2, "vector").dtype == sdk.DEFAULT_DTYPE.numpy
