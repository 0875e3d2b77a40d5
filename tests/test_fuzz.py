"""Fuzzing the real server: random requests (fuzz_requests.py) and raw byte bodies, for
every RPC of the contract, on a compiled and an eager engine.

The RPCs come from the service descriptor (tracewire.v1 TraceService): every method, its
request type and whether it streams requests (uploads) or responses, so a new RPC or a
new field is fuzzed without editing this file. Each request is one of three kinds:
descriptor-random, plausible (shaped like a real request from a table of values per field
name built from the served model, its modules and dictionaries: fuzz_requests.Plausible;
references between invokes linked to reads that exist), or raw bytes.

Whatever a request holds, the answer is OK or a client-error status (INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, FAILED_PRECONDITION; and the statuses dictionary.proto documents for
the dictionary RPCs: ALREADY_EXISTS, PERMISSION_DENIED, NOT_FOUND), health stays SERVING,
a greedy result is the same afterwards (and HF's), and the server holds the dictionaries
it held before.

The session servers are shared with the other tests, so what the fuzzer changes on them
is its own: the names it registers and deletes carry its prefix (a valid name without it
gets it; an invalid one is refused anyway), uploads run before the other requests and
deletes after them (a trace compiled against a dictionary that is then deleted fails by
design), and whatever it registered is deleted at the end. Intervention names never take
the fault-injection prefix (--enable-fault-injection, on for the tests' servers).

The seed is printed and in every failure message: TRACEWIRE_FUZZ_SEED=<seed> reproduces
a run's requests, TRACEWIRE_FUZZ_REQUESTS sets its size (per engine kind: by default
1000 on the compiled server, 600 on the eager one).
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from fuzz_requests import RequestFuzzer, link_references, plant_reference, plausible_values
from google.protobuf import descriptor, message_factory, text_format
from safetensors.numpy import save as save_safetensors
from tracewire.v1 import dictionary_pb2, service_pb2
from tracewire_server.frontend.interventions import FAULT_PREFIX

# Per engine kind (the plausible ones reach the engine: each costs more than a refusal);
# the eager engine's steps take about twice the compiled one's, so it gets fewer, for a
# run of about the same time. TRACEWIRE_FUZZ_REQUESTS sets both.
REQUESTS = {"server": 1000, "eager": 600}
if os.environ.get("TRACEWIRE_FUZZ_REQUESTS"):
    REQUESTS = dict.fromkeys(REQUESTS, int(os.environ["TRACEWIRE_FUZZ_REQUESTS"]))
CLIENT_ERRORS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}
# Statuses the contract documents for one RPC beside those (dictionary.proto): a taken
# name, another's or the operator's dictionary, an unknown name.
DOCUMENTED = {"RegisterDictionary": {grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED},
              "DeleteDictionary": {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED}}
SERVICE = service_pb2.DESCRIPTOR.services_by_name["TraceService"]
RAW_SHARE, PLAUSIBLE_SHARE = 0.15, 0.55
# Methods that change what the server holds: creating ones run first, removing ones last.
CREATES, REMOVES = re.compile(r"^(Register|Create|Upload|Put|Add)"), re.compile(r"^(Delete|Remove)")
VALID_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
PROMPT = "The capital of France is"


@dataclass(frozen=True)
class Case:
    index: int
    method: descriptor.MethodDescriptor
    bodies: tuple[bytes, ...]  # one per request message (a client stream: any number)
    shown: str  # for a failure message: the request as text, or the raw bytes

    @property
    def phase(self) -> int:
        return 0 if CREATES.match(self.method.name) else 2 if REMOVES.match(self.method.name) else 1


def _weight(method: descriptor.MethodDescriptor) -> float:
    """A method's share of the requests: the message types its request reaches (Trace's
    dozens, GetModelInfo's one), a client stream's counted twice for its many messages."""
    seen: set[str] = set()

    def walk(desc: descriptor.Descriptor) -> None:
        if desc.full_name in seen:
            return
        seen.add(desc.full_name)
        for f in desc.fields:
            if f.message_type is not None:
                walk(f.message_type)

    walk(method.input_type)
    return (1 + len(seen)) * (2 if method.client_streaming else 1)


def cases(seed: int, count: int, vocab: int, table: Any, prefix: str, shipped: set[str]) -> list[Case]:
    fuzz = RequestFuzzer(seed, vocab, table)
    methods = list(SERVICE.methods)
    weights = [_weight(m) for m in methods]
    out = []
    for i in range(count):
        method = fuzz.rng.choices(methods, weights)[0]
        roll = fuzz.rng.random()
        plausible = roll < PLAUSIBLE_SHARE
        if method.client_streaming:
            messages = fuzz.stream(method.input_type) if plausible else [
                fuzz.message(method.input_type) for _ in range(fuzz.rng.choice((0, 1, 2, 3)))]
        else:
            messages = [fuzz.plausible(method.input_type) if plausible else fuzz.message(method.input_type)]
            if plausible:
                plant_reference(messages[0], fuzz)
                link_references(messages[0], fuzz.rng)
        for message in messages:
            _own_names(message, method, prefix, shipped)
        bodies = [m.SerializeToString() for m in messages]
        if roll > 1 - RAW_SHARE and bodies:
            k = fuzz.rng.randrange(len(bodies))
            bodies[k] = fuzz.raw_body(bodies[k])
            shown = f"raw bytes (message {k}) {bodies[k][:200]!r}"
        else:
            shown = "\n---\n".join(text_format.MessageToString(m)[:2000] for m in messages)[:4000]
        out.append(Case(i, method, tuple(bodies), shown))
    return out


def _own_names(message: Any, method: descriptor.MethodDescriptor, prefix: str, shipped: set[str]) -> None:
    """What a request may name, on servers other tests share: no intervention name asks
    for an injected fault; a method that creates or removes names only valid names of its
    own prefix (or the operator's, which no client can change)."""
    changes = bool(CREATES.match(method.name) or REMOVES.match(method.name))
    for fd, value in message.ListFields():
        if fd.type == fd.TYPE_STRING and fd.name == "name" and not fd.is_repeated:
            if value.startswith(FAULT_PREFIX):
                setattr(message, fd.name, value.removeprefix("__"))
            elif changes and VALID_NAME.match(value) and not value.startswith(prefix) and value not in shipped:
                setattr(message, fd.name, (prefix + value)[:64])
        elif fd.type == fd.TYPE_MESSAGE and not fd.message_type.GetOptions().map_entry:
            for item in value if fd.is_repeated else (value,):
                _own_names(item, method, prefix, shipped)


def send(channel: grpc.Channel, case: Case) -> tuple[grpc.StatusCode, str]:
    path = f"/{SERVICE.full_name}/{case.method.name}"
    calls = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
             (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    call = calls[case.method.client_streaming, case.method.server_streaming](path)
    request = iter(case.bodies) if case.method.client_streaming else case.bodies[0]
    try:
        answer = call(request, timeout=120)
        if case.method.server_streaming:
            for _ in answer:
                pass
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def dictionary_files(hidden: int, seed: int) -> list[bytes]:
    """safetensors files an upload may carry: a probe's and an SAE's of the model's width
    (three times each: most uploads should be valid), a JumpReLU SAE's, and ones refused
    for their shapes, dtype or values."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    bad = normal(3, hidden)
    bad[0, 0] = np.nan
    probe = {"W": normal(3, hidden), "b": normal(3)}
    sae = {"W_enc": normal(hidden, 16), "b_enc": normal(16), "W_dec": normal(16, hidden), "b_dec": normal(hidden)}
    return [save_safetensors(t) for t in (
        probe, probe, probe, sae, sae, sae,
        {"W_enc": normal(hidden, 16), "W_dec": normal(16, hidden), "threshold": np.abs(normal(16))},
        {"W": bad},
        {"W": normal(3, hidden + 1)},
        {"W": normal(3, hidden).astype(np.float64)},
    )] + [b"not a safetensors file"]


def _stub_call(target: str, method: str, request: Any) -> Any:
    from tracewire.v1 import service_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        return getattr(service_pb2_grpc.TraceServiceStub(channel), method)(request, timeout=60)


def _greedy(target: str) -> list[int]:
    response = _stub_call(target, "Generate", service_pb2.GenerateRequest(
        prompts=[{"text": PROMPT}], sampling_params={"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}))
    return list(response.outputs[0].outputs[0].token_ids)


def _held(target: str) -> dict[str, tuple[str, int]]:
    listed = _stub_call(target, "ListDictionaries", dictionary_pb2.ListDictionariesRequest(omit_labels=True))
    return {d.name: (d.owner, d.generation) for d in listed.dictionaries}


@pytest.fixture(params=["server", "eager"])
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The compiled (default) and the eager session server: no server of the test's own."""
    yield request.getfixturevalue(request.param)


def test_fuzzed_requests_get_client_statuses_and_harm_no_one(engine, hf, request):
    seed = int(os.environ.get("TRACEWIRE_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
    kind = request.node.callspec.params["engine"]
    print(f"fuzz seed {seed} on {kind} (TRACEWIRE_FUZZ_SEED={seed} reproduces this run)")
    target = engine.target
    before = _greedy(target)
    assert before == hf.greedy(hf.encode(PROMPT), 8)
    held = _held(target)
    info = _stub_call(target, "GetModelInfo", service_pb2.GetModelInfoRequest())
    listed = _stub_call(target, "ListDictionaries", dictionary_pb2.ListDictionariesRequest())
    prefix = f"fuzz{seed:08x}-"
    table = plausible_values(info, listed.dictionaries, [f"{prefix}{i}" for i in range(3)],
                             dictionary_files(info.hidden_size, seed))
    todo = cases(seed, REQUESTS[kind], info.vocab_size, table, prefix, set(held))

    answers: dict[int, tuple[grpc.StatusCode, str]] = {}
    try:
        with grpc.insecure_channel(target) as channel, concurrent.futures.ThreadPoolExecutor(6) as pool:
            for phase in (0, 1, 2):
                batch = [case for case in todo if case.phase == phase]
                answers.update(zip((c.index for c in batch), pool.map(lambda c: send(channel, c), batch), strict=True))
    finally:
        for name, (owner, _) in _held(target).items():
            if name.startswith(prefix) and owner:
                _stub_call(target, "DeleteDictionary", dictionary_pb2.DeleteDictionaryRequest(name=name))

    bad = [(case, *answers[case.index]) for case in todo
           if answers[case.index][0] not in CLIENT_ERRORS | DOCUMENTED.get(case.method.name, set())]
    assert not bad, f"seed {seed} on {kind}: {len(bad)} of {len(todo)} requests got other statuses; first:\n" + (
        "\n".join(f"#{case.index} {case.method.name} -> {code.name}: {details[:300]}\n  {case.shown[:1500]}"
                  for case, code, details in bad[:5]))
    codes = collections.Counter(code.name for code, _ in answers.values())
    per_method = collections.Counter((c.method.name, answers[c.index][0].name) for c in todo)
    print("statuses:", dict(codes))
    print("by method:", dict(sorted(per_method.items())))
    assert {m.name for m in SERVICE.methods} <= {c.method.name for c in todo}  # every RPC was called
    assert codes["OK"] and codes["INVALID_ARGUMENT"]  # it reached both
    ok_traces = sum(1 for c in todo if c.method.name == "Trace" and answers[c.index][0] == grpc.StatusCode.OK)
    assert ok_traces, "no trace passed validation: the plausible requests reach no engine"

    assert engine.health() == "SERVING"
    assert _greedy(target) == before
    assert _held(target) == held  # the operator's dictionaries and other tests' as they were


def test_requests_are_generated_for_every_message_of_the_contract():
    """The generator reaches every message type a request can hold, and both of a client
    stream's parts, from the descriptors alone (no server: the table of a made-up model)."""

    class Info:
        model = "tiny"
        num_layers, num_attention_heads, vocab_size, intermediate_size, hidden_size, head_dim = 4, 4, 2048, 640, 256, 64
        modules = [type("M", (), {"path": p, "kind": k, "shape": s}) for p, k, s in (
            ("layers.0", "decoder_layer", [256]), ("layers.0.self_attn.heads", "attention_heads", [4, 64]),
            ("layers.0.mlp.act", "mlp_activation", [640]))]

    table = plausible_values(Info, [], ["fuzz-0"], dictionary_files(256, 0))
    todo = cases(7, 1500, 2048, table, "fuzz-", set())
    reached: set[str] = set()

    def walk(message: Any) -> None:
        reached.add(message.DESCRIPTOR.full_name)
        for fd, value in message.ListFields():
            if fd.type == fd.TYPE_MESSAGE and not fd.message_type.GetOptions().map_entry:
                for item in value if fd.is_repeated else (value,):
                    walk(item)

    for case in todo:
        cls = message_factory.GetMessageClass(case.method.input_type)
        for body in case.bodies:
            try:
                walk(cls.FromString(body))
            except Exception:  # noqa: BLE001 - a raw body
                pass
    wanted: set[str] = set()

    def all_types(desc: descriptor.Descriptor) -> None:
        if desc.full_name in wanted or desc.GetOptions().map_entry:
            return
        wanted.add(desc.full_name)
        for f in desc.fields:
            if f.message_type is not None:
                all_types(f.message_type)

    for method in SERVICE.methods:
        all_types(method.input_type)
    assert wanted - reached == set()
    refs = [ref for c in todo if c.method.name == "Trace" for ref in _patch_refs(c)]
    assert refs, "no write references another invoke's read"


def _patch_refs(case: Case) -> list[tuple[int, str]]:
    """A Trace case's module writes whose operand is another invoke's module read that exists."""
    try:
        trace = service_pb2.TraceRequest.FromString(case.bodies[0])
    except Exception:  # noqa: BLE001 - a raw body
        return []
    found = []
    for i, invoke in enumerate(trace.invokes):
        for iv in invoke.interventions:
            op = iv.write_module.WhichOneof("op") if iv.WhichOneof("action") == "write_module" else None
            if op not in ("patch", "add_read"):
                continue
            ref = getattr(iv.write_module, op)
            if ref.invoke != i and 0 <= ref.invoke < len(trace.invokes) and any(
                    s.name == ref.name and s.WhichOneof("action") == "read_module"
                    for s in trace.invokes[ref.invoke].interventions):
                found.append((ref.invoke, ref.name))
    return found


# -- what the fuzzer found ---------------------------------------------------------------

def _trace_values(target: str, text: str) -> dict[str, list[Any]]:
    """A trace's read values by name, step by step (as numpy arrays)."""
    from google.protobuf import text_format as tf
    from tracewire.v1 import service_pb2_grpc

    request = tf.Parse(text, service_pb2.TraceRequest())
    values: dict[str, list[Any]] = collections.defaultdict(list)
    with grpc.insecure_channel(target) as channel:
        for event in service_pb2_grpc.TraceServiceStub(channel).Trace(request, timeout=60):
            for step in event.steps.results:
                for name, value in step.values.items():
                    t = value.values
                    values[name].append(np.frombuffer(t.data, np.float32).reshape(tuple(t.shape)))
    return values


def test_a_lens_naming_a_layer_twice_beside_a_mean_read(eager):
    """Found by the fuzzer: a logit lens naming one layer twice (1 and -3 of 4 layers) in a
    trace that also reads a module's mean failed the trace with INTERNAL ("read 'lens@1' of
    'layers.1' saw 2 of 1 positions"): its stream was gathered once per mention. Each
    mention now gets the layer's values, the same as a lens of that layer alone (at the
    new token and at prompt positions)."""
    invoke = ('invokes {{ prompt {{ token_ids {{ ids: 4 ids: 17 }} }} '
              'sampling_params {{ max_tokens: 3 temperature: 0 }} '
              'interventions {{ name: "lens" read_logit_lens {{ layers: {layers} top_k: 5 {positions} }} }} '
              'interventions {{ name: "mean" read_module {{ module: "norm" reduction: REDUCTION_MEAN }} }} }}')
    for positions in ("", "positions { all_prompt {} }"):
        twice = _trace_values(eager.target, invoke.format(layers="1 layers: -3", positions=positions))
        once = _trace_values(eager.target, invoke.format(layers="1", positions=positions))
        assert len(twice["lens"]) == len(once["lens"]) == (3 if not positions else 1)
        for both, alone in zip(twice["lens"], once["lens"], strict=True):
            assert both.shape[0] == 2 and alone.shape[0] == 1
            # (one lm_head matmul over two rows or one: float32 rounding apart)
            np.testing.assert_allclose(both[0], alone[0], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(both[1], alone[0], rtol=1e-5, atol=1e-5)


def _seeded(target: str, prompt_ids: list[int]) -> list[int]:
    response = _stub_call(target, "Generate", service_pb2.GenerateRequest(
        prompts=[{"token_ids": {"ids": prompt_ids}}],
        sampling_params={"seed": 7, "temperature": 1.0, "max_tokens": 6, "ignore_eos": True}))
    return list(response.outputs[0].outputs[0].token_ids)


def test_a_seeded_request_in_a_chunked_prefill_leaves_the_cpu_engine_alive(eager, server):
    """Found by the fuzzer: a seeded request (temperature > 0) whose prompt takes more than
    one engine step (the eager server's 64-token steps: chunked prefill) killed a CPU
    engine: vLLM rewinds the seeded generator of a row whose sample it discards with
    set_offset, which a CPU generator refuses ("CPU Generator does not use offset"). Now
    it is answered, the engine serves on, and the generator is where vLLM's rewind would
    have left it: the tokens are those of the same request on a server that prefills the
    prompt in one step (the default one)."""
    prompt_ids = [(17 * i) % 2000 + 3 for i in range(150)]  # > 2 x 64 tokens: three prefill chunks
    chunked = _seeded(eager.target, prompt_ids)
    assert eager.health() == "SERVING"
    assert _seeded(eager.target, prompt_ids) == chunked
    assert _seeded(server.target, prompt_ids) == chunked
