"""The compiled steering tables' slot accounting under request churn: many more steering
requests over time than the tables have slots, each slot given back when its request
ends, whatever the worker's own caches do meanwhile. Driven with a stand-in runner, so
hundreds of requests come and go in a second (test_compiled_steering.py checks the
steered values against transformers on a real compiled engine)."""

from __future__ import annotations

import types

import numpy as np
import torch
from tracewire_server import plan as P
from tracewire_server import steering
from tracewire_server import worker_hooks as W
from worker_standin import Sampler, Sender, request, runner

HIDDEN = 8
BATCH = 8  # requests in the engine at once


def _steer(layer: int, value: float) -> P.Op:
    vector = np.full(HIDDEN, value, "<f4").tobytes()
    return P.Op("", P.StepSet(), None, P.WriteModule(f"layers.{layer}", P.Positions(), "add", vector))


def test_every_slot_comes_back_after_hundreds_of_requests():
    engine = runner({})
    engine._model_forward = lambda: None
    hooks = W.PlanHooks(engine, fault_injection=False)
    hooks.senders[0] = Sender()
    tables = steering.SteeringTables([0, 1], slots=2 * BATCH + 1, max_tokens=BATCH, hidden=HIDDEN,
                                     dtype=torch.float32, device=torch.device("cpu"))
    hooks.install_compiled_steering(engine, tables)
    sampler = Sampler()
    hooks.install(sampler)
    ended = 0
    for n in range(400):  # one new request per pass, each lives BATCH passes
        req_id = f"r{n}"
        state = request(P.encode_plan(P.SequencePlan(key=req_id, ops=(_steer(n % 2, float(n)),))))
        state.output_token_ids = []
        engine.requests[req_id] = state
        if len(engine.requests) > BATCH:
            del engine.requests[next(iter(engine.requests))]  # the oldest ends
            ended += 1
        engine.input_batch.req_ids = list(engine.requests)
        # one decode row each, after its 2 prompt tokens and the tokens drawn so far
        engine.input_batch.num_computed_tokens_cpu = np.array([2 + len(s.output_token_ids)
                                                               for s in engine.requests.values()])
        engine.query_start_loc = types.SimpleNamespace(np=np.arange(len(engine.requests) + 1))
        engine._model_forward()
        # each request's row reads its own slot: its vector at its layer, slot 0 at the other
        for row, rid in enumerate(engine.input_batch.req_ids):
            k = int(rid[1:])
            slot = int(tables.slots[row, k % 2])
            assert float(tables.vectors[k % 2, slot, 0]) == float(k) and int(tables.slots[row, 1 - k % 2]) == 0
        sampler.forward(torch.zeros(len(engine.requests), 16), None)
        for state in engine.requests.values():
            state.output_token_ids.append(0)
    assert ended > 20 * len(tables.vectors[0])  # far more requests than slots came and went
    assert not [s.error for s in hooks.sequences.values() if s is not None and s.error]
    planner = hooks.steering
    live = sum(len(a) for a in planner.assigned)
    assert live == BATCH  # the requests still in the engine hold one slot each
    assert [len(f) for f in planner.free] == [2 * BATCH - len(a) for a in planner.assigned]
