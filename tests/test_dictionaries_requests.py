"""The SDK's dictionary API (probes, SAEs) builds exactly the request the contract means,
and decodes the values the server sends per selection and positions. No server: the
requests are compared with hand-written protobufs (intervention.proto's ReadDictionary,
WriteDictionary, DictionaryThreshold), and decoding is fed hand-built step results.
tests/test_dictionaries_sdk.py runs the same API against the real server."""

from __future__ import annotations

import numpy as np
import pytest
import tracewire as tw
from tracewire.tensors import from_numpy
from tracewire.tracing import Tracer
from tracewire.v1 import intervention_pb2 as ipb
from tracewire.v1 import service_pb2, tensor_pb2, trace_pb2

NEW = ipb.Positions(new_token=ipb.NewToken())
EVERY = ipb.StepSelector(all=ipb.AllSteps())


def _tracer(runner=lambda request: iter(())) -> Tracer:
    return Tracer(runner, "The capital of France is", max_tokens=4)


def _interventions(tracer: Tracer) -> list[ipb.Intervention]:
    return list(tracer.request().invokes[0].interventions)


def test_reads_build_read_dictionary_on_the_modules_positions():
    t = _tracer()
    out = t.model.layers[3].output
    out.probe("refusal").save("p")
    out.probe("refusal", outputs=[2, 0]).save("p2")
    out.features("res-l3", top_k=20).save("top")
    out.features("res-l3", ids=[1, 2]).save("ids")
    t.iter[0].model.layers[1].output[[-2, -1]].reconstruction_error("res-l1").save("err")
    t.all().module("layers.2", positions="all").features("res-l2").save("every")
    got = _interventions(t)
    assert got == [
        ipb.Intervention(name="p", steps=EVERY, read_dictionary=ipb.ReadDictionary(
            dictionary="refusal", module="layers.3", positions=NEW)),
        ipb.Intervention(name="p2", steps=EVERY, read_dictionary=ipb.ReadDictionary(
            dictionary="refusal", module="layers.3", positions=NEW, features=ipb.UnitIds(ids=[2, 0]))),
        ipb.Intervention(name="top", steps=EVERY, read_dictionary=ipb.ReadDictionary(
            dictionary="res-l3", module="layers.3", positions=NEW, top_k=ipb.TopK(k=20))),
        ipb.Intervention(name="ids", steps=EVERY, read_dictionary=ipb.ReadDictionary(
            dictionary="res-l3", module="layers.3", positions=NEW, features=ipb.UnitIds(ids=[1, 2]))),
        ipb.Intervention(
            name="err", steps=ipb.StepSelector(list=ipb.StepList(steps=[0])),
            read_dictionary=ipb.ReadDictionary(
                dictionary="res-l1", module="layers.1",
                positions=ipb.Positions(prompt_list=ipb.PositionList(positions=[-2, -1])),
                reconstruction_error=ipb.ReconstructionError())),
        ipb.Intervention(name="every", steps=EVERY, read_dictionary=ipb.ReadDictionary(
            dictionary="res-l2", module="layers.2", positions=ipb.Positions(all=ipb.AllPositions()))),
    ]


def test_writes_build_write_dictionary_with_their_conditions():
    t = _tracer()
    out = t.model.layers[3].output
    out.steer_feature("res-l3", 1234, alpha=4)
    t.iter[1:3].model.layers[3].output.steer_feature("res-l3", [5, 7], alpha=-0.5)
    t.all().when(tw.feature_active("res-l3", 9)).model.layers[3].output.clamp_feature("res-l3", 9, 2.5)
    t.iter[0].model.layers[3].output[4].ablate_feature("res-l3", [9])
    out.steer_probe("refusal", 1, -3.0)
    active = ipb.Condition(dictionary_value=ipb.DictionaryThreshold(
        dictionary="res-l3", feature=9, threshold=ipb.Threshold(comparison=ipb.COMPARISON_GREATER, value=0.0)))
    assert _interventions(t) == [
        ipb.Intervention(steps=EVERY, write_dictionary=ipb.WriteDictionary(
            dictionary="res-l3", module="layers.3", positions=NEW, features=[1234], steer=4.0)),
        ipb.Intervention(
            steps=ipb.StepSelector(range=ipb.StepRange(start=1, stop=3)),
            write_dictionary=ipb.WriteDictionary(
                dictionary="res-l3", module="layers.3", positions=NEW, features=[5, 7], steer=-0.5)),
        ipb.Intervention(steps=EVERY, condition=active, write_dictionary=ipb.WriteDictionary(
            dictionary="res-l3", module="layers.3", positions=NEW, features=[9], clamp=2.5)),
        ipb.Intervention(
            steps=ipb.StepSelector(list=ipb.StepList(steps=[0])),
            write_dictionary=ipb.WriteDictionary(
                dictionary="res-l3", module="layers.3",
                positions=ipb.Positions(prompt_list=ipb.PositionList(positions=[4])),
                features=[9], ablate=ipb.FeatureAblation())),
        ipb.Intervention(steps=EVERY, write_dictionary=ipb.WriteDictionary(
            dictionary="refusal", module="layers.3", positions=NEW, features=[1], steer=-3.0)),
    ]


def _threshold(dictionary: str, feature: int, comparison: int, value: float) -> ipb.Condition:
    return ipb.Condition(dictionary_value=ipb.DictionaryThreshold(
        dictionary=dictionary, feature=feature, threshold=ipb.Threshold(comparison=comparison, value=value)))


