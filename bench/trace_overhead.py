"""Trace overhead vs raw vLLM, side by side in one run (`make bench`).

Two engines on the same settings live side by side: vLLM's AsyncLLM in this
process (no tracewire code at all) and the tracewire server in a subprocess,
driven through gRPC from this process (`--load h2load`: from h2load, in C,
which takes far less of the machine's CPU per message; `make bench` runs
both). Rows are measured interleaved (raw, Generate, each trace kind, raw
again, ...) and each cell is the median of the repeats, so machine drift hits
every row alike. Same prompts, greedy, fixed
new-token count, at concurrency 1, 16 and 64. Reports generated tokens/s and
the ratio to raw, and for streamed rows the p50/p99 time from the server
receiving a step's token from the engine to the client receiving its StepResult.
Results: bench/results/trace-overhead-<date>-<host>.json.

GPU mode (`--shape qwen3-8b`, see bench/gpu.sh): a realistic shape with dummy
weights, bf16, CUDA graphs and torch.compile, 128 new tokens, concurrency up to
256, plus a row for vLLM's own logprobs=20 through tracewire.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from shapes import SHAPES, write_model_dir  # noqa: E402

PROMPTS = [
    "The capital of France is", "The capital of Japan is", "Once upon a time",
    "One, two, three,", "Mars is the", "Monday, Tuesday,", "The cow says", "Red, green,",
]
ENGINE: dict[str, object] = dict(dtype="float32", max_model_len=512, max_num_seqs=64)
# Two engines share one GPU: each gets part of its memory.
GPU_ENGINE: dict[str, object] = dict(dtype="bfloat16", load_format="dummy", max_model_len=1024,
                                     max_num_seqs=256, gpu_memory_utilization=0.42)
REQUEST_TIMEOUT_S = 300
# vLLM's workers keep polling their input queue in a sched_yield loop for a second
# after their last step (shm_broadcast's busy_loop_s) before they sleep. Both engines'
# workers are pinned to the same core on a CPU machine, so a cell timed right after the
# other engine's cell shared that core with a spinning worker for its first second:
# each cell waits that out first.
SETTLE_S = 1.5
LATENCY_NS: dict[str, dict[int, list[int]]] = {}  # row -> concurrency -> samples
FRONTEND_US: dict[str, dict[int, list[float]]] = {}  # row -> concurrency -> µs per token, per repeat
CHECKS: dict[str, dict[str, object]] = {}  # what a row's engine did, checked before timing it
# row -> concurrency -> CpuMeter.cores(), per repeat
CPU_CORES: dict[str, dict[int, list[dict[str, dict[str, float]]]]] = {}
# row -> concurrency -> each repeat's ratio to raw vLLM at the time the cell ran (paired_ratios)
PAIRED: dict[str, dict[int, list[float]]] = {}
RAW = "raw vLLM AsyncLLM"
# --eager-raw: a second raw AsyncLLM in this process with --enforce-eager, its ratio to the
# compiled raw engine measured in the same cells: what an eager server gives up before any
# tracewire code runs (issue 26: 0.23x at c=64 on the H200).
EAGER_RAW = "raw vLLM AsyncLLM, --enforce-eager"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CpuMeter:
    """CPU time the process serving a row spent over a cell's measured window: `pid`
    and its descendants except vLLM's engine processes (VLLM::*), i.e. the frontend(s).
    Per generated token, it is what serving costs beside the engine, and far steadier
    on a noisy machine than tokens/s. Also kept per process, engine processes included,
    with each one's busiest thread and thread count: where a row's extra CPU goes (a
    thread that spins shows as one core). Where vLLM cannot name its engine processes
    (no setproctitle) they count as frontends: the per-process view tells them apart.
    Linux (/proc) only; pid None measures nothing."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.seconds = 0.0
        self.tokens = 0
        self.wall = 0.0
        self.by_process: dict[str, tuple[float, float, int]] = {}  # name:pid -> (seconds, busiest thread's, threads)
        self._start: dict[int, tuple[str, int, dict[int, int]]] = {}
        self._started = 0.0

    def start(self) -> None:
        self._start, self._started = self._ticks(), time.perf_counter()

    def stop(self, tokens: int) -> None:
        end, hz = self._ticks(), os.sysconf("SC_CLK_TCK")
        self.tokens, self.wall = tokens, time.perf_counter() - self._started
        self.seconds, self.by_process = 0.0, {}
        for pid, (comm, ticks, threads) in end.items():
            _, before, before_threads = self._start.get(pid, (comm, 0, {}))
            spent = (ticks - before) / hz
            busiest = max((t - before_threads.get(tid, 0) for tid, t in threads.items()), default=0) / hz
            if not comm.startswith("VLLM::"):
                self.seconds += spent
            self.by_process[f"{comm}:{pid}"] = (spent, busiest, len(threads))

    def us_per_token(self) -> float | None:
        return 1e6 * self.seconds / self.tokens if self.pid and self.tokens else None

    def cores(self, top: int = 8) -> dict[str, dict[str, float]]:
        """The `top` busiest processes: cores busy on average over the window, their
        busiest thread's, their thread count."""
        if not self.wall:
            return {}
        ranked = sorted(self.by_process.items(), key=lambda kv: -kv[1][0])[:top]
        return {name: {"cores": round(s / self.wall, 3), "busiest_thread": round(t / self.wall, 3), "threads": n}
                for name, (s, t, n) in ranked}

    def _ticks(self) -> dict[int, tuple[str, int, dict[int, int]]]:
        """pid -> (name, user+system ticks, ticks per thread) for `pid` and its descendants."""
        if not self.pid:
            return {}
        stats = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stats[int(entry.name)] = _stat(entry / "stat")
                except (OSError, ValueError):  # gone meanwhile
                    continue
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        found, todo = {}, [self.pid]
        while todo:
            pid = todo.pop()
            if pid in stats:
                threads = {}
                for task in Path(f"/proc/{pid}/task").glob("*"):
                    try:
                        threads[int(task.name)] = _stat(task / "stat")[2]
                    except (OSError, ValueError):
                        continue
                found[pid] = (stats[pid][1], stats[pid][2], threads)
            todo += children.get(pid, [])
        return found


