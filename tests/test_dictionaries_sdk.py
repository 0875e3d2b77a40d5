"""Dictionaries (linear probes, SAEs) through the Python SDK against the real server, checked
against transformers on the same weights with the shipped dictionaries' weights (read here
with safetensors, applied in numpy): reads equal the dictionary's arithmetic on HF's
residual stream; a feature steer and a clamp equal HF with a forward hook doing the same
arithmetic; conditions fire at exactly the steps a step-by-step HF simulation says.

Dictionary reads and writes run in module hooks, so this module starts an eager server
with the shipped dictionaries (--dictionaries models/tracewire-tiny/dictionaries).
Tolerances as tests/test_hidden_states.py / test_heads_neurons.py: values 1e-4 absolute
(float32 both sides; 1e-3 for SAE activations, a [hidden, d] matmul more), logits under a
write 2e-3, greedy tokens exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import tracewire as tw
from conftest import DICTIONARIES
from google.protobuf import json_format
from safetensors.numpy import load_file
from tracewire.v1 import dictionary_pb2 as dpb

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, ignore_eos=True)
STEPS = 6
READ_ATOL = 1e-4
FEATURE_ATOL = 1e-3
LOGITS_ATOL = 2e-3


@dataclass(frozen=True)
class Reference:
    """A shipped dictionary as numpy computes it (dictionary.proto's arithmetic)."""

    name: str
    spec: dpb.DictionarySpec
    tensors: dict[str, np.ndarray[Any, Any]]

    @property
    def layer(self) -> int:
        return int(self.spec.module.split(".")[1])

    def values(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """[positions, hidden] -> [positions, size]."""
        t = self.tensors
        if self.spec.kind == dpb.DICTIONARY_KIND_PROBE:
            z = x @ t["W"].T + t.get("b", 0.0)
            if self.spec.probe_activation == dpb.PROBE_ACTIVATION_SIGMOID:
                return 1.0 / (1.0 + np.exp(-z))
            if self.spec.probe_activation == dpb.PROBE_ACTIVATION_SOFTMAX:
                e = np.exp(z - z.max(-1, keepdims=True))
                return e / e.sum(-1, keepdims=True)
            return z
        if self.spec.subtract_decoder_bias:
            x = x - t.get("b_dec", 0.0)
        z = x @ t["W_enc"] + t.get("b_enc", 0.0)
        if self.spec.sae_activation == dpb.SAE_ACTIVATION_JUMPRELU:
            return np.where(z > t["threshold"], z, 0.0)
        if self.spec.sae_activation == dpb.SAE_ACTIVATION_TOPK:
            keep = np.argsort(-z, axis=-1, kind="stable")[..., : self.spec.sae_top_k]
            out = np.zeros_like(z)
            np.put_along_axis(out, keep, np.maximum(np.take_along_axis(z, keep, -1), 0.0), -1)
            return out
        return np.maximum(z, 0.0)

    def error(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        reconstruction = self.values(x) @ self.tensors["W_dec"] + self.tensors.get("b_dec", 0.0)
        return np.linalg.norm(x - reconstruction, axis=-1, keepdims=True)


def _shipped() -> list[Reference]:
    found = []
    for manifest in sorted(DICTIONARIES.glob("*.json")):
        spec = json_format.Parse(manifest.read_text(), dpb.DictionarySpec())
        tensors = {k: v.astype(np.float64) for k, v in load_file(manifest.with_suffix(".safetensors")).items()}
        found.append(Reference(manifest.stem, spec, tensors))
    return found


def _one(kind: int) -> Reference:
    matching = [d for d in _shipped() if d.spec.kind == kind]
    assert matching, f"{DICTIONARIES} ships no dictionary of kind {dpb.DictionaryKind.Name(kind)}"
    return matching[0]


@pytest.fixture(scope="module")
def probe() -> Reference:
    return _one(dpb.DICTIONARY_KIND_PROBE)


@pytest.fixture(scope="module")
def sae() -> Reference:
    return _one(dpb.DICTIONARY_KIND_SAE)


@pytest.fixture(scope="module")
def sdk(eager):
    """The session's eager server (conftest), which serves the shipped dictionaries."""
    with tw.Client(eager.target, timeout=300) as client:
        yield client


def hf_layer(hf, ids, layer, edit=None):
    """A full forward over `ids`: layer `layer`'s output [positions, hidden] (float64, after
    `edit(x) -> x` on it, which the hook feeds on) and the last position's logits."""
    found = {}

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        x = hidden[0].double()
        if edit is not None:
            x = torch.as_tensor(edit(x.numpy().copy()))
        found["x"] = x.numpy()
        edited = x.to(hidden.dtype)[None]
        return (edited, *output[1:]) if isinstance(output, tuple) else edited

    handle = hf.model.model.layers[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = hf.model(torch.tensor([ids])).logits[0, -1].double().numpy()
    finally:
        handle.remove()
    return found["x"], logits


def test_probe_features_and_error_reads_equal_numpy_on_hfs_residual_stream(sdk, hf, probe, sae):
    with sdk.trace(PROMPT, max_tokens=STEPS, **GREEDY) as t:
        p_out = t.model.layers[probe.layer].output
        probe_new = p_out.probe(probe.name).save()
        probe_prompt = t.iter[0].module(probe.spec.module, positions="prompt").probe(probe.name).save()
        s_out = t.model.layers[sae.layer].output
        top = s_out.features(sae.name, top_k=8).save()
        every = t.iter[0].model.layers[sae.layer].output.features(sae.name).save()
        error = s_out.reconstruction_error(sae.name).save()
        error_prompt = t.iter[0].model.layers[sae.layer].output[[0, -1]].reconstruction_error(sae.name).save()
    ids = hf.encode(PROMPT)
    tokens = t.result.outputs[0].token_ids
    assert tokens == hf.greedy(ids, STEPS)
    assert probe_new.steps == top.steps == error.steps == list(range(STEPS))

    x0_probe, _ = hf_layer(hf, ids, probe.layer)
    np.testing.assert_allclose(probe_prompt.value, probe.values(x0_probe), atol=READ_ATOL)
    x0_sae, _ = hf_layer(hf, ids, sae.layer)
    np.testing.assert_allclose(error_prompt.value, sae.error(x0_sae[[0, -1]]), rtol=1e-4, atol=READ_ATOL)
    np.testing.assert_allclose(every.value, sae.values(x0_sae[-1]), atol=FEATURE_ATOL)
    for step in range(STEPS):
        x_probe, _ = hf_layer(hf, ids + tokens[:step], probe.layer)
        np.testing.assert_allclose(probe_new[step], probe.values(x_probe[-1]), atol=READ_ATOL, err_msg=f"step {step}")
        x_sae, _ = hf_layer(hf, ids + tokens[:step], sae.layer)
        features = sae.values(x_sae[-1])
        ranked = np.sort(features)[::-1]
        np.testing.assert_allclose(top[step].values, ranked[:8], atol=FEATURE_ATOL, err_msg=f"step {step}")
        # ids only where the value is active and clear of its neighbours (ties may come in any order)
        gaps = np.concatenate([[np.inf], -np.diff(ranked)])  # gaps[i]: ranked[i - 1] - ranked[i]
        clear = [i for i in range(8) if ranked[i] > FEATURE_ATOL and min(gaps[i], gaps[i + 1]) > 2 * FEATURE_ATOL]
        assert clear, f"step {step}: no clearly separated active feature to check ids with"
        assert top[step].ids[clear].tolist() == np.argsort(-features, kind="stable")[clear].tolist()
        np.testing.assert_allclose(error[step], sae.error(x_sae[-1]), rtol=1e-4, atol=READ_ATOL)


def _strong_feature(hf, sae: Reference) -> tuple[int, float]:
    """A feature and an alpha that move this prompt's greedy continuation: the feature most
    active at the prompt's last position, alpha 4x the residual's norm over its direction's."""
    x, _ = hf_layer(hf, hf.encode(PROMPT), sae.layer)
    feature = int(np.argmax(sae.values(x[-1])))
    alpha = 4.0 * float(np.linalg.norm(x[-1]) / np.linalg.norm(sae.tensors["W_dec"][feature]))
    return feature, round(alpha, 3)


def _hf_greedy_under(hf, ids, layer, delta_of, steps):
    """Greedy decoding with `delta_of(x)` ([positions, hidden] -> [positions, hidden]) added
    at every position the engine's "new" token was at some step: prompt_len - 1 onwards."""
    prompt_len, tokens, logits_per_step = len(ids), [], []
    for _ in range(steps):
        def edit(x):
            x[prompt_len - 1:] += delta_of(x[prompt_len - 1:])
            return x
        _, logits = hf_layer(hf, ids + tokens, layer, edit)
        logits_per_step.append(logits)
        tokens.append(int(np.argmax(logits)))
    return tokens, logits_per_step


def test_feature_steer_and_clamp_equal_hf_with_the_same_hook(sdk, hf, sae):
    feature, alpha = _strong_feature(hf, sae)
    clamp_to = 0.0  # ablation: x - a_f(x) * W_dec[f]
    direction = sae.tensors["W_dec"][feature]
    t = sdk.trace(max_tokens=STEPS, **GREEDY)
    with t.invoke(PROMPT) as steered:
        steered.model.layers[sae.layer].output.steer_feature(sae.name, feature, alpha=alpha)
        steered_logits = steered.all().logits.raw.save()
    with t.invoke(PROMPT) as clamped:
        clamped.model.layers[sae.layer].output.ablate_feature(sae.name, [feature])
        clamped_logits = clamped.all().logits.raw.save()
    t.run()
    ids = hf.encode(PROMPT)
    plain = hf.greedy(ids, STEPS)

    tokens, logits = _hf_greedy_under(hf, ids, sae.layer, lambda x: alpha * direction[None], STEPS)
    assert steered.result.outputs[0].token_ids == tokens != plain
    for step in range(STEPS):
        np.testing.assert_allclose(steered_logits[step], logits[step], atol=LOGITS_ATOL, err_msg=f"step {step}")

    def clamp(x):
        return (clamp_to - sae.values(x)[:, [feature]]) * direction[None]

    tokens, logits = _hf_greedy_under(hf, ids, sae.layer, clamp, STEPS)
    assert clamped.result.outputs[0].token_ids == tokens
    for step in range(STEPS):
        np.testing.assert_allclose(clamped_logits[step], logits[step], atol=LOGITS_ATOL, err_msg=f"step {step}")


def _probe_trajectory(hf, probe: Reference, ids, steps) -> list[float]:
    """Probe output 0 at the new token of each step of plain greedy decoding."""
    tokens = hf.greedy(ids, steps)
    return [float(probe.values(hf_layer(hf, ids + tokens[:s], probe.layer)[0][-1])[0]) for s in range(steps)]


def test_conditions_fire_at_the_steps_the_reference_says(sdk, hf, probe):
    """Reads and stops see this step's value, writes the previous step's (none at step 0)."""
    ids = hf.encode(PROMPT)
    values = _probe_trajectory(hf, probe, ids, STEPS)
    threshold = float(np.median(values))
    fires = [s for s, v in enumerate(values) if v > threshold]
    assert 0 < len(fires) < STEPS, values

    # a read under the condition, and one under its negation
    with sdk.trace(PROMPT, max_tokens=STEPS, **GREEDY) as t:
        above = t.all().when(tw.probe_above(probe.name, threshold)).samples.save()
        below = t.all().when(~tw.probe_above(probe.name, threshold)).samples.save()
    assert above.steps == fires
    assert below.steps == [s for s in range(STEPS) if s not in fires]

    # a stop: at the first step whose value is above
    with sdk.trace(PROMPT, max_tokens=STEPS, **GREEDY) as t:
        t.stop(when=tw.probe_above(probe.name, threshold))
    assert len(t.result.outputs[0].token_ids) == fires[0] + 1

    # a write: decided before the forward pass, on the previous step's value; it changes
    # the tokens and so the later values, which the reference follows step by step
    marker = int(np.argmin(hf.next_logits(ids).numpy()))  # a token greedy decoding never draws
    tokens, drawn_at = [], []
    previous = None
    for step in range(STEPS):
        x, logits = hf_layer(hf, ids + tokens, probe.layer)
        if previous is not None and previous > threshold:
            logits[marker] += 100.0
            drawn_at.append(step)
        tokens.append(int(np.argmax(logits)))
        previous = float(probe.values(x[-1])[0])
    assert drawn_at, "the write never fired: pick another threshold"
    with sdk.trace(PROMPT, max_tokens=STEPS, **GREEDY) as t:
        t.all().when(tw.probe_above(probe.name, threshold)).logits.bias({marker: 100.0})
    assert t.result.outputs[0].token_ids == tokens
    assert [s for s, tok in enumerate(tokens) if tok == marker] == drawn_at
