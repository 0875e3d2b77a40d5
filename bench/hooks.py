"""The worker hooks alone: host time per traced row per step (`python bench/hooks.py`).

A stand-in for vLLM's model runner and sampler drives tracewire's real sampler
hooks over a batch of traced requests, and the records go over the real side
channel (ZMQ) to a reader in another process. What it measures is the Python the
hooks add to each engine step, without vLLM around it: a quiet, repeatable number
to compare worker-side changes with on a noisy machine, where `make bench`'s
end-to-end ratios move by more than the change. Not a substitute for `make bench`.
A last table times the collector thread's work for a step beside a thread that keeps the
GIL busy, as vLLM's engine thread does under load.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service" / "src")]

from tracewire_server.shared import plan as P  # noqa: E402
from tracewire_server.shared import steering  # noqa: E402
from tracewire_server.shared.read_buffers import AttentionInput, ReadBuffers, UnitInput  # noqa: E402
from tracewire_server.worker.batch import StepWork  # noqa: E402
from tracewire_server.worker.hooks import PlanHooks  # noqa: E402
from tracewire_server.worker.runner import AttentionLayer  # noqa: E402
from tracewire_server.worker.sender import Sender  # noqa: E402
from tracewire_server.worker.standin import Sampler, give_model, hooks_over, request, runner  # noqa: E402

PLANS = {
    "top-20 every step": (P.Op("t", P.StepSet(), None, P.ReadLogits("processed", top_k=20)),),
    "top-20 + sample every step": (
        P.Op("t", P.StepSet(), None, P.ReadLogits("processed", top_k=20)),
        P.Op("s", P.StepSet(), None, P.ReadSample()),
    ),
    "forced token at step 0": (P.Op("f", P.StepSet(steps=frozenset({0})), None, P.ForceSample(5)),),
    "stop on a token": (P.Op("stop", P.StepSet(), P.SampledIn(frozenset({1})), P.Stop()),),
}


def _drain(address: str, ready) -> None:
    import zmq

    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.bind(address)
    ready.set()
    while socket.recv(copy=False):
        pass


def measure(ops: tuple[P.Op, ...], rows: int, vocab: int, steps: int, address: str) -> float:
    """Microseconds the hooks add per traced row per step (hooked minus bare sampler)."""
    requests = {f"r{i}": request(P.encode_plan(P.SequencePlan(key=f"k{i}", ops=ops))) for i in range(rows)}
    hooks = hooks_over(runner(requests))
    hooks.senders[0] = Sender(address)
    return _hooked_minus_bare(hooks, rows, vocab, steps)


def _hooked_minus_bare(hooks: PlanHooks, rows: int, vocab: int, steps: int,
                       before_draw: Callable[[], None] = lambda: None, installed: Sampler | None = None) -> float:
    """Median µs per row per step of `before_draw` (the forward pass's host work) and a
    sampler with `hooks` installed (`installed`: one they already are on), less a bare
    sampler's."""
    bare = Sampler()
    if installed is None:
        hooked = Sampler()
        hooks.install(hooked)
    else:
        hooked = installed
    logits = torch.randn(rows, vocab)

    def run(sampler: Sampler, before: Callable[[], None]) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            before()
            sampler.forward(logits.clone(), None)
        return time.perf_counter() - start

    run(hooked, before_draw)  # warm-up: plans decoded, caches filled
    samples = [(run(hooked, before_draw) - run(bare, lambda: None)) / (steps * rows) * 1e6 for _ in range(5)]
    for sender in hooks.senders.values():
        sender.close()
    return statistics.median(samples)


STEER = P.Op("", P.StepSet(), None, P.WriteModule("layers.1", P.Positions(), "add",
                                                 np.full(256, 0.01, "<f4").tobytes()))


def _decoding(rows: int, ops: tuple[P.Op, ...], routes: int = 1) -> types.SimpleNamespace:
    """A stand-in runner whose pass decodes one token for each of `rows` requests with
    these ops, after their 2-token prompts (its forward pass does nothing); request i
    is frontend i % routes's."""
    requests = {f"r{i}": request(P.encode_plan(P.SequencePlan(key=f"k{i}", ops=ops, route=i % routes)))
                for i in range(rows)}
    for state in requests.values():
        state.output_token_ids = []
    engine = runner(requests)
    engine.query_start_loc = types.SimpleNamespace(np=np.arange(rows + 1))  # one decode row each
    engine.input_batch.num_computed_tokens_cpu = np.full(rows, 2)  # after the 2-token prompt
    engine._model_forward = lambda: None
    return engine


def measure_steering(rows: int, vocab: int, steps: int, address: str, churn: bool) -> float:
    """The same for a steering write every step on a compiled engine: the steering
    tables filled before each forward pass (steering.py), plus the sampler hooks.
    `churn`: the batch's order changes every pass (as when requests come and go), so
    every pass is planned; else the same batch decodes again, which keeps its slots."""
    engine = _decoding(rows, (STEER,))
    hooks = hooks_over(engine)
    hooks.senders[0] = Sender(address)
    tables = steering.SteeringTables([f"layers.{layer}" for layer in range(4)], slots=rows + 1, max_tokens=rows,
                                     hidden=256, dtype=torch.float32, device=torch.device("cpu"))
    hooks.install_compiled_steering([tables])
    forward = engine._model_forward

    def before_draw() -> None:
        if churn:
            ids = engine.input_batch.req_ids
            engine.input_batch.req_ids = ids[1:] + ids[:1]
        forward()

    return _hooked_minus_bare(hooks, rows, vocab, steps, before_draw)


# --compiled-reads: reads served from the read buffers (stand-in model: 4 layers, --hidden wide)
HEADS = "layers.1.self_attn.heads"  # (a stand-in o_proj input: 4 heads of hidden / 4 each)
COMPILED_READS = {
    "layer read every step (compiled, read buffers)": (
        P.Op("h", P.StepSet(), None, P.ReadModule("layers.1", P.Positions())),),
    "logit lens top-5 of 4 layers every step (compiled)": (
        P.Op("lens", P.StepSet(), None, P.ReadLogitLens((0, 1, 2, 3), P.Positions(), 5)),),
    "head read (2 of 4 heads) every step (compiled, unit buffers)": (
        P.Op("heads", P.StepSet(), None, P.ReadModule(HEADS, P.Positions(), units=P.Units(ids=(0, 2)))),),
}


def measure_compiled_reads(ops: tuple[P.Op, ...], rows: int, vocab: int, steps: int, addresses: list[str],
                           hidden: int) -> float:
    """The same for reads on a compiled engine: each pass planned on the host before
    the forward, its rows taken from the read buffers after it (module_hooks.py), then
    the sampler hooks launch the values (module_reads.py) and the collector sends them.
    The graph's own copies into the buffers are not counted (the buffers hold one
    random pass throughout). The requests are spread over one frontend per address."""
    engine = _decoding(rows, ops, len(addresses))
    give_model(engine, 4, hidden, vocab)
    units = {HEADS: UnitInput("unit_0", hidden, hidden // 4)}
    buffers = ReadBuffers([0, 1, 2, 3], max_tokens=rows, hidden=hidden, dtype=torch.float32,
                          device=torch.device("cpu"), units=units)
    for name in buffers.names:
        getattr(buffers, name).normal_()
    hooks = hooks_over(engine)
    for route, address in enumerate(addresses):
        hooks.senders[route] = Sender(address)
    hooks.install_compiled_reads(buffers)
    return _hooked_minus_bare(hooks, rows, vocab, steps, engine._model_forward)


# The stand-in's attention at layer 1 for the pattern row: 4 query heads, 2 KV heads of --hidden / 4.
PATTERN_HEADS, PATTERN_KV = 4, 2


def measure_compiled_patterns(rows: int, vocab: int, steps: int, addresses: list[str], hidden: int) -> float:
    """The same for an attention pattern's top 5 (layer 1, every head) at every new token
    on a compiled engine: each pass's keys into the key pool, the new tokens' scores, top
    k and column (attention_patterns.py, module_reads.py) from random queries and keys in
    the read buffers. One prefill pass first (the prompts' keys), then the same decode
    pass again (each request's new token at position 2)."""
    head_dim = hidden // PATTERN_HEADS
    read = P.ReadAttentionPattern((1,), tuple(range(PATTERN_HEADS)), P.Positions(), 5, tuple(range(PATTERN_KV)),
                                  head_dim, 64)
    engine = _decoding(rows, (P.Op("a", P.StepSet(), None, read),), len(addresses))
    give_model(engine, 4, hidden, vocab)
    attention = {1: AttentionInput(hidden, PATTERN_KV * head_dim)}
    buffers = ReadBuffers([0, 1, 2, 3], max_tokens=2 * rows, hidden=hidden, dtype=torch.float32,
                          device=torch.device("cpu"), attention=attention)
    for name in ("queries_1", "keys_1"):
        getattr(buffers, name).normal_()
    hooks = hooks_over(engine)
    for route, address in enumerate(addresses):
        hooks.senders[route] = Sender(address)
    hooks.install_compiled_reads(buffers)
    # (the stand-in has no vLLM Attention module for the runner to find: its shape, as found)
    hooks.modules.patterns.layers = {1: AttentionLayer(None, PATTERN_HEADS, PATTERN_KV, head_dim,
                                                       head_dim ** -0.5, None, None, "")}
    decode = engine.query_start_loc.np
    engine.query_start_loc.np = np.arange(rows + 1) * 2  # the prefill: both prompt tokens each
    engine.input_batch.num_computed_tokens_cpu = np.zeros(rows, np.int64)
    prefill = Sampler()
    hooks.install(prefill)
    engine._model_forward()
    prefill.forward(torch.randn(rows, vocab), None)
    engine.query_start_loc.np = decode
    engine.input_batch.num_computed_tokens_cpu = np.full(rows, 2)
    taken = _hooked_minus_bare(hooks, rows, vocab, steps, engine._model_forward, installed=prefill)
    failed = [seq.error for seq in hooks.sequences.by_id.values() if seq is not None and seq.error]
    if failed or not hooks.modules.patterns._pools:
        raise RuntimeError(f"the pattern row did not run: {failed[:1] or 'no keys kept'}")
    return taken


def measure_collector(rows: int, routes: int, vocab: int, addresses: list[str]) -> tuple[float, float]:
    """The collector's work for one top-20 step of `rows` rows spread over `routes`
    frontends, in ms: alone, and on its own thread beside a thread busy in Python and
    small torch calls (vLLM's engine thread at c=256 is ~90% busy). The two share the
    GIL: each time the collector lets go of it (a ZMQ send, most torch and some numpy
    calls), it waits to get it back. On the H200 at ~175 rows and 8 frontends,
    TRACEWIRE_HOOK_TIMES read 2.3 ms a step for this."""
    ops = PLANS["top-20 every step"]
    requests = {f"r{i}": request(P.encode_plan(P.SequencePlan(key=f"{i:032x}", ops=ops, route=i % routes)))
                for i in range(rows)}
    hooks = hooks_over(runner(requests))
    for route in range(routes):
        hooks.senders[route] = Sender(addresses[route])
    works: list[StepWork] = []
    hooks.collector.submit = works.append  # type: ignore[method-assign]
    sampler = Sampler()
    hooks.install(sampler)
    sampler.forward(torch.randn(rows, vocab), None)
    work = works[-1]

    def finish_ms(steps: int, interval_s: float = 0.0) -> float:
        taken = []
        for _ in range(steps):
            start = time.perf_counter()
            hooks._finish(work)  # the same step again: its records go out every time
            taken.append(time.perf_counter() - start)
            time.sleep(interval_s)
        return statistics.median(taken) * 1e3

    finish_ms(5)
    alone = finish_ms(50)
    stop = threading.Event()

    def engine() -> None:
        a, b = torch.zeros(64), torch.ones(64)
        while not stop.is_set():
            for _ in range(20):
                a.add_(b)
            sum(range(300))

    busy = threading.Thread(target=engine)
    busy.start()
    try:
        beside = finish_ms(80, interval_s=0.013)  # a step every ~13 ms, as at c=256
    finally:
        stop.set()
        busy.join()
        for sender in hooks.senders.values():
            sender.close()
    return alone, beside


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--routes", type=int, default=8, help="frontends for the collector and compiled rows")
    parser.add_argument("--hidden", type=int, default=256, help="the compiled rows' stand-in hidden size")
    parser.add_argument("--only", default="", help="only the rows whose name has this text (e.g. compiled)")
    args = parser.parse_args()
    addresses = [f"ipc:///tmp/tracewire-hooks-bench-{time.monotonic_ns()}-{i}" for i in range(args.routes)]
    readers = []
    for address in addresses:
        ready = multiprocessing.Event()
        readers.append(multiprocessing.Process(target=_drain, args=(address, ready), daemon=True))
        readers[-1].start()
        ready.wait(30)
    address = addresses[0]
    levels = [int(r) for r in args.rows.split(",")]
    print("| plan | " + " | ".join(f"{r} rows: µs/row/step" for r in levels) + " |")
    print("|" + "---|" * (len(levels) + 1))
    for name, ops in PLANS.items():
        if args.only not in name:
            continue
        cells = [measure(ops, r, args.vocab, args.steps, address) for r in levels]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    for churn, label in ((False, "same batch every pass"), (True, "batch changes every pass")):
        if args.only not in f"steering write every step (compiled tables, {label})":
            continue
        cells = [measure_steering(r, args.vocab, args.steps, address, churn) for r in levels]
        print(f"| steering write every step (compiled tables, {label}) | "
              + " | ".join(f"{c:.1f}" for c in cells) + " |")
    for name, ops in COMPILED_READS.items():
        if args.only not in name:
            continue
        cells = [measure_compiled_reads(ops, r, args.vocab, args.steps, addresses, args.hidden) for r in levels]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    name = "attention pattern top-5 (layer 1, 4 heads) every step (compiled, read buffers)"
    if args.only in name:
        cells = [measure_compiled_patterns(r, args.vocab, args.steps, addresses, args.hidden) for r in levels]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    if args.only not in "collector":
        for reader in readers:
            reader.kill()
        return 0
    print()
    print(f"| collector, top-20, {args.routes} frontends, vocab {args.vocab} | "
          + " | ".join(f"{r} rows: ms/step alone / beside a busy engine thread" for r in levels) + " |")
    print("|" + "---|" * (len(levels) + 1))
    cells = [measure_collector(r, args.routes, args.vocab, addresses) for r in levels]
    print("| median of the steps | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in cells) + " |")
    for reader in readers:
        reader.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