def test_dictionary_conditions_compose_and_stop():
    above = _threshold("refusal", 0, ipb.COMPARISON_GREATER, 0.9)
    below = _threshold("refusal", 2, ipb.COMPARISON_LESS, 0.25)
    assert tw.probe_above("refusal", 0.9).message == above
    assert tw.probe_below("refusal", 0.25, output=2).message == below
    assert tw.feature_active("res-l3", 7, threshold=1.5).message == _threshold(
        "res-l3", 7, ipb.COMPARISON_GREATER, 1.5)
    assert (tw.dictionary_value("res-l3", 7) >= 2).message == _threshold("res-l3", 7, ipb.COMPARISON_GREATER_EQUAL, 2)
    assert (tw.dictionary_value("res-l3", 7) <= -1).message == _threshold("res-l3", 7, ipb.COMPARISON_LESS_EQUAL, -1)

    t = _tracer()
    t.stop(when=tw.probe_above("refusal", 0.9) | (tw.sampled_in(13) & ~tw.probe_below("refusal", 0.25, output=2)))
    t.all().when(tw.probe_above("refusal", 0.9)).samples.save("drawn")
    either = ipb.Condition(any_of=ipb.Conditions(conditions=[
        above,
        ipb.Condition(all_of=ipb.Conditions(conditions=[
            ipb.Condition(sampled_in=ipb.TokenSet(token_ids=[13])),
            ipb.Condition(**{"not": below}),
        ])),
    ]))
    assert _interventions(t) == [
        ipb.Intervention(steps=EVERY, condition=either, stop=ipb.Stop()),
        ipb.Intervention(name="drawn", steps=EVERY, condition=above, read_sample=ipb.ReadSample()),
    ]


@pytest.mark.parametrize(
    ("act", "message"),
    [
        (lambda out: out.features("res", top_k=3, ids=[1]), "top_k or ids, not both"),
        (lambda out: out.features("res", top_k=0), "top_k must be an int >= 1"),
        (lambda out: out.features("", top_k=3), "a dictionary name"),
        (lambda out: out.features("res", ids=[]), "at least one feature id"),
        (lambda out: out.probe("p", outputs=[1, 1]), "duplicate feature ids"),
        (lambda out: out.steer_feature("res", 1.5, alpha=1), "a feature id"),
        (lambda out: out.steer_feature("res", [1, "2"], alpha=1), "feature ids are ints"),
        (lambda out: out.steer_feature("res", 1, alpha=float("nan")), "alpha: must be finite"),
        (lambda out: out.clamp_feature("res", 1, float("inf")), "value: must be finite"),
        (lambda out: out.steer_probe("p", True, 1.0), "a feature id"),
        (lambda out: out.select([0]).probe("p"), r"not \.select\(\)ed units"),
    ],
)
def test_bad_arguments_are_refused_before_sending(act, message):
    t = _tracer()
    with pytest.raises(tw.InvalidArgument, match=message):
        act(t.model.layers[3].output)
    with pytest.raises(tw.InvalidArgument, match="drop mean=True"):
        t.all().module("layers.3", positions="prompt", mean=True).probe("p")
    with pytest.raises(tw.InvalidArgument, match="must be finite"):
        tw.probe_above("p", float("nan"))
    assert t.request().invokes[0].interventions == []


def test_values_decode_per_selection_and_positions():
    """Probe values [k] at the new token, [positions, k] elsewhere (also for "all" after
    step 0, which the server may send as the new token's row alone); top-k as a TopK;
    the reconstruction error [1]."""

    def value(values, ids=None, positions=None) -> trace_pb2.ReadValue:
        out = trace_pb2.ReadValue(values=from_numpy(values))
        if ids is not None:
            out.token_ids.CopyFrom(_int32(ids))
        if positions is not None:
            out.positions.CopyFrom(_int32(positions))
        return out

    steps = [
        trace_pb2.StepResult(step=0, token_id=5, values={
            "p": value([0.1, 0.9]),
            "top": value([3.0, 2.0], ids=[7, 1]),
            "err": value([0.5]),
            "all": value([[1.0, 2.0], [3.0, 4.0]], positions=[0, 1]),
            "alltop": value([[3.0], [4.0]], ids=[[2], [0]], positions=[0, 1]),
        }),
        trace_pb2.StepResult(step=1, token_id=6, values={
            "p": value([0.2, 0.8]),
            "top": value([1.0, 0.5], ids=[4, 7]),
            "err": value([0.25]),
            "all": value([5.0, 6.0]),
            "alltop": value([6.0], ids=[1]),
        }),
    ]
    events = [service_pb2.TraceResponse(steps=trace_pb2.StepResults(results=steps)),
              service_pb2.TraceResponse(end=trace_pb2.TraceEnd())]
    t = _tracer(lambda request: iter(events))
    out = t.model.layers[3].output
    probe = out.probe("refusal").save("p")
    top = out.features("res-l3", top_k=2).save("top")
    err = out.reconstruction_error("res-l3").save("err")
    every = t.all().module("layers.3", positions="all").probe("refusal").save("all")
    every_top = t.all().module("layers.3", positions="all").features("res-l3", top_k=1).save("alltop")
    t.run()
    np.testing.assert_array_equal(np.stack(probe), np.float32([[0.1, 0.9], [0.2, 0.8]]))
    assert isinstance(top[0], tw.TopK) and top[1].ids.tolist() == [4, 7] and top[1].values.tolist() == [1.0, 0.5]
    assert [e.tolist() for e in err] == [[0.5], [0.25]]
    assert every[0].shape == (2, 2) and every[1].tolist() == [[5.0, 6.0]]
    assert every_top[0].ids.tolist() == [[2], [0]] and every_top[1].ids.tolist() == [[1]]
    assert every_top[1].values.tolist() == [[6.0]] and probe.steps == [0, 1]


def _int32(values) -> tensor_pb2.Tensor:
    array = np.ascontiguousarray(np.asarray(values, dtype="<i4"))
    return tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT32, shape=list(array.shape), data=array.tobytes())
