"""`tracewire`: generate and trace from the shell.

    tracewire generate "The capital of France is" --max-tokens 8
    tracewire trace "The capital of France is" --top-k 5 --max-tokens 16
    tracewire trace "..." --json            # one JSON object per step, then the result
    tracewire lens "The capital of France is"        # logit lens table (server: --enforce-eager or --compiled-reads)
    tracewire lens "The capital of France is" --plot lens.png   # ... and as a heatmap (tracewire[plot])
    tracewire collect prompts.jsonl acts/ --layers 1,2 --positions last   # activations to Parquet shards
    tracewire tokenize " Berlin"

The server address comes from --target or $TRACEWIRE_TARGET (default 127.0.0.1:50051).
A server started with --auth-tokens needs a token: --token-file FILE, or $TRACEWIRE_TOKEN
(--token TOKEN works too, but shows the token to anyone who can list processes). TLS:
--tls (the system's CAs), --tls-ca FILE, and for mutual TLS --tls-cert / --tls-key
($TRACEWIRE_TLS_CA, $TRACEWIRE_TLS_CERT, $TRACEWIRE_TLS_KEY).
Any vLLM sampling parameter: -s name=value (value parsed as JSON when it can be).
generate and trace decode greedily (--temperature 0) unless given --temperature (or
-s temperature=...); the model's generation config is not applied.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from .client import Client
from .errors import TracewireError, Unreachable
from .rpcs import ModelInfo
from .tls import Tls

# The server applies vLLM's defaults (temperature 1), not the model's generation config, and
# does not expose that config: a newcomer asking for a capital should get the model's best
# guess, so the CLI decodes greedily unless told otherwise.
DEFAULT_TEMPERATURE = 0.0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"temperature": DEFAULT_TEMPERATURE}
    for name in ("max_tokens", "temperature", "seed"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    for item in args.param or []:
        name, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"tracewire: -s expects name=value, got {item!r}")
        try:
            kw[name] = json.loads(raw)
        except json.JSONDecodeError:
            kw[name] = raw
    return kw


def _generate(client: Client, args: argparse.Namespace) -> None:
    outputs = client.generate(args.prompts, **_sampling(args))
    if args.json:
        for out in outputs:
            print(json.dumps({
                "prompt": out.prompt,
                "outputs": [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                            for c in out.outputs],
            }))
        return
    for out in outputs:
        for c in out.outputs:
            print(f"{out.prompt!r} -> {c.text!r} ({c.finish_reason})")


def _trace(client: Client, args: argparse.Namespace) -> None:
    tracer = client.trace(args.prompt, **_sampling(args))
    tracer.all().logprobs(top_k=args.top_k).save("lp")
    decode = _TokenText(client)
    header = not args.json  # printed with the first step: a call that fails prints nothing but its error
    for step in client.stream_trace(tracer):
        if header:
            print(f"{'step':>4}  {'token':<16} {'p':>6}  top {args.top_k}")
            header = False
        lp = step.values["lp"]
        alternatives = [(decode(t), math.exp(v)) for t, v in lp.top.items()]
        if args.json:
            print(json.dumps({
                "sequence": step.sequence_index, "step": step.step, "token_id": step.token_id,
                "token": decode(step.token_id), "p": math.exp(lp.logprob),
                "top": [{"token_id": t, "token": decode(t), "p": math.exp(v)} for t, v in lp.top.items()],
            }), flush=True)
        else:
            alts = "  ".join(f"{tok!r} {p:.3f}" for tok, p in alternatives)
            print(f"{step.step:>4}  {decode(step.token_id)!r:<16} {math.exp(lp.logprob):>6.3f}  {alts}", flush=True)
    result = tracer.result
    assert result is not None
    if args.json:
        final = result.outputs[0]
        print(json.dumps({"text": final.text, "token_ids": final.token_ids, "finish_reason": final.finish_reason}))
    else:
        print(f"\n{args.prompt}{result.outputs[0].text}")
        print(f"({len(result.outputs[0].token_ids)} tokens, {result.outputs[0].finish_reason})")
    for w in tracer.warnings:
        print(f"warning: {w}", file=sys.stderr)


def _lens(client: Client, args: argparse.Namespace) -> None:
    """The logit lens at every prompt position: each layer's top guess for the next token."""
    info = client.model_info()
    layers = [int(x) for x in args.layers.split(",")] if args.layers else _lens_layers(info)
    with client.trace(args.prompt, max_tokens=1, temperature=0.0) as tracer:
        lens = tracer.iter[0].logit_lens(layers, positions="prompt", top_k=1).save("lens")
    top = lens.value
    ids = client.tokenizer.encode(args.prompt)
    decode = _TokenText(client)
    if args.plot:
        _save_lens_plot(args.plot, top, layers, [decode(t) for t in ids], decode)
    if args.json:
        print(json.dumps({
            "positions": [decode(t) for t in ids],
            "layers": [{"layer": layer, "top": [{"token": decode(int(top.ids[k, p, 0])),
                                                 "p": math.exp(float(top.values[k, p, 0]))}
                                                for p in range(len(ids))]}
                       for k, layer in enumerate(layers)],
        }))
        return
    header = ["layer", *(repr(decode(t)) for t in ids)]
    rows = [
        [str(layer), *(_Cell(repr(decode(int(top.ids[k, p, 0]))), math.exp(float(top.values[k, p, 0])))
                       for p in range(len(ids)))]
        for k, layer in enumerate(layers)
    ]
    for line in _table(header, rows, colour=_colour_wanted()):
        print(line)


