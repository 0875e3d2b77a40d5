"""Module writes survive vLLM's preemption (worker/recompute.py).

When the KV cache is full vLLM preempts a running request and later recomputes it: a
prefill over its prompt and every token it drew. The writes a trace made the first time
(at prompt positions at step 0, at each step's new token) must be made again there, or
the rest of the generation runs on keys and values that were never written to: a
different answer, with no error, only because the server was busy.

Servers with a KV cache of 6 blocks (128 tokens each on the CPU build: 768 tokens) and six
concurrent traces of 5 + 150 tokens, two blocks each: some are preempted and recomputed
(the worker logs each recomputation; the test checks it happened). Every trace must read,
at every step, exactly what it reads when it runs alone on the same server.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import tracewire as tw
from conftest import ServerProcess, stop_soon, take
from server_pool import ServerSpec, servers

PROMPTS = ["Once upon a time"] + [f"Story number {i} begins" for i in range(1, 6)]
SMALL_KV = ("--num-gpu-blocks-override", "6", "--max-num-seqs", "6")
RECOMPUTED = "a preempted request is recomputed"
STEERING = np.random.default_rng(0).normal(size=256).astype(np.float32)


def _small_kv(name: str, *flags: str) -> ServerSpec:
    # INFO: the worker's line for each recomputation
    return ServerSpec(name, (*SMALL_KV, *flags), env={"VLLM_LOGGING_LEVEL": "INFO"})


EAGER, COMPILED = _small_kv("preemption-eager", "--enforce-eager"), _small_kv("preemption-compiled",
                                                                               "--compiled-steering", "1")
pytestmark = servers(EAGER, COMPILED)


@pytest.fixture(scope="module")
def eager() -> Iterator[ServerProcess]:
    server = take(EAGER)
    yield server
    stop_soon(server)


@pytest.fixture(scope="module")
def compiled() -> Iterator[ServerProcess]:
    server = take(COMPILED)
    yield server
    stop_soon(server)


def top_logits_alone_and_together(server: ServerProcess, write) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
    """Each prompt's raw top-3 logits at every step, run alone, then all six at once."""
    client = tw.Client(server.target, timeout=600)

    def run(prompt: str) -> np.ndarray:
        with client.trace(prompt, temperature=0.0, max_tokens=150, ignore_eos=True) as tracer:
            write(tracer)
            top = tracer.all().logits.raw.top_k(3).save()
        return np.stack([t.values for t in top])

    alone = [run(p) for p in PROMPTS]
    together: dict[int, np.ndarray] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, run(PROMPTS[i]))) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    return alone, together


def assert_same_under_preemption(server: ServerProcess, write) -> None:
    before = server.log().count(RECOMPUTED)
    alone, together = top_logits_alone_and_together(server, write)
    assert server.log().count(RECOMPUTED) > before, "no request was preempted: the test proves nothing"
    assert len(together) == 6
    for i in range(6):
        np.testing.assert_allclose(together[i], alone[i], atol=1e-5, err_msg=f"prompt {i}: {PROMPTS[i]!r}")


def test_eager_writes_at_every_step_and_at_prompt_positions_are_made_again(eager: ServerProcess) -> None:
    def write(tracer):
        tracer.all().model.layers[1].output.add(STEERING, scale=2.0)  # every new token
        tracer.iter[0].module("layers.2", positions=[1, 2]).zero()  # prompt positions, at step 0
        tracer.iter[3:40].model.layers[0].mlp.act.output.select([5, 7]).set([4.0, -4.0])  # some steps

    assert_same_under_preemption(eager, write)


def test_compiled_steering_is_made_again(compiled: ServerProcess) -> None:
    def write(tracer):
        tracer.all().model.layers[1].output.add(STEERING, scale=2.0)

    assert_same_under_preemption(compiled, write)

    def write_some_steps(tracer):  # not the same at every step: planned per pass
        tracer.iter[2:60].model.layers[1].output.add(STEERING, scale=3.0)

    assert_same_under_preemption(compiled, write_some_steps)
