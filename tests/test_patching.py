"""Activation patching across invokes, against transformers doing the same copy with a
forward hook on the same weights (models/tracewire-tiny: Qwen3, 4 layers, GQA).

The session's eager server (conftest's `eager`: module hooks, a metrics port): the
worker's patch store is observed through `tracewire_patch_*` after each trace. Tolerance: logits within
2e-3 absolute + 1e-4 relative (float32 on both sides, as test_trace.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import httpx
import numpy as np
import pytest
import torch
import tracewire as tw
import tracewire.patching
from conftest import eventually, wait_for_unfinished
from trace_requests import TraceResult, invoke, iv, logits, run, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc

CLEAN, CORRUPTED = "The capital of France is", "The capital of Italy is"  # 5 tokens each, differ at 3
PARIS, ROME = 806, 834
ATOL, RTOL = 2e-3, 1e-4
GREEDY = dict(temperature=0.0, ignore_eos=True)


class Patched:
    def __init__(self, server) -> None:
        self.server = server

    def scrape(self) -> dict[str, float]:
        # (the URL asked for here: only the tests that scrape need the metrics port)
        text = httpx.get(self.server.metrics_url, timeout=10).text
        return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines()
                                            if line.startswith("tracewire_patch"))}


@pytest.fixture(scope="module")
def patched(eager):
    return Patched(eager)


@pytest.fixture(scope="module")
def pstub(patched):
    with grpc.insecure_channel(patched.server.target) as channel:
        yield service_pb2_grpc.TraceServiceStub(channel)


# -- transformers, the reference ---------------------------------------------------


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


def hf_streams(hf, ids: list[int], layer: int) -> np.ndarray:
    """Layer `layer`'s output (the residual stream after it) at every position: [positions, hidden]."""
    found = {}

    def keep(module, args, output) -> None:  # (returns None: the output stays as it is)
        found["v"] = _hidden(output)[0].detach().clone()

    handle = hf.model.model.layers[layer].register_forward_hook(keep)
    try:
        with torch.no_grad():
            hf.model(torch.tensor([ids]))
    finally:
        handle.remove()
    return found["v"].numpy()


def hf_logits_patched(hf, ids: list[int], copies: dict[int, dict[int, np.ndarray]], add: float | None = None):
    """The last position's logits with layer L's output at position p replaced by
    copies[L][p] (or, with `add`, plus add * copies[L][p]): a forward hook does the copy."""
    handles = []
    for layer, rows in copies.items():
        def hook(module, args, output, rows=rows):
            hidden = _hidden(output).clone()
            for p, value in rows.items():
                v = torch.from_numpy(value)
                hidden[0, p] = v if add is None else hidden[0, p] + add * v
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        handles.append(hf.model.model.layers[layer].register_forward_hook(hook))
    try:
        with torch.no_grad():
            return hf.model(torch.tensor([ids])).logits[0, -1].numpy()
    finally:
        for h in handles:
            h.remove()


def prompt_read(name: str, layer: int, *positions: int) -> I.Intervention:
    return iv(name, steps(at=[0]), read_module=I.ReadModule(
        module=f"layers.{layer}", positions=I.Positions(prompt_list=I.PositionList(positions=list(positions)))))


def patch_at(layer: int, target: int, name: str, source: int, op: str = "patch", scale: float | None = None):
    w = I.WriteModule(module=f"layers.{layer}", positions=I.Positions(prompt_list=I.PositionList(positions=[target])),
                      **{op: I.ReadRef(invoke=0, name=name, positions=[source])})
    if scale is not None:
        w.scale = scale
    return iv("", steps(at=[0]), write_module=w)


# -- prompt positions ----------------------------------------------------------------


def test_a_prompt_position_patch_gives_the_logits_of_hfs_forward_hook_copy(pstub, hf, patched):
    before = patched.scrape()
    check_prompt_position_patches(pstub, hf)
    # the worker kept the sources' rows (3 rows + 1 row of [256] float32) and freed them at the end
    assert eventually(lambda: delta(before, patched.scrape(), "tracewire_patch_released_bytes_total") == 3 * 256 * 4)
    assert patched.scrape()["tracewire_patch_store_bytes"] == 0


