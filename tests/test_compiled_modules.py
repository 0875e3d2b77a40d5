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
    if path.count(".") == 1:  # a decoder layer
        return model.layers[int(path.split(".")[1])]
    _, layer, part = path.split(".")
    return getattr(model.layers[int(layer)], part)


def hf_logits_editing(hf, ids, edits):
    """Last-position logits of a transformers forward pass with `edits` ({path: fn(rows)
    -> new rows}, rows [positions, hidden]) applied to those modules' outputs."""
    return _last_logits(hf, ids, [_hf_module(hf, path).register_forward_hook(
        lambda module, args, output, edit=edit: _edited(output, edit)) for path, edit in edits.items()])


def _last_logits(hf, ids, handles):
    """Last-position logits of a transformers forward pass with these hooks, removed after."""
    try:
        with torch.no_grad():
            return hf.model(torch.tensor([ids])).logits[0, -1].float().numpy()
    finally:
        for h in handles:
            h.remove()


def check_module_outputs(mstub, hf):
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


def check_module_writes(mstub, hf):
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


# -- mean ablation (--compiled-mean-ablation: in the graph's tables, a running sum per pass) ---


def _mean_of(positions):
    def edit(rows):
        rows[positions] = rows[positions].mean(0, keepdim=True)
        return rows
    return edit


def _hf_logits_with_unit_means(hf, ids, heads, neurons):
    """transformers' logits with o_proj's input of `heads` ({layer: [heads]}) and
    down_proj's of `neurons` ({layer: [neurons]}) replaced by their mean over every
    prompt position, per unit (pre-hooks: the columns those units own)."""
    head_dim = hf.model.config.head_dim

    def pre(columns):
        def hook(module, args):
            x = args[0].clone()
            x[0][:, columns] = x[0][:, columns].mean(0, keepdim=True)
            return (x, *args[1:])
        return hook

    handles = []
    for layer, chosen in heads.items():
        columns = [h * head_dim + d for h in chosen for d in range(head_dim)]
        handles.append(hf.model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(pre(columns)))
    for layer, chosen in neurons.items():
        handles.append(hf.model.model.layers[layer].mlp.down_proj.register_forward_pre_hook(pre(list(chosen))))
    return _last_logits(hf, ids, handles)


def check_layer_and_module_means(mstub, hf):
    """A mean over prompt positions 1-3 of layers.1 after an add at every prompt position
    there (mean(x + v) = mean(x) + v, composed in the same slot), and one over positions 0
    and 4 of layers.2.mlp: step 0's logits."""
    vector = np.random.default_rng(9).normal(size=hf.model.config.hidden_size).astype(np.float32)
    ids = hf.encode(PROMPT)
    result = run(mstub, trace(invoke(
        PROMPT,
        iv(write_module=I.WriteModule(module="layers.1", positions=I.Positions(all_prompt=I.AllPrompt()),
                                      add=f32(vector))),
        iv(write_module=I.WriteModule(module="layers.1", positions=_at(1, 2, 3), mean=I.MeanAblation())),
        iv(write_module=I.WriteModule(module="layers.2.mlp", positions=_at(0, 4), mean=I.MeanAblation())),
        iv("raw", read_logits=RAW),
    ), max_tokens=1, **GREEDY))

    def add_then_mean(rows):
        rows[: len(ids)] += torch.from_numpy(vector)
        return _mean_of([1, 2, 3])(rows)

    ref = hf_logits_editing(hf, ids, {"layers.1": add_then_mean, "layers.2.mlp": _mean_of([0, 4])})
    np.testing.assert_allclose(result.values("raw")[0], ref, atol=2e-3, rtol=1e-4)
    assert not np.allclose(ref, hf.next_logits(ids).numpy(), atol=1e-2)


def test_mean_ablations_of_heads_and_neurons_equal_hfs_pre_hooks(mstub, hf):
    ids = hf.encode(PROMPT)
    every = I.Positions(all_prompt=I.AllPrompt())
    result = run(mstub, trace(invoke(
        PROMPT,
        iv(write_module=I.WriteModule(module="layers.0.self_attn.heads", positions=every, units=I.UnitIds(ids=[2]),
                                      mean=I.MeanAblation())),
        iv(write_module=I.WriteModule(module="layers.1.mlp.act", positions=every, units=I.UnitIds(ids=[1, 5, 40]),
                                      mean=I.MeanAblation())),
        iv("raw", read_logits=RAW),
    ), max_tokens=1, **GREEDY))
    ref = _hf_logits_with_unit_means(hf, ids, {0: [2]}, {1: [1, 5, 40]})
    np.testing.assert_allclose(result.values("raw")[0], ref, atol=2e-3, rtol=1e-4)
    assert not np.allclose(ref, hf.next_logits(ids).numpy(), atol=1e-3)


