"""Trace overhead vs raw vLLM, side by side in one run (`make bench`).

Phase 1 runs vLLM's AsyncLLM in this process (no tracewire at all); phase 2
starts the tracewire server on the same engine settings and drives it through
gRPC from this process. Same prompts, greedy, fixed new-token count, at
concurrency 1, 16 and 64. Reports generated tokens/s and the ratio to raw.
Results: bench/results/trace-overhead-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The capital of France is", "The capital of Japan is", "Once upon a time",
    "One, two, three,", "Mars is the", "Monday, Tuesday,", "The cow says", "Red, green,",
]
ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def timed(concurrency: int, rounds: int, one) -> float:
    """Tokens/s with `concurrency` requests in flight, `rounds` requests per slot."""
    async def slot(i: int) -> int:
        return sum([await one(i * rounds + r) for r in range(rounds)])

    await asyncio.gather(*(one(i) for i in range(min(concurrency, 4))))  # warm-up
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(slot(i) for i in range(concurrency))))
    return tokens / (time.perf_counter() - start)


async def raw_vllm(model: str, levels, rounds, new_tokens) -> dict[int, float]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **ENGINE))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]

    async def one(i: int) -> int:
        final = None
        async for out in llm.generate({"prompt_token_ids": ids[i % len(ids)]}, params, f"r{i}-{time.monotonic_ns()}"):
            final = out
        return len(final.outputs[0].token_ids)

    try:
        return {c: await timed(c, rounds, one) for c in levels}
    finally:
        llm.shutdown()


def trace_request(kind: str, prompt: str, new_tokens: int):
    from tracewire.v1 import intervention_pb2 as I
    from tracewire.v1 import prompt_pb2, sampling_pb2, service_pb2, trace_pb2

    ivs = {
        "trace, no interventions": [],
        "top-20 logits every step": [I.Intervention(name="t", read_logits=I.ReadLogits(top_k=I.TopK(k=20)))],
        "full logits every step": [I.Intervention(name="f", read_logits=I.ReadLogits(full=I.FullRow()))],
        "forced token at step 0": [I.Intervention(steps=I.StepSelector(list=I.StepList(steps=[0])),
                                                  force_sample=I.ForceSample(token_id=5))],
    }[kind]
    return service_pb2.TraceRequest(
        sampling_params=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
        invokes=[trace_pb2.Invoke(prompt=prompt_pb2.Prompt(text=prompt), interventions=ivs)],
    )


async def tracewire_rows(model: str, levels, rounds, new_tokens) -> dict[str, dict[int, float]]:
    import grpc
    from tracewire.v1 import prompt_pb2, sampling_pb2, service_pb2, service_pb2_grpc

    port = free_port()
    args = [sys.executable, "-m", "tracewire_server", "--model", model, "--port", str(port),
            "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"])]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = service_pb2_grpc.TraceServiceStub(channel)
        for _ in range(600):
            try:
                await stub.GetModelInfo(service_pb2.GetModelInfoRequest(), timeout=2)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(1)
        sampling = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

        async def generate(i: int) -> int:
            r = await stub.Generate(service_pb2.GenerateRequest(
                prompts=[prompt_pb2.Prompt(text=PROMPTS[i % len(PROMPTS)])], sampling_params=sampling))
            return len(r.outputs[0].outputs[0].token_ids)

        rows = {"Generate": {c: await timed(c, rounds, generate) for c in levels}}
        for kind in ("trace, no interventions", "top-20 logits every step",
                     "full logits every step", "forced token at step 0"):
            async def traced(i: int, kind=kind) -> int:
                steps = 0
                async for ev in stub.Trace(trace_request(kind, PROMPTS[i % len(PROMPTS)], new_tokens)):
                    steps += ev.WhichOneof("event") == "step"
                return steps
            rows[kind] = {c: await timed(c, rounds, traced) for c in levels}
        await channel.close()
        return rows
    finally:
        server.terminate()
        server.wait(120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(ROOT / "models" / "tracewire-tiny"))
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=2, help="requests per concurrency slot")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    levels = [int(c) for c in args.concurrency.split(",")]

    raw = asyncio.run(raw_vllm(args.model, levels, args.rounds, args.new_tokens))
    rows = {"raw vLLM AsyncLLM": raw, **asyncio.run(tracewire_rows(args.model, levels, args.rounds, args.new_tokens))}

    import vllm

    now = dt.datetime.now(dt.UTC)
    result = {
        "benchmark": "trace-overhead",
        "date": now.isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "vllm_version": vllm.__version__,
        "model": args.model, "engine": ENGINE, "new_tokens": args.new_tokens,
        "rounds": args.rounds, "tokens_per_second": rows,
        "ratio_to_raw": {k: {c: v[c] / raw[c] for c in levels} for k, v in rows.items()},
    }
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"trace-overhead-{now:%Y%m%d-%H%M}-{platform.node()}.json"
    path.write_text(json.dumps(result, indent=2))

    header = "| row | " + " | ".join(f"c={c} tok/s (x raw)" for c in levels) + " |"
    print(header)
    print("|" + "---|" * (len(levels) + 1))
    for name, by_c in rows.items():
        cells = " | ".join(f"{by_c[c]:.0f} ({by_c[c] / raw[c]:.2f}x)" for c in levels)
        print(f"| {name} | {cells} |")
    print(f"written to {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
