"""The logit lens's device work alone, on a GPU: where a lens step's time goes, and
whether it can hide behind the next decode step.

Times (CUDA events, medians) at the bench's shape: `--rows` streams (c=64 x 4 layers)
through the final norm and an lm_head of `--hidden` x `--vocab` in bf16:
  - each part: norm, the lm_head matmul, top-k, the float32 log-softmax, the gather;
  - top-k variants: torch.topk over the whole row, and in two stages (the top k of
    each of G slices of the row, then of those candidates: the same set);
  - vocab_topk's one Triton kernel, and its torch calls;
  - the whole lens before vocab_topk and with it.
Then a stand-in decode step (the Qwen3-8B shape's projections at `--batch` rows, all
layers, captured in a CUDA graph), replayed back to back with the lens after each replay
on the same stream, and with the lens on a second stream, overlapping the next replay.

  python3 bench/lens_device.py [--rows 256] [--hidden 4096] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "service" / "src"))
from tracewire_server.worker import vocab_topk  # noqa: E402


def timed(fn, repeats: int = 30, warmup: int = 5) -> float:
    """Median milliseconds of fn() on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def topk_two_stage(logits: torch.Tensor, k: int, slices: int) -> torch.Tensor:
    """The ids of each row's top k, found as the top k of every slice's top k."""
    rows, vocab = logits.shape
    width = -(-vocab // slices)
    padded = torch.nn.functional.pad(logits, (0, width * slices - vocab), value=float("-inf"))
    local = torch.topk(padded.view(rows, slices, width), k, dim=-1)
    best = torch.topk(local.values.view(rows, -1), k, dim=-1).indices
    slice_of = best // k
    return (slice_of * width + local.indices.view(rows, -1).gather(-1, best)).long()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", type=int, default=64, help="the stand-in decode step's rows")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.hidden, device=dev, dtype=dt)
    norm_w = torch.ones(args.hidden, device=dev, dtype=dt)
    head = torch.randn(args.vocab, args.hidden, device=dev, dtype=dt) * 0.02
    k = args.k
    res: dict[str, float] = {}
    normed = rms_norm(x, norm_w)
    logits = normed @ head.t()
    res["norm"] = timed(lambda: rms_norm(x, norm_w))
    res["matmul bf16 out"] = timed(lambda: normed @ head.t())
    try:
        res["matmul fp32 out (out_dtype)"] = timed(lambda: torch.mm(normed, head.t(), out_dtype=torch.float32))
    except Exception as e:  # noqa: BLE001 - not in every torch
        print("out_dtype:", e)
    res["topk full row"] = timed(lambda: torch.topk(logits, k, dim=-1))
    for slices in (64, 256, 1024):
        res[f"topk two-stage {slices}"] = timed(lambda s=slices: topk_two_stage(logits, k, s))
    full = torch.topk(logits, k, dim=-1)
    for slices in (64, 256, 1024):
        two = topk_two_stage(logits, k, slices)
        same = torch.equal(logits.gather(-1, two).sort(-1).values, full.values.sort(-1).values)
        print(f"two-stage {slices}: same top values as torch.topk: {same}")
    res["log_softmax fp32 from bf16"] = timed(lambda: torch.log_softmax(logits, -1, dtype=torch.float32))
    res["logsumexp of .float()"] = timed(lambda: torch.logsumexp(logits.float(), -1))
    top = full.indices
    res["vocab_topk.stats + top_k (torch calls)"] = timed(
        lambda: vocab_topk.top_k(logits, k, vocab_topk.stats(logits)))
    res["vocab_topk.top_k_logprobs"] = timed(lambda: vocab_topk.top_k_logprobs(logits, k))
    for name, lg in (("bf16", logits), ("fp32", logits.float()), ("bf16 padded view", torch.nn.functional.pad(
            logits, (0, 64))[:, :args.vocab])):
        want = torch.log_softmax(lg, -1, dtype=torch.float32).topk(k, dim=-1)
        got_values, got_ids = vocab_topk.top_k_logprobs(lg, k)
        print(f"top_k_logprobs {name}: ids equal {torch.equal(got_ids, want.indices)}, "
              f"max |value diff| {(got_values - want.values).abs().max().item():.2e}")
    res["lens old (log_softmax then gather)"] = timed(lambda: torch.log_softmax(rms_norm(x, norm_w) @ head.t(), -1,
                                                          dtype=torch.float32).gather(-1, top))

    def lens_today() -> tuple[torch.Tensor, torch.Tensor]:
        lg = rms_norm(x, norm_w) @ head.t()
        t = torch.topk(lg, k, dim=-1).indices
        return torch.log_softmax(lg, -1, dtype=torch.float32).gather(-1, t), t

    def lens_two_stage() -> tuple[torch.Tensor, torch.Tensor]:
        lg = rms_norm(x, norm_w) @ head.t()
        t = topk_two_stage(lg, k, 256)
        return torch.log_softmax(lg, -1, dtype=torch.float32).gather(-1, t), t

    def lens_now() -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_topk.top_k_logprobs(rms_norm(x, norm_w) @ head.t(), k)

    res["lens (norm, matmul, topk, log_softmax, gather)"] = timed(lens_today)
    res["lens with vocab_topk"] = timed(lens_now)
    res["lens with two-stage topk"] = timed(lens_two_stage)

    # A stand-in decode step: every layer's projections at `batch` rows, in a graph.
    b, h, inter, layers = args.batch, args.hidden, args.intermediate, args.layers
    ws = [(torch.randn(h, 6144 if h == 4096 else 3 * h, device=dev, dtype=dt) * 0.02,
           torch.randn(h, h, device=dev, dtype=dt) * 0.02,
           torch.randn(h, 2 * inter, device=dev, dtype=dt) * 0.02,
           torch.randn(inter, h, device=dev, dtype=dt) * 0.02) for _ in range(layers)]
    act = torch.randn(b, h, device=dev, dtype=dt)

    def step() -> None:
        y = act
        for qkv, o, gu, down in ws:
            q = y @ qkv
            y = y + (q[:, :h] @ o)
            g = y @ gu
            y = y + (torch.nn.functional.silu(g[:, :inter]) * g[:, inter:]) @ down
        act.copy_(y * 0.5)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    res["decode step (graph)"] = timed(graph.replay)
    side = torch.cuda.Stream()
    n = 20

    def serial() -> None:
        for _ in range(n):
            graph.replay()
            lens_today()

    def serial_now() -> None:
        for _ in range(n):
            graph.replay()
            lens_now()

    def overlapped() -> None:
        main = torch.cuda.current_stream()
        for _ in range(n):
            graph.replay()
            side.wait_stream(main)  # (in the server: an event after the step's gathers)
            with torch.cuda.stream(side):
                lens_today()
        main.wait_stream(side)

    res[f"{n} steps, no lens"] = timed(lambda: [graph.replay() for _ in range(n)], repeats=5)
    res[f"{n} steps, lens after each, same stream"] = timed(serial, repeats=5)
    res[f"{n} steps, lens on a second stream"] = timed(overlapped, repeats=5)
    res[f"{n} steps, vocab_topk lens after each"] = timed(serial_now, repeats=5)
    for name, ms in res.items():
        print(f"{ms:9.3f} ms  {name}")
    base = res[f"{n} steps, no lens"]
    print(f"same stream: x{base / res[f'{n} steps, lens after each, same stream']:.3f} of no lens; "
          f"second stream: x{base / res[f'{n} steps, lens on a second stream']:.3f}; "
          f"vocab_topk: x{base / res[f'{n} steps, vocab_topk lens after each']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
                       "args": vars(args), "torch": torch.__version__, "ms": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
