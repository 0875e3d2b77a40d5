"""`python -m tracewire_server --model PATH [--port N] [any vLLM engine option]`."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

from .arg_errors import one_line_errors
from .frontend import connection_limits, launcher
from .frontend.auth import TokenFileError, TokenTable
from .frontend.dictionaries import DEFAULT_MAX_BYTES
from .frontend.dictionary_directory import read_directory
from .frontend.graph_hooks import DEFAULT_BUDGET_BYTES
from .frontend.model_path import model_problem
from .frontend.ray_backend import platform_ray_problem
from .frontend.server import ServerConfig
from .frontend.servicer import TraceOptions
from .frontend.tenants import TenantQuotas
from .frontend.tls import ServerTls, TlsConfigError
from .shared.limits import DEFAULT_PATCH_STORE_BYTES, PATCH_STORE_BYTES_ENV

log = logging.getLogger("tracewire_server")

# The embedded default model, when running from a checkout of the project.
_EMBEDDED_MODEL = Path(__file__).resolve().parents[3] / "models" / "tracewire-tiny"


def parse_args(argv: list[str]) -> ServerConfig:
    from .frontend.engine import (
        GRAPH_HOOK_FLAGS,
        default_cpu_environment,
        use_compiled_mean_ablation,
        use_default_graph_hooks,
        use_graph_hooks,
    )
    from .frontend.vllm_compat import AsyncEngineArgs, FlexibleArgumentParser

    default_cpu_environment()
    parser = FlexibleArgumentParser(
        prog="python -m tracewire_server",
        description="tracewire: observe and steer vLLM generation over gRPC. "
        "Every vLLM engine option is accepted (see below).",
    )
    group = parser.add_argument_group("tracewire")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=50051, help="gRPC port")
    group.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="also serve the API to browsers on this HTTP port (Connect protocol with JSON or "
        "binary protobuf, and gRPC-Web), on --host; 0: off",
    )
    group.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="browser origin allowed to call the HTTP port, e.g. https://dash.example.com "
        "(repeatable; '*' allows any). Default: pages served from localhost / 127.0.0.1 / [::1] only",
    )
    group.add_argument(
        "--frontends",
        type=int,
        default=1,
        help="server processes sharing the engine, all on --port (and --http-port): more "
        "frontends stream more steps a second to many concurrent clients (like vLLM's "
        "--api-server-count)",
    )
    group.add_argument(
        "--grace-period",
        type=float,
        default=10.0,
        help="seconds in-flight calls get to finish on SIGTERM before they are cancelled",
    )
    group.add_argument(
        "--max-message-bytes",
        type=int,
        default=256 * 1024 * 1024,
        help="largest message sent (responses: a step of full-row reads can be large)",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=ServerConfig.max_request_bytes,
        help="largest request received on either port, after decompression (a gzip body "
        "counts as what it inflates to); larger ones are refused with RESOURCE_EXHAUSTED",
    )
    group.add_argument(
        "--max-read-bytes",
        type=int,
        default=TraceOptions.max_read_bytes,
        help="largest total of read values one trace may ask for; larger traces are refused "
        "with RESOURCE_EXHAUSTED before they run",
    )
    group.add_argument(
        "--patch-store-bytes",
        type=int,
        metavar="N",
        help="device bytes the worker keeps for activation patching (sources' values, until their trace "
        f"ends); a patching trace takes its worst case before it starts, one that does not fit now is "
        f"refused with RESOURCE_EXHAUSTED (default ${PATCH_STORE_BYTES_ENV}, else {DEFAULT_PATCH_STORE_BYTES})",
    )
    group.add_argument(
        "--max-sequences",
        type=int,
        default=TraceOptions.max_sequences,
        help="most engine requests one call may make (its prompts or invokes times n); "
        "more are refused with INVALID_ARGUMENT naming the field before any work is done",
    )
    group.add_argument(
        "--trace-buffer-bytes",
        type=int,
        default=TraceOptions.buffer_bytes,
        help="step results one trace may have waiting for a slow client before it fails "
        "with RESOURCE_EXHAUSTED",
    )
    group.add_argument(
        "--compiled-steering",
        nargs="?",
        const="all",
        metavar="LAYERS",
        help="serve decoder-layer writes (add / replace / zero on layers.N) on a compiled, "
        "CUDA-graph engine: the writes become part of the compiled graph, which then runs one "
        "small gather-and-add per steerable layer in every forward pass. LAYERS: 'all' (the "
        "default) or the layer numbers, e.g. 12,16,20, to pay only on those. Without it a "
        "compiled engine refuses module interventions (--enforce-eager serves them all)",
    )
    group.add_argument(
        "--compiled-reads",
        nargs="?",
        const="all",
        metavar="LAYERS",
        help="serve decoder-layer reads (read_module of layers.N, the logit lens, probe and SAE "
        "reads) on a compiled, CUDA-graph engine: the graph copies each readable layer's residual "
        "stream into a buffer in every forward pass (max-num-batched-tokens x hidden values a "
        "layer). LAYERS: 'all' (the default) or the layer numbers, e.g. 12,16,20",
    )
    group.add_argument(
        "--compiled-unit-steering",
        nargs="?",
        const="all",
        metavar="LAYERS",
        help="serve add / replace / zero writes of attention heads (layers.N.self_attn.heads) and MLP "
        "neurons (layers.N.mlp.act) on a compiled, CUDA-graph engine: the graph scales and shifts "
        "o_proj's and down_proj's inputs by per-row table entries in every forward pass (2 x "
        "(2 x max-num-seqs + 1) x (heads x head_dim + intermediate size) values a layer). LAYERS: "
        "'all' (the default) or the layer numbers",
    )
    group.add_argument(
        "--graph-hook-bytes",
        type=int,
        default=DEFAULT_BUDGET_BYTES,
        metavar="N",
        help="on a compiled engine started without any --compiled-* flag, the device bytes the "
        "graph's hooks may reserve: layer writes, layer reads, head and neuron writes, head and "
        "neuron reads, attention queries and keys, other modules' writes and reads, each on every "
        "layer while the total fits (the start log says what fit and "
        "what each kind left off costs); 0: none. Any --compiled-* flag sets exactly what the "
        "graph carries instead",
    )
    group.add_argument(
        "--compiled-unit-reads",
        nargs="?",
        const="all",
        metavar="LAYERS",
        help="serve reads of attention heads (layers.N.self_attn.heads) and MLP neurons "
        "(layers.N.mlp.act) on a compiled, CUDA-graph engine: the graph copies o_proj's and "
        "down_proj's inputs into buffers in every forward pass (max-num-batched-tokens x "
        "(heads x head_dim + intermediate size) values a layer). LAYERS: 'all' (the default) or "
        "the layer numbers",
    )
    group.add_argument(
        "--compiled-pattern-reads",
        nargs="?",
        const="all",
        metavar="LAYERS",
        help="serve attention-pattern reads on a compiled, CUDA-graph engine: the graph copies "
        "each layer's attention queries and keys (after rotary) into buffers in every forward pass "
        "(max-num-batched-tokens x (heads + KV heads) x head_dim values a layer), and the patterns "
        "are computed from them after the pass. LAYERS: 'all' (the default) or the layer numbers",
    )
    group.add_argument(
        "--compiled-module-reads",
        nargs="?",
        const="all",
        metavar="LAYERS",
        help="serve reads of the other modules (embed_tokens, layers.N.self_attn, layers.N.mlp, norm) "
        "on a compiled, CUDA-graph engine: the graph copies each one's output into a buffer in every "
        "forward pass (max-num-batched-tokens x hidden values a module). LAYERS: 'all' (the default) or "
        "the layers whose attention and MLP outputs are kept (embed_tokens and norm always are)",
    )
    group.add_argument(
        "--compiled-module-steering",
        nargs="?",
        const="all",
        metavar="LAYERS",
        help="serve add / replace / zero, patch and dictionary-steer writes of the other modules "
        "(embed_tokens, layers.N.self_attn, layers.N.mlp, norm) on a compiled, CUDA-graph engine, as "
        "--compiled-steering does for decoder layers. LAYERS: 'all' (the default) or the layers whose "
        "attention and MLP outputs get tables (embed_tokens and norm always do)",
    )
    group.add_argument(
        "--compiled-dictionary-clamps",
        nargs="?",
        const="all",
        metavar="LAYERS",
        help="serve clamps and ablations of ReLU / JumpReLU SAE features (write_dictionary's clamp, "
        "ablate) on a compiled, CUDA-graph engine, on decoder layers with --compiled-steering tables: "
        "each table gets 64 feature columns and the graph computes their activations every forward "
        "pass (two small matmuls a layer). LAYERS: 'all' (the default) or the layer numbers",
    )
    group.add_argument(
        "--compiled-mean-ablation",
        action="store_true",
        help="serve mean ablations (write_module's mean) on a compiled, CUDA-graph engine's write tables "
        "(--compiled-steering, --compiled-unit-steering, --compiled-module-steering): the graph keeps a "
        "running sum over each pass's rows per table. The default graph hooks include it where every kind "
        "fit (this flag alone keeps the default hooks and adds it to them)",
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics at http://HOST:N/metrics, on --host; with --frontends K, "
        "frontend i on N+i (each counts what it serves); 0: off",
    )
    group.add_argument(
        "--access-log",
        default="",
        metavar="FILE",
        help="one JSON line per call (both ports) appended to FILE; default: the normal log "
        "(logger tracewire.access); 'off': none",
    )
    group.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name the HTTP ports answer for in the Host header besides the listening address "
        "(repeatable; '*': any). Others get 421: DNS rebinding protection",
    )
    group.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="testing only: interventions named '__fault__:<message>' raise in the engine hooks",
    )
    _dictionary_flags(parser)
    _security_flags(parser)
    connection_limits.add_flags(parser)
    parser = AsyncEngineArgs.add_cli_args(parser)
    one_line_errors(parser)
    if _EMBEDDED_MODEL.is_dir():
        parser.set_defaults(model=str(_EMBEDDED_MODEL))
    args = parser.parse_args(argv)
    if (problem := model_problem(args.model)) is not None:
        raise SystemExit(f"tracewire: {problem}")
    if args.frontends < 1:
        parser.error("--frontends must be >= 1")
    if args.max_sequences < 1:
        parser.error("--max-sequences must be >= 1")
    if (problem := platform_ray_problem(args.distributed_executor_backend)) is not None:
        parser.error(problem)
    graph_flags = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in GRAPH_HOOK_FLAGS}
    if args.pipeline_parallel_size > 1 and any(graph_flags.values()):
        # The steering tables and read buffers of earlier stages' layers would be filled and
        # read by hooks that run on the last stage only (where the sample is drawn).
        flag = next(name for name, value in graph_flags.items() if value)
        parser.error(f"{flag} needs --pipeline-parallel-size 1: under pipeline parallelism the compiled "
                     "graph's hooks run on the last stage only (module interventions need --enforce-eager there)")
    engine_args = AsyncEngineArgs.from_cli_args(args)
    for flag, value in graph_flags.items():
        if value:
            use_graph_hooks(engine_args, flag, _layer_list(parser, flag, value))
    if args.compiled_mean_ablation:
        use_compiled_mean_ablation(engine_args)
    if args.graph_hook_bytes < 0:
        parser.error("--graph-hook-bytes must be >= 0 (0: no default graph hooks)")
    if not any(graph_flags.values()) and not engine_args.enforce_eager and args.pipeline_parallel_size == 1 \
            and args.graph_hook_bytes > 0:
        if (hooks := use_default_graph_hooks(engine_args, args.graph_hook_bytes)) is not None:
            log.info("%s", hooks.describe(args.graph_hook_bytes))
    try:
        tls = ServerTls.load(args.tls_cert, args.tls_key, args.tls_client_ca)
        tokens = TokenTable.load(Path(args.auth_tokens)) if args.auth_tokens else None
    except (TlsConfigError, TokenFileError) as e:
        parser.error(str(e))
    quotas = _tenant_quotas(parser, args, auth=tokens is not None)
    if args.patch_store_bytes is not None:
        if args.patch_store_bytes < 0:
            parser.error("--patch-store-bytes must be >= 0 (0: no activation patching)")
        os.environ[PATCH_STORE_BYTES_ENV] = str(args.patch_store_bytes)  # (the engine's processes read it)
    if args.max_dictionary_bytes < 0:
        parser.error("--max-dictionary-bytes must be >= 0 (0: no uploads)")
    # Before the engine starts: a bad file is one line now, not after a minute's start.
    dictionaries = read_directory(Path(args.dictionaries)) if args.dictionaries else ()
    if tokens is None and not _loopback(args.host):
        log.warning("listening on %s without --auth-tokens: anyone who can reach it may call it", args.host)
    return ServerConfig(
        host=args.host,
        port=args.port,
        grace_seconds=args.grace_period,
        max_message_bytes=args.max_message_bytes,
        max_request_bytes=args.max_request_bytes,
        engine_args=engine_args,
        trace=TraceOptions(
            max_read_bytes=args.max_read_bytes,
            max_sequences=args.max_sequences,
            buffer_bytes=args.trace_buffer_bytes,
            fault_injection=args.enable_fault_injection,
        ),
        http_port=args.http_port,
        cors_origins=tuple(args.cors_origin),
        frontends=args.frontends,
        tls=tls,
        tokens=tokens,
        tenant_quotas=quotas,
        reflection=not args.no_reflection,
        connections=connection_limits.from_args(parser, args),
        metrics_port=args.metrics_port,
        access_log=args.access_log,
        allowed_hosts=tuple(args.allowed_host),
        dictionaries=dictionaries,
        max_dictionary_bytes=args.max_dictionary_bytes,
    )


def _dictionary_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dictionaries (docs: Probes and SAEs)")
    group.add_argument(
        "--dictionaries", metavar="DIR",
        help="load the probes and SAEs in DIR at start (NAME.json, a DictionarySpec in protobuf JSON, "
        "beside NAME.safetensors for each); clients read them by NAME and cannot delete them",
    )
    group.add_argument(
        "--max-dictionary-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="N",
        help="device bytes all dictionaries uploaded with RegisterDictionary may take together "
        "(--dictionaries' not counted); an upload over what is left is refused with RESOURCE_EXHAUSTED "
        "as its chunks arrive",
    )


def _security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (docs: Security)")
    group.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve TLS on both ports")
    group.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="PEM CA certificates: mutual TLS, clients must present a certificate they signed (both ports)",
    )
    group.add_argument(
        "--auth-tokens",
        metavar="FILE",
        help="bearer tokens, one 'TENANT TOKEN' a line ('#' comments): every call but health's "
        "needs 'authorization: Bearer TOKEN' (reflection too), and tenants get quotas",
    )
    defaults = TenantQuotas()
    group.add_argument(
        "--tenant-max-calls", type=int, metavar="N",
        help=f"with --auth-tokens: calls one tenant may have in flight (default {defaults.max_calls}; 0: unlimited)",
    )
    group.add_argument(
        "--tenant-max-sequences", type=int, metavar="N",
        help="with --auth-tokens: engine requests (prompts or invokes x n) one tenant may have in "
        f"flight over all its calls (default {defaults.max_sequences}; 0: unlimited)",
    )
    group.add_argument(
        "--tenant-read-bytes-per-minute", type=int, metavar="B",
        help="with --auth-tokens: read bytes one tenant's traces may ask for in a sliding minute, "
        "each charged its worst case when admitted (default "
        f"{defaults.read_bytes_per_minute or 'unlimited'}; 0: unlimited)",
    )
    group.add_argument(
        "--tenant-patch-store-bytes", type=int, metavar="B",
        help="with --auth-tokens: bytes of the worker's patch store (--patch-store-bytes) one tenant's "
        "patching traces may hold at once, each its worst case (default "
        f"{defaults.patch_store_bytes or 'unlimited'}; 0: unlimited)",
    )
    group.add_argument(
        "--no-reflection", action="store_true",
        help="do not serve gRPC server reflection (on by default; needs a token with --auth-tokens)",
    )


def _tenant_quotas(parser: argparse.ArgumentParser, args: argparse.Namespace, *, auth: bool) -> TenantQuotas:
    """The flags' quotas over the defaults; tenants exist only with tokens, so a quota
    without --auth-tokens is a mistake, not something to ignore."""
    given = {
        "max_calls": args.tenant_max_calls,
        "max_sequences": args.tenant_max_sequences,
        "read_bytes_per_minute": args.tenant_read_bytes_per_minute,
        "patch_store_bytes": args.tenant_patch_store_bytes,
    }
    flags = {name: "--" + f"tenant_{name}".replace("_", "-") for name in given}
    for name, value in given.items():
        if value is None:
            continue
        if not auth:
            parser.error(f"{flags[name]} needs --auth-tokens (quotas are per tenant, tenants come from tokens)")
        if value < 0:
            parser.error(f"{flags[name]} must be >= 0 (0: unlimited)")
    defaults = TenantQuotas()
    return TenantQuotas(
        max_calls=defaults.max_calls if args.tenant_max_calls is None else args.tenant_max_calls,
        max_sequences=defaults.max_sequences if args.tenant_max_sequences is None else args.tenant_max_sequences,
        read_bytes_per_minute=(
            defaults.read_bytes_per_minute
            if args.tenant_read_bytes_per_minute is None
            else args.tenant_read_bytes_per_minute
        ),
        patch_store_bytes=(
            defaults.patch_store_bytes if args.tenant_patch_store_bytes is None else args.tenant_patch_store_bytes
        ),
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _layer_list(parser: argparse.ArgumentParser, flag: str, value: str) -> list[int] | None:
    if value == "all":
        return None
    try:
        layers = sorted({int(part) for part in value.split(",")})
    except ValueError:
        parser.error(f"{flag}: 'all' or layer numbers like 12,16,20, not {value!r}")
    if layers[0] < 0:
        parser.error(f"{flag}: layer numbers count from 0, not {layers[0]}")
    return layers


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return launcher.run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
