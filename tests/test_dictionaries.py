"""Dictionaries (probes, SAEs) in traces, end to end against HF transformers.

The dictionaries are uploaded through RegisterDictionary (seeded random weights of the
model's hidden size): reads equal numpy applied to HF's residual stream, steering and
clamping equal an HF forward hook doing the same arithmetic, and a condition fires at
exactly the steps the reference says. The probe reads layers.1 and the SAEs layers.2,
so a write through an SAE never changes the stream its gating probe reads at the same
position.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import numpy as np
import pytest
import torch
from safetensors.numpy import save as save_safetensors
from trace_requests import cmp, invoke, iv, run, trace
from tracewire.v1 import dictionary_pb2 as D
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, ignore_eos=True)
HIDDEN = 256
PROBE_LAYER, SAE_LAYER = 1, 2
ATOL = 2e-4


def _weights() -> dict[str, tuple[D.DictionarySpec, dict[str, np.ndarray]]]:
    rng = np.random.default_rng(25)

    def normal(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    sae = {"W_enc": normal(HIDDEN, 96), "b_enc": normal(96, scale=0.2), "W_dec": normal(96, HIDDEN, scale=0.2),
           "b_dec": normal(HIDDEN, scale=0.5)}
    return {
        "t-probe": (D.DictionarySpec(kind=D.DICTIONARY_KIND_PROBE, module=f"layers.{PROBE_LAYER}",
                                     probe_activation=D.PROBE_ACTIVATION_SIGMOID, labels=["a", "b", "c"]),
                    {"W": normal(3, HIDDEN, scale=0.02), "b": normal(3, scale=0.5)}),
        "t-sae": (D.DictionarySpec(kind=D.DICTIONARY_KIND_SAE, module=f"layers.{SAE_LAYER}",
                                   subtract_decoder_bias=True), sae),
        "t-jump": (D.DictionarySpec(kind=D.DICTIONARY_KIND_SAE, module=f"layers.{SAE_LAYER}",
                                    sae_activation=D.SAE_ACTIVATION_JUMPRELU),
                   {**sae, "threshold": np.abs(normal(96, scale=0.5))}),
        "t-topk": (D.DictionarySpec(kind=D.DICTIONARY_KIND_SAE, module=f"layers.{SAE_LAYER}",
                                    sae_activation=D.SAE_ACTIVATION_TOPK, sae_top_k=8), sae),
    }


WEIGHTS = _weights()


def register(stub, name, spec, tensors, chunk=4096, replace=True):
    data = save_safetensors(tensors)
    parts = [D.RegisterDictionaryRequest(header=D.DictionaryHeader(name=name, spec=spec, replace=replace))]
    parts += [D.RegisterDictionaryRequest(chunk=data[i:i + chunk]) for i in range(0, len(data), chunk)]
    return stub.RegisterDictionary(iter(parts), timeout=60).dictionary


def values_np(name: str, x: np.ndarray) -> np.ndarray:
    """dictionary.proto's arithmetic in numpy (float64): [positions, size]."""
    spec, w = WEIGHTS[name]
    x = x.astype(np.float64)
    if spec.kind == D.DICTIONARY_KIND_PROBE:
        return 1 / (1 + np.exp(-(x @ w["W"].T + w["b"])))
    if spec.subtract_decoder_bias:
        x = x - w["b_dec"]
    z = x @ w["W_enc"] + w["b_enc"]
    if spec.sae_activation == D.SAE_ACTIVATION_JUMPRELU:
        return np.where(z > w["threshold"], z, 0.0)
    if spec.sae_activation == D.SAE_ACTIVATION_TOPK:
        keep = np.argsort(-z, axis=-1)[:, :spec.sae_top_k]
        out = np.zeros_like(z)
        np.put_along_axis(out, keep, np.maximum(np.take_along_axis(z, keep, -1), 0), -1)
        return out
    return np.maximum(z, 0)