def check_prompt_position_patches(pstub, hf) -> None:
    """Patches and an add_read of prompt positions (layers 1 and 2), against HF's copies."""
    clean_ids, bad_ids = hf.encode(CLEAN), hf.encode(CORRUPTED)
    raw0 = iv("logits", steps(at=[0]), read_logits=logits(raw=True))
    request = trace(
        invoke(CLEAN, prompt_read("clean_l1", 1, 3, 1), prompt_read("clean_l2", 2, 3), raw0),
        invoke(CORRUPTED, patch_at(1, 3, "clean_l1", 3), raw0),  # the same position
        invoke(CORRUPTED, patch_at(1, 4, "clean_l1", 1), raw0),  # another position's row
        invoke(CORRUPTED, patch_at(2, 3, "clean_l2", -2, "add_read", 0.5), raw0),  # add, scaled
        invoke(CORRUPTED, raw0),  # unpatched
        max_tokens=2, **GREEDY)
    result = run(pstub, request)
    l1, l2 = hf_streams(hf, clean_ids, 1), hf_streams(hf, clean_ids, 2)
    # the source's read itself is what HF's layer gives
    np.testing.assert_allclose(result.values("clean_l1")[0], l1[[1, 3]], atol=1e-4)
    expected = {
        1: hf_logits_patched(hf, bad_ids, {1: {3: l1[3]}}),
        2: hf_logits_patched(hf, bad_ids, {1: {4: l1[1]}}),
        3: hf_logits_patched(hf, bad_ids, {2: {3: l2[3]}}, add=0.5),
        4: hf.next_logits(bad_ids).numpy(),
    }
    for k, ref in expected.items():
        (served,) = result.values("logits", invoke=k)
        np.testing.assert_allclose(served, ref, atol=ATOL, rtol=RTOL, err_msg=f"invoke {k}")
    # the patch changed something (the test could fail): patched != unpatched
    assert np.abs(expected[1] - expected[4]).max() > 10 * ATOL


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)



# -- generation steps ----------------------------------------------------------------


def test_a_generation_step_patch_equals_hf_copying_during_its_greedy_loop(pstub, hf):
    check_step_patch(pstub, hf)


def check_step_patch(pstub, hf) -> None:
    """A new-token patch of layers.1 at steps 1 and 2, against HF's greedy loop doing it."""
    layer, patched_steps, max_tokens = 1, [1, 2], 4
    request = trace(
        invoke(CLEAN, iv("clean", read_module=I.ReadModule(module=f"layers.{layer}"))),
        invoke(CORRUPTED,
               iv("", steps(at=patched_steps), write_module=I.WriteModule(
                   module=f"layers.{layer}", patch=I.ReadRef(invoke=0, name="clean"))),
               iv("logits", read_logits=logits(raw=True))),
        max_tokens=max_tokens, **GREEDY)
    result = run(pstub, request)
    expected = hf_step_patch(hf, layer, patched_steps, max_tokens)
    assert_step_patch(result, expected, max_tokens)
    prompt_len = len(hf.encode(CORRUPTED))
    assert any(np.abs(ref - hf.next_logits(expected.ids[:prompt_len + step]).numpy()).max() > 10 * ATOL
               for step, ref in enumerate(expected.logits))  # the patch changed something


@dataclass(frozen=True)
class StepPatch:
    source: np.ndarray  # the clean run's new-token stream at each step: [steps, hidden]
    logits: list[np.ndarray]  # the patched corrupted run's logits at each step
    ids: list[int]  # its prompt and greedy tokens


def hf_step_patch(hf, layer: int, patched_steps: list[int], max_tokens: int) -> StepPatch:
    """HF's reference for a new-token patch of layer `layer` at `patched_steps`, clean
    into corrupted, greedy: full forward passes, copies made by a forward hook."""
    clean_ids = hf.encode(CLEAN)
    source = []
    for _ in range(max_tokens):
        source.append(hf_streams(hf, clean_ids, layer)[-1])
        clean_ids = clean_ids + [int(hf.next_logits(clean_ids).argmax())]
    # the corrupted greedy loop: every forward pass re-applies the copies made so far
    # (vLLM computes a position once and keeps its keys and values: the copy persists)
    ids = hf.encode(CORRUPTED)
    prompt_len = len(ids)
    refs = []
    for step in range(max_tokens):
        copies = {prompt_len - 1 + s: source[s] for s in patched_steps if s <= step}
        refs.append(hf_logits_patched(hf, ids, {layer: copies}))
        ids = ids + [int(refs[-1].argmax())]
    return StepPatch(np.stack(source), refs, ids)


