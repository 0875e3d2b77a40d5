"""A bounded soak of the real server (`make soak`): many mixed clients for a few minutes.

Not a test, a load run. One tracewire server (eager, so steering and layer reads are in
the mix) on the embedded model; first every kind of call runs alone on each prompt and its
result is kept; then `--clients` threads (100) call it for `--seconds` (180), each picking
kinds at random: plain and streamed generation, traces with reads, forced tokens, stops,
steering writes at new tokens and at prompt positions, seeded n=3 sampling, bad requests,
cancellations mid-stream and deadlines. Every deterministic result is compared with its
solo result: one request's writes, caches or size must never change another's. Prints the
calls by kind and status, the mismatches (must be 0) and the server's RSS and open-fd growth
from after the warm-up to the end; writes them to bench/results/soak-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import prompt_pb2, sampling_pb2, service_pb2, service_pb2_grpc, tensor_pb2, trace_pb2

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tracewire-tiny"
SERVER_FLAGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "64",
                "--http-port", "0"]
PROMPTS = ("The capital of France is", "Once upon a time", "One, two, three,",
           # longer than one KV block (128 tokens on the CPU backend): prefix caching in play;
           # with the longest generation (300) within the context (512)
           " ".join(["The capital of France is Paris."] * 24))
TIMEOUT_S = 120.0

Signature = tuple[Any, ...] | None  # what must equal the solo result; None: nothing to compare


@dataclass(frozen=True)
class Kind:
    name: str
    call: Callable[[service_pb2_grpc.TraceServiceStub, str], Signature]
    deterministic: bool = True


def _sampling(**kw: Any) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(**kw)


GREEDY = dict(temperature=0.0, ignore_eos=True)


def _trace(stub: service_pb2_grpc.TraceServiceStub, prompt: str, *interventions: I.Intervention,
           **sampling: Any) -> tuple[tuple[int, ...], ...]:
    request = service_pb2.TraceRequest(
        invokes=[trace_pb2.Invoke(prompt=prompt_pb2.Prompt(text=prompt), interventions=list(interventions))],
        sampling_params=_sampling(**sampling))
    outputs: tuple[tuple[int, ...], ...] = ()
    for event in stub.Trace(request, timeout=TIMEOUT_S):
        if event.WhichOneof("event") == "invoke_result":
            outputs = tuple(tuple(o.token_ids) for o in event.invoke_result.output.outputs)
    return outputs


def _vector(seed: int, hidden: int) -> tensor_pb2.Tensor:
    v = (np.random.default_rng(seed).normal(size=hidden) * 4).astype("<f4")
    return tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[hidden], data=v.tobytes())


def kinds(hidden: int, period_token: int) -> list[Kind]:
    every = I.StepSelector(all=I.AllSteps())
    steer_new = I.Intervention(steps=every, write_module=I.WriteModule(
        module="layers.1", positions=I.Positions(new_token=I.NewToken()), add=_vector(1, hidden)))
    steer_prompt = I.Intervention(write_module=I.WriteModule(
        module="layers.2", positions=I.Positions(all_prompt=I.AllPrompt()), add=_vector(2, hidden)))

    def generate(stub: Any, prompt: str) -> Signature:
        response = stub.Generate(service_pb2.GenerateRequest(
            prompts=[prompt_pb2.Prompt(text=prompt)], sampling_params=_sampling(max_tokens=12, **GREEDY)),
            timeout=TIMEOUT_S)
        return tuple(response.outputs[0].outputs[0].token_ids)

    def stream(stub: Any, prompt: str) -> Signature:
        ids: list[int] = []
        for chunk in stub.GenerateStream(service_pb2.GenerateStreamRequest(
                prompts=[prompt_pb2.Prompt(text=prompt)], sampling_params=_sampling(max_tokens=12, **GREEDY)),
                timeout=TIMEOUT_S):
            ids += chunk.output.outputs[0].token_ids
        return tuple(ids)

    def top_k(stub: Any, prompt: str) -> Signature:
        read = I.Intervention(name="top", read_logits=I.ReadLogits(stage=I.LOGITS_STAGE_RAW, top_k=I.TopK(k=5)))
        return _trace(stub, prompt, read, max_tokens=10, **GREEDY)

    def force_and_stop(stub: Any, prompt: str) -> Signature:
        force = I.Intervention(steps=I.StepSelector(list=I.StepList(steps=[1])),
                               force_sample=I.ForceSample(token_id=period_token))
        stop = I.Intervention(steps=I.StepSelector(list=I.StepList(steps=[5])), stop=I.Stop())
        return _trace(stub, prompt, force, stop, max_tokens=16, **GREEDY)

    def text_stop(stub: Any, prompt: str) -> Signature:
        stop = I.Intervention(condition=I.Condition(text_matches=r"[.!?]\s*$"), stop=I.Stop())
        return _trace(stub, prompt, stop, max_tokens=24, **GREEDY)

    def steer(stub: Any, prompt: str) -> Signature:
        return _trace(stub, prompt, steer_new, max_tokens=10, **GREEDY)

    def steer_prompt_positions(stub: Any, prompt: str) -> Signature:
        return _trace(stub, prompt, steer_prompt, max_tokens=6, **GREEDY)

    def layer_read(stub: Any, prompt: str) -> Signature:
        read = I.Intervention(name="h", read_module=I.ReadModule(module="layers.3"))
        return _trace(stub, prompt, read, max_tokens=8, **GREEDY)

    def seeded_n3(stub: Any, prompt: str) -> Signature:
        return _trace(stub, prompt, max_tokens=10, n=3, seed=7, temperature=0.8)

    def bad(stub: Any, prompt: str) -> Signature:
        stub.Generate(service_pb2.GenerateRequest(prompts=[prompt_pb2.Prompt(text=prompt)],
                                                  sampling_params=_sampling(top_p=3.0)), timeout=TIMEOUT_S)
        return None

    def cancel(stub: Any, prompt: str) -> Signature:
        call = stub.Trace(service_pb2.TraceRequest(
            invokes=[trace_pb2.Invoke(prompt=prompt_pb2.Prompt(text=prompt))],
            sampling_params=_sampling(max_tokens=300, **GREEDY)), timeout=TIMEOUT_S)
        for seen, _ in enumerate(call):
            if seen == 2:
                call.cancel()
        return None

    def deadline(stub: Any, prompt: str) -> Signature:
        stub.Generate(service_pb2.GenerateRequest(prompts=[prompt_pb2.Prompt(text=prompt)],
                                                  sampling_params=_sampling(max_tokens=300, **GREEDY)), timeout=0.05)
        return None

    return [Kind("generate", generate), Kind("generate_stream", stream), Kind("trace_top_k", top_k),
            Kind("trace_force_stop", force_and_stop), Kind("trace_text_stop", text_stop),
            Kind("trace_steer_new_tokens", steer), Kind("trace_steer_prompt", steer_prompt_positions),
            Kind("trace_layer_read", layer_read), Kind("trace_seeded_n3", seeded_n3),
            Kind("bad_request", bad, False), Kind("cancel_mid_stream", cancel, False),
            Kind("deadline", deadline, False)]


def run(kind: Kind, stub: Any, prompt: str) -> tuple[str, Signature]:
    try:
        return "OK", kind.call(stub, prompt)
    except grpc.RpcError as e:
        return e.code().name, None


class Process:
    """The server's process tree: RSS and open files, engine processes included."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)

    def sample(self) -> dict[str, int]:
        procs = [self.root, *self.root.children(recursive=True)]
        rss = fds = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
                fds += p.num_fds()
            except psutil.NoSuchProcess:
                pass
        return {"rss_bytes": rss, "fds": fds, "processes": len(procs)}

    def rss_by_process(self) -> dict[str, int]:
        """MiB per process of the tree, by name (the server, the engine core, its worker)."""
        out: dict[str, int] = {}
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                name = "server" if p.pid == self.root.pid else p.name()
                out[name] = out.get(name, 0) + (p.memory_info().rss >> 20)
            except psutil.NoSuchProcess:
                pass
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tracewire_server", "--model", str(MODEL),
                                 "--port", str(port), *SERVER_FLAGS], stdout=out, stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    with grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.TraceServiceStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                stub.GetModelInfo(service_pb2.GetModelInfoRequest(), timeout=2)
                return proc, target
            except grpc.RpcError:
                time.sleep(1)
    proc.kill()
    raise SystemExit("the server did not start in 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp()) / "soak-server.log"
    proc, target = start_server(log)
    try:
        report = soak(target, Process(proc.pid), args)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    report["server_exit_code"] = proc.returncode
    out = ROOT / "bench" / "results" / f"soak-{dt.datetime.now():%Y%m%d-%H%M}-vm.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {out.relative_to(ROOT)}")
    if report["mismatch_count"] or proc.returncode != 0:
        raise SystemExit(1)