def _stat(path: Path) -> tuple[int, str, int]:
    """(parent pid, name, user+system ticks) from a /proc stat file."""
    text = path.read_text()
    comm, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
    return int(fields[1]), comm, int(fields[11]) + int(fields[12])


def steal_ticks() -> int:
    """CPU time the hypervisor gave to others (all CPUs; /proc/stat's steal), in ticks."""
    try:
        with open("/proc/stat") as stat:
            return int(stat.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return 0


def paired_ratios(cells: list[tuple[str, float, float]]) -> dict[str, list[float]]:
    """Each row's ratio to raw vLLM as fast as raw was when that cell ran.

    `cells`: (row, midpoint time, tok/s) in the order measured, raw first in every
    repeat and once more after the last. On a VM whose speed drifts by 20-40% over a few
    minutes (seen here), a row measured late in a repeat against the repeat's one raw
    cell reads the drift as overhead: raw is interpolated in time between the raw
    cells around it instead."""
    raws = [(t, v) for name, t, v in cells if name == RAW]
    out: dict[str, list[float]] = {}
    for name, t, v in cells:
        if name == RAW:
            continue
        before = max((r for r in raws if r[0] <= t), default=raws[0])
        after = min((r for r in raws if r[0] >= t), default=raws[-1])
        span = after[0] - before[0]
        raw = before[1] + (after[1] - before[1]) * ((t - before[0]) / span if span else 0.0)
        out.setdefault(name, []).append(v / raw)
    return out


async def timed(concurrency: int, rounds: int, one, meter: CpuMeter) -> float:
    """Tokens/s with `concurrency` requests in flight, `rounds` requests per slot."""
    async def slot(i: int) -> int:
        return sum([await one(i * rounds + r, concurrency) for r in range(rounds)])

    await asyncio.gather(*(one(i, 0) for i in range(min(concurrency, 4))))  # warm-up (not sampled)
    meter.start()
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(slot(i) for i in range(concurrency))))
    elapsed = time.perf_counter() - start
    meter.stop(tokens)
    return tokens / elapsed


ROWS = ("trace, no interventions", "top-20 logits every step", "full logits every step",
        "forced token at step 0")
LOGPROBS_ROW = "vLLM logprobs=20 (Generate)"
# bench/bare_stream.py: vLLM and one gRPC message per token, no tracewire code (CPU mode).
BARE_ROW = "bare gRPC token stream (no tracewire)"
INTERVAL_ROW = "top-20 logits every step, 50 ms stream interval"
GPU_ROWS = ("trace, no interventions", "top-20 logits every step", INTERVAL_ROW, "forced token at step 0")
# --hidden: module hooks need eager engines (both engines run --enforce-eager then).
PATTERN_ROW = "attention pattern (top-5, layer 1, all heads) every step"
LENS_ROW = "logit lens top-5 (4 layers) every step"
PROBE_ROW = "probe read (k=16, layer 1) every step"
SAE_ROW = "SAE top-20 (layer 1) every step"
HEAD_ZERO_ROW = "head zero (layers.1, head 0) every step"
SAE_STEER_ROW = "SAE feature steering (layer 1, 2 features) every step"
HIDDEN_ROWS = ("trace, no interventions", "layer read every step", "steering write every step",
               "head read every step", PATTERN_ROW, PROBE_ROW, SAE_ROW, LENS_ROW)
# The dictionary rows' probe and SAE: random weights of the model's hidden size, made at
# start (write_dictionaries); --sae-features sets the SAE's width.
DICTIONARY_ROWS = (PROBE_ROW, SAE_ROW, SAE_STEER_ROW)
# --compiled-steering: both engines compiled (CUDA graphs on a GPU), the server with its
# steering tables; layer reads need eager engines, so only the write is measured (and
# top-20, which the tables cost as they cost every request).
COMPILED_STEERING_ROWS = ("trace, no interventions", "top-20 logits every step", "steering write every step")
# --compiled-reads: both engines compiled (CUDA graphs on a GPU), the server with read
# buffers on every layer, of residual streams and of units (and steering tables: a read of
# a steered layer is the common research loop); the targets are the layer read, the
# 4-layer lens and the head read (and unit tables: the head write).
COMPILED_READS_ROWS = ("trace, no interventions", "layer read every step", "head read every step", LENS_ROW,
                       PROBE_ROW, SAE_ROW, "steering write every step", HEAD_ZERO_ROW, SAE_STEER_ROW, PATTERN_ROW)
SERVER_FLAGS: list[str] = []  # tracewire's own options for the server (not the raw engine's)


def async_llm(model: str, engine: dict[str, object], new_tokens: int, **params: Any):
    """vLLM's AsyncLLM on these settings, the bench's greedy sampling params (plus
    `params`) and PROMPTS as token ids: the raw row's engine and the bare stream's."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **engine))
    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, **params)
    tok = llm.get_tokenizer()
    return llm, sampling, [tok.encode(p) for p in PROMPTS]


async def raw_engine(model: str, new_tokens: int, **overrides: object):
    """vLLM's AsyncLLM in this process: the baseline, no tracewire code at all (with
    `overrides` of the bench's engine settings: the eager raw row)."""
    llm, params, ids = async_llm(model, {**ENGINE, **overrides}, new_tokens)

    async def one(i: int, concurrency: int) -> int:
        final = None
        request_id = f"r{i}-{time.monotonic_ns()}"
        async for out in llm.generate({"prompt_token_ids": ids[i % len(ids)]}, params, request_id):
            final = out
        return len(final.outputs[0].token_ids)

    return llm, one


