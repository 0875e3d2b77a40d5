"""Module writes and vLLM's prefix cache: scenarios run on an eager and a compiled-steering
server (test_hidden_states.py, test_compiled_steering.py), each checked against transformers.

vLLM caches KV blocks by token ids; a module write changes the keys and values of the
positions it touches. A request with module writes must neither read blocks that others
computed nor leave blocks that others read, while identical steered requests may share.
`num_cached_tokens` (the InvokeResult's) shows which of the two happened. Every scenario
uses prompts of its own (random token ids, longer than one block), so no other test's
blocks are in the way.
"""

from __future__ import annotations

import numpy as np
import torch
from trace_requests import f32, invoke, iv, run, steps, trace
from tracewire.v1 import intervention_pb2 as I

BLOCK = 128  # vLLM's KV block size on the CPU backend (GPU backends use smaller ones)
ATOL, RTOL = 2e-3, 1e-4
GREEDY = dict(temperature=0.0, ignore_eos=True)
RAW = I.ReadLogits(stage=I.LOGITS_STAGE_RAW, full=I.FullRow())
LAYER = 1


def random_prompt(hf, seed: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(16, hf.model.config.vocab_size, size=length)]


def vector(hf, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=hf.model.config.hidden_size).astype(np.float32) * 4


def prompt_write(v: np.ndarray) -> I.WriteModule:
    """Add `v` to layers.1's residual stream at every prompt position."""
    return I.WriteModule(module=f"layers.{LAYER}", positions=I.Positions(all_prompt=I.AllPrompt()), add=f32(v))


def first_logits(stub, ids, *interventions, max_tokens=1):
    """(raw logits at step 0, the InvokeResult's output) of a greedy trace."""
    result = run(stub, trace(invoke(ids, *interventions, iv("raw", sel=steps(at=[0]), read_logits=RAW)),
                             max_tokens=max_tokens, **GREEDY))
    (raw,) = result.values("raw")
    return raw, result.invokes[0], result


def hf_prompt_steered(hf, ids, v) -> np.ndarray:
    """transformers' next-token logits with `v` added to the layer's output at every position."""
    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden + torch.from_numpy(v)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = hf.model.model.layers[LAYER].register_forward_hook(hook)
    try:
        return hf_plain(hf, ids)
    finally:
        handle.remove()


def hf_plain(hf, ids) -> np.ndarray:
    return hf.next_logits(ids).numpy()


def steered_then_plain(stub, hf, seed: int) -> None:
    ids, v = random_prompt(hf, seed, BLOCK + 72), vector(hf, seed)
    steered, _, _ = first_logits(stub, ids, iv(write_module=prompt_write(v)))
    np.testing.assert_allclose(steered, hf_prompt_steered(hf, ids, v), atol=ATOL, rtol=RTOL)
    plain, output, _ = first_logits(stub, ids)
    np.testing.assert_allclose(plain, hf_plain(hf, ids), atol=ATOL, rtol=RTOL)
    assert output.num_cached_tokens == 0  # the steered blocks are not for plain requests


def plain_then_steered(stub, hf, seed: int) -> None:
    ids, v = random_prompt(hf, seed, BLOCK + 72), vector(hf, seed)
    plain, _, _ = first_logits(stub, ids)
    np.testing.assert_allclose(plain, hf_plain(hf, ids), atol=ATOL, rtol=RTOL)
    steered, output, _ = first_logits(stub, ids, iv(write_module=prompt_write(v)))
    np.testing.assert_allclose(steered, hf_prompt_steered(hf, ids, v), atol=ATOL, rtol=RTOL)
    assert output.num_cached_tokens == 0  # it wrote every prompt position itself


def steered_generation_then_plain_continuation(stub, hf, seed: int) -> None:
    """Blocks filled by generated tokens: 100 prompt tokens, 40 steered steps, then a plain
    request for the prompt and 39 of them (the first block is all cacheable)."""
    ids, v = random_prompt(hf, seed, 100), vector(hf, seed)
    every_step = I.WriteModule(module=f"layers.{LAYER}", positions=I.Positions(new_token=I.NewToken()), add=f32(v))
    _, _, steered = first_logits(stub, ids, iv(write_module=every_step), max_tokens=40)
    generated = steered.tokens()
    assert len(generated) == 40
    continuation = ids + generated[:39]
    plain, output, _ = first_logits(stub, continuation)
    np.testing.assert_allclose(plain, hf_plain(hf, continuation), atol=ATOL, rtol=RTOL)
    assert output.num_cached_tokens == 0


def cacheable_tokens(stub, hf, seed: int, length: int) -> int:
    """How many tokens of a prompt this long the engine serves from its cache on a second run."""
    ids = random_prompt(hf, seed + 1000, length)
    first_logits(stub, ids)
    return first_logits(stub, ids)[1].num_cached_tokens


def identical_steered_requests_share(stub, hf, seed: int) -> None:
    """The same writes on the same prompt share blocks; other writes on it do not."""
    ids, v, other = random_prompt(hf, seed, BLOCK + 72), vector(hf, seed), vector(hf, seed + 1)
    first, output, _ = first_logits(stub, ids, iv(write_module=prompt_write(v)))
    assert output.num_cached_tokens == 0
    second, output, _ = first_logits(stub, ids, iv(write_module=prompt_write(v)))
    # All the full blocks, computed with the same writes: as many tokens as a plain prompt of
    # the same length gets from its own second run (one 128-token block on the CPU backend,
    # twelve 16-token blocks on a GPU).
    assert output.num_cached_tokens == cacheable_tokens(stub, hf, seed, len(ids)) > 0
    reference = hf_prompt_steered(hf, ids, v)
    np.testing.assert_allclose(first, reference, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(second, reference, atol=ATOL, rtol=RTOL)
    third, output, _ = first_logits(stub, ids, iv(write_module=prompt_write(other)))
    np.testing.assert_allclose(third, hf_prompt_steered(hf, ids, other), atol=ATOL, rtol=RTOL)
    assert output.num_cached_tokens == 0


SCENARIOS = {
    "steered_then_plain": steered_then_plain,
    "plain_then_steered": plain_then_steered,
    "steered_generation_then_plain_continuation": steered_generation_then_plain_continuation,
    "identical_steered_requests_share": identical_steered_requests_share,
}
