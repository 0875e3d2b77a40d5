"""Fuzzing the real server: random requests (fuzz_requests.py) and raw byte bodies.

Whatever a request holds, the answer is OK or a client-error status (INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, FAILED_PRECONDITION), health stays SERVING, and a known greedy result
is the same afterwards. The seed is printed and in every failure message:
TRACEWIRE_FUZZ_SEED=<seed> reproduces a run, TRACEWIRE_FUZZ_REQUESTS sets its size.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import random
from dataclasses import dataclass

import grpc
from fuzz_requests import RequestFuzzer
from google.protobuf import text_format
from tracewire.v1 import prompt_pb2, service_pb2

REQUESTS = int(os.environ.get("TRACEWIRE_FUZZ_REQUESTS", "2000"))
CLIENT_ERRORS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}
SERVICE = "/tracewire.v1.TraceService/"
# (method, request type, server streaming, share of the requests)
METHODS = (
    ("Trace", service_pb2.TraceRequest, True, 0.45),
    ("Generate", service_pb2.GenerateRequest, False, 0.15),
    ("GenerateStream", service_pb2.GenerateStreamRequest, True, 0.1),
    ("Tokenize", service_pb2.TokenizeRequest, False, 0.05),
    ("Detokenize", service_pb2.DetokenizeRequest, False, 0.05),
)
RAW_SHARE = 0.2


@dataclass(frozen=True)
class Case:
    index: int
    method: str
    streaming: bool
    body: bytes
    shown: str  # for a failure message: the request as text, or the raw bytes


def cases(seed: int, count: int, vocab: int) -> list[Case]:
    fuzz = RequestFuzzer(seed, vocab)
    weights = [share for *_, share in METHODS]
    out = []
    for i in range(count):
        method, request_type, streaming, _ = fuzz.rng.choices(METHODS, weights)[0]
        request = fuzz.message(request_type.DESCRIPTOR)
        if method == "Trace" and fuzz.rng.random() < 0.5:
            _plausible_prompts(request, fuzz.rng)  # so the interventions get compiled and run
        body = request.SerializeToString()
        if fuzz.rng.random() < RAW_SHARE:
            body = fuzz.raw_body(body)
            out.append(Case(i, method, streaming, body, f"raw bytes {body[:200]!r}"))
        else:
            out.append(Case(i, method, streaming, body, text_format.MessageToString(request)[:2000]))
    return out


def _plausible_prompts(request: service_pb2.TraceRequest, rng: random.Random) -> None:
    for invoke in request.invokes:
        invoke.prompt.CopyFrom(prompt_pb2.Prompt(text=rng.choice(("The capital of France is", "Once upon a time"))))


def send(channel: grpc.Channel, case: Case) -> tuple[grpc.StatusCode, str]:
    path = SERVICE + case.method
    try:
        if case.streaming:
            for _ in channel.unary_stream(path)(case.body, timeout=120):
                pass
        else:
            channel.unary_unary(path)(case.body, timeout=120)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_fuzzed_requests_get_client_statuses_and_harm_no_one(server, client, hf):
    seed = int(os.environ.get("TRACEWIRE_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
    print(f"fuzz seed {seed} (TRACEWIRE_FUZZ_SEED={seed} reproduces this run)")
    prompt = "The capital of France is"
    (before,) = client.generate(prompt, temperature=0.0, max_tokens=8, ignore_eos=True)
    assert before.outputs[0].token_ids == hf.greedy(hf.encode(prompt), 8)

    todo = cases(seed, REQUESTS, hf.model.config.vocab_size)
    with grpc.insecure_channel(server.target) as channel, concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda case: send(channel, case), todo))
    bad = [(case, code, details) for case, (code, details) in zip(todo, answers, strict=True)
           if code not in CLIENT_ERRORS]
    assert not bad, f"seed {seed}: {len(bad)} of {len(todo)} requests got other statuses; first:\n" + "\n".join(
        f"#{case.index} {case.method} -> {code.name}: {details[:300]}\n  {case.shown[:600]}"
        for case, code, details in bad[:5])
    codes = collections.Counter(code.name for code, _ in answers)
    print("statuses:", dict(codes))
    assert codes["OK"] and codes["INVALID_ARGUMENT"]  # it reached both

    assert server.health() == "SERVING"
    (after,) = client.generate(prompt, temperature=0.0, max_tokens=8, ignore_eos=True)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