def generate_request(prompt: str, new_tokens: int, **params: Any):
    """The Generate rows' request: the bench's greedy sampling (plus `params`)."""
    from tracewire.v1 import prompt_pb2, sampling_pb2, service_pb2

    return service_pb2.GenerateRequest(
        prompts=[prompt_pb2.Prompt(text=prompt)],
        sampling_params=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                                                    **params))


def trace_request(kind: str, prompt: str, new_tokens: int):
    import numpy as np
    from tracewire.v1 import intervention_pb2 as I
    from tracewire.v1 import prompt_pb2, sampling_pb2, service_pb2, tensor_pb2, trace_pb2

    vector = np.full(HIDDEN_SIZE[0], 0.01, dtype="<f4")
    steer = I.WriteModule(
        module="layers.1",
        add=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[vector.size], data=vector.tobytes()),
    )
    ivs = {
        "layer read every step": [I.Intervention(name="h", read_module=I.ReadModule(module="layers.1"))],
        # four layers (negative: from the end; the tiny model has 4), the new token's top-5 each
        LENS_ROW: [I.Intervention(name="lens", read_logit_lens=I.ReadLogitLens(layers=[0, 1, -2, -1], top_k=5))],
        "steering write every step": [I.Intervention(write_module=steer)],
        # two heads of layers.1 at each step's new token: [2, head_dim] (o_proj's input)
        "head read every step": [I.Intervention(name="heads", read_module=I.ReadModule(
            module="layers.1.self_attn.heads", units=I.UnitSelection(ids=I.UnitIds(ids=[0, 2]))))],
        # head 0 of layers.1 zeroed at every step (o_proj's input columns)
        HEAD_ZERO_ROW: [I.Intervention(write_module=I.WriteModule(
            module="layers.1.self_attn.heads", units=I.UnitIds(ids=[0]), zero=I.ZeroAblation()))],
        # two features' decoder rows added at every step (a steering-table slot, as a layer write)
        SAE_STEER_ROW: [I.Intervention(write_dictionary=I.WriteDictionary(dictionary="bench-sae", features=[1, 2],
                                                                           steer=4.0))],
        # the new token's weights over every key, each step: the key copy, q . K, softmax, top-k
        PATTERN_ROW: [I.Intervention(name="a", read_attention_pattern=I.ReadAttentionPattern(layers=[1], top_k=5))],
        # the dictionaries' one batched matmul per step over every row reading them
        PROBE_ROW: [I.Intervention(name="p", read_dictionary=I.ReadDictionary(dictionary="bench-probe"))],
        SAE_ROW: [I.Intervention(name="f", read_dictionary=I.ReadDictionary(dictionary="bench-sae",
                                                                              top_k=I.TopK(k=20)))],
        "trace, no interventions": [],
        "top-20 logits every step": [I.Intervention(name="t", read_logits=I.ReadLogits(top_k=I.TopK(k=20)))],
        INTERVAL_ROW: [I.Intervention(name="t", read_logits=I.ReadLogits(top_k=I.TopK(k=20)))],
        "full logits every step": [I.Intervention(name="f", read_logits=I.ReadLogits(full=I.FullRow()))],
        "forced token at step 0": [
            I.Intervention(steps=I.StepSelector(list=I.StepList(steps=[0])), force_sample=I.ForceSample(token_id=5))
        ],
    }[kind]
    return service_pb2.TraceRequest(
        sampling_params=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
        invokes=[trace_pb2.Invoke(prompt=prompt_pb2.Prompt(text=prompt), interventions=ivs)],
        options=trace_pb2.TraceOptions(stream_interval_ms=50 if kind == INTERVAL_ROW else 0),
    )


async def steering_check(port: int, new_tokens: int = 24) -> dict[str, object]:
    """Whether the steering row does what it says on this engine (the GPU runs it with
    CUDA graphs and async scheduling, which the CPU tests do not): greedy tokens of one
    prompt plain, steered at every step (the planner's steady path), steered through a
    step range covering the same steps (its per-pass path: must agree), steered from
    step 4 on (the first 4 tokens must be the plain ones), and with a zero vector (must
    equal plain). Reported in the results, not asserted: dummy weights may be too flat
    for a vector to move the argmax."""
    import grpc
    import numpy as np
    from tracewire.v1 import intervention_pb2 as I
    from tracewire.v1 import prompt_pb2, sampling_pb2, service_pb2, service_pb2_grpc, tensor_pb2, trace_pb2

    sampling = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompt = prompt_pb2.Prompt(text=PROMPTS[0])
    vector = np.random.default_rng(0).normal(0.0, 8.0, HIDDEN_SIZE[0]).astype("<f4")

    def steer(values, steps=None):
        add = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[values.size], data=values.tobytes())
        return trace_pb2.Invoke(prompt=prompt, interventions=[I.Intervention(
            steps=steps, write_module=I.WriteModule(module="layers.1", add=add))])

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.TraceServiceStub(channel)

        async def traced(invoke) -> list[int]:
            ends = [ev async for ev in stub.Trace(service_pb2.TraceRequest(sampling_params=sampling,
                                                                          invokes=[invoke]), timeout=120)
                    if ev.HasField("invoke_result")]
            return list(ends[0].invoke_result.output.outputs[0].token_ids)

        plain = list((await stub.Generate(service_pb2.GenerateRequest(prompts=[prompt], sampling_params=sampling),
                                          timeout=120)).outputs[0].outputs[0].token_ids)
        steady = await traced(steer(vector))
        per_pass = await traced(steer(vector, I.StepSelector(range=I.StepRange(start=0, stop=new_tokens))))
        late = await traced(steer(vector, I.StepSelector(range=I.StepRange(start=4))))
        zero = await traced(steer(np.zeros_like(vector)))
    return {"steered_differs_from_plain": steady != plain, "steady_equals_per_pass": steady == per_pass,
            "from_step_4_keeps_first_4": late[:4] == plain[:4], "zero_vector_equals_plain": zero == plain,
            "tokens": {"plain": plain, "steered": steady, "per_pass": per_pass, "from_step_4": late, "zero": zero}}


