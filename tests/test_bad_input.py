"""Every invalid request gets INVALID_ARGUMENT naming the field; serving goes on."""

from __future__ import annotations

import grpc
import pytest
import tracewire
from tracewire.v1 import prompt_pb2, sampling_pb2, service_pb2


def _text(s):
    return prompt_pb2.Prompt(text=s)


def _ids(ids):
    return prompt_pb2.Prompt(token_ids=prompt_pb2.TokenIds(ids=ids))


def _expect_invalid(stub, request, field):
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request, timeout=60)
    err = tracewire.errors.from_rpc_error(info.value)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert err.field == field, (err.field, err.message)
    assert field in info.value.details()
    return err


CASES = {
    "empty prompt list": (service_pb2.GenerateRequest(), "prompts"),
    "empty prompt": (service_pb2.GenerateRequest(prompts=[prompt_pb2.Prompt()]), "prompts[0]"),
    "empty text": (service_pb2.GenerateRequest(prompts=[_text("")]), "prompts[0].text"),
    "empty ids": (service_pb2.GenerateRequest(prompts=[_text("a"), _ids([])]),
                  "prompts[1].token_ids.ids"),
    "id above vocab": (service_pb2.GenerateRequest(prompts=[_ids([1, 2, 10**6])]),
                       "prompts[0].token_ids.ids[2]"),
    "negative id": (service_pb2.GenerateRequest(prompts=[_ids([-1])]),
                    "prompts[0].token_ids.ids[0]"),
    "prompt too long": (service_pb2.GenerateRequest(prompts=[_ids([5] * 600)]), "prompts[0].token_ids.ids"),
    "prompt text too long": (service_pb2.GenerateRequest(prompts=[_text("Paris " * 600)]), "prompts[0]"),
    "negative max_tokens": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(max_tokens=-3)),
        "sampling_params.max_tokens"),
    "zero max_tokens": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(max_tokens=0)),
        "sampling_params.max_tokens"),
    "negative temperature": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(temperature=-0.5)),
        "sampling_params.temperature"),
    "top_p zero": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(top_p=0.0)),
        "sampling_params.top_p"),
    "top_p above one": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(top_p=1.5)),
        "sampling_params.top_p"),
    "n zero": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(n=0)),
        "sampling_params.n"),
    "nan temperature": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(temperature=float("nan"))),
        "sampling_params.temperature"),
    "logprobs above cap": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(logprobs=10**6)),
        "sampling_params.logprobs"),
    "stop token outside vocab": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(stop_token_ids=[10**7])),
        "sampling_params.stop_token_ids[0]"),
    "logit bias outside vocab": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(logit_bias={-4: 1.0})),
        "sampling_params.logit_bias[0]"),
    # 500 + 13 > max_model_len 512: refused, not cut short at the model's length
    "max_tokens past max_model_len": (service_pb2.GenerateRequest(
        prompts=[_text("a"), _ids([5] * 500)], sampling_params=sampling_pb2.SamplingParams(max_tokens=13)),
        "sampling_params.max_tokens"),
    "unknown model": (service_pb2.GenerateRequest(prompts=[_text("a")], model="gpt-17"), "model"),
    # Found by vLLM itself, inside the engine adapter: named as the sampling parameters,
    # never INTERNAL from the call's TaskGroup.
    "empty bad word": (service_pb2.GenerateRequest(
        prompts=[_text("a"), _text("b")], sampling_params=sampling_pb2.SamplingParams(bad_words=[""])),
        "sampling_params"),
    "min_tokens over the default max_tokens": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(min_tokens=40)),
        "sampling_params"),
    # --max-sequences (256 by default): refused before any per-sequence work.
    "n over the sequence cap": (service_pb2.GenerateRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(n=1177284119)),
        "sampling_params.n"),
    "n x prompts over the sequence cap": (service_pb2.GenerateRequest(
        prompts=[_text("a")] * 3, sampling_params=sampling_pb2.SamplingParams(n=100)),
        "sampling_params.n"),
    "prompts over the sequence cap": (service_pb2.GenerateRequest(prompts=[_text("a")] * 257), "prompts"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_generate_names_the_field(stub, client, case):
    request, field = CASES[case]
    _expect_invalid(stub, request, field)
    # The server and engine keep serving everyone else.
    (out,) = client.generate("The capital of France is", temperature=0.0, max_tokens=2)
    assert len(out.outputs[0].token_ids) == 2


def test_invalid_stream_request_names_the_field(stub):
    request = service_pb2.GenerateStreamRequest(
        prompts=[_text("a")], sampling_params=sampling_pb2.SamplingParams(top_p=2.0))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.top_p" in info.value.details()


def test_max_tokens_must_fit_the_model_length(stub, client):
    """Prompt + max_tokens beyond max_model_len (512) is refused by both generate RPCs,
    naming the field, instead of ending early with finish_reason "length"; a max_tokens
    that exactly fits generates all of them, and an unset one is 16 or what the prompt
    leaves."""
    long_prompt = [5] * 500
    request = service_pb2.GenerateStreamRequest(
        prompts=[_ids(long_prompt)], sampling_params=sampling_pb2.SamplingParams(max_tokens=13))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert tracewire.errors.from_rpc_error(info.value).field == "sampling_params.max_tokens"
    assert "at most 12" in info.value.details() and "prompts[0]" in info.value.details()
    (fits,) = client.generate([long_prompt], max_tokens=12, ignore_eos=True)
    assert len(fits.outputs[0].token_ids) == 12
    (unset_long, unset_short) = client.generate([long_prompt, [5] * 10], ignore_eos=True)
    assert len(unset_long.outputs[0].token_ids) == 12
    assert len(unset_short.outputs[0].token_ids) == 16


def test_detokenize_rejects_ids_outside_vocab(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Detokenize(service_pb2.DetokenizeRequest(token_ids=[1, 10**6]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids[1]" in info.value.details()


def test_sdk_raises_typed_error_with_field(client):
    with pytest.raises(tracewire.InvalidArgument) as info:
        client.generate("a", top_p=3.0)
    assert info.value.field == "sampling_params.top_p"


def test_sdk_misspelled_keyword_names_valid_ones(client):
    with pytest.raises(tracewire.InvalidArgument) as info:
        client.generate("a", temprature=0.0)
    message = str(info.value)
    assert "'temprature'" in message and "Did you mean 'temperature'" in message
    assert "max_tokens" in message and "stop_token_ids" in message


def test_concurrent_bad_requests_do_not_disturb_a_good_one(server, client, hf):
    import concurrent.futures

    def bad(i):
        with pytest.raises(tracewire.InvalidArgument):
            tracewire.Client(server.target, timeout=60).generate([[10**6 + i]])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        good = pool.submit(client.generate, "The capital of France is",
                           temperature=0.0, max_tokens=8, ignore_eos=True)
        list(pool.map(bad, range(16)))
        out = good.result()
    assert out[0].outputs[0].token_ids == hf.greedy(hf.encode("The capital of France is"), 8)


def _trace_n(*ns, trace_n=None):
    from tracewire.v1 import trace_pb2

    request = service_pb2.TraceRequest(invokes=[
        trace_pb2.Invoke(prompt=_text("a"), sampling_params=sampling_pb2.SamplingParams(
            **({} if n is None else {"n": n}), max_tokens=1)) for n in ns])
    if trace_n is not None:
        request.sampling_params.n = trace_n
    return request


TRACE_SEQUENCE_CASES = {
    "huge n": (_trace_n(None, trace_n=1177284119), "sampling_params.n"),
    "huge invoke n": (_trace_n(1, 1177284119), "invokes[1].sampling_params.n"),
    "n summed over invokes": (_trace_n(*[30] * 10), "invokes[8].sampling_params.n"),
    "trace n summed over invokes": (_trace_n(*[None] * 10, trace_n=30), "sampling_params.n"),
    "too many invokes": (_trace_n(*[None] * 257), "invokes"),
}


@pytest.mark.parametrize("case", sorted(TRACE_SEQUENCE_CASES))
def test_trace_sequences_are_capped_before_any_work(stub, client, case):
    """n is summed over the invokes and checked before anything is built per sequence:
    n = 1177284119 once froze the server and grew it to 13 GB."""
    request, field = TRACE_SEQUENCE_CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Trace(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert tracewire.errors.from_rpc_error(info.value).field == field
    assert "--max-sequences" in info.value.details()
    (out,) = client.generate("The capital of France is", temperature=0.0, max_tokens=2)
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [1] * 70, [2, 1024]])
def test_write_tensor_shapes_are_checked_before_numpy_sees_them(stub, shape):
    """Shapes numpy refuses (over 64 dimensions, 2^124 elements) were INTERNAL errors."""
    from tracewire.v1 import intervention_pb2, tensor_pb2, trace_pb2

    tensor = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=shape, data=b"")
    write = intervention_pb2.Intervention(write_logits=intervention_pb2.WriteLogits(replace=tensor))
    request = service_pb2.TraceRequest(invokes=[trace_pb2.Invoke(prompt=_text("a"), interventions=[write])])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Trace(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert tracewire.errors.from_rpc_error(info.value).field == "invokes[0].interventions[0].write_logits.replace.shape"


def test_errors_quoting_a_large_input_are_clipped(stub):
    """A 100 kB `model` was quoted whole: past the client's 16 KiB metadata limit the
    client saw RESOURCE_EXHAUSTED instead of the INVALID_ARGUMENT naming `model`. Strings
    are bounded now (1024 characters), and messages quoting them clipped."""
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(service_pb2.GenerateRequest(prompts=[_text("a")], model="m" * 1000), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert tracewire.errors.from_rpc_error(info.value).field == "model"
    assert "more characters" in info.value.details() and len(info.value.details()) < 1200


def test_a_module_that_does_not_exist_is_unknown_on_the_compiled_server_too(stub):
    """The default server is compiled (no module hooks): an address the model lacks is the
    eager server's INVALID_ARGUMENT "unknown module" (test_hidden_states), not a hint to
    start it with --enforce-eager."""
    from tracewire.v1 import intervention_pb2, trace_pb2

    read = intervention_pb2.Intervention(name="h", read_module=intervention_pb2.ReadModule(module="layers.99"))
    request = service_pb2.TraceRequest(invokes=[trace_pb2.Invoke(prompt=_text("a"), interventions=[read])])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Trace(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert tracewire.errors.from_rpc_error(info.value).field == "invokes[0].interventions[0].read_module.module"
    assert "unknown module 'layers.99'" in info.value.details()