def assert_step_patch(result, expected: StepPatch, max_tokens: int) -> None:
    np.testing.assert_allclose(np.stack(result.values("clean")[:max_tokens]), expected.source, atol=1e-4)
    served = result.values("logits", invoke=1)
    for step, ref in enumerate(expected.logits):
        np.testing.assert_allclose(served[step], ref, atol=ATOL, rtol=RTOL, err_msg=f"step {step}")
    prompt_len = len(expected.ids) - max_tokens
    assert result.tokens(1) == expected.ids[prompt_len:]


# -- the sweep -------------------------------------------------------------------------


def test_the_sweep_is_one_trace_equal_to_separate_hf_runs(patched, hf):
    check_sweep(patched.server.target, hf)


def check_sweep(target: str, hf) -> None:
    layers, positions = [0, 2], [1, 3, -1]
    with tw.Client(target, timeout=120) as client:
        heatmap = tracewire.patching.sweep(client, CLEAN, CORRUPTED, layers, positions, (PARIS, ROME))
    assert heatmap.shape == (2, 3)
    clean_ids, bad_ids = hf.encode(CLEAN), hf.encode(CORRUPTED)
    expected = np.empty((2, 3), dtype=np.float32)
    for i, layer in enumerate(layers):
        streams = hf_streams(hf, clean_ids, layer)
        for j, p in enumerate(positions):
            out = hf_logits_patched(hf, bad_ids, {layer: {p % len(bad_ids): streams[p]}})
            expected[i, j] = out[PARIS] - out[ROME]
    np.testing.assert_allclose(heatmap, expected, atol=2 * ATOL)
    assert np.ptp(expected) > 10 * ATOL  # the cells differ: a wrong cell would show


def test_the_sdk_single_patch(patched, hf):
    with tw.Client(patched.server.target, timeout=120) as client:
        with client.trace(max_tokens=1, temperature=0.0) as tracer:
            with tracer.invoke(CLEAN) as clean:
                saved = clean.iter[0].model.layers[2].output[3].save("clean_l2")
            with tracer.invoke(CORRUPTED) as corrupted:
                corrupted.iter[0].model.layers[2].output[3].patch(saved)
                got = corrupted.iter[0].logits.raw.save()
        with pytest.raises(tw.InvalidArgument):
            with client.trace(max_tokens=1) as bad:
                with bad.invoke(CORRUPTED) as inv:
                    inv.iter[0].model.layers[2].output[3].patch(got)  # not a module read
    stream = hf_streams(hf, hf.encode(CLEAN), 2)
    ref = hf_logits_patched(hf, hf.encode(CORRUPTED), {2: {3: stream[3]}})
    np.testing.assert_allclose(got.value, ref, atol=ATOL, rtol=RTOL)


def hf_module_inputs(hf, ids: list[int], module: str) -> np.ndarray:
    """The input of `module` (a path under the HF model, e.g. "model.layers.1.self_attn.o_proj")
    at every position: [positions, width]."""
    found = {}
    handle = hf.model.get_submodule(module).register_forward_pre_hook(
        lambda m, args: found.__setitem__("v", args[0][0].detach().clone()))
    try:
        with torch.no_grad():
            hf.model(torch.tensor([ids]))
    finally:
        handle.remove()
    return found["v"].numpy()


def hf_logits_with_input(hf, ids: list[int], module: str, p: int, columns: slice | list[int], value) -> np.ndarray:
    """The last position's logits with `module`'s input at position p, these columns, set to `value`."""
    def hook(m, args):
        x = args[0].clone()
        x[0, p, columns] = torch.as_tensor(value, dtype=x.dtype)
        return (x, *args[1:])
    handle = hf.model.get_submodule(module).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            return hf.model(torch.tensor([ids])).logits[0, -1].numpy()
    finally:
        handle.remove()


