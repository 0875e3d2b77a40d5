"""Terse builders for raw tracewire.v1 trace requests (tests talk to the generated stubs)."""

from __future__ import annotations

import numpy as np
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import prompt_pb2, sampling_pb2, service_pb2, tensor_pb2, trace_pb2


def steps(*, start=None, stop=None, at=None):
    if at is not None:
        return I.StepSelector(list=I.StepList(steps=list(at)))
    if start is None and stop is None:
        return I.StepSelector(all=I.AllSteps())
    rng = I.StepRange(start=start or 0)
    if stop is not None:
        rng.stop = stop
    return I.StepSelector(range=rng)


def iv(name="", sel=None, when=None, **action):
    msg = I.Intervention(name=name, **action)
    if sel is not None:
        msg.steps.CopyFrom(sel)
    if when is not None:
        msg.condition.CopyFrom(when)
    return msg


def logits(k=None, ids=None, raw=False):
    stage = I.LOGITS_STAGE_RAW if raw else I.LOGITS_STAGE_PROCESSED
    if k is not None:
        return I.ReadLogits(stage=stage, top_k=I.TopK(k=k))
    if ids is not None:
        return I.ReadLogits(stage=stage, token_ids=I.TokenSet(token_ids=ids))
    return I.ReadLogits(stage=stage, full=I.FullRow())


def f32(values) -> tensor_pb2.Tensor:
    a = np.asarray(values, dtype="<f4")
    return tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=a.shape, data=a.tobytes())


def invoke(prompt, *interventions, **sampling):
    p = prompt_pb2.Prompt(text=prompt) if isinstance(prompt, str) else prompt_pb2.Prompt(
        token_ids=prompt_pb2.TokenIds(ids=prompt))
    return trace_pb2.Invoke(prompt=p, interventions=list(interventions),
                            sampling_params=sampling_pb2.SamplingParams(**sampling))


def trace(*invokes, options=None, **sampling):
    req = service_pb2.TraceRequest(invokes=list(invokes),
                                   sampling_params=sampling_pb2.SamplingParams(**sampling))
    if options is not None:
        req.options.CopyFrom(options)
    return req


def cmp(op: str):
    return {">": I.COMPARISON_GREATER, ">=": I.COMPARISON_GREATER_EQUAL,
            "<": I.COMPARISON_LESS, "<=": I.COMPARISON_LESS_EQUAL}[op]


def to_numpy(t: tensor_pb2.Tensor) -> np.ndarray:
    dtype = {tensor_pb2.DTYPE_FLOAT32: "<f4", tensor_pb2.DTYPE_INT32: "<i4",
             tensor_pb2.DTYPE_INT64: "<i8"}[t.dtype]
    return np.frombuffer(t.data, dtype=dtype).reshape(tuple(t.shape))


class TraceResult:
    """A finished trace stream, sorted into steps per (invoke, sequence)."""

    def __init__(self, events):
        self.events = list(events)
        self.steps: dict[tuple[int, int], list] = {}
        self.invokes: dict[int, object] = {}
        self.end = None
        for ev in self.events:
            kind = ev.WhichOneof("event")
            if kind == "steps":
                for step in ev.steps.results:
                    self.steps.setdefault((step.invoke_index, step.sequence_index), []).append(step)
            elif kind == "invoke_result":
                self.invokes[ev.invoke_result.invoke_index] = ev.invoke_result.output
            else:
                self.end = ev.end

    def seq(self, invoke=0, sequence=0):
        return self.steps.get((invoke, sequence), [])

    def values(self, name, invoke=0, sequence=0):
        return [to_numpy(s.values[name].values) for s in self.seq(invoke, sequence)
                if name in s.values]

    def ids(self, name, invoke=0, sequence=0):
        return [to_numpy(s.values[name].token_ids) for s in self.seq(invoke, sequence)
                if name in s.values]

    def tokens(self, invoke=0, sequence=0):
        return list(self.invokes[invoke].outputs[sequence].token_ids)


def run(stub, request, timeout=120):
    return TraceResult(stub.Trace(request, timeout=timeout))
