"""The worker's end of the side channel: one ZMQ PUSH socket per frontend.

Separate from the wire format (shared/sidechannel.py) because only the worker sends,
and how it sends is tuned to the worker's process: the GIL it shares with vLLM's
engine thread, the CPU cores vLLM's CPU backend pins it to.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import stat
from collections.abc import Callable

import zmq

from ..shared.sidechannel import StepBatch, encode

ZERO_COPY_FROM = 1 << 16


@functools.cache
def _send_keeping_gil() -> Callable[[int, bytes, int, int], int] | None:
    """libzmq's own zmq_send, called through ctypes.PyDLL, which keeps the GIL (None
    where pyzmq's libzmq is not found). pyzmq lets go of the GIL for every send. The
    collector thread then waits to get it back from vLLM's busy engine thread, once per
    frontend per step: ~1 ms a step of 8 sends beside a busy thread (bench/hooks.py).
    A send that would block cannot hold the GIL: it is tried with ZMQ_DONTWAIT only."""
    try:
        with open("/proc/self/maps") as maps:  # pyzmq's wheels load their own libzmq
            paths = {line.split()[-1] for line in maps if "libzmq" in line.rsplit("/", 1)[-1]}
        if len(paths) != 1:
            return None
        send = ctypes.PyDLL(paths.pop()).zmq_send
    except (OSError, AttributeError):
        return None
    send.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    send.restype = ctypes.c_int
    return send  # type: ignore[no-any-return]


def _threads() -> set[int]:
    """This process's thread ids (Linux; empty elsewhere)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


@functools.cache
def _sender_context() -> zmq.Context:  # type: ignore[type-arg]
    """The senders' ZMQ context, one per process, made on the thread that will send.

    Every send wakes the context's I/O thread, which inherits the creating thread's CPU
    affinity. vLLM's CPU backend pins its worker to some cores and leaves the others for
    everything else: there the I/O thread would wake on the worker's own core and preempt
    the step that sent the message, once per step (~0.3 ms a step on the 2-core VM, most
    of what a one-request top-20 trace cost). It is moved to the other cores, where there
    are any; elsewhere (a GPU worker is not pinned) nothing changes."""
    context = zmq.Context(io_threads=1)
    before = _threads()
    # The first socket starts the context's threads (I/O and reaper). They name themselves
    # only once running, so they are told apart as the threads that were not there before.
    context.socket(zmq.PUSH).close(linger=0)
    try:
        others = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
    except (AttributeError, OSError):  # no affinities on this platform
        return context
    if not others:  # not pinned (a GPU worker), or no other CPU to go to
        return context
    for tid in _threads() - before:
        try:
            os.sched_setaffinity(tid, others)  # the kernel keeps those of this cgroup
        except OSError:
            pass  # none of the other CPUs is ours (or the thread is gone): it stays put
    return context


def unreachable(address: str, rank: int = 0) -> str | None:
    """Why this worker (of `rank`) cannot send to the frontend's side channel `address`, or None.

    The frontend binds a local (ipc://) socket on its own machine. A worker on another
    machine (a Ray cluster's node) would connect to a path that is not there: ZMQ connects
    lazily and queues what is sent, so every trace would wait forever instead of failing."""
    path = address.removeprefix("ipc://")
    if path == address:  # not a local socket
        return None
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            return None
    except OSError:
        pass
    return (
        f"tracewire: the worker of rank {rank} runs on {socket.gethostname()}, which has no side channel "
        f"socket {path}: that is a local socket of the machine the server runs on, and rank {rank} "
        "sends its traces' records through it (rank 0, and under pipeline parallelism each stage's "
        "first rank). With --distributed-executor-backend ray, those workers must run there: start "
        "the server on a node whose accelerators are in the Ray cluster, and keep pipeline stages on "
        "it (vLLM gives rank 0 to a worker on the node it starts on when it has one; "
        "VLLM_RAY_BUNDLE_INDICES must not place it elsewhere). deploy/README.md: Multi-node with Ray"
    )


class Sender:
    """Worker side. send() never drops: a full pipe blocks the step (HWM is large)."""

    def __init__(self, address: str, high_water_mark: int = 100_000) -> None:
        self._context = _sender_context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)  # messages queued before send() waits
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(address)
        self._send_now = _send_keeping_gil()

    def send(self, batch: StepBatch) -> None:
        data = encode(batch)
        if self._send_now is not None:
            if self._send_now(self._socket.underlying, data, len(data), zmq.DONTWAIT) == len(data):
                return
            # Else the pipe is full (or the send failed): pyzmq waits, or raises what failed.
        # Below ~64 KB pyzmq's zero-copy send costs more than copying (4 µs against 19 µs
        # for 9 KB, measured): it sets up a frame whose release another thread tracks.
        self._socket.send(data, copy=len(data) < ZERO_COPY_FROM)

    def close(self) -> None:
        self._socket.close(linger=0)