def test_heads_and_neurons_patch_from_the_sources_same_units(patched, hf):
    check_units_patch(patched.server.target, hf)


def check_units_patch(target: str, hf) -> None:
    """A head of layers.1.self_attn.heads and two neurons of layers.2.mlp.act, patched at
    position 3 from the clean run: HF doing the same copy on o_proj's / down_proj's input.
    The source's read chose other units: the store keeps whole rows, the write takes its own."""
    clean_ids, bad_ids = hf.encode(CLEAN), hf.encode(CORRUPTED)
    down = hf_module_inputs(hf, clean_ids, "model.layers.2.mlp.down_proj")
    # the 32 neurons the two prompts differ most in at position 3 (a patch that shows)
    differ = np.abs(down[3] - hf_module_inputs(hf, bad_ids, "model.layers.2.mlp.down_proj")[3])
    head, head_dim, neurons = 2, 64, [int(i) for i in np.argsort(-differ)[:32]]
    with tw.Client(target, timeout=120) as client:
        with client.trace(max_tokens=1, temperature=0.0) as tracer:
            with tracer.invoke(CLEAN) as clean:
                heads = clean.iter[0].model.layers[1].self_attn.heads.output[3].select([0]).save("h")
                act = clean.iter[0].model.layers[2].mlp.act.output[3].save("a")
            with tracer.invoke(CORRUPTED) as one:
                one.iter[0].model.layers[1].self_attn.heads.output[3].select(head).patch(heads)
                got_head = one.iter[0].logits.raw.save()
            with tracer.invoke(CORRUPTED) as two:
                two.iter[0].model.layers[2].mlp.act.output[3].select(neurons).patch(act)
                got_neurons = two.iter[0].logits.raw.save()
    o_proj = hf_module_inputs(hf, clean_ids, "model.layers.1.self_attn.o_proj")
    columns = slice(head * head_dim, (head + 1) * head_dim)
    ref = hf_logits_with_input(hf, bad_ids, "model.layers.1.self_attn.o_proj", 3, columns, o_proj[3, columns])
    np.testing.assert_allclose(got_head.value, ref, atol=ATOL, rtol=RTOL)
    unpatched = hf_logits_with_input(hf, bad_ids, "model.layers.1.self_attn.o_proj", 3, [], [])
    assert np.abs(ref - unpatched).max() > 10 * ATOL  # the patch moved the logits
    ref = hf_logits_with_input(hf, bad_ids, "model.layers.2.mlp.down_proj", 3, neurons, down[3, neurons])
    np.testing.assert_allclose(got_neurons.value, ref, atol=ATOL, rtol=RTOL)
    assert np.abs(ref - unpatched).max() > 10 * ATOL


def test_units_patch_only_from_the_same_kind_of_address(patched):
    with tw.Client(patched.server.target, timeout=120) as client, pytest.raises(tw.InvalidArgument) as error:
        with client.trace(max_tokens=1) as tracer:
            with tracer.invoke(CLEAN) as clean:
                layer = clean.iter[0].model.layers[1].output[3].save("l")  # [hidden]: 256 = 4 heads x 64
            with tracer.invoke(CORRUPTED) as target:
                target.iter[0].model.layers[1].self_attn.heads.output[3].select(0).patch(layer)
    assert error.value.field == "invokes[1].interventions[0].write_module.patch.name"


# -- failures ------------------------------------------------------------------------------


def test_a_bad_reference_is_invalid_argument_naming_the_field(patched):
    with tw.Client(patched.server.target, timeout=60) as client:
        with pytest.raises(tw.InvalidArgument) as info:
            with client.trace(max_tokens=1) as tracer:
                with tracer.invoke(CLEAN) as clean:
                    saved = clean.iter[0].model.layers[1].output[[1, 2]].save("clean")
                with tracer.invoke(CORRUPTED) as corrupted:
                    corrupted.iter[0].model.layers[1].output[3].patch(saved)  # 2 rows for 1 position
    assert info.value.field == "invokes[1].interventions[0].write_module.positions"
    assert "selects 1 positions but takes 2 rows" in info.value.message