def error_np(name: str, x: np.ndarray) -> np.ndarray:
    w = WEIGHTS[name][1]
    reconstruction = values_np(name, x) @ w["W_dec"] + w["b_dec"]
    return np.linalg.norm(x - reconstruction, axis=-1)


@pytest.fixture(scope="module")
def estub(eager):
    """The session's eager server (conftest), with this file's dictionaries uploaded, and
    deleted again at the end (other files list the server's dictionaries)."""
    with grpc.insecure_channel(eager.target) as channel:
        stub = service_pb2_grpc.TraceServiceStub(channel)
        for name, (spec, tensors) in WEIGHTS.items():
            register(stub, name, spec, tensors)
        yield stub
        for name in WEIGHTS:
            stub.DeleteDictionary(D.DeleteDictionaryRequest(name=name), timeout=30)


def hf_streams(hf, ids, edits=()):
    """Layer outputs (residual streams) [positions, hidden] of PROBE_LAYER and SAE_LAYER,
    and the last position's logits, with `edits` ((layer, position, fn(row) -> row), ...)
    applied in the forward pass as hooks."""
    found, handles = {}, []

    def hook(layer):
        def fn(module, args, output):
            hidden = (output[0] if isinstance(output, tuple) else output).clone()
            for at, position, edit in edits:
                if at == layer:
                    hidden[0, position] = edit(hidden[0, position])
            found[layer] = hidden[0].detach().numpy().copy()
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return fn

    for layer in (PROBE_LAYER, SAE_LAYER):
        handles.append(hf.model.model.layers[layer].register_forward_hook(hook(layer)))
    try:
        with torch.no_grad():
            logits = hf.model(torch.tensor([ids])).logits[0, -1].float().numpy()
    finally:
        for h in handles:
            h.remove()
    return found[PROBE_LAYER], found[SAE_LAYER], logits


def read(name, positions=None, **selection):
    r = I.ReadDictionary(dictionary=name, **selection)
    if positions is not None:
        r.positions.CopyFrom(positions)
    return r


def test_reads_equal_numpy_on_hf_streams(estub, hf):
    ids = hf.encode(PROMPT)
    prompt_all = I.Positions(all_prompt=I.AllPrompt())
    result = run(estub, trace(invoke(
        PROMPT,
        iv("probe", read_dictionary=read("t-probe")),
        iv("probe_prompt", read_dictionary=read("t-probe", prompt_all, module=f"layers.{PROBE_LAYER}")),
        iv("top", read_dictionary=read("t-sae", top_k=I.TopK(k=5))),
        iv("chosen", read_dictionary=read("t-sae", I.Positions(prompt_list=I.PositionList(positions=[0, -1])),
                                          features=I.UnitIds(ids=[7, 3]))),
        iv("all", read_dictionary=read("t-sae")),
        iv("error", read_dictionary=read("t-sae", reconstruction_error=I.ReconstructionError())),
    ), max_tokens=4, **GREEDY))
    tokens = result.tokens()
    probe_x, sae_x, _ = hf_streams(hf, ids + tokens)
    n = len(ids)
    np.testing.assert_allclose(result.values("probe_prompt")[0], values_np("t-probe", probe_x[:n]), atol=ATOL)
    np.testing.assert_allclose(result.values("chosen")[0], values_np("t-sae", sae_x[[0, n - 1]])[:, [7, 3]],
                               atol=ATOL)
    for s in range(4):
        p = n - 1 + s  # the position step s processes
        np.testing.assert_allclose(result.values("probe")[s], values_np("t-probe", probe_x[[p]])[0], atol=ATOL)
        every = values_np("t-sae", sae_x[[p]])[0]
        assert (every > 0).sum() > 5  # (the top 5 are real activations)
        np.testing.assert_allclose(result.values("all")[s], every, atol=ATOL, rtol=1e-4)
        top, top_ids = result.values("top")[s], result.ids("top")[s]
        np.testing.assert_allclose(top, np.sort(every)[::-1][:5], atol=ATOL, rtol=1e-4)
        np.testing.assert_allclose(every[top_ids], top, atol=ATOL, rtol=1e-4)  # the ids are theirs
        np.testing.assert_allclose(result.values("error")[s], error_np("t-sae", sae_x[[p]]), rtol=1e-4)


