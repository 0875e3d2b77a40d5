"""The synchronous client: each call's request and decoding come from rpcs.py; this
module only sends them, blocking."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from . import rpcs
from .channel import connect
from .dictionaries import Dictionary, SpecLike, TensorsLike
from .errors import InvalidArgument, TypedErrors
from .mapping import MapOptions, MapResults, run_map
from .outputs import RequestOutput
from .prompts import PromptLike
from .rpcs import EngineStats, ModelInfo, Rpc, StreamUpdate
from .tls import Tls
from .tokenizer import RemoteTokenizer
from .tracing import Step, Tracer
from .v1 import service_pb2

if TYPE_CHECKING:
    from .collect import Manifest, ShardWritten
    from .shards import Storage

T = TypeVar("T")
R = TypeVar("R")


class Client:
    """A connection to a tracewire server.

    `target` is "host:port". `token`: the bearer token of a server started with
    --auth-tokens, sent with every call. `tls`: True for TLS trusting the system's CAs, or
    a `Tls` (a CA to trust, a client certificate for mutual TLS); `credentials`, any
    grpc.ChannelCredentials instead. `timeout` is the default deadline in seconds for
    every call.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: Tls | bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        connection = connect(grpc, target, token=token, tls=tls, credentials=credentials, options=options)
        self._target = target
        self._channel: grpc.Channel = connection.channel
        self._stub = connection.stub
        self._metadata = connection.metadata
        self.timeout = timeout
        self.tokenizer = RemoteTokenizer(self._unary)

    # -- I/O ----------------------------------------------------------------------

    def _unary(self, rpc: Rpc[T]) -> T:
        with TypedErrors(self._target):
            response = getattr(self._stub, rpc.method)(rpc.request, timeout=self.timeout, metadata=self._metadata)
        return rpc.decode(response)

    def _stream(self, rpc: Rpc[T]) -> Iterator[T]:
        call = getattr(self._stub, rpc.method)(rpc.request, timeout=self.timeout, metadata=self._metadata)
        try:
            with TypedErrors(self._target):
                for message in call:
                    yield rpc.decode(message)
        finally:
            call.cancel()

    def _run_trace(self, request: service_pb2.TraceRequest) -> Iterator[service_pb2.TraceResponse]:
        return self._stream(rpcs.trace(request))

    # -- public API -------------------------------------------------------------

    def generate(
        self, prompts: PromptLike | Sequence[PromptLike], **sampling: Any
    ) -> list[RequestOutput]:
        """Plain generation, like vLLM's LLM.generate: one RequestOutput per prompt.

        `prompts` is one prompt or a list of them; keywords are vLLM's
        SamplingParams fields (a misspelled one raises InvalidArgument).
        """
        return self._unary(rpcs.generate(prompts, sampling))

    def generate_stream(
        self, prompts: PromptLike | Sequence[PromptLike], **sampling: Any
    ) -> Iterator[StreamUpdate]:
        """Plain generation, streamed: deltas (new text and token ids) as they come."""
        yield from self._stream(rpcs.generate_stream(prompts, sampling))

    def trace(self, prompt: PromptLike | None = None, **sampling: Any) -> Tracer:
        """A trace; used as `with client.trace(prompt, **sampling) as tracer:` it runs on exit.

        Without a prompt, add prompts with `tracer.invoke(prompt, **overrides)`.
        """
        return Tracer(self._run_trace, prompt, **sampling)

    def stream_trace(self, trace: Tracer | PromptLike, **sampling: Any) -> Iterator[Step]:
        """Run a trace built with `client.trace(...)` (not entered), or a plain prompt, and
        yield each step as it arrives. Saved values and `.result` fill in meanwhile."""
        if not isinstance(trace, Tracer):
            trace = self.trace(trace, **sampling)
        elif sampling:
            raise InvalidArgument("sampling keywords go to client.trace(), not stream_trace(tracer)")
        return trace.events()

    def map(
        self,
        prompts: Iterable[PromptLike],
        trace_fn: Callable[[Tracer], R],
        *,
        concurrency: int = 8,
        retries: int = 2,
        progress: bool | None = None,
        **sampling: Any,
    ) -> MapResults[R]:
        """Trace every prompt, `concurrency` at a time: `trace_fn(tracer)` adds the reads and
        writes to one prompt's trace and returns what to keep (filled once it has run). One
        `Item` per prompt, in input order, with its value or its error (UNAVAILABLE is
        retried `retries` times). `progress`: a bar on a terminal with tqdm (None), never
        (False). `sampling`: every trace's sampling parameters (mapping.py)."""
        return run_map(self, prompts, trace_fn, MapOptions(concurrency, retries, progress), sampling)

    def collect(
        self,
        prompts: Iterable[str] | str | os.PathLike[str],
        output: str | os.PathLike[str],
        *,
        layers: Sequence[int] = (),
        positions: str | Sequence[int] = "last",
        mean: bool = False,
        logits_top_k: int = 0,
        samples: bool = False,
        max_tokens: int = 1,
        storage: Storage = "parquet",
        shard_size: int = 256,
        column: str | None = None,
        concurrency: int = 8,
        retries: int = 2,
        progress: bool | None = None,
        on_shard: Callable[[ShardWritten], None] | None = None,
        **sampling: Any,
    ) -> Manifest:
        """Collect activations of a dataset into `output` (a folder): sharded Parquet or
        safetensors and manifest.json, resumable (collect.py). `prompts`: text prompts, or a
        .jsonl / .txt / .parquet / .csv file (`column`: its prompt column). Read them back
        with `tracewire.collect.load(output)`."""
        from .collect import CollectPlan, collect

        plan = CollectPlan(tuple(int(x) for x in layers),
                           positions if isinstance(positions, str) else tuple(int(p) for p in positions),
                           mean, logits_top_k, samples, max_tokens)
        return collect(self, prompts, output, plan, storage=storage, shard_size=shard_size, column=column,
                       options=MapOptions(concurrency, retries, progress), on_shard=on_shard, sampling=sampling)

    def register_dictionary(
        self, name: str, spec: SpecLike, tensors: TensorsLike, *, replace: bool = False
    ) -> Dictionary:
        """Upload a dictionary (a linear probe or an SAE) under `name`: `spec` is a mapping
        ({"kind": "probe", "module": "layers.2", "probe_activation": "sigmoid", "labels":
        [...]}), a DictionarySpec or a NAME.json path; `tensors` a mapping of arrays ("W", "b";
        or "W_enc", "b_enc", "W_dec", "b_dec", "threshold"), safetensors bytes or a
        .safetensors path. `replace`: replace your own dictionary of that name. Returns it as
        the server holds it."""
        return self._unary(rpcs.register_dictionary(name, spec, tensors, replace))

    def list_dictionaries(self, *, omit_labels: bool = False) -> list[Dictionary]:
        """Every dictionary the server holds (the operator's have owner "")."""
        return self._unary(rpcs.list_dictionaries(omit_labels))

    def delete_dictionary(self, name: str) -> int:
        """Remove a dictionary you registered; the device bytes freed."""
        return self._unary(rpcs.delete_dictionary(name))

    def model_info(self) -> ModelInfo:
        return self._unary(rpcs.get_model_info())

    def engine_stats(self) -> EngineStats:
        """GetEngineStats: requests in the engine now (unfinished, running, waiting)."""
        return self._unary(rpcs.get_engine_stats())

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
