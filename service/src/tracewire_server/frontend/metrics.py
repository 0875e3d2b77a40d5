"""Every Prometheus metric the server exports, in one place (`--metrics-port`).

The metrics live in prometheus_client's default registry, one per process: with
`--frontends N` each frontend serves its own on `--metrics-port + i` (frontend i counts
the calls, traces and steps that it serves; sum over the ports). The registry also
holds prometheus_client's process collector (CPU, memory, fds of this process).

Hot path: a trace binds its label children once (`TraceMetrics`) and counts steps and
read values in plain integers, handed to the counters once a second and when it ends;
the one per-step Prometheus call is the engine-to-client latency observation.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics, make_asgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .compiler import CompiledTrace

# No `_created` series beside every counter and histogram: they double a scrape for
# timestamps Prometheus does not need (it sees counter resets itself).
disable_created_metrics()

# Latencies on one machine: tens of microseconds (an idle stream) to seconds (a stalled
# client, a stream_interval_ms cap).
_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)
_HOOK_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
_RPC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# Labels: `transport` is grpc (the gRPC port), connect or grpc-web (the HTTP port);
# `method` the full RPC name (`tracewire.v1.TraceService/Generate`; `unknown` for a path
# the HTTP port does not serve); `code` the gRPC status name; `tenant` who called, ""
# until authentication names tenants.
RPCS = Counter(
    "tracewire_rpcs", "Calls finished, by transport, method, status code and tenant",
    ["transport", "method", "code", "tenant"],
)
RPC_SECONDS = Histogram(
    "tracewire_rpc_duration_seconds", "Call duration, from arrival to its status",
    ["transport", "method"], buckets=_RPC_BUCKETS,
)
TRACES_IN_FLIGHT = Gauge("tracewire_traces_in_flight", "Trace calls running", ["tenant"])
TRACE_STEPS = Counter("tracewire_trace_steps", "StepResults streamed to clients", ["tenant"])
# kind: the read's type, as the TraceRequest names it: logits, logprobs, sample, module, logit_lens,
# attention_pattern.
READ_VALUES = Counter("tracewire_trace_read_values", "Read values streamed, by read kind", ["kind", "tenant"])
READ_BYTES = Counter(
    "tracewire_trace_read_bytes", "Bytes of read values streamed (the tensors' data), by read kind",
    ["kind", "tenant"],
)
ENGINE_TO_CLIENT = Histogram(
    "tracewire_step_engine_to_transport_seconds",
    "From a StepResult's engine_time (its token arrived from the engine) to the moment its "
    "message is handed to the transport",
    buckets=_LATENCY_BUCKETS,
)
# The worker's hook time per engine step that carried this frontend's traces, sent with
# the step's side-channel batch: on the engine's thread (what a traced step adds to the
# engine) and on the collector thread (finishing reads and conditions; inline on CPUs).
HOOK_SECONDS = Histogram(
    "tracewire_hook_seconds", "Worker hook time per traced engine step, by thread",
    ["thread"], buckets=_HOOK_BUCKETS,
)
_HOOK_ENGINE = HOOK_SECONDS.labels("engine")
_HOOK_COLLECTOR = HOOK_SECONDS.labels("collector")

# Activation patching: the worker keeps patch sources' values per trace until the trace
# ends; each release answers with what the store still holds (rank 0's worker).
PATCH_STORE_BYTES = Gauge(
    "tracewire_patch_store_bytes",
    "Bytes of patch sources' values the worker holds, as of the last trace released",
)
PATCH_STORE_TRACES = Gauge(
    "tracewire_patch_store_traces", "Traces whose patch sources' values the worker holds, as of the last release",
)
PATCH_RELEASED_BYTES = Counter(
    "tracewire_patch_released_bytes", "Bytes of patch sources' values freed when their traces ended",
)

# How often a running trace hands its counts to the counters.
PUBLISH_EVERY_NS = 1_000_000_000


def observe_hook_times(engine_s: float, collector_s: float) -> None:
    _HOOK_ENGINE.observe(engine_s)
    _HOOK_COLLECTOR.observe(collector_s)


class _Counted(Protocol):
    def inc(self, amount: float = 1) -> None: ...


@dataclass
class _ReadCounts:
    values: _Counted
    bytes: _Counted
    count: int = 0
    size: int = 0


@dataclass
class TraceMetrics:
    """One trace's label children, bound once, and what it streamed since it last
    published. `reads`: read name -> its kind's counts, per invoke."""

    tenant: str
    steps: _Counted
    reads: list[dict[str, _ReadCounts]]
    step_count: int = 0
    _published_ns: int = field(default_factory=time.monotonic_ns)

    @classmethod
    def start(cls, trace: CompiledTrace, tenant: str) -> TraceMetrics:
        by_kind: dict[str, _ReadCounts] = {}
        reads: list[dict[str, _ReadCounts]] = []
        for ops in trace.ops_by_invoke:
            names: dict[str, _ReadCounts] = {}
            for op in ops:
                kind = _read_kind(type(op.action).__name__)
                if kind is None:
                    continue
                if kind not in by_kind:
                    by_kind[kind] = _ReadCounts(READ_VALUES.labels(kind, tenant), READ_BYTES.labels(kind, tenant))
                names[op.name] = by_kind[kind]
            reads.append(names)
        TRACES_IN_FLIGHT.labels(tenant).inc()
        return cls(tenant, TRACE_STEPS.labels(tenant), reads)

    def publish(self) -> None:
        if self.step_count:
            self.steps.inc(self.step_count)
            self.step_count = 0
        for names in self.reads:
            for counts in names.values():
                if counts.count:
                    counts.values.inc(counts.count)
                    counts.bytes.inc(counts.size)
                    counts.count = counts.size = 0
        self._published_ns = time.monotonic_ns()

    def maybe_publish(self) -> None:
        """Publish if a second has passed: a long trace shows up while it runs."""
        if time.monotonic_ns() - self._published_ns > PUBLISH_EVERY_NS:
            self.publish()

    def finish(self) -> None:
        self.publish()
        TRACES_IN_FLIGHT.labels(self.tenant).dec()


def _read_kind(action: str) -> str | None:
    """ReadLogitLens -> logit_lens; None for what is not a read."""
    if not action.startswith("Read"):
        return None
    name = action.removeprefix("Read")
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


class _Occupied(Protocol):
    queued: int

    def waiting_messages(self) -> int: ...


class OutboxOccupancy(Collector):
    """Bytes and messages waiting in the live traces' outboxes, summed at scrape time
    (the outboxes keep their own counts; nothing is updated per step for this)."""

    def __init__(self) -> None:
        self._outboxes: weakref.WeakSet[_Occupied] = weakref.WeakSet()

    def add(self, outbox: _Occupied) -> None:
        self._outboxes.add(outbox)

    def discard(self, outbox: _Occupied) -> None:
        self._outboxes.discard(outbox)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        outboxes: Iterable[_Occupied] = list(self._outboxes)
        queued = messages = 0
        for box in outboxes:
            queued += box.queued
            messages += box.waiting_messages()
        yield GaugeMetricFamily(
            "tracewire_outbox_bytes", "Step result bytes waiting for clients in trace outboxes", value=queued
        )
        yield GaugeMetricFamily(
            "tracewire_outbox_messages", "Messages waiting for clients in trace outboxes", value=messages
        )


OUTBOXES = OutboxOccupancy()
REGISTRY.register(OUTBOXES)


def asgi_app() -> object:
    """/metrics (any path) in Prometheus' text format, served on the event loop (so a
    scrape reads the outboxes on the thread that changes them)."""
    return make_asgi_app(REGISTRY)