def soak(target: str, server: Process, args: argparse.Namespace) -> dict[str, Any]:
    channel = grpc.insecure_channel(target)
    stub = service_pb2_grpc.TraceServiceStub(channel)
    info = stub.GetModelInfo(service_pb2.GetModelInfoRequest(), timeout=10)
    period = stub.Tokenize(service_pb2.TokenizeRequest(text="."), timeout=10).token_ids[-1]
    catalogue = kinds(info.hidden_size, period)
    solo: dict[tuple[str, str], Signature] = {}
    for kind in catalogue:  # alone, one at a time: the results load must not change
        for prompt in PROMPTS:
            status, signature = run(kind, stub, prompt)
            if kind.deterministic:
                assert status == "OK", f"{kind.name} alone: {status}"
                solo[kind.name, prompt] = signature
    before = server.sample()
    print(f"warm: {before}; {args.clients} clients for {args.seconds:.0f} s", flush=True)

    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    mismatches: list[dict[str, Any]] = []
    peak = dict(before)
    lock = threading.Lock()
    stop_at = time.monotonic() + args.seconds

    def client(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        with grpc.insecure_channel(target) as own:  # each client its own connection
            own_stub = service_pb2_grpc.TraceServiceStub(own)
            while time.monotonic() < stop_at:
                kind, prompt = rng.choice(catalogue), rng.choice(PROMPTS)
                status, signature = run(kind, own_stub, prompt)
                with lock:
                    calls[kind.name, status] += 1
                    if kind.deterministic and status == "OK" and signature != solo[kind.name, prompt]:
                        mismatches.append({"kind": kind.name, "prompt": prompt[:40],
                                           "solo": solo[kind.name, prompt], "under_load": signature})

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    started = time.monotonic()
    timeline: list[tuple[float, int]] = []  # (seconds in, RSS MiB): does it level off?
    by_process: list[tuple[float, dict[str, int]]] = []  # and which process holds it
    while any(t.is_alive() for t in threads):
        sample = server.sample()
        peak = {k: max(peak[k], sample[k]) for k in peak}
        seconds = round(time.monotonic() - started, 1)
        timeline.append((seconds, sample["rss_bytes"] >> 20))
        if len(timeline) % 15 == 1:
            by_process.append((seconds, server.rss_by_process()))
        time.sleep(2)
    after = server.sample()
    health = stub.GetEngineStats(service_pb2.GetEngineStatsRequest(), timeout=10)
    channel.close()

    by_kind: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (name, status), count in sorted(calls.items()):
        by_kind[name][status] = count
    print(f"{'kind':<26} calls by status")
    for name, statuses in by_kind.items():
        print(f"{name:<26} " + ", ".join(f"{s} {n}" for s, n in statuses.items()))
    total = sum(calls.values())
    compared = sum(n for (name, status), n in calls.items()
                   if status == "OK" and any(k.name == name and k.deterministic for k in catalogue))
    print(f"calls: {total}; compared with their solo results: {compared}; mismatches: {len(mismatches)}")
    print(f"server RSS {before['rss_bytes'] / 2**20:.0f} -> {after['rss_bytes'] / 2**20:.0f} MiB "
          f"(peak {peak['rss_bytes'] / 2**20:.0f}); open fds {before['fds']} -> {after['fds']} (peak {peak['fds']}); "
          f"requests left in the engine: {health.num_unfinished_requests}")
    every = max(1, len(timeline) // 6)
    print("RSS MiB over the run: " + ", ".join(f"{t:.0f} s {mib}" for t, mib in timeline[::every]))
    print("by process: " + "; ".join(f"{t:.0f} s {procs}" for t, procs in by_process))
    return {
        "machine": {"host": platform.node(), "cpus": psutil.cpu_count(), "python": platform.python_version()},
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "commit": _commit(),
        "clients": args.clients, "seconds": args.seconds, "seed": args.seed,
        "calls": total, "compared": compared, "calls_by_kind": by_kind,
        "mismatches": mismatches[:20], "mismatch_count": len(mismatches),
        "server_before": before, "server_after": after, "server_peak": peak,
        "unfinished_after": health.num_unfinished_requests,
        "rss_mib_timeline": timeline,
        "rss_mib_by_process": by_process,
    }


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


if __name__ == "__main__":
    main()