def start_bare(model: str, log_path: Path, new_tokens: int) -> tuple[subprocess.Popen[bytes], int]:
    """bench/bare_stream.py in a subprocess on the same engine settings."""
    port = free_port()
    args = [sys.executable, str(ROOT / "bench" / "bare_stream.py"), str(port), model, json.dumps(ENGINE),
            str(new_tokens)]
    with open(log_path, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT), port


async def wait_for_bare(bare: subprocess.Popen[bytes], log_path: Path) -> None:
    for _ in range(360):
        if bare.poll() is not None:
            tail = log_path.read_bytes()[-3000:].decode(errors="replace")
            raise SystemExit(f"bench/bare_stream.py exited with {bare.returncode}; its log ends:\n{tail}")
        if b"bare stream: serving" in log_path.read_bytes():
            return
        await asyncio.sleep(1)
    raise SystemExit("bench/bare_stream.py did not start in 360 s")


def write_dictionaries(model: str, out: Path, sae_features: int) -> int:
    """A probe (k=16) and a ReLU SAE of `sae_features` features on layers.1, random (seeded)
    float32 weights of the model's hidden size, for --dictionaries: the device bytes
    they take."""
    import numpy as np
    from safetensors.numpy import save_file

    hidden = int(json.loads((Path(model) / "config.json").read_text())["hidden_size"])
    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    made = {
        "bench-probe": ({"kind": "DICTIONARY_KIND_PROBE", "module": "layers.1",
                         "probe_activation": "PROBE_ACTIVATION_SIGMOID"},
                        {"W": rng.standard_normal((16, hidden), np.float32) * 0.01,
                         "b": np.zeros(16, np.float32)}),
        "bench-sae": ({"kind": "DICTIONARY_KIND_SAE", "module": "layers.1"},
                      {"W_enc": rng.standard_normal((hidden, sae_features), np.float32) * 0.01,
                       "b_enc": np.zeros(sae_features, np.float32),
                       "W_dec": rng.standard_normal((sae_features, hidden), np.float32) * 0.01,
                       "b_dec": np.zeros(hidden, np.float32)}),
    }
    total = 0
    for name, (spec, tensors) in made.items():
        (out / f"{name}.json").write_text(json.dumps(spec))
        save_file(tensors, str(out / f"{name}.safetensors"))
        total += sum(t.nbytes for t in tensors.values())
    return total


def start_server(model: str, log_path: Path, frontends: int) -> tuple[subprocess.Popen[bytes], int]:
    """The tracewire server in a subprocess, its output in `log_path`."""
    port = free_port()
    args = [sys.executable, "-m", "tracewire_server", "--model", model, "--port", str(port),
            "--frontends", str(frontends), *SERVER_FLAGS]
    for key, value in ENGINE.items():  # the same engine settings as the raw engine
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False:
            args += [flag, str(value)]
    with open(log_path, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT), port


HIDDEN_SIZE = [0]  # set from GetModelInfo
DICTIONARY_BYTES = [0]  # the dictionary rows' weights (write_dictionaries)


async def wait_for_server(server: subprocess.Popen[bytes], log_path: Path, port: int) -> int:
    """Until the server answers; its hidden size."""
    import grpc
    from tracewire.v1 import service_pb2, service_pb2_grpc

    def log_tail() -> str:
        return log_path.read_bytes()[-3000:].decode(errors="replace")

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.TraceServiceStub(channel)
        for _ in range(360):
            if server.poll() is not None:  # say so at once instead of waiting out the start
                raise SystemExit(f"the tracewire server exited with {server.returncode}; its log ends:\n{log_tail()}")
            try:
                info = await stub.GetModelInfo(service_pb2.GetModelInfoRequest(), timeout=2)
                return int(info.hidden_size)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(1)
    raise SystemExit(f"the tracewire server did not answer in 360 s; its log ends:\n{log_tail()}")


async def tracewire_clients(port: int, new_tokens: int, rows: tuple[str, ...], channels: int = 1,
                            bare_port: int = 0):
    """One request function per tracewire row, all through gRPC from this process, the
    requests spread over `channels` connections (a server with several frontends
    balances connections, not calls); and the bare stream's on `bare_port`."""
    import grpc
    from tracewire.v1 import service_pb2, service_pb2_grpc

    opened = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(channels)]
    stubs = [service_pb2_grpc.TraceServiceStub(c) for c in opened]

    def generate(**params: Any):
        async def one(i: int, concurrency: int) -> int:
            r = await stubs[i % len(stubs)].Generate(
                generate_request(PROMPTS[i % len(PROMPTS)], new_tokens, **params), timeout=REQUEST_TIMEOUT_S)
            return len(r.outputs[0].outputs[0].token_ids)
        return one

    def latencies(row: str, concurrency: int) -> list[int]:
        return LATENCY_NS.setdefault(row, {}).setdefault(concurrency, []) if concurrency else []

    def bare(call_bare):
        async def one(i: int, concurrency: int) -> int:
            call = call_bare(str(i % len(PROMPTS)).encode(), timeout=REQUEST_TIMEOUT_S)
            return await read_steps(call, latencies(BARE_ROW, concurrency))
        return one

    def traced(kind: str):
        async def one(i: int, concurrency: int) -> int:
            call = stubs[i % len(stubs)].Trace(trace_request(kind, PROMPTS[i % len(PROMPTS)], new_tokens),
                                                timeout=REQUEST_TIMEOUT_S)
            return await read_steps(call, latencies(kind, concurrency))
        return one

    fns = {"Generate": generate(),
           **{kind: traced(kind) for kind in rows if kind not in (LOGPROBS_ROW, BARE_ROW)}}
    if LOGPROBS_ROW in rows:
        fns[LOGPROBS_ROW] = generate(logprobs=20)
    if bare_port:
        bare_channel = grpc.aio.insecure_channel(f"127.0.0.1:{bare_port}")
        opened.append(bare_channel)
        from bare_stream import METHOD
        fns[BARE_ROW] = bare(bare_channel.unary_stream(
            METHOD, response_deserializer=service_pb2.TraceResponse.FromString))
    return opened, fns