def test_concurrent_mean_ablations_keep_to_their_own_rows(mstub):
    """Each trace's mean is over its own rows: the same results alone and eight at once."""
    import concurrent.futures

    prompts = ["The capital of France is", "Once upon a time there was", "One two three four five six"]
    requests = [trace(invoke(p, iv(write_module=I.WriteModule(
        module="layers.1", positions=I.Positions(all_prompt=I.AllPrompt()), mean=I.MeanAblation())),
        iv("raw", read_logits=RAW)), max_tokens=3, **GREEDY) for p in prompts]
    solo = [run(mstub, r).values("raw") for r in requests]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda r: run(mstub, r).values("raw"), requests * 3))
    for got, want in zip(together, solo * 3, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


def test_a_mean_the_graph_cannot_take_fails_its_own_trace_saying_so(graph, hf):
    """A mean over positions 1-3 with an add at position 2 only: its rows' other writes
    differ, so the graph's group mean would not be the eager one. That trace fails saying
    why and naming --enforce-eager (which serves it); the next mean ablation is served."""
    with grpc.insecure_channel(graph.target) as channel:
        stub = service_pb2_grpc.TraceServiceStub(channel)
        vector = np.ones(hf.model.config.hidden_size, np.float32)
        with pytest.raises(grpc.RpcError) as error:
            run(stub, trace(invoke(
                PROMPT,
                iv(write_module=I.WriteModule(module="layers.1", positions=_at(2), add=f32(vector))),
                iv(write_module=I.WriteModule(module="layers.1", positions=_at(1, 2, 3), mean=I.MeanAblation())),
            ), max_tokens=1, **GREEDY))
        assert "mean of layers.1" in error.value.details() and "--enforce-eager" in error.value.details()
        result = run(stub, trace(invoke(PROMPT, iv(write_module=I.WriteModule(
            module="layers.1", positions=_at(1, 2, 3), mean=I.MeanAblation())), iv("raw", read_logits=RAW)),
            max_tokens=1, **GREEDY))
        hook_ref = hf_logits_editing(hf, hf.encode(PROMPT), {"layers.1": _mean_of([1, 2, 3])})
        np.testing.assert_allclose(result.values("raw")[0], hook_ref, atol=2e-3, rtol=1e-4)


def _edited(output, edit):
    """A transformers module's output with `edit` applied to its rows."""
    hidden = (output[0] if isinstance(output, tuple) else output).clone()
    hidden[0] = edit(hidden[0])
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden



def test_model_info_says_which_modules_means_and_clamps_each_server_serves(graph, server, eager, bare):
    import tracewire as tw

    kept = ["embed_tokens", *[f"layers.{layer}.{part}" for layer in range(3) for part in ("mlp", "self_attn")],
            "norm"]
    every = ["embed_tokens", *[f"layers.{layer}.{part}" for layer in range(4) for part in ("mlp", "self_attn")],
             "norm"]
    expected = {"graph": (kept, kept, True, [0, 1, 2]), "server": (every, every, True, [0, 1, 2, 3]),
                "eager": ([], [], False, []), "bare": ([], [], False, [])}
    for name, proc in (("graph", graph), ("server", server), ("eager", eager), ("bare", bare)):
        with tw.Client(proc.target, timeout=60) as client:
            info = client.model_info()
        assert (info.readable_modules, info.steerable_modules, info.compiled_mean_ablation,
                info.clamp_layers) == expected[name], name


def test_module_outputs_at_prompt_positions_and_every_step_equal_hf(mstub, hf):
    check_module_outputs(mstub, hf)


def test_writes_of_each_module_kind_equal_hfs_hooks(mstub, hf):
    check_module_writes(mstub, hf)


def test_mean_ablations_of_a_layer_after_a_steer_and_of_an_mlp_output_equal_hf(mstub, hf):
    check_layer_and_module_means(mstub, hf)
