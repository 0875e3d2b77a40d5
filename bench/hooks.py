"""The worker hooks alone: host time per traced row per step (`python bench/hooks.py`).

A stand-in for vLLM's model runner and sampler drives tracewire's real sampler
hooks over a batch of traced requests, and the records go over the real side
channel (ZMQ) to a reader in another process. What it measures is the Python the
hooks add to each engine step, without vLLM around it: a quiet, repeatable number
to compare worker-side changes with on a noisy machine, where `make bench`'s
end-to-end ratios move by more than the change. Not a substitute for `make bench`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service" / "src"), str(ROOT / "tests")]

from tracewire_server import plan as P  # noqa: E402
from tracewire_server import sidechannel, steering  # noqa: E402
from tracewire_server import worker_hooks as W  # noqa: E402
from worker_standin import Sampler, request, runner  # noqa: E402

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
    hooks = W.PlanHooks(runner(requests), fault_injection=False)
    hooks.senders[0] = sidechannel.Sender(address)
    return _hooked_minus_bare(hooks, rows, vocab, steps)


def _hooked_minus_bare(hooks: W.PlanHooks, rows: int, vocab: int, steps: int,
                       before_draw: Callable[[], None] = lambda: None) -> float:
    """Median µs per row per step of `before_draw` (the forward pass's host work) and a
    sampler with `hooks` installed, less a bare sampler's."""
    bare, hooked = Sampler(), Sampler()
    hooks.install(hooked)
    logits = torch.randn(rows, vocab)

    def run(sampler: Sampler, before: Callable[[], None]) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            before()
            sampler.forward(logits.clone(), None)
        return time.perf_counter() - start

    run(hooked, before_draw)  # warm-up: plans decoded, caches filled
    samples = [(run(hooked, before_draw) - run(bare, lambda: None)) / (steps * rows) * 1e6 for _ in range(5)]
    hooks.senders[0].close()
    return statistics.median(samples)


STEER = P.Op("", P.StepSet(), None, P.WriteModule("layers.1", P.Positions(), "add",
                                                 np.full(256, 0.01, "<f4").tobytes()))


def measure_steering(rows: int, vocab: int, steps: int, address: str, churn: bool) -> float:
    """The same for a steering write every step on a compiled engine: the steering
    tables filled before each forward pass (steering.py), plus the sampler hooks.
    `churn`: the batch's order changes every pass (as when requests come and go), so
    every pass is planned; else the same batch decodes again, which keeps its slots."""
    requests = {f"r{i}": request(P.encode_plan(P.SequencePlan(key=f"k{i}", ops=(STEER,)))) for i in range(rows)}
    for state in requests.values():
        state.output_token_ids = []
    engine = runner(requests)
    engine.query_start_loc = types.SimpleNamespace(np=np.arange(rows + 1))  # one decode row each
    engine.input_batch.num_computed_tokens_cpu = np.full(rows, 2)  # after the 2-token prompt
    engine._model_forward = lambda: None
    hooks = W.PlanHooks(engine, fault_injection=False)
    hooks.senders[0] = sidechannel.Sender(address)
    tables = steering.SteeringTables([0, 1, 2, 3], slots=rows + 1, max_tokens=rows, hidden=256,
                                     dtype=torch.float32, device=torch.device("cpu"))
    hooks.install_compiled_steering(engine, tables)
    forward = engine._model_forward

    def before_draw() -> None:
        if churn:
            ids = engine.input_batch.req_ids
            engine.input_batch.req_ids = ids[1:] + ids[:1]
        forward()

    return _hooked_minus_bare(hooks, rows, vocab, steps, before_draw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    address = f"ipc:///tmp/tracewire-hooks-bench-{time.monotonic_ns()}"
    ready = multiprocessing.Event()
    reader = multiprocessing.Process(target=_drain, args=(address, ready), daemon=True)
    reader.start()
    ready.wait(30)
    levels = [int(r) for r in args.rows.split(",")]
    print("| plan | " + " | ".join(f"{r} rows: µs/row/step" for r in levels) + " |")
    print("|" + "---|" * (len(levels) + 1))
    for name, ops in PLANS.items():
        cells = [measure(ops, r, args.vocab, args.steps, address) for r in levels]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    for churn, label in ((False, "same batch every pass"), (True, "batch changes every pass")):
        cells = [measure_steering(r, args.vocab, args.steps, address, churn) for r in levels]
        print(f"| steering write every step (compiled tables, {label}) | "
              + " | ".join(f"{c:.1f}" for c in cells) + " |")
    reader.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