async def read_steps(call, latencies: list[int]) -> int:
    """The steps a stream of TraceResponses carries (the bare stream and Trace alike), and
    each one's time from the server receiving its token to this client holding it."""
    steps = 0
    async for ev in call:
        now = time.time_ns()
        for step in ev.steps.results:
            latencies.append(now - step.engine_time.ToNanoseconds())
        steps += len(ev.steps.results)
    return steps


def _client_proc(conn, port: int, new_tokens: int, rows: tuple[str, ...], channels: int, hidden: int,
                 bare_port: int) -> None:
    """A load-generator process: runs its share of each cell when told to, on its own
    connections, and reports (tokens, start, end, latency samples)."""
    HIDDEN_SIZE[0] = hidden

    async def main() -> None:
        opened, fns = await tracewire_clients(port, new_tokens, rows, channels, bare_port)
        while (cell := await asyncio.to_thread(conn.recv)) is not None:
            name, first, share, rounds, concurrency = cell
            one = fns[name]
            LATENCY_NS.clear()
            await asyncio.gather(*(one(first + i, 0) for i in range(min(share, 4))))  # warm-up
            conn.send("ready")
            await asyncio.to_thread(conn.recv)  # all processes start together
            start = time.monotonic()
            tokens = await _share(one, first, share, rounds, concurrency)
            conn.send((tokens, start, time.monotonic(), LATENCY_NS.get(name, {}).get(concurrency, [])))
        for channel in opened:
            await channel.close()

    asyncio.run(main())


async def _share(one, first: int, share: int, rounds: int, concurrency: int) -> int:
    """Tokens from `share` slots of a cell, `rounds` requests each, slots first.. ."""
    async def slot(i: int) -> int:
        return sum([await one((first + i) * rounds + r, concurrency) for r in range(rounds)])

    return sum(await asyncio.gather(*(slot(i) for i in range(share))))


