"""Activation collection: `client.collect` against the same collection as a plain loop of
`client.trace` calls (`python bench/collect.py`).

One tracewire server (eager: layer reads) in a subprocess; the same prompts collected three
ways, interleaved, each the median of the repeats:

  plain loop       for each prompt, `with client.trace(prompt)` reading the same layers and
                   logits, one after another, records written with the same shard writer
                   (what a user writes without collect);
  collect, concurrency 1   client.collect with one trace in flight: what its machinery
                   (map, shards, manifest) costs over the loop;
  collect, concurrency 8   client.collect as it runs by default.

Each prompt reads layers 1 and 2 at its last position and the top-5 logits, drawing
--max-tokens tokens (default 1). Every repeat checks the collections hold the same values.
Results: bench/results/collect-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patching_sweep import ROOT, start_server, wait_ready  # noqa: E402  (the same server start)

SUBJECTS = ["France", "Japan", "Italy", "Spain", "Egypt", "Peru", "Canada", "Kenya"]
TEMPLATES = ["The capital of {} is", "The largest city in {} is", "People in {} speak",
             "The flag of {} has", "My friend from {} likes", "A famous dish from {} is",
             "The weather in {} is", "Once upon a time in {}, there"]
LAYERS = [1, 2]
TOP_K = 5


def prompts(n: int) -> list[str]:
    every = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
    return [every[i % len(every)] + ("" if i < len(every) else f" (take {i // len(every)})") for i in range(n)]


def plain_loop(client: Any, texts: list[str], folder: Path, max_tokens: int, shard_size: int) -> None:
    from tracewire import shards

    folder.mkdir(parents=True)
    shard = shards.Shard(0, [], [])
    number = 0
    for i, prompt in enumerate(texts):
        with client.trace(prompt, temperature=0.0, max_tokens=max_tokens) as tracer:
            rows = {layer: tracer.iter[0].module(f"layers.{layer}", positions=[-1]).save() for layer in LAYERS}
            top = tracer.all().logits.top_k(TOP_K).save()
        assert tracer.result is not None
        shard.prompts.append(prompt)
        shard.texts.append(tracer.result.outputs[0].text)
        record = {f"layers.{layer}": np.asarray(rows[layer].value, np.float32) for layer in LAYERS}
        record["logits.values"] = np.stack([t.values for t in top])
        record["logits.ids"] = np.stack([t.ids for t in top])
        for name, array in record.items():
            shard.arrays.setdefault(name, []).append(array)
        if len(shard) == shard_size or i == len(texts) - 1:
            shards.write(shard, folder / shards.shard_name(number, "parquet"), "parquet")
            number += 1
            shard = shards.Shard(i + 1, [], [])


def with_collect(client: Any, texts: list[str], folder: Path, max_tokens: int, shard_size: int,
                 concurrency: int) -> None:
    client.collect(texts, folder, layers=LAYERS, positions="last", logits_top_k=TOP_K, max_tokens=max_tokens,
                   shard_size=shard_size, concurrency=concurrency, progress=False)


def layer_values(folder: Path) -> np.ndarray:
    from tracewire import shards

    found = sorted(folder.glob("shard-*.parquet"))
    return np.concatenate([np.concatenate(shards.read(p, "parquet", 0).arrays["layers.2"]) for p in found])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "tracewire-tiny"))
    parser.add_argument("--target", default=None, help="a running eager server instead of starting one")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()

    import tracewire

    work = Path(tempfile.mkdtemp())
    proc, log_path = None, work / "server.log"
    target = args.target
    if target is None:
        proc, target = start_server(args.model, log_path)
    client = tracewire.Client(target, timeout=300)
    texts = prompts(args.prompts)
    rows = {
        "plain loop of client.trace": lambda out: plain_loop(client, texts, out, args.max_tokens, args.shard_size),
        "client.collect, concurrency 1": lambda out: with_collect(client, texts, out, args.max_tokens,
                                                                  args.shard_size, 1),
        "client.collect, concurrency 8": lambda out: with_collect(client, texts, out, args.max_tokens,
                                                                  args.shard_size, 8),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    try:
        wait_ready(client, proc, log_path) if proc is not None else client.model_info()
        plain_loop(client, texts[:16], work / "warm-up", args.max_tokens, args.shard_size)
        for repeat in range(args.repeats):
            values = []
            for n, (name, run) in enumerate(rows.items()):
                out = work / f"r{repeat}-{n}"
                started = time.perf_counter()
                run(out)
                times[name].append(time.perf_counter() - started)
                values.append(layer_values(out))
            for other in values[1:]:
                np.testing.assert_allclose(other, values[0], atol=1e-4)
    finally:
        client.close()
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    results = []
    for name in rows:
        wall = statistics.median(times[name])
        results.append({"row": name, "wall_s": wall, "prompts_per_s": args.prompts / wall, "walls_s": times[name]})
    base = results[0]["wall_s"]
    print(f"{args.prompts} prompts, layers {LAYERS} at the last position + top-{TOP_K} logits, "
          f"{args.max_tokens} new token(s), shards of {args.shard_size}, median of {args.repeats}:")
    print("| | wall | prompts/s | vs plain loop |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['row']} | {r['wall_s']:.2f} s | {r['prompts_per_s']:.1f} | {base / r['wall_s']:.2f}x |")
    now = dt.datetime.now(dt.UTC)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"collect-{now:%Y%m%d-%H%M}-{platform.node()}.json"
    path.write_text(json.dumps({
        "date": now.isoformat(), "host": platform.node(), "machine": platform.machine(), "model": args.model,
        "prompts": args.prompts, "shard_size": args.shard_size, "max_tokens": args.max_tokens, "layers": LAYERS,
        "top_k": TOP_K, "repeats": args.repeats, "method": "rows interleaved, median of repeats", "rows": results,
    }, indent=2))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