def test_jumprelu_and_topk_activations(estub, hf):
    ids = hf.encode(PROMPT)
    prompt_all = I.Positions(all_prompt=I.AllPrompt())
    result = run(estub, trace(invoke(PROMPT, iv("jump", read_dictionary=read("t-jump", prompt_all)),
                                     iv("topk", read_dictionary=read("t-topk", prompt_all))), max_tokens=1))
    _, sae_x, _ = hf_streams(hf, ids)
    jump, topk = result.values("jump")[0], result.values("topk")[0]
    np.testing.assert_allclose(jump, values_np("t-jump", sae_x), atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(topk, values_np("t-topk", sae_x), atol=ATOL, rtol=1e-4)
    assert ((topk > 0).sum(-1) <= 8).all() and (jump == 0).any()


def _steered_run(estub, hf, write, edit, steps_n=5):
    """Greedy tokens and raw logits under `write`, against HF with `edit` at each
    new-token position: the server's tokens."""
    return _check_steered(_steered(estub, write, steps_n), hf, edit, steps_n)


def _steered(stub, write, steps_n):
    return run(stub, trace(invoke(PROMPT, iv(write_dictionary=write),
                                  iv("raw", read_logits=I.ReadLogits(stage=I.LOGITS_STAGE_RAW, full=I.FullRow()))),
                           max_tokens=steps_n, **GREEDY))


def _check_steered(result, hf, edit, steps_n):
    """`result`'s tokens and raw logits against HF with `edit` at each new-token position
    (HF's hooks are on the one shared model: one check at a time)."""
    ids = hf.encode(PROMPT)
    tokens = result.tokens()
    seq = list(ids)
    for s in range(steps_n):
        edits = [(SAE_LAYER, p, edit) for p in range(len(ids) - 1, len(seq))]
        _, _, logits = hf_streams(hf, seq, edits)
        np.testing.assert_allclose(result.values("raw")[s], logits, atol=2e-3, rtol=1e-4)
        assert tokens[s] == int(logits.argmax())
        seq.append(tokens[s])
    return tokens


def test_feature_steering_equals_an_hf_hook(estub, hf):
    w_dec = torch.from_numpy(WEIGHTS["t-sae"][1]["W_dec"])
    write = I.WriteDictionary(dictionary="t-sae", features=[5, 9], steer=40.0)
    tokens = _steered_run(estub, hf, write, lambda row: row + 40.0 * (w_dec[5] + w_dec[9]))
    assert tokens != hf.greedy(hf.encode(PROMPT), 5)  # the steer changes the continuation


def test_feature_steering_on_a_compiled_server_equals_an_hf_hook(graph, hf):
    """A steer is an add of its features' directions: a compiled server's steering tables
    serve it (conftest's `graph`: tables on layers 0-2, the SAE on layers.2), two traces
    steering different features at once each get their own slot (clamps there:
    test_clamps_on_a_compiled_server_equal_an_hf_hook)."""
    w_dec = torch.from_numpy(WEIGHTS["t-sae"][1]["W_dec"])
    spec, tensors = WEIGHTS["t-sae"]
    with grpc.insecure_channel(graph.target) as channel:
        gstub = service_pb2_grpc.TraceServiceStub(channel)
        register(gstub, "t-sae", spec, tensors)
        try:
            runs = [(I.WriteDictionary(dictionary="t-sae", features=[5, 9], steer=40.0),
                     lambda row: row + 40.0 * (w_dec[5] + w_dec[9])),
                    (I.WriteDictionary(dictionary="t-sae", features=[3], steer=-30.0),
                     lambda row: row - 30.0 * w_dec[3])]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both in the engine at once
                results = list(pool.map(lambda w: _steered(gstub, w, 5), [w for w, _ in runs]))
            tokens = [_check_steered(result, hf, e, 5) for result, (_, e) in zip(results, runs, strict=True)]
            assert tokens[0] != hf.greedy(hf.encode(PROMPT), 5) and tokens[0] != tokens[1]
        finally:
            gstub.DeleteDictionary(D.DeleteDictionaryRequest(name="t-sae"), timeout=30)


def _clamp(name, features, value):
    w = {k: torch.from_numpy(v).double() for k, v in WEIGHTS[name][1].items()}

    def edit(row):
        x = row.double()
        activations = torch.from_numpy(values_np(name, x[None].numpy()))[0, features]
        return (x + (value - activations) @ w["W_dec"][features]).to(row.dtype)
    return edit


def test_clamp_and_ablate_equal_an_hf_hook(estub, hf):
    _steered_run(estub, hf, I.WriteDictionary(dictionary="t-sae", features=[2, 11], clamp=25.0),
                 _clamp("t-sae", [2, 11], 25.0))
    top = int(np.argmax(values_np("t-sae", hf_streams(hf, hf.encode(PROMPT))[1][[-1]])[0]))
    _steered_run(estub, hf, I.WriteDictionary(dictionary="t-sae", features=[top], ablate=I.FeatureAblation()),
                 _clamp("t-sae", [top], 0.0), steps_n=3)


def test_clamps_on_a_compiled_server_equal_an_hf_hook(graph, hf):
    """Clamps and ablations through the graph's clamp columns (conftest's `graph`: on layers
    0-2, the SAEs on layers.2): a ReLU SAE with its decoder bias subtracted, a JumpReLU one,
    two traces clamping different features at once, then more features one after another
    than a table has columns (they come back when traces end). A top-k SAE's clamp, and a
    write of more features than a slot holds, are refused naming the field."""
    with grpc.insecure_channel(graph.target) as channel:
        gstub = service_pb2_grpc.TraceServiceStub(channel)
        for name in ("t-sae", "t-jump", "t-topk"):
            register(gstub, name, *WEIGHTS[name])
        try:
            runs = [(I.WriteDictionary(dictionary="t-sae", features=[2, 11], clamp=25.0),
                     _clamp("t-sae", [2, 11], 25.0)),
                    (I.WriteDictionary(dictionary="t-jump", features=[4], clamp=-12.0),
                     _clamp("t-jump", [4], -12.0))]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both in the engine at once
                results = list(pool.map(lambda w: _steered(gstub, w, 4), [w for w, _ in runs]))
            tokens = [_check_steered(result, hf, e, 4) for result, (_, e) in zip(results, runs, strict=True)]
            assert tokens[0] != hf.greedy(hf.encode(PROMPT), 4)
            top = int(np.argmax(values_np("t-sae", hf_streams(hf, hf.encode(PROMPT))[1][[-1]])[0]))
            _steered_run(gstub, hf, I.WriteDictionary(dictionary="t-sae", features=[top], ablate=I.FeatureAblation()),
                         _clamp("t-sae", [top], 0.0), steps_n=2)
            for k in range(10):  # 80 features in all, over a table's 64 columns
                features = list(range(8 * k, 8 * k + 8))
                _steered_run(gstub, hf, I.WriteDictionary(dictionary="t-sae", features=features, clamp=3.0),
                             _clamp("t-sae", features, 3.0), steps_n=1)
            for write, field, says in (
                    (I.WriteDictionary(dictionary="t-topk", features=[1], clamp=2.0), "write_dictionary.clamp",
                     "top-k SAE"),
                    (I.WriteDictionary(dictionary="t-sae", features=list(range(9)), clamp=2.0),
                     "write_dictionary.features", "at most 8 features")):
                code, details = _status(gstub, iv(write_dictionary=write))
                assert code == grpc.StatusCode.FAILED_PRECONDITION, details
                assert f"interventions[0].{field}" in details and says in details, details
        finally:
            for name in ("t-sae", "t-jump", "t-topk"):
                gstub.DeleteDictionary(D.DeleteDictionaryRequest(name=name), timeout=30)


def _probe_threshold(hf, n_steps):
    """The probe's output-0 values at each step's new token on HF's greedy run, and a
    threshold between them that splits the steps."""
    ids = hf.encode(PROMPT)
    tokens = hf.greedy(ids, n_steps)
    probe_x, _, _ = hf_streams(hf, ids + tokens)
    values = values_np("t-probe", probe_x[len(ids) - 1:len(ids) - 1 + n_steps])[:, 0]
    threshold = float(np.median(values))
    assert 0 < (values > threshold).sum() < n_steps  # the condition goes both ways
    return values, threshold


def probe_above(threshold):
    return I.Condition(dictionary_value=I.DictionaryThreshold(
        dictionary="t-probe", feature=0, threshold=I.Threshold(comparison=cmp(">"), value=threshold)))


def test_read_and_stop_conditions_fire_at_the_reference_steps(estub, hf):
    values, threshold = _probe_threshold(hf, 8)
    result = run(estub, trace(invoke(PROMPT, iv("s", when=probe_above(threshold), read_sample=I.ReadSample())),
                              max_tokens=8, **GREEDY))
    fired = [step.step for step in result.seq() if "s" in step.values]
    assert fired == [s for s in range(8) if values[s] > threshold]
    stopped = run(estub, trace(invoke(PROMPT, iv(when=probe_above(threshold), stop=I.Stop())),
                               max_tokens=8, **GREEDY))
    first = next(s for s in range(8) if values[s] > threshold)
    assert len(stopped.tokens()) == first + 1


def test_a_write_conditioned_on_the_previous_steps_probe_value(estub, hf):
    """Steer at step s when the probe's value at step s - 1 was above the threshold."""
    values, threshold = _probe_threshold(hf, 8)
    w_dec = torch.from_numpy(WEIGHTS["t-sae"][1]["W_dec"])

    def steer(row):
        return row + 30.0 * w_dec[5]
    ids = hf.encode(PROMPT)
    seq, edits, applied = list(ids), [], []
    for s in range(8):
        if s > 0:
            probe_x, _, _ = hf_streams(hf, seq, edits)
            if values_np("t-probe", probe_x[[len(seq) - 2]])[0, 0] > threshold:
                edits.append((SAE_LAYER, len(seq) - 1, steer))
                applied.append(s)
        seq.append(int(hf_streams(hf, seq, edits)[2].argmax()))
    assert applied and len(applied) < 7
    result = run(estub, trace(invoke(PROMPT, iv(when=probe_above(threshold), write_dictionary=I.WriteDictionary(
        dictionary="t-sae", features=[5], steer=30.0))), max_tokens=8, **GREEDY))
    assert result.tokens() == seq[len(ids):]


def _status(stub, *interventions):
    with pytest.raises(grpc.RpcError) as info:
        run(stub, trace(invoke(PROMPT, *interventions), max_tokens=2))
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("intervention, field", [
    (iv("r", read_dictionary=read("nope")), "read_dictionary.dictionary"),
    (iv("r", read_dictionary=read("t-sae", module="layers.1")), "read_dictionary.module"),
    (iv("r", read_dictionary=read("t-sae", features=I.UnitIds(ids=[96]))), "read_dictionary.features.ids[0]"),
    (iv("r", read_dictionary=read("t-sae", features=I.UnitIds(ids=[1, 1]))), "read_dictionary.features.ids[1]"),
    (iv("r", read_dictionary=read("t-probe", top_k=I.TopK(k=4))), "read_dictionary.top_k.k"),
    (iv("r", read_dictionary=read("t-probe", reconstruction_error=I.ReconstructionError())),
     "read_dictionary.reconstruction_error"),
    (iv(write_dictionary=I.WriteDictionary(dictionary="t-probe", features=[0], clamp=1.0)), "write_dictionary.clamp"),
    (iv(write_dictionary=I.WriteDictionary(dictionary="t-sae", features=[], steer=1.0)), "write_dictionary.features"),
    (iv(write_dictionary=I.WriteDictionary(dictionary="t-sae", features=[1], steer=float("nan"))),
     "write_dictionary.steer"),
    (iv(write_dictionary=I.WriteDictionary(dictionary="t-sae", features=[1])), "write_dictionary.op"),
    (iv("s", when=I.Condition(dictionary_value=I.DictionaryThreshold(
        dictionary="t-probe", feature=3, threshold=I.Threshold(comparison=cmp(">"), value=0.5))),
        read_sample=I.ReadSample()), "condition.dictionary_value.feature"),
])
def test_bad_dictionary_interventions_name_the_field(estub, intervention, field):
    code, details = _status(estub, intervention)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"invokes[0].interventions[0].{field}" in details
    assert run(estub, trace(invoke(PROMPT, iv("p", read_dictionary=read("t-probe"))), max_tokens=2)).values("p")


def test_the_default_compiled_server_reads_steers_and_clamps_dictionaries(stub, hf):
    # The dictionary exists on this server (an unknown one is INVALID_ARGUMENT on every
    # engine kind). The default graph keeps every layer (a read is served: test_compiled_reads
    # checks its values against transformers) and the tiny model's default hooks clamp there.
    register(stub, "t-sae", *WEIGHTS["t-sae"])
    try:
        _steered_run(stub, hf, I.WriteDictionary(dictionary="t-sae", features=[2, 11], clamp=25.0),
                     _clamp("t-sae", [2, 11], 25.0), steps_n=2)
    finally:
        stub.DeleteDictionary(D.DeleteDictionaryRequest(name="t-sae"), timeout=30)
    spec, tensors = WEIGHTS["t-probe"]
    register(stub, "t-compiled-probe", spec, tensors)
    try:
        result = run(stub, trace(invoke(PROMPT, iv("r", read_dictionary=read("t-compiled-probe"))), max_tokens=2))
        assert len(result.values("r")) == 2 and np.isfinite(np.asarray(result.values("r"))).all()
        code, details = _status(stub, iv("r", read_dictionary=read("t-unregistered")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "read_dictionary.dictionary" in details
    finally:
        stub.DeleteDictionary(D.DeleteDictionaryRequest(name="t-compiled-probe"), timeout=30)


def test_a_replaced_dictionary_fails_the_traces_running_against_it(estub):
    spec, tensors = WEIGHTS["t-probe"]
    register(estub, "t-temp", spec, tensors)
    calls = estub.Trace(trace(invoke(PROMPT, iv("p", read_dictionary=read("t-temp"))), max_tokens=400,
                              **GREEDY), timeout=120)
    first = next(calls)  # running
    assert first.WhichOneof("event") == "steps"
    register(estub, "t-temp", spec, tensors)  # a new generation
    with pytest.raises(grpc.RpcError) as info:
        list(calls)
    # another call's doing (this client's own, or a co-owner's), not the server's fault
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    assert "dictionary 't-temp' was deleted or registered again while the trace ran" in info.value.details()
    # deleted mid-run: the same
    calls = estub.Trace(trace(invoke(PROMPT, iv("p", read_dictionary=read("t-temp"))), max_tokens=400,
                              **GREEDY), timeout=120)
    assert next(calls).WhichOneof("event") == "steps"
    estub.DeleteDictionary(D.DeleteDictionaryRequest(name="t-temp"), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        list(calls)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    assert "'t-temp' was deleted or registered again" in info.value.details()
    code, details = _status(estub, iv("p", read_dictionary=read("t-temp")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown dictionary 't-temp'" in details
