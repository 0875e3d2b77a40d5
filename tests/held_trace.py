"""A trace kept in flight on a server for as long as a test needs: a drain lasts while it
runs, so a test can watch what new calls meet during the drain however fast the machine
generates (a quick CI machine finished ordinary traces before any call met the drain).

The trace reads each step's whole logits rows, raw and processed (16 KiB a step for the
tiny model's vocabulary; 16 MiB over STEPS steps). After its first step the client reads
nothing until `release` is set: HTTP/2 takes some of the rest (6-8 MiB seen with
grpc-python) and the server's write waits with the remainder, so the server must be
started with a per-trace buffer that holds it all (SERVER_ARGS) and a context long enough
for STEPS steps."""

from __future__ import annotations

import threading

import grpc
from conftest import ServerProcess
from trace_requests import TraceResult, invoke, iv, logits, trace
from tracewire.v1 import service_pb2_grpc

STEPS = 1000
# What a server holding this trace needs: a context for STEPS steps, a buffer for all of it.
SERVER_ARGS = ("--max-model-len", "1024", "--trace-buffer-bytes", str(64 << 20))


class HeldTrace(threading.Thread):
    """The trace, on a connection of its own to `server`. `started` is set once its first
    step has arrived (it is running in the engine); after that it reads no more until
    `release` is set (at most `hold_s`). `error` is its gRPC error, if any."""

    def __init__(self, server: ServerProcess, hold_s: float = 60) -> None:
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(server.target)
        self.hold_s = hold_s
        self.started = threading.Event()
        self.release = threading.Event()
        self.events: list[object] = []
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        rows = iv("row", read_logits=logits()), iv("raw", read_logits=logits(raw=True))
        request = trace(invoke("The capital of France is", *rows), max_tokens=STEPS, ignore_eos=True, temperature=0.0)
        try:
            for event in service_pb2_grpc.TraceServiceStub(self.channel).Trace(request, timeout=120):
                self.events.append(event)
                if not self.started.is_set():
                    self.started.set()
                    self.release.wait(self.hold_s)
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.started.set()
            self.channel.close()

    def check_complete(self) -> None:
        """It ended without an error, every step of both reads there."""
        assert self.error is None, self.error
        result = TraceResult(self.events)
        assert len(result.tokens()) == STEPS, len(result.tokens())
        assert len(result.values("row")) == len(result.values("raw")) == STEPS
