"""The other modules on a compiled engine (--compiled-module-reads, --compiled-module-steering):
the embeddings, the attention and MLP outputs, the final norm, read and written from
buffers and tables in the graph, against transformers' forward hooks on the same weights,
and the same trace on the eager server. conftest's `graph` server keeps them for layers
0-2 (layers.3.mlp has none: its refusal is tested); the default `server` for every layer."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from test_hidden_states import GREEDY, PROMPT, hf_module_outputs, prompt_read
from trace_requests import f32, invoke, iv, run, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire.v1 import service_pb2_grpc

ATOL = 1e-4
RAW = I.ReadLogits(stage=I.LOGITS_STAGE_RAW, full=I.FullRow())
SITES = ["embed_tokens", "layers.0.self_attn", "layers.1.mlp", "layers.2.self_attn", "layers.2.mlp", "norm"]


@pytest.fixture(scope="module", params=["graph", "server", "eager"])
def mstub(request):
    """A stub of each engine kind: the graph server, the default compiled one, the eager one."""
    target = request.getfixturevalue(request.param).target
    with grpc.insecure_channel(target) as channel:
        yield service_pb2_grpc.TraceServiceStub(channel)


def _hf_module(hf, path):
    model = hf.model.model
    if path in ("embed_tokens", "norm"):
        return getattr(model, path)
    _, layer, part = path.split(".")
    return getattr(model.layers[int(layer)], part)


def hf_logits_editing(hf, ids, edits):
    """Last-position logits of a transformers forward pass with `edits` ({path: fn(rows)
    -> new rows}, rows [positions, hidden]) applied to those modules' outputs."""
    def hook_of(edit):
        def hook(module, args, output):
            hidden = (output[0] if isinstance(output, tuple) else output).clone()
            hidden[0] = edit(hidden[0])
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return hook

    handles = [_hf_module(hf, path).register_forward_hook(hook_of(edit)) for path, edit in edits.items()]
    try:
        with torch.no_grad():
            return hf.model(torch.tensor([ids])).logits[0, -1].float().numpy()
    finally:
        for h in handles:
            h.remove()


def test_module_outputs_at_prompt_positions_and_every_step_equal_hf(mstub, hf):
    result = run(mstub, trace(invoke(PROMPT, *[iv(p, read_module=prompt_read(p)) for p in SITES],
                                     *[iv(f"new {p}", read_module=I.ReadModule(module=p)) for p in SITES[1::2]]),
                              max_tokens=3, **GREEDY))
    ids = hf.encode(PROMPT)
    tokens = result.tokens()
    assert tokens == hf.greedy(ids, 3)
    ref = hf_module_outputs(hf, ids)
    for path in SITES:
        (value,) = result.values(path)
        np.testing.assert_allclose(value, ref[path], atol=ATOL, err_msg=path)
    for step in range(3):
        step_ref = hf_module_outputs(hf, ids + tokens[:step])
        for path in SITES[1::2]:
            np.testing.assert_allclose(result.values(f"new {path}")[step], step_ref[path][-1], atol=ATOL,
                                       err_msg=f"{path} at step {step}")


def _at(*positions):
    return I.Positions(prompt_list=I.PositionList(positions=list(positions)))


def test_writes_of_each_module_kind_equal_hfs_hooks(mstub, hf):
    """An add on the MLP's output at every new token, a replace of two embeddings, a zero of
    an attention output, an add on the final norm's output: the logits at every step."""
    rng = np.random.default_rng(5)
    hidden = hf.model.config.hidden_size
    add, put, bias = (rng.normal(size=hidden).astype(np.float32) for _ in range(3))
    ids = hf.encode(PROMPT)
    result = run(mstub, trace(invoke(
        PROMPT,
        iv(write_module=I.WriteModule(module="layers.1.mlp", positions=I.Positions(new_token=I.NewToken()),
                                      add=f32(add), scale=3.0)),
        iv(write_module=I.WriteModule(module="embed_tokens", positions=_at(1, 2), replace=f32(put))),
        iv(write_module=I.WriteModule(module="layers.0.self_attn", positions=_at(0, 3), zero=I.ZeroAblation())),
        iv(write_module=I.WriteModule(module="norm", positions=I.Positions(new_token=I.NewToken()),
                                      add=f32(bias), scale=0.5)),
        iv("raw", read_logits=RAW),
    ), max_tokens=4, **GREEDY))
    tokens = result.tokens()
    seq = list(ids)
    first_new = len(ids) - 1  # (the last prompt position is the first new token's row)

    def from_first_new(vector, scale):
        def edit(rows):
            rows[first_new:] += scale * torch.from_numpy(vector)
            return rows
        return edit

    def rows_to(positions, value):
        def edit(rows):
            rows[positions] = value
            return rows
        return edit

    for step in range(4):
        ref = hf_logits_editing(hf, seq, {
            "layers.1.mlp": from_first_new(add, 3.0),
            "embed_tokens": rows_to([1, 2], torch.from_numpy(put)),
            "layers.0.self_attn": rows_to([0, 3], 0.0),
            "norm": from_first_new(bias, 0.5),
        })
        np.testing.assert_allclose(result.values("raw")[step], ref, atol=2e-3, rtol=1e-4, err_msg=f"step {step}")
        assert tokens[step] == int(ref.argmax())
        seq.append(tokens[step])
    assert tokens != hf.greedy(ids, 4)  # the writes change the continuation


def test_a_patch_of_an_mlp_output_equals_hfs_copy(mstub, hf):
    """Activation patching on a module site: the clean run's layers.1.mlp rows replace the
    corrupted run's at two prompt positions."""
    clean, corrupted = "The capital of France is", "The capital of Italy is"
    ids_clean, ids_bad = hf.encode(clean), hf.encode(corrupted)
    assert len(ids_clean) == len(ids_bad)
    result = run(mstub, trace(
        invoke(clean, iv("src", read_module=prompt_read("layers.1.mlp"))),
        invoke(corrupted, iv("", steps(at=[0]), write_module=I.WriteModule(
            module="layers.1.mlp", positions=_at(3, 4), patch=I.ReadRef(invoke=0, name="src", positions=[3, 4]))),
            iv("raw", read_logits=RAW)),
        max_tokens=1, **GREEDY))
    source = torch.from_numpy(hf_module_outputs(hf, ids_clean)["layers.1.mlp"][[3, 4]])

    def copy(rows):
        rows[[3, 4]] = source
        return rows

    ref = hf_logits_editing(hf, ids_bad, {"layers.1.mlp": copy})
    np.testing.assert_allclose(result.values("raw", invoke=1)[0], ref, atol=2e-3, rtol=1e-4)


def test_modules_without_buffers_or_tables_are_refused_naming_the_field_and_flag(graph, bare):
    for target, module, flag in ((graph.target, "layers.3.mlp", "--compiled-module-reads"),
                                 (bare.target, "norm", "--compiled-module-reads")):
        with grpc.insecure_channel(target) as channel:
            stub = service_pb2_grpc.TraceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                run(stub, trace(invoke(PROMPT, iv("h", read_module=prompt_read(module)))))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "read_module" in info.value.details() and flag in info.value.details(), info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                run(stub, trace(invoke(PROMPT, iv(write_module=I.WriteModule(
                    module=module, positions=_at(0), zero=I.ZeroAblation())))))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = info.value.details()  # (the bare server has no tables at all: the field is the write)
            assert "write_module" in details and "--compiled-module-steering" in details, details