def test_a_source_that_ends_before_the_step_fails_the_trace_clearly(pstub, patched):
    before = patched.scrape()
    request = trace(
        invoke(CLEAN, iv("clean", read_module=I.ReadModule(module="layers.1")), iv("", steps(at=[1]), stop=I.Stop())),
        invoke(CORRUPTED, iv("", steps(at=[3]), write_module=I.WriteModule(
            module="layers.1", patch=I.ReadRef(invoke=0, name="clean")))),
        max_tokens=5, **GREEDY)
    with pytest.raises(grpc.RpcError) as info:
        run(pstub, request)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "needs invoke 0's step 3, but invoke 0 ended before it" in info.value.details()
    assert eventually(lambda: delta(before, patched.scrape(), "tracewire_patch_released_bytes_total") >= 2 * 256 * 4)
    assert patched.scrape()["tracewire_patch_store_bytes"] == 0


def test_a_cancelled_trace_frees_the_workers_store(pstub, patched):
    before = patched.scrape()
    # the target waits for the source's last step (299): cancelled long before
    request = trace(
        invoke(CLEAN, iv("clean", read_module=I.ReadModule(module="layers.1"))),
        invoke(CORRUPTED, iv("", write_module=I.WriteModule(module="layers.1",
                                                            patch=I.ReadRef(invoke=0, name="clean")))),
        max_tokens=300, **GREEDY)
    call = pstub.Trace(request, timeout=120)
    seen = 0
    for event in call:
        seen += len(event.steps.results)
        if seen >= 3:
            break
    call.cancel()
    assert eventually(lambda: delta(before, patched.scrape(), "tracewire_patch_released_bytes_total") >= 3 * 256 * 4)
    assert patched.scrape()["tracewire_patch_store_bytes"] == 0
    assert patched.scrape()["tracewire_patch_store_traces"] == 0
    assert wait_for_unfinished(patched.server.target, lambda n: n == 0)


# -- the patch store's room ------------------------------------------------------------


def test_a_trace_the_patch_store_has_no_room_for_is_refused_and_never_pushes_out_a_running_ones(pstub, hf,
                                                                                               patched):
    """The eager server's store holds 768 KiB (conftest's EAGER: --patch-store-bytes): one
    trace whose source keeps 500 rows of [256] float32 fits, a second one does not."""
    layer, patched_steps, short, long = 1, [1, 2], 4, 500
    request = trace(
        invoke(CLEAN, iv("clean", read_module=I.ReadModule(module=f"layers.{layer}")), max_tokens=long),
        invoke(CORRUPTED,
               iv("", steps(at=patched_steps), write_module=I.WriteModule(
                   module=f"layers.{layer}", patch=I.ReadRef(invoke=0, name="clean"))),
               iv("logits", read_logits=logits(raw=True)), max_tokens=short),
        **GREEDY)
    first = admitted(pstub, request)  # (an earlier test's trace may still be releasing its room)
    with pytest.raises(grpc.RpcError) as info:  # 500 source steps: the first trace runs for seconds yet
        run(pstub, request)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = info.value.details()
    assert "invokes[0].interventions[0] (read 'clean')" in details and "--patch-store-bytes" in details
    assert f"holds {long * 256 * 4} of its {768 << 10} bytes" in details
    result = tracewire_result(first)  # the running trace lost nothing
    assert len(result.values("clean")) == long
    assert_step_patch(result, hf_step_patch(hf, layer, patched_steps, short), short)
    assert eventually(lambda: patched.scrape()["tracewire_patch_store_bytes"] == 0)
    assert len(tracewire_result(admitted(pstub, request)).values("clean")) == long  # and now it fits


def admitted(stub, request, timeout: float = 10.0):
    """The trace's stream once its first event came, retried while the store has no room."""
    deadline = time.monotonic() + timeout
    while True:
        call = stub.Trace(request, timeout=120)
        events = iter(call)
        try:
            return [next(events)], events
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def tracewire_result(started):
    seen, rest = started
    return TraceResult([*seen, *rest])