def _lens_layers(info: ModelInfo) -> list[int]:
    """The lens's default layers: all of them, except on a compiled server that reads only
    some (--compiled-reads LAYERS: readable_layers), and under pipeline parallelism the
    last stage's (lm_head is there). One without read buffers gets all, and refuses them
    itself, naming the flags that would serve them."""
    layers = list(range(info.stage_first_layers[-1], info.num_layers))
    if info.engine_mode not in ("eager", "unspecified") and info.readable_layers:
        return [layer for layer in sorted(info.readable_layers) if layer in layers]
    return layers


def _save_lens_plot(path: str, top: Any, layers: list[int], tokens: list[str], decode: _TokenText) -> None:
    try:
        from . import plot

        figure = plot.logit_lens(top, layers=layers, tokens=tokens, decode=decode)
    except ImportError as e:
        raise SystemExit(f"tracewire: --plot: {e}") from e
    try:
        figure.savefig(path, dpi=150)
    except (OSError, ValueError) as e:  # a folder that is not there; a suffix matplotlib cannot write
        raise SystemExit(f"tracewire: --plot {path}: {e}") from e
    print(f"wrote {path}", file=sys.stderr)


def _collect(client: Client, args: argparse.Namespace) -> None:
    """A dataset's activations into sharded files (collect.py), with a progress bar."""
    try:
        layers = [int(x) for x in args.layers.split(",")] if args.layers else []
        positions: str | list[int] = (args.positions if args.positions in ("prompt", "last", "new")
                                      else [int(p) for p in args.positions.split(",")])
    except ValueError as e:
        raise SystemExit(f"tracewire: --layers / --positions: comma-separated integers expected ({e})") from e
    manifest = client.collect(
        args.prompts, args.output, layers=layers, positions=positions, mean=args.mean,
        logits_top_k=args.logits_top_k, samples=args.samples, max_tokens=args.max_tokens or 1,
        storage=args.format, shard_size=args.shard_size, column=args.column, concurrency=args.concurrency,
        progress=False if args.no_progress else None,
        **{k: v for k, v in _sampling(args).items() if k != "max_tokens"},
    )
    print(json.dumps({"output": args.output, "prompts": manifest.count, "shards": len(manifest.shards),
                      "fields": manifest.fields}))


class _Cell:
    """A lens cell: the token and its probability, the probability coloured on a terminal."""

    def __init__(self, token: str, p: float) -> None:
        self.token, self.p = token, p

    def plain(self) -> str:
        return f"{self.token} {self.p:.2f}"

    def coloured(self) -> str:
        # Bright green when the layer is sure, yellow when it leans, dim when it guesses.
        code = "1;32" if self.p >= 0.5 else "33" if self.p >= 0.1 else "2"
        return f"{self.token} \x1b[{code}m{self.p:.2f}\x1b[0m"


def _table(header: list[str], rows: list[list[Any]], colour: bool) -> list[str]:
    """Left-aligned columns, each as wide as its widest cell (no cell is cut); the first
    column right-aligned. Widths come from the plain text, so colour codes do not skew them."""
    plain = [header, *([c.plain() if isinstance(c, _Cell) else c for c in row] for row in rows)]
    widths = [max(len(line[i]) for line in plain) for i in range(len(header))]
    lines = []
    for n, line in enumerate(plain):
        cells = []
        for i, text in enumerate(line):
            cell = rows[n - 1][i] if n > 0 else None
            shown = cell.coloured() if colour and isinstance(cell, _Cell) else text
            pad = " " * (widths[i] - len(text))
            cells.append(pad + shown if i == 0 else shown + pad)
        lines.append("  ".join(cells).rstrip())
    return lines