class ClientProcesses:
    """The gRPC load spread over several processes, so that at high concurrency the
    client's own per-message Python is not what the bench measures. Each process
    opens its own connections (a server with several frontends balances those)."""

    def __init__(self, procs: int, port: int, new_tokens: int, rows: tuple[str, ...], channels: int,
                 bare_port: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_proc, daemon=True,
                               args=(child, port, new_tokens, rows, channels, HIDDEN_SIZE[0], bare_port))
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def cell(self, name: str):
        async def run(concurrency: int, rounds: int, meter: CpuMeter) -> float:
            k = len(self.conns)
            shares = [concurrency // k + (1 if i < concurrency % k else 0) for i in range(k)]
            active = [(conn, sum(shares[:i]), share)
                      for i, (conn, share) in enumerate(zip(self.conns, shares, strict=True)) if share]
            for conn, first, share in active:
                conn.send((name, first, share, rounds, concurrency))
            for conn, _, _ in active:
                assert await asyncio.to_thread(conn.recv) == "ready"
            meter.start()
            for conn, _, _ in active:
                conn.send("go")
            results = [await asyncio.to_thread(conn.recv) for conn, _, _ in active]
            meter.stop(sum(r[0] for r in results))
            LATENCY_NS.setdefault(name, {}).setdefault(concurrency, []).extend(
                sample for r in results for sample in r[3])
            return sum(r[0] for r in results) / (max(r[2] for r in results) - min(r[1] for r in results))
        return run

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(30)


class H2Load:
    """The load from h2load (nghttp2's HTTP/2 load generator, in C) instead of Python clients.

    On a machine with no core to spare, a Python gRPC client costs ~80-90 µs of CPU per
    streamed message (Node's connect-node ~70; h2load ~17, measured side by side against
    one server): at c=64 the client alone takes a fifth of a core from the server it
    measures. h2load sends each row's request (gRPC-framed, one prompt) on one connection,
    `concurrency` streams at a time, and reads every response whole; it cannot read the
    messages, so no latency is measured in this mode. A failed RPC still has HTTP status
    200, so each cell is checked two ways: no stream may end in a trailers-only error
    (`grpc-status` among its headers, printed by -v), and the response bytes must be at
    least 90% of the warm-up's per request (a stream cut short carries fewer)."""

    def __init__(self, port: int, new_tokens: int, bare_port: int) -> None:
        import shutil

        self.binary = shutil.which("h2load")
        if self.binary is None:
            raise SystemExit("--load h2load needs h2load (Debian: apt-get install nghttp2-client)")
        self.port, self.bare_port, self.new_tokens = port, bare_port, new_tokens
        self.body_dir = Path(tempfile.mkdtemp(prefix="bench-h2load-"))

    def cell(self, name: str):
        port, method = self.port, "/tracewire.v1.TraceService/Trace"
        if name == "Generate":
            method = "/tracewire.v1.TraceService/Generate"
            message = generate_request(PROMPTS[0], self.new_tokens).SerializeToString()
        elif name == BARE_ROW:
            from bare_stream import METHOD
            port, method, message = self.bare_port, METHOD, b"0"
        else:
            message = trace_request(name, PROMPTS[0], self.new_tokens).SerializeToString()
        body = self.body_dir / f"{len(list(self.body_dir.iterdir()))}.grpc"
        body.write_bytes(b"\0" + len(message).to_bytes(4, "big") + message)  # one uncompressed gRPC message
        url = f"http://127.0.0.1:{port}{method}"
        floor = self.new_tokens * (1 if name == "Generate" else 5)  # bytes a whole response has at least

        async def run(concurrency: int, rounds: int, meter: CpuMeter) -> float:
            warm = min(concurrency, 4)
            per_request = (await self._h2load(url, body, warm, concurrency, name))["data"] / warm
            if per_request < floor:
                raise SystemExit(f"{name}: the warm-up's responses were {per_request:.0f} bytes, under the "
                                 f"{floor} a whole one has: the server failed them")
            requests = concurrency * rounds
            meter.start()
            done = await self._h2load(url, body, requests, concurrency, name)
            meter.stop(requests * self.new_tokens)
            if done["data"] < 0.9 * per_request * requests:
                raise SystemExit(f"{name}: {done['data']} response bytes for {requests} requests, under 90% "
                                 f"of the warm-up's {per_request:.0f} each: some were cut short")
            return requests * self.new_tokens / done["seconds"]
        return run

    async def _h2load(self, url: str, body: Path, requests: int, concurrency: int, name: str) -> dict[str, float]:
        proc = await asyncio.create_subprocess_exec(
            self.binary, "-v", "-n", str(requests), "-c", "1", "-m", str(concurrency), "-d", str(body),
            "-H", "content-type: application/grpc", "-H", "te: trailers", url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out = (await proc.communicate())[0].decode(errors="replace")
        finished = re.search(r"finished in ([\d.]+)(us|ms|s),", out)
        succeeded = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded", out)
        data = re.search(r"traffic: .* \((\d+)\) data", out)
        errors = [line for line in out.splitlines() if "grpc-status:" in line or "grpc-message:" in line]
        if proc.returncode or not (finished and succeeded and data) or int(succeeded[1]) != requests or errors:
            tail = "\n".join(errors[:4] or out.splitlines()[-12:])
            raise SystemExit(f"{name}: h2load's {requests} requests did not all succeed:\n{tail}")
        scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0}[finished[2]]
        return {"seconds": float(finished[1]) * scale, "data": float(data[1])}


def _profile(server_pid: int, row: str, concurrency: int, out_dir: str) -> list[subprocess.Popen[bytes]]:
    """py-spy on the server and its engine processes, and on the load generator, while
    one cell runs, when BENCH_PYSPY (the py-spy binary) and BENCH_PROFILE
    ("<row>@<concurrency>", several separated by '|') ask for it, the first such cell of
    each; BENCH_PYSPY_ARGS replaces --nonblocking. `server_pid`: the process serving the
    row (the bare stream's own, for its row)."""
    spy, wanted = os.environ.get("BENCH_PYSPY"), os.environ.get("BENCH_PROFILE", "").split("|")
    cell = f"{row}@{concurrency}"
    if not spy or cell not in wanted or cell in _profile.done:  # type: ignore[attr-defined]
        return []
    _profile.done.add(cell)  # type: ignore[attr-defined]
    tag = "" if len(wanted) == 1 else "-" + re.sub(r"[^a-z0-9]+", "-", cell.lower()).strip("-")
    # The server and every process under it (frontends, engine core, workers), stacks
    # tagged by process; and this process with its client processes (the load).
    # py-spy options in place of --nonblocking, e.g. "--idle --native" (native stacks stop
    # the process at each sample: they cannot be taken nonblocking)
    extra = os.environ.get("BENCH_PYSPY_ARGS", "--nonblocking").split()
    return [subprocess.Popen([spy, "record", "-p", str(pid), "--subprocesses", "-r", "250", "-d", "3",
                              "-f", "raw", *extra, "-o", str(Path(out_dir) / f"spy-{name}{tag}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for pid, name in ((server_pid, "server"), (os.getpid(), "bench"))]


_profile.done = set()  # type: ignore[attr-defined]


async def measure(model: str, levels, rounds: dict[int, int], repeats: int, new_tokens: int,
                  rows_kinds: tuple[str, ...], out_dir: str = ".", frontends: int = 1, client_procs: int = 1,
                  load: str = "python", eager_raw: bool = False):
    """Rows interleaved (raw, Generate, each trace kind, raw, ...) so drift hits all alike;
    the median of `repeats` per cell, and of each row's ratios to raw at its own time
    (paired_ratios: one more raw cell closes each concurrency)."""
    began = time.perf_counter()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    log_path = Path(out_dir) / "server.log"
    server, port = start_server(model, log_path, frontends)
    bare, bare_port = start_bare(model, Path(out_dir) / "bare.log", new_tokens) if BARE_ROW in rows_kinds else (None, 0)
    try:
        HIDDEN_SIZE[0] = await wait_for_server(server, log_path, port)
        log(f"tracewire server up after {time.perf_counter() - began:.0f} s")
        if "steering write every step" in rows_kinds:
            CHECKS["steering"] = await steering_check(port)
            log(f"steering check: {json.dumps({k: v for k, v in CHECKS['steering'].items() if k != 'tokens'})}")
        if bare is not None:
            await wait_for_bare(bare, Path(out_dir) / "bare.log")
            log(f"bare stream up after {time.perf_counter() - began:.0f} s")
        # One connection per frontend and client process is not enough to spread the
        # load evenly (the kernel picks the frontend per connection): a few more.
        channels = 1 if frontends == 1 else 4 * frontends
        clients = None
        if load == "h2load":
            opened: list = []
            h2load = H2Load(port, new_tokens, bare_port)
            cells = {name: h2load.cell(name) for name in ("Generate", *rows_kinds)}
        elif client_procs > 1:
            clients = ClientProcesses(client_procs, port, new_tokens, rows_kinds, channels, bare_port)
            opened = []
            cells = {name: clients.cell(name) for name in ("Generate", *rows_kinds)}
        else:
            opened, fns = await tracewire_clients(port, new_tokens, rows_kinds, channels, bare_port)
            cells = {name: _in_process(fn) for name, fn in fns.items()}
        llm, raw = await raw_engine(model, new_tokens)
        log(f"raw engine up after {time.perf_counter() - began:.0f} s")
        engines = [llm]
        if eager_raw:
            eager_llm, eager = await raw_engine(model, new_tokens, enforce_eager=True)
            engines.append(eager_llm)
            cells = {EAGER_RAW: _in_process(eager), **cells}
            log(f"eager raw engine up after {time.perf_counter() - began:.0f} s")
        # This process holds a whole AsyncLLM and is the tracewire rows' client: a full GC
        # over its startup objects stalls every stream it reads for ~0.3 s. The tracewire
        # server and the bare stream freeze theirs alike, as vLLM's API server does.
        gc.collect()
        gc.freeze()
        # raw, the bare stream (when measured), then tracewire's rows
        cells = {RAW: _in_process(raw), **dict(sorted(cells.items(), key=lambda kv: kv[0] != BARE_ROW))}
        samples: dict[str, dict[int, list[float]]] = {k: {c: [] for c in levels} for k in cells}
        # The raw engine shares this process with the tracewire rows' client: no meter.
        serving = {RAW: None, EAGER_RAW: None, BARE_ROW: bare.pid if bare is not None else None}
        for c in levels:
            for name in cells:
                FRONTEND_US.setdefault(name, {})[c] = []
        try:
            for c in levels:
                timeline: list[tuple[str, float, float]] = []
                # every repeat's rows, then raw once more: each row has raw cells on both sides
                order = [*(name for _ in range(repeats) for name in cells), RAW]
                for i, name in enumerate(order):
                    cell = cells[name]
                    await asyncio.sleep(SETTLE_S)
                    closing = i == len(order) - 1
                    profile = _profile(serving.get(name) or server.pid, name, c, out_dir)
                    meter = CpuMeter(serving.get(name, server.pid))
                    seen = len(LATENCY_NS.get(name, {}).get(c, []))
                    stolen, began_cell = steal_ticks(), time.perf_counter()
                    tok_s = await cell(c, rounds[c], meter)
                    timeline.append((name, (began_cell + time.perf_counter()) / 2, tok_s))
                    steal = (steal_ticks() - stolen) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - began_cell)
                    if not closing:  # (the closing raw cell only brackets the last repeat)
                        samples[name][c].append(tok_s)
                    latency = LATENCY_NS.get(name, {}).get(c, [])[seen:]  # this cell's
                    if (us := meter.us_per_token()) is not None:
                        FRONTEND_US[name][c].append(us)
                        CPU_CORES.setdefault(name, {}).setdefault(c, []).append(meter.cores())
                        log(f"  cores busy: {json.dumps(meter.cores())}")
                    if profile:
                        for p in profile:
                            p.wait()
                    us = f", frontend {FRONTEND_US[name][c][-1]:.0f} µs CPU/token" if FRONTEND_US[name][c] else ""
                    ms = (f", latency p50 / p99 {percentile(latency, 0.5):.2f} / {percentile(latency, 0.99):.2f} ms"
                          if latency else "")
                    stole = f", {100 * steal:.0f}% of a CPU stolen by the hypervisor" if steal >= 0.01 else ""
                    log(f"c={c} {name}: {tok_s:.0f} tok/s{us}{ms}{stole}")
                for name, ratios in paired_ratios(timeline).items():
                    PAIRED.setdefault(name, {})[c] = ratios
        finally:
            for engine in engines:
                engine.shutdown()
            for channel in opened:
                await channel.close()
            if clients is not None:
                clients.close()
        return {k: {c: statistics.median(v) for c, v in by_c.items()} for k, by_c in samples.items()}
    finally:
        for proc in (server, bare):
            if proc is not None:
                proc.terminate()
                proc.wait(120)


def _in_process(one):
    async def run(concurrency: int, rounds: int, meter: CpuMeter) -> float:
        return await timed(concurrency, rounds, one, meter)
    return run


def log(message: str) -> None:
    """Progress on stderr as cells finish: a run cut off still leaves its numbers."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6 if ordered else float("nan")


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a description only
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(ROOT / "models" / "tracewire-tiny"))
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="GPU mode: this model shape with dummy weights, bf16, compiled, "
                        "concurrency 1,16,64,256, 128 new tokens")
    parser.add_argument("--concurrency", default=None, help="default 1,16,64 (GPU mode: 1,16,64,256)")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--hidden", action="store_true",
                      help="hidden-state rows (layer read, steering write) on eager engines")
    mode.add_argument("--compiled-reads", action="store_true",
                      help="layer and head reads, the logit lens, probe and SAE reads on compiled engines "
                      "(CUDA graphs on a GPU): the server runs with --compiled-reads --compiled-unit-reads "
                      "--compiled-steering --compiled-unit-steering --compiled-pattern-reads 1 (the pattern "
                      "row's layer)")
    mode.add_argument("--compiled-steering", action="store_true",
                      help="the steering row on compiled engines (CUDA graphs on a GPU): the server "
                      "runs with --compiled-steering")
    parser.add_argument("--frontends", type=int, default=1,
                        help="the server's --frontends (processes sharing its engine core)")
    parser.add_argument("--client-procs", type=int, default=1,
                        help="load-generator processes for the tracewire rows (1: this process)")
    parser.add_argument("--load", choices=("python", "h2load"), default="python",
                        help="what sends the tracewire rows' requests: Python gRPC clients (latency measured), "
                        "or h2load (C, ~5x less CPU per message; tokens/s only, one prompt for every row)")
    parser.add_argument("--rounds", type=int, default=2, help="requests per concurrency slot")
    parser.add_argument("--min-tokens", type=int, default=1024,
                        help="more rounds at low concurrency until a cell generates at least this many "
                        "tokens (a c=1 cell of 2 requests lasts about a second: too short to read)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64 (GPU mode: 128)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per cell (median)")
    parser.add_argument("--sae-features", type=int, default=4096,
                        help="the SAE row's dictionary width (--hidden; the issue's GPU row: 16384)")
    parser.add_argument("--rows", default=None,
                        help="only these rows, names separated by ';' (raw vLLM and Generate always run), "
                        "e.g. --rows 'trace, no interventions;top-20 logits every step'")
    parser.add_argument("--eager-raw", action="store_true",
                        help="also a raw vLLM engine with --enforce-eager in this process, measured beside "
                        "the compiled one (GPU mode: each engine then takes 0.28 of the GPU's memory)")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="engine setting for both engines, e.g. --engine dtype=bfloat16 "
                        "--engine load_format=dummy --engine max_num_seqs=256 (values parsed as JSON)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.shape:
        ENGINE.clear()
        ENGINE.update(GPU_ENGINE)
        args.model = str(write_model_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape))
        if args.eager_raw:  # three engines on one GPU
            ENGINE["gpu_memory_utilization"] = 0.28
    args.concurrency = args.concurrency or ("1,16,64,256" if args.shape else "1,16,64")
    args.new_tokens = args.new_tokens or (128 if args.shape else 64)
    for item in args.engine:
        key, _, raw_value = item.partition("=")
        try:
            ENGINE[key] = json.loads(raw_value)
        except json.JSONDecodeError:
            ENGINE[key] = raw_value
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.load == "h2load":
        if args.shape or args.client_procs > 1:
            parser.error("--load h2load is for the CPU mode, with no --client-procs")
        del PROMPTS[1:]  # h2load sends one request body: every row, raw too, gets the same prompt

    if args.hidden:
        ENGINE["enforce_eager"] = True
        kind, kinds = "hidden", HIDDEN_ROWS
    elif args.compiled_reads:
        SERVER_FLAGS.extend(["--compiled-reads", "--compiled-unit-reads", "--compiled-steering",
                             "--compiled-unit-steering", "--compiled-pattern-reads", "1"])
        kind, kinds = "compiled-reads", COMPILED_READS_ROWS
    elif args.compiled_steering:
        SERVER_FLAGS.append("--compiled-steering")
        kind, kinds = "compiled-steering", COMPILED_STEERING_ROWS
    else:
        kind, kinds = "trace", (GPU_ROWS + (LOGPROBS_ROW,) if args.shape else (BARE_ROW, *ROWS))
    if args.rows:
        wanted = [name.strip() for name in args.rows.split(";") if name.strip()]
        unknown = [name for name in wanted if name not in kinds]
        if unknown:
            parser.error(f"--rows: no row named {unknown}; rows of this mode: {'; '.join(kinds)}")
        kinds = tuple(name for name in kinds if name in wanted)
    if any(name in DICTIONARY_ROWS for name in kinds):
        folder = Path(tempfile.mkdtemp()) / "dictionaries"
        DICTIONARY_BYTES[0] = write_dictionaries(args.model, folder, args.sae_features)
        SERVER_FLAGS.extend(["--dictionaries", str(folder)])
    rounds = {c: max(args.rounds, -(-args.min_tokens // (c * args.new_tokens))) for c in levels}
    rows = asyncio.run(measure(args.model, levels, rounds, args.repeats, args.new_tokens, kinds, args.out_dir,
                               args.frontends, args.client_procs, args.load, args.eager_raw))
    raw = rows[RAW]

    import vllm

    now = dt.datetime.now(dt.UTC)
    result = {
        "benchmark": f"{kind}-overhead",
        "date": now.isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "gpu": _gpu_name()},
        "vllm_version": vllm.__version__,
        "model": args.shape or args.model, "engine": ENGINE, "new_tokens": args.new_tokens,
        "rounds": rounds, "repeats": args.repeats, "method": "rows interleaved, median of repeats",
        "frontends": args.frontends, "client_procs": args.client_procs, "load": args.load,
        **({"dictionaries": {"sae_features": args.sae_features, "device_bytes": DICTIONARY_BYTES[0]}}
           if DICTIONARY_BYTES[0] else {}),
        "tokens_per_second": rows,
        # each repeat's ratio to raw interpolated at the cell's time (paired_ratios), median
        "ratio_to_raw": {k: {c: statistics.median(PAIRED[k][c]) if k in PAIRED else 1.0 for c in levels}
                         for k in rows},
        "ratio_to_raw_by_repeat": PAIRED,
        "ratio_of_medians": {k: {c: v[c] / raw[c] for c in levels} for k, v in rows.items()},
        "frontend_cpu_us_per_token": {
            k: {c: statistics.median(v) for c, v in by_c.items() if v} for k, by_c in FRONTEND_US.items()
            if any(by_c.values())
        },
        "server_cpu_cores_by_process": CPU_CORES,
        "checks": CHECKS,
        "streaming_latency_ms": {
            k: {c: {"p50": percentile(v, 0.5), "p99": percentile(v, 0.99), "samples": len(v)}
                for c, v in by_c.items()}
            for k, by_c in LATENCY_NS.items()
        },
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{kind}{f'-{args.shape}' if args.shape else ''}-overhead-{now:%Y%m%d-%H%M}-{platform.node()}.json"
    path.write_text(json.dumps(result, indent=2))

    header = "| row | " + " | ".join(f"c={c} tok/s (x raw)" for c in levels) + " |"
    print(header)
    print("|" + "---|" * (len(levels) + 1))
    for name, by_c in rows.items():
        cells = " | ".join(f"{by_c[c]:.0f} ({result['ratio_to_raw'][name][c]:.2f}x)" for c in levels)
        print(f"| {name} | {cells} |")
    if result["streaming_latency_ms"]:  # (not measured under h2load)
        print()
        print("| streaming latency, engine output to client (ms) | "
              + " | ".join(f"c={c} p50 / p99" for c in levels) + " |")
        print("|" + "---|" * (len(levels) + 1))
        for name, stats in result["streaming_latency_ms"].items():
            cells = " | ".join(f"{stats[c]['p50']:.2f} / {stats[c]['p99']:.2f}" if c in stats else "-"
                               for c in levels)
            print(f"| {name} | {cells} |")
    print()
    print("| frontend CPU per generated token (µs) | " + " | ".join(f"c={c}" for c in levels) + " |")
    print("|" + "---|" * (len(levels) + 1))
    for name, by_c in result["frontend_cpu_us_per_token"].items():
        print(f"| {name} | " + " | ".join(f"{by_c[c]:.0f}" if c in by_c else "-" for c in levels) + " |")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
