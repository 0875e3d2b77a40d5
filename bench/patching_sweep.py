"""The 4x4 (layer, position) activation-patching sweep: one trace vs 16 traces (`make bench`).

A tracewire server per engine kind (`--engines`: eager, module hooks; compiled, the default
graph hooks: patches through the steering tables) in a subprocess, one after the other; on
each the same 16 patched runs measured three ways, interleaved, each the median of the
repeats, and the compiled engine's one-trace sweep as a ratio to the eager one's:

  one trace        a clean invoke + 16 corrupted invokes, each patched at one (layer,
                   position) from the clean one (tracewire.patching.sweep): the 16 wait
                   for the clean invoke's step 0, then run batched;
  16 traces, one after another   clean + one patched invoke per trace;
  16 traces at once              the same 16 traces concurrently (16 client threads).

Each patched run draws max_tokens new tokens (default 1: the heatmap's metric is step 0's
logits; --new-tokens for longer runs). Reports wall time, patched runs/s and generated
tokens/s (every invoke's, the clean ones included), and checks the three give the same
heatmap. Results: bench/results/patching-sweep-<date>-<host>.json.

GPU mode (`--shape qwen3-8b`, see bench/shapes.py; run on the device machine with
bench/gpu-env.sh sourced): that shape with dummy weights, bfloat16, CUDA graphs on the
compiled server; LAYERS become 4 layers spread evenly over the model, and the compiled
server carries exactly the graph hooks the sweep needs (--compiled-reads and
--compiled-steering on those layers: a big shape's default graph hooks do not include
layer reads). The metric's ids are looked up in the model directory's tokenizer. With
dummy weights the heatmaps mean nothing and bf16 numerics differ between batchings and
engines, so the heatmap checks (within an engine and across engines) are reported, not
asserted: only the timing counts. Results: patching-sweep-<shape>-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from shapes import SHAPES, write_model_dir  # noqa: E402

CLEAN, CORRUPTED = "The capital of France is", "The capital of Italy is"
PARIS, ROME = 806, 834  # " Paris", " Rome" in the default model's tokenizer
LAYERS, POSITIONS = [0, 1, 2, 3], [0, 1, 3, 4]
SERVER_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "64"]
ENGINE_FLAGS = {"eager": ["--enforce-eager"], "compiled": []}  # (compiled: the default graph hooks)
# --shape: one server at a time on the GPU, so most of its memory; 17 sequences at most in flight.
GPU_SERVER_FLAGS = ["--dtype", "bfloat16", "--load-format", "dummy", "--max-model-len", "1024",
                    "--max-num-seqs", "64", "--gpu-memory-utilization", "0.85"]
CHECK_ATOL = [1e-3, 2e-3]  # within an engine, across engines; None (--shape): report, do not assert
CHECKS: dict[str, Any] = {}  # max |difference| of the heatmaps, per engine and across engines


def use_shape(shape: str) -> str:
    """GPU mode: the shape's model directory (dummy weights), LAYERS spread over its
    layers, the compiled server's graph hooks on exactly those layers, the metric's ids
    from its tokenizer, the checks reported only. The model directory."""
    global PARIS, ROME
    model = write_model_dir(shape, Path(tempfile.mkdtemp()) / shape)
    n = int(SHAPES[shape]["num_hidden_layers"])
    LAYERS[:] = sorted({round(i * (n - 1) / 3) for i in range(4)})  # e.g. 0, 12, 23, 35 of 36
    SERVER_FLAGS[:] = GPU_SERVER_FLAGS
    listed = ",".join(str(layer) for layer in LAYERS)
    ENGINE_FLAGS["compiled"] = ["--compiled-reads", listed, "--compiled-steering", listed]
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    PARIS, ROME = vocab.get("\u0120Paris", PARIS), vocab.get("\u0120Rome", ROME)  # (BPE: \u0120 is a space)
    CHECK_ATOL[:] = [None, None]
    return str(model)


def check(name: str, actual: np.ndarray, expected: np.ndarray, atol: float | None, err_msg: str) -> None:
    """The largest difference of two heatmaps, kept under `name`; asserted within `atol`
    unless it is None."""
    CHECKS[name] = max(CHECKS.get(name, 0.0), float(np.max(np.abs(actual - expected))))
    if atol is not None:
        np.testing.assert_allclose(actual, expected, atol=atol, err_msg=err_msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, engine: str, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tracewire_server", "--model", model, "--port", str(port),
                                 *SERVER_FLAGS, *ENGINE_FLAGS[engine]], stdout=out, stderr=subprocess.STDOUT)
    return proc, f"127.0.0.1:{port}"


def wait_ready(client: Any, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            client.model_info()
            return
        except Exception:  # noqa: BLE001 - still starting
            time.sleep(1)
    raise SystemExit("the server did not start in 600 s")


def one_trace(client: Any, new_tokens: int) -> np.ndarray:
    import tracewire.patching

    tracer, cells = tracewire.patching.sweep_trace(client, CLEAN, CORRUPTED, LAYERS, POSITIONS, (PARIS, ROME),
                                                   max_tokens=new_tokens, ignore_eos=True)
    tracer.run()
    return tracewire.patching.heatmap(cells)


def single(client: Any, layer: int, position: int, new_tokens: int) -> float:
    """One patched run as a trace of its own: clean + one corrupted invoke."""
    with client.trace(temperature=0.0, max_tokens=new_tokens, ignore_eos=True) as tracer:
        with tracer.invoke(CLEAN) as clean:
            saved = clean.iter[0].module(f"layers.{layer}", positions=[position]).save("clean")
        with tracer.invoke(CORRUPTED) as corrupted:
            corrupted.iter[0].module(f"layers.{layer}", positions=[position]).patch(saved)
            metric = corrupted.iter[0].logits.raw.select([PARIS, ROME]).save("metric")
    return float(metric[0][0] - metric[0][1])


def separate(client: Any, new_tokens: int, threads: int) -> np.ndarray:
    cells = [(layer, p) for layer in LAYERS for p in POSITIONS]
    with ThreadPoolExecutor(threads) as pool:
        values = list(pool.map(lambda c: single(client, c[0], c[1], new_tokens), cells))
    return np.array(values, dtype=np.float32).reshape(len(LAYERS), len(POSITIONS))


def measure(client: Any, new_tokens: int, repeats: int,
            engine: str = "") -> tuple[list[dict[str, Any]], np.ndarray]:
    """The three rows on one server: each row's median wall time and rates, and the heatmap."""
    cells = len(LAYERS) * len(POSITIONS)
    rows: dict[str, tuple[Any, int]] = {
        "one trace (clean + 16 patched invokes)": (lambda: one_trace(client, new_tokens), cells + 1),
        "16 traces, one after another": (lambda: separate(client, new_tokens, 1), 2 * cells),
        "16 traces at once": (lambda: separate(client, new_tokens, cells), 2 * cells),
    }
    for run, _ in rows.values():  # warm-up, and the three must agree
        run()
    reference = one_trace(client, new_tokens)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, (run, _) in rows.items():
            started = time.perf_counter()
            heatmap = run()
            times[name].append(time.perf_counter() - started)
            check(f"{engine}: rows vs one trace", heatmap, reference, CHECK_ATOL[0], name)
    results = []
    for name, (_, invokes) in rows.items():
        wall = statistics.median(times[name])
        results.append({"row": name, "wall_s": wall, "patched_runs_per_s": cells / wall,
                        "generated_tokens_per_s": invokes * new_tokens / wall, "walls_s": times[name]})
    return results, reference