def _colour_wanted() -> bool:
    """Colour only on a terminal, and never with $NO_COLOR set (https://no-color.org)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def _tokenize(client: Client, args: argparse.Namespace) -> None:
    ids = client.tokenizer.encode(args.text)
    if args.json:
        print(json.dumps({"token_ids": ids, "tokens": [client.tokenizer.decode(i) for i in ids]}))
    else:
        for i in ids:
            print(f"{i:>8}  {client.tokenizer.decode(i)!r}")


class _TokenText:
    """Token id -> its text, fetched once per id."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self._cache:
            self._cache[token_id] = self._client.tokenizer.decode(token_id, skip_special_tokens=False)
        return self._cache[token_id]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tracewire", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=os.environ.get("TRACEWIRE_TARGET", "127.0.0.1:50051"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per call")
    p.add_argument("--token", help="bearer token (default: $TRACEWIRE_TOKEN)")
    p.add_argument("--token-file", metavar="FILE", help="read the bearer token from FILE")
    p.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs (implied by --tls-ca)")
    p.add_argument("--tls-ca", metavar="FILE", default=os.environ.get("TRACEWIRE_TLS_CA"),
                   help="PEM CA certificates to trust ($TRACEWIRE_TLS_CA)")
    p.add_argument("--tls-cert", metavar="FILE", default=os.environ.get("TRACEWIRE_TLS_CERT"),
                   help="client certificate for mutual TLS ($TRACEWIRE_TLS_CERT)")
    p.add_argument("--tls-key", metavar="FILE", default=os.environ.get("TRACEWIRE_TLS_KEY"),
                   help="its private key ($TRACEWIRE_TLS_KEY)")
    sub = p.add_subparsers(dest="command", required=True)

    def sampling_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--max-tokens", type=int, dest="max_tokens")
        sp.add_argument("--temperature", type=float,
                        help=f"default {DEFAULT_TEMPERATURE:g}: greedy, the most likely token each step "
                             "(not the model's generation config); e.g. 1.0 to sample")
        sp.add_argument("--seed", type=int)
        sp.add_argument("-s", "--param", action="append", metavar="NAME=VALUE",
                        help="any vLLM sampling parameter, e.g. -s top_p=0.9 -s 'stop=[\".\"]'")
        sp.add_argument("--json", action="store_true", help="machine-readable output, one JSON object per line")

    g = sub.add_parser("generate", help="plain generation")
    g.add_argument("prompts", nargs="+")
    sampling_flags(g)
    t = sub.add_parser("trace", help="stream each step: token, probability, top alternatives")
    t.add_argument("prompt")
    t.add_argument("--top-k", type=int, default=5, dest="top_k", help="alternatives shown per step")
    sampling_flags(t)
    lens = sub.add_parser("lens", help="the logit lens at every prompt position "
                          "(server needs --enforce-eager or --compiled-reads)")
    lens.add_argument("prompt")
    lens.add_argument("--layers", help="comma-separated layer indices (default: all the server reads: every "
                      "layer on an eager server, its readable_layers on a compiled one)")
    lens.add_argument("--json", action="store_true")
    lens.add_argument("--plot", metavar="FILE", help="also save a heatmap (.png, .svg, .pdf; needs tracewire[plot])")
    c = sub.add_parser("collect", help="a dataset's activations into Parquet / safetensors shards, resumable")
    c.add_argument("prompts", help="a .jsonl, .txt, .parquet or .csv file of prompts")
    c.add_argument("output", help="the collection's folder (run again to resume)")
    c.add_argument("--column", help="the prompt column / JSON field (default: prompt, else text)")
    c.add_argument("--layers", help="comma-separated decoder layers to read (server needs --enforce-eager, "
                   "or --compiled-reads on these layers)")
    c.add_argument("--positions", default="last",
                   help="prompt | last | new | comma-separated prompt positions (default last)")
    c.add_argument("--mean", action="store_true", help="average the prompt positions on the server")
    c.add_argument("--logits-top-k", type=int, default=0, dest="logits_top_k", help="the k largest logits per step")
    c.add_argument("--samples", action="store_true", help="the token drawn at each step")
    c.add_argument("--format", choices=("parquet", "safetensors"), default="parquet")
    c.add_argument("--shard-size", type=int, default=256, dest="shard_size", help="prompts per shard")
    c.add_argument("--concurrency", type=int, default=8, help="traces in flight")
    c.add_argument("--no-progress", action="store_true", dest="no_progress", help="no progress bar")
    sampling_flags(c)
    k = sub.add_parser("tokenize", help="token ids of a text")
    k.add_argument("text")
    k.add_argument("--json", action="store_true")
    return p


def _token(args: argparse.Namespace) -> str | None:
    if args.token is not None and args.token_file is not None:
        raise SystemExit("tracewire: --token or --token-file, not both")
    if args.token_file is not None:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as e:
            raise SystemExit(f"tracewire: --token-file {args.token_file}: {e.strerror or e}") from e
    token: str | None = args.token if args.token is not None else os.environ.get("TRACEWIRE_TOKEN")
    return token


def _tls(args: argparse.Namespace) -> Tls | bool:
    if args.tls_ca is None and args.tls_cert is None and args.tls_key is None:
        return bool(args.tls)
    try:
        return Tls.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    except OSError as e:
        raise SystemExit(f"tracewire: {e.filename}: {e.strerror or e}") from e
    except ValueError as e:
        raise SystemExit(f"tracewire: --tls-cert / --tls-key: {e}") from e


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        with Client(args.target, token=_token(args), tls=_tls(args), timeout=args.timeout) as client:
            commands = {"generate": _generate, "trace": _trace, "lens": _lens, "tokenize": _tokenize,
                        "collect": _collect}
            commands[args.command](client, args)
    except Unreachable as e:
        print(f"tracewire: cannot reach a tracewire server at {e.target} ({e.reason}): start one (make serve), "
              "or give its address: --target HOST:PORT or $TRACEWIRE_TARGET", file=sys.stderr)
        return 1
    except TracewireError as e:
        where = f" (field {e.field})" if e.field else ""
        print(f"tracewire: {e.code.name}{where}: {e.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
