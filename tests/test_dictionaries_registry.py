"""The dictionary registry: the operator's dictionaries (--dictionaries, the shared server
serves the ones shipped with tracewire-tiny), uploads through the SDK (register, list,
replace, delete), and bad uploads, each refused naming its field while the engine and a
concurrent generation carry on. Sizes are checked against the shipped files as the
safetensors library reads them, not against the server's own arithmetic."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tracewire
from conftest import DICTIONARIES, MODEL, SHARED_MAX_DICTIONARY_BYTES, take
from safetensors.numpy import load_file
from server_pool import Prepared, ServerSpec, servers
from test_startup import last_line, start_forked
from tracewire.dictionaries import safetensors_bytes
from tracewire.v1 import dictionary_pb2
from tracewire_server.frontend.dictionaries import DictionaryRegistry
from tracewire_server.frontend.errors import PermissionDenied, ResourceExhausted
from tracewire_server.shared.dictionary_spec import DictionaryInfo

SHIPPED = {"next-token-class": ("probe", 3), "res-l2-sae": ("sae", 1024)}
PROMPT = "The capital of France is"


def probe(k: int = 2, hidden: int = 256, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"W": rng.standard_normal((k, hidden)).astype(np.float32), "b": np.zeros(k, np.float32)}


PROBE_SPEC = {"kind": "probe", "module": "layers.1", "probe_activation": "sigmoid", "labels": ["a", "b"]}


def test_list_shows_the_shipped_dictionaries(client) -> None:
    held = {d.name: d for d in client.list_dictionaries()}
    for name, (kind, size) in SHIPPED.items():
        d = held[name]
        spec = json.loads((DICTIONARIES / f"{name}.json").read_text())
        tensors = load_file(str(DICTIONARIES / f"{name}.safetensors"))
        assert (d.kind, d.size, d.module, d.owner) == (kind, size, spec["module"], "")
        assert d.input_size == 256 and d.dtype == "float32"
        assert d.device_bytes == sum(t.nbytes for t in tensors.values())
        assert list(d.labels) == spec["labels"] and d.description == spec["description"]
    assert held["next-token-class"].probe_activation == "sigmoid"
    assert held["res-l2-sae"].sae_activation == "relu" and held["res-l2-sae"].subtract_decoder_bias
    assert all(not d.labels for d in client.list_dictionaries(omit_labels=True))


def test_register_list_replace_delete(client) -> None:
    weights = probe()
    first = client.register_dictionary("test-probe", PROBE_SPEC, weights)
    assert (first.kind, first.size, first.input_size, first.dtype) == ("probe", 2, 256, "float32")
    assert first.device_bytes == weights["W"].nbytes + weights["b"].nbytes
    assert first.owner == "anonymous" and first.labels == ("a", "b")
    assert "test-probe" in {d.name for d in client.list_dictionaries()}
    with pytest.raises(tracewire.AlreadyExists):
        client.register_dictionary("test-probe", PROBE_SPEC, weights)
    # replaced by its owner: another generation, another size (from a file this time)
    bigger = probe(k=3, seed=1)
    replaced = client.register_dictionary("test-probe", {**PROBE_SPEC, "labels": []}, safetensors_bytes(bigger),
                                          replace=True)
    assert replaced.size == 3 and replaced.generation != first.generation
    assert client.delete_dictionary("test-probe") == bigger["W"].nbytes + bigger["b"].nbytes
    assert "test-probe" not in {d.name for d in client.list_dictionaries()}
    with pytest.raises(tracewire.NotFound) as e:
        client.delete_dictionary("test-probe")
    assert "test-probe" in str(e.value)


def test_async_client_registers_lists_and_deletes(server) -> None:
    async def run() -> tuple[tracewire.Dictionary, set[str], int]:
        async with tracewire.AsyncClient(server.target, timeout=120) as aclient:
            made = await aclient.register_dictionary("test-async", PROBE_SPEC, probe(seed=2))
            names = {d.name for d in await aclient.list_dictionaries()}
            return made, names, await aclient.delete_dictionary("test-async")

    made, names, freed = asyncio.run(run())
    assert made.size == 2 and "test-async" in names and freed == made.device_bytes == 2 * 256 * 4 + 2 * 4


def _bad_shape() -> dict[str, np.ndarray]:
    return {"W": np.ones((2, 255), np.float32)}


def _nan() -> dict[str, np.ndarray]:
    weights = probe()
    weights["W"][1, 7] = np.nan
    return weights


@pytest.mark.parametrize(("name", "spec", "tensors", "field"), [
    ("bad name!", PROBE_SPEC, probe(), "header.name"),
    ("test-bad", {**PROBE_SPEC, "module": "layers.99"}, probe(), "header.spec.module"),
    ("test-bad", {**PROBE_SPEC, "kind": 0}, probe(), "header.spec.kind"),
    ("test-bad", {**PROBE_SPEC, "labels": ["one"]}, probe(), "header.spec.labels"),
    ("test-bad", {**PROBE_SPEC, "labels": []}, _bad_shape(), "tensors.W"),
    ("test-bad", PROBE_SPEC, _nan(), "tensors.W"),
    ("test-bad", PROBE_SPEC, b"not a safetensors file", "chunk[0]"),
    ("test-bad", PROBE_SPEC, b"\x02\0\0\0\0\0\0\0{x", "file"),
])
def test_bad_upload_is_invalid_argument_naming_the_field(client, name, spec, tensors, field) -> None:
    with pytest.raises(tracewire.InvalidArgument) as e:
        client.register_dictionary(name, spec, tensors)
    assert e.value.field == field, e.value
    assert "test-bad" not in {d.name for d in client.list_dictionaries()}


def test_a_chunk_first_is_invalid_argument_naming_the_header(stub) -> None:
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterDictionary(iter([dictionary_pb2.RegisterDictionaryRequest(chunk=b"12345678")]), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("header:")


def test_upload_over_the_limit_stops_at_the_chunk(stub) -> None:
    """Refused as the chunks arrive: the stream is not read to its (100 MiB) end."""
    sent = 0
    chunk = 1 << 20

    def requests() -> Iterator[dictionary_pb2.RegisterDictionaryRequest]:
        nonlocal sent
        spec = dictionary_pb2.DictionarySpec(kind=dictionary_pb2.DICTIONARY_KIND_PROBE, module="layers.1")
        yield dictionary_pb2.RegisterDictionaryRequest(
            header=dictionary_pb2.DictionaryHeader(name="test-huge", spec=spec))
        rows = 100 * chunk // (256 * 4)
        header = json.dumps({"W": {"dtype": "F32", "shape": [rows, 256], "data_offsets": [0, rows * 1024]}}).encode()
        yield dictionary_pb2.RegisterDictionaryRequest(chunk=len(header).to_bytes(8, "little") + header)
        for _ in range(100):
            sent += 1
            yield dictionary_pb2.RegisterDictionaryRequest(chunk=bytes(chunk))

    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterDictionary(requests(), timeout=120)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    assert e.value.details().startswith("chunk[")
    assert "--max-dictionary-bytes" in e.value.details()
    # The server stops at the chunk that crosses the room (less than the limit when other
    # tests' uploads hold some of it); chunk[0] is the safetensors header.
    limit_chunks = SHARED_MAX_DICTIONARY_BYTES // chunk
    index = int(re.match(r"chunk\[(\d+)\]", e.value.details())[1])
    assert 1 <= index <= limit_chunks + 1, e.value.details()
    # grpc's client reads ahead by its flow-control window, which grows under load (30 chunks
    # seen in a full run): what matters is that the 100 MiB stream was not read to its end.
    assert index <= sent < 80, sent


def test_the_operators_and_missing_names_are_refused(client) -> None:
    with pytest.raises(tracewire.AlreadyExists):
        client.register_dictionary("next-token-class", PROBE_SPEC, probe())
    with pytest.raises(tracewire.PermissionDenied) as e:
        client.register_dictionary("next-token-class", PROBE_SPEC, probe(), replace=True)
    assert "operator" in str(e.value)
    with pytest.raises(tracewire.PermissionDenied):
        client.delete_dictionary("res-l2-sae")
    with pytest.raises(tracewire.NotFound):
        client.delete_dictionary("no-such-dictionary")
    assert SHIPPED.keys() <= {d.name for d in client.list_dictionaries()}


def test_bad_uploads_leave_generation_running(client) -> None:
    """A generation running while uploads are refused ends as one alone does."""
    alone = client.generate(PROMPT, max_tokens=24, temperature=0)[0].outputs[0].token_ids
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.generate, PROMPT, max_tokens=24, temperature=0)
        for tensors in (_nan(), _bad_shape(), b"junk"):
            with pytest.raises(tracewire.InvalidArgument):
                client.register_dictionary("test-bad", {**PROBE_SPEC, "labels": []}, tensors)
        assert running.result(timeout=300)[0].outputs[0].token_ids == alone


def test_list_and_delete_over_http(server) -> None:
    url = server.http_url + "/tracewire.v1.TraceService/"
    listed = httpx.post(url + "ListDictionaries", json={"omitLabels": True}, timeout=60)
    assert listed.status_code == 200, listed.text
    names = {d["name"]: d for d in listed.json()["dictionaries"]}
    assert SHIPPED.keys() <= names.keys() and "labels" not in names["res-l2-sae"]["spec"]
    refused = httpx.post(url + "DeleteDictionary", json={"name": "res-l2-sae"}, timeout=60)
    assert refused.json()["code"] == "permission_denied"


def write_dictionary(directory: Path, name: str, spec: dict, tensors: dict[str, np.ndarray]) -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(spec))
    (directory / f"{name}.safetensors").write_bytes(safetensors_bytes(tensors))


GOOD_SPEC = {"kind": "DICTIONARY_KIND_PROBE", "module": "layers.1"}


BAD_DIRECTORIES = {
    "unknown field": ({**GOOD_SPEC, "colour": "red"}, probe(), ("p.json", "not a DictionarySpec")),
    "no kind": ({**GOOD_SPEC, "kind": "DICTIONARY_KIND_UNSPECIFIED"}, probe(), ("p.json", "spec.kind")),
    "nan weights": (GOOD_SPEC, _nan(), ("p.safetensors", "tensors.W")),
}


@pytest.fixture(scope="module")
def bad_directory_starts(tmp_path_factory):
    """A start on each of BAD_DIRECTORIES, in forks of one process (test_startup's
    start_forked: each start would otherwise pay vLLM's import): (its directory, result)."""
    starts, folders = {}, {}
    for case, (spec, tensors, _) in BAD_DIRECTORIES.items():
        folders[case] = tmp_path_factory.mktemp("bad") / "d"
        write_dictionary(folders[case], "p", spec, tensors)
        starts[case] = ("--port", "0", "--dictionaries", str(folders[case]))
    results = start_forked(starts)
    return {case: (folders[case], results[case]) for case in BAD_DIRECTORIES}


@pytest.mark.parametrize("case", BAD_DIRECTORIES)
def test_bad_dictionary_directory_refuses_start_in_one_line(bad_directory_starts, case) -> None:
    """Found before the engine starts: one line naming the file and the field."""
    names = BAD_DIRECTORIES[case][2]
    directory, result = bad_directory_starts[case]
    assert result.returncode == 1
    line = last_line(result)
    assert line.startswith(f"tracewire: --dictionaries {directory / names[0]}: "), line
    assert names[1] in line


def _another_models_dictionary(directory: Path) -> Prepared:
    write_dictionary(directory / "d", "p", {**GOOD_SPEC, "module": "layers.7"}, probe())
    return Prepared(("--dictionaries", str(directory / "d")))


ANOTHER_MODELS = ServerSpec("another-models-dictionary", prepare=_another_models_dictionary)


@servers(ANOTHER_MODELS)
def test_dictionary_for_another_model_refuses_start() -> None:
    """Found once the engine describes the model: a wrong module, one line, exit 1."""
    with pytest.raises(RuntimeError) as e:
        take(ANOTHER_MODELS)
    log = str(e.value)
    path = re.search(rf"tracewire: --dictionaries (\S+/{ANOTHER_MODELS.name}/d/p\.json): ", log)  # (its directory)
    assert path is not None, log[-3000:]
    assert f"tracewire: --dictionaries {path[1]}: spec.module: unknown module 'layers.7'" in log
    assert "Traceback" not in log
    assert MODEL.is_dir()


# -- the registry's own rules, against a fake of the worker's three calls ---------------------


class FakeWorker:
    """Holds DictionaryInfos as the worker would (no weights); counts list calls."""

    def __init__(self) -> None:
        self.held: dict[str, DictionaryInfo] = {}
        self.lists = 0

    async def load(self, info: DictionaryInfo, path: Path) -> DictionaryInfo | tuple[str, str]:
        self.held[info.name] = info
        return info

    async def delete(self, name: str) -> int:
        info = self.held.pop(name, None)
        return info.device_bytes if info else 0

    async def held_infos(self) -> list[DictionaryInfo]:
        self.lists += 1
        return list(self.held.values())


def _info(name: str, owner: str, nbytes: int) -> DictionaryInfo:
    return DictionaryInfo(name=name, kind="probe", module="layers.1", input_size=256, size=1, dtype="float32",
                          device_bytes=nbytes, owner=owner, generation=1)


def test_room_counts_uploads_only_and_the_replaced_one_is_not_counted() -> None:
    async def run() -> None:
        worker = FakeWorker()
        registry = DictionaryRegistry(_Adapter(worker), max_upload_bytes=1000)
        await registry.load_operator(_info("op", "", 5000), Path("x"))
        await registry.register(_info("a", "alice", 600), Path("x"), replace=False)
        assert registry.room("bob") == 400 and registry.room("alice", "a") == 1000
        with pytest.raises(ResourceExhausted):
            await registry.register(_info("b", "bob", 401), Path("x"), replace=False)
        await registry.register(_info("a", "alice", 900), Path("x"), replace=True)  # replaces its own
        with pytest.raises(PermissionDenied):
            await registry.register(_info("a", "bob", 1), Path("x"), replace=True)
        with pytest.raises(PermissionDenied):
            await registry.delete("op", "alice")
        assert await registry.delete("a", "alice") == 900 and registry.room("bob") == 1000

    asyncio.run(run())


def test_a_shared_frontend_finds_what_another_registered() -> None:
    async def run() -> None:
        worker = FakeWorker()
        one = DictionaryRegistry(_Adapter(worker), shared=True)
        other = DictionaryRegistry(_Adapter(worker), shared=True)
        await other.register(_info("a", "alice", 10), Path("x"), replace=False)
        assert one.lookup("a") is None
        await one.prefetch({"a"})
        assert one.lookup("a") == worker.held["a"]
        lists = worker.lists
        await asyncio.gather(*(one.prefetch({"a"}) for _ in range(10)))  # cached and fresh: no call
        assert worker.lists == lists
        await asyncio.gather(*(one.prefetch({"b"}) for _ in range(10)))  # unknown: one shared call
        assert worker.lists == lists + 1

    asyncio.run(run())


class _Adapter:
    def __init__(self, worker: FakeWorker) -> None:
        self.load, self.delete, self.held = worker.load, worker.delete, worker.held_infos