def on_engine(engine: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], np.ndarray]:
    """`measure` on a server of this engine kind (`--target`: that running server instead)."""
    import tracewire

    proc, log_path = None, Path(tempfile.mkdtemp()) / "server.log"
    target = args.target
    if target is None:
        proc, target = start_server(args.model, engine, log_path)
    client = tracewire.Client(target, timeout=300)
    try:
        wait_ready(client, proc, log_path) if proc is not None else client.model_info()
        return measure(client, args.new_tokens, args.repeats, engine)
    finally:
        client.close()
        if proc is not None:
            proc.terminate()
            proc.wait(120)


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a description only
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "tracewire-tiny"))
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="GPU mode: this model shape with dummy weights, bf16, 4 layers spread over it, "
                        "the compiled server with --compiled-reads / --compiled-steering on those layers")
    parser.add_argument("--engines", default="eager,compiled", help="engine kinds, in order: eager, compiled")
    parser.add_argument("--target", default=None, help="a running server instead of starting one (one engine)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=1)
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := [e for e in engines if e not in ENGINE_FLAGS]:
        parser.error(f"--engines: unknown {unknown}; known: {', '.join(ENGINE_FLAGS)}")
    if args.target is not None and len(engines) != 1:
        parser.error("--target measures one running server: name its engine alone in --engines")

    if args.shape:
        args.model = use_shape(args.shape)
    cells = len(LAYERS) * len(POSITIONS)
    measured = {engine: on_engine(engine, args) for engine in engines}
    heatmaps = [heatmap for _, heatmap in measured.values()]
    for heatmap in heatmaps[1:]:  # every engine draws the same heatmap
        check("across engines", heatmap, heatmaps[0], CHECK_ATOL[1], "the engines' heatmaps differ")
    if args.shape:
        print(f"{args.shape} (dummy weights, bf16), layers {LAYERS}, metric ids {PARIS}, {ROME}; heatmap checks "
              f"reported, not asserted (dummy weights): max |difference| {json.dumps(CHECKS)}")
    print(f"4x4 patching sweep, {args.new_tokens} new token(s) per run, median of {args.repeats}:")
    print("| engine | | wall | patched runs/s | generated tok/s | vs one trace |")
    print("|---|---|---|---|---|---|")
    for engine, (results, _) in measured.items():
        base = results[0]["wall_s"]
        for r in results:
            print(f"| {engine} | {r['row']} | {r['wall_s'] * 1000:.0f} ms | {r['patched_runs_per_s']:.1f} | "
                  f"{r['generated_tokens_per_s']:.1f} | {r['wall_s'] / base:.2f}x |")
    if "eager" in measured and "compiled" in measured:
        eager, compiled = (measured[e][0][0]["wall_s"] for e in ("eager", "compiled"))
        print(f"one-trace sweep: compiled {eager / compiled:.2f}x as fast as eager "
              f"({cells} patched runs in {compiled * 1000:.0f} ms vs {eager * 1000:.0f} ms)")
    now = dt.datetime.now(dt.UTC)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"patching-sweep{f'-{args.shape}' if args.shape else ''}-{now:%Y%m%d-%H%M}-{platform.node()}.json"
    path.write_text(json.dumps({
        "date": now.isoformat(), "host": platform.node(), "machine": platform.machine(), "model": args.model,
        "shape": args.shape, "gpu": _gpu_name(), "metric_ids": [PARIS, ROME], "server_flags": SERVER_FLAGS,
        "engine_flags": {e: ENGINE_FLAGS[e] for e in engines}, "layers": LAYERS,
        "positions": POSITIONS, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "method": "rows interleaved on each server, servers one after the other, median of repeats",
        "heatmap_checks": {"max_abs_difference": CHECKS,
                           "asserted": CHECK_ATOL[0] is not None, "atol": CHECK_ATOL},
        "engines": {engine: {"rows": results, "heatmap": heatmap.tolist()}
                    for engine, (results, heatmap) in measured.items()},
    }, indent=2))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
