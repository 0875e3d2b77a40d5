"""The default compiled graph hooks (frontend/graph_hooks.py): what a server started
without any --compiled-* flag reserves, checked against what the hook modules
(shared/steering.py, shared/read_buffers.py) really allocate."""

from __future__ import annotations

import types

import pytest
import torch
from tracewire_server.frontend import graph_hooks as G
from tracewire_server.shared import read_buffers, steering


def _config(**widths: object) -> types.SimpleNamespace:
    base = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=64, intermediate_size=640,
                dtype="bfloat16")
    return types.SimpleNamespace(**{**base, **widths})


TINY = G.shape_of(_config(), "auto")


def _allocated(layers: int, size: G.PassSize, dtype: torch.dtype) -> dict[str, int]:
    """Bytes each kind's modules hold on `layers` layers of TINY's widths."""
    def nbytes(module: torch.nn.Module) -> int:
        return sum(b.numel() * b.element_size() for b in module.buffers())

    heads, neurons = 4 * 64, 640
    sites = [(path, width, unit) for layer in range(layers)
             for path, width, unit in ((f"layers.{layer}.self_attn.heads", heads, 64),
                                       (f"layers.{layer}.mlp.act", neurons, 1))]
    units = {path: read_buffers.UnitInput(f"b{i}", width, unit) for i, (path, width, unit) in enumerate(sites)}
    cpu = torch.device("cpu")
    modules = ["embed_tokens", *[f"layers.{layer}.{part}" for layer in range(layers) for part in ("self_attn", "mlp")],
               "norm"]
    layer_sites = [f"layers.{layer}" for layer in range(layers)]
    return {
        steering.LAYERS: nbytes(steering.SteeringTables(layer_sites, size.slots, size.tokens, 256, dtype, cpu)),
        read_buffers.LAYERS: nbytes(read_buffers.ReadBuffers(list(range(layers)), size.tokens, 256, dtype, cpu)),
        steering.UNIT_LAYERS: nbytes(steering.UnitTables(sites, size.slots, size.tokens, dtype, cpu)),
        read_buffers.UNIT_LAYERS: nbytes(read_buffers.ReadBuffers([], size.tokens, 256, dtype, cpu, units)),
        read_buffers.PATTERN_LAYERS: nbytes(read_buffers.ReadBuffers(
            [], size.tokens, 256, dtype, cpu, attention={layer: read_buffers.AttentionInput(4 * 64, 4 * 64)
                                                         for layer in range(layers)})),
        steering.MODULE_LAYERS: nbytes(steering.SteeringTables(modules, size.slots, size.tokens, 256, dtype, cpu)),
        read_buffers.MODULE_LAYERS: nbytes(read_buffers.ReadBuffers([], size.tokens, 256, dtype, cpu,
                                                                    modules=modules)),
        # (the clamp columns of layer tables: theirs less the tables without clamps)
        steering.CLAMP_LAYERS: nbytes(steering.SteeringTables(layer_sites, size.slots, size.tokens, 256, dtype, cpu,
                                                              clamp_sites=layer_sites))
        - nbytes(steering.SteeringTables(layer_sites, size.slots, size.tokens, 256, dtype, cpu)),
    }


@pytest.mark.parametrize("tokens, seqs", [(64, 8), (2048, 256)])
def test_the_estimate_is_what_the_hook_modules_allocate(tokens: int, seqs: int) -> None:
    size = G.pass_size(tokens, seqs)
    chosen = G.choose(TINY, size, budget=1 << 40).chosen
    assert [kind.flag for kind, _ in chosen] == [
        "--compiled-steering", "--compiled-reads", "--compiled-unit-steering", "--compiled-unit-reads",
        "--compiled-pattern-reads", "--compiled-module-steering", "--compiled-module-reads",
        "--compiled-dictionary-clamps"]
    real = _allocated(4, size, torch.bfloat16)
    assert {kind.key: cost for kind, cost in chosen} == real


def test_kinds_are_taken_in_order_while_the_total_fits() -> None:
    size = G.pass_size(None, None)  # vLLM's largest defaults: 16384 tokens, 1024 sequences
    assert (size.tokens, size.seqs) == (16384, 1024)
    costs = {kind.flag: cost for kind, cost in G.choose(TINY, size, budget=1 << 40).chosen}
    # room for layer writes and reads only: the unit kinds are left off, each named with its cost
    budget = costs["--compiled-steering"] + costs["--compiled-reads"] + costs["--compiled-unit-steering"] - 1
    hooks = G.choose(TINY, size, budget)
    # (the module tables, cheaper than the unit tables, still fit after them)
    assert costs["--compiled-module-steering"] < costs["--compiled-unit-steering"] < costs["--compiled-module-reads"]
    assert [kind.flag for kind, _ in hooks.chosen] == [
        "--compiled-steering", "--compiled-reads", "--compiled-module-steering"]
    # (dictionary clamps, cheap in memory, only where every kind before them fit: not here)
    assert [(kind.flag, cost) for kind, cost in hooks.left] == [
        ("--compiled-unit-steering", costs["--compiled-unit-steering"]),
        ("--compiled-unit-reads", costs["--compiled-unit-reads"]),
        ("--compiled-pattern-reads", costs["--compiled-pattern-reads"]),
        ("--compiled-module-reads", costs["--compiled-module-reads"]),
        ("--compiled-dictionary-clamps", costs["--compiled-dictionary-clamps"])]
    assert not hooks.means  # (mean ablation, on the same terms as the clamps)
    assert hooks.reserved == (costs["--compiled-steering"] + costs["--compiled-reads"]
                              + costs["--compiled-module-steering"]) <= budget
    line = hooks.describe(budget)
    assert line.startswith("compiled graph hooks on every layer: layer writes, layer reads, module writes (")
    assert "left off: head and neuron writes: --compiled-unit-steering [LAYERS] (" in line
    assert "head and neuron reads: --compiled-unit-reads [LAYERS] (" in line
    assert line.endswith("; mean ablation: --compiled-mean-ablation")
    # a later, cheaper kind still fits after a dear one was left off (many tokens, few
    # sequences: layer reads cost more than the unit tables' slots)
    few = G.pass_size(16384, 8)
    few_costs = {kind.flag: cost for kind, cost in G.choose(TINY, few, budget=1 << 40).chosen}
    assert few_costs["--compiled-reads"] > few_costs["--compiled-unit-steering"]
    skip = G.choose(TINY, few, few_costs["--compiled-steering"] + few_costs["--compiled-unit-steering"])
    assert [kind.flag for kind, _ in skip.chosen] == ["--compiled-steering", "--compiled-unit-steering"]
    nothing = G.choose(TINY, size, 1)
    assert nothing.chosen == () and nothing.describe(1).startswith("no compiled graph hooks fit --graph-hook-bytes")


def test_the_default_budget_gives_a_small_model_everything_and_a_large_one_the_cheap_kinds() -> None:
    size = G.pass_size(None, None)
    small = G.choose(TINY, size, G.DEFAULT_BUDGET_BYTES)
    assert len(small.chosen) == len(G.KINDS) and small.left == () and small.means
    qwen3_8b = G.shape_of(_config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, head_dim=128,
                                  intermediate_size=12288), "auto")
    large = G.choose(qwen3_8b, size, G.DEFAULT_BUDGET_BYTES)
    assert [kind.flag for kind, _ in large.chosen] == ["--compiled-steering"] and not large.means
    assert large.reserved <= G.DEFAULT_BUDGET_BYTES


def test_tensor_parallel_engines_reserve_nothing_for_heads_and_neurons() -> None:
    """The compiler refuses unit interventions at tensor-parallel size > 1: no memory for them."""
    hooks = G.choose(TINY, G.pass_size(64, 8), budget=1 << 40, units=False)
    assert [kind.flag for kind, _ in hooks.chosen] == ["--compiled-steering", "--compiled-reads",
                                                       "--compiled-module-steering", "--compiled-module-reads",
                                                       "--compiled-dictionary-clamps"]
    assert hooks.left == ()


def test_shapes_come_from_the_text_model_and_the_engine_dtype() -> None:
    assert TINY == G.ModelShape(num_layers=4, hidden=256, unit_width=4 * 64 + 640, attention_width=8 * 64,
                                dtype_bytes=2)
    assert G.shape_of(_config(num_key_value_heads=2), "auto").attention_width == (4 + 2) * 64  # GQA
    assert G.shape_of(_config(), "float32").dtype_bytes == 4
    assert G.shape_of(_config(dtype="float32"), "auto").dtype_bytes == 4
    assert G.shape_of(_config(dtype="float32"), "half").dtype_bytes == 2
    no_head_dim = G.shape_of(_config(head_dim=None), "auto")  # head_dim: hidden / heads
    assert no_head_dim.unit_width == 256 + 640
    multimodal = types.SimpleNamespace(get_text_config=lambda: _config(num_hidden_layers=7))
    assert G.shape_of(multimodal, "auto").num_layers == 7
    # the largest CUDA graph sizes the buffers when the pass is smaller
    assert G.pass_size(64, None).tokens == G.LARGEST_GRAPH


class _Loaded:
    """A loader handing back a model with no decoder stack (`model.layers`)."""

    def load_model(self, vllm_config: object, model_config: object, prefix: str = "") -> torch.nn.Module:
        model = torch.nn.Module()
        model.model = torch.nn.Linear(2, 2)
        return model


def _vllm_config(**extra: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        additional_config={steering.LAYERS: "all", steering.UNIT_LAYERS: "all", read_buffers.LAYERS: "all",
                           read_buffers.UNIT_LAYERS: "all", read_buffers.PATTERN_LAYERS: "all",
                           steering.MODULE_LAYERS: "all", read_buffers.MODULE_LAYERS: "all",
                           steering.CLAMP_LAYERS: "all", **extra},
        scheduler_config=types.SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=16),
        compilation_config=types.SimpleNamespace(cudagraph_capture_sizes=[8]),
        model_config=types.SimpleNamespace(get_hidden_size=lambda: 2))


def test_a_model_the_default_hooks_cannot_attach_to_starts_without_them() -> None:
    """The server chose the hooks (no flag): a model without a decoder stack loads with
    none, and the worker reports none, so the frontend refuses what they would serve. A
    flag the user gave fails the start instead, naming the flag."""
    loader = object.__new__(steering.SteerableLoader)
    loader.inner = _Loaded()
    model = loader.load_model(_vllm_config(**{steering.DEFAULTED: True}), None)
    assert steering.attached(model) == {steering.LAYERS: [], steering.UNIT_LAYERS: [], read_buffers.LAYERS: [],
                                        read_buffers.UNIT_LAYERS: [], read_buffers.PATTERN_LAYERS: [],
                                        steering.MODULE_LAYERS: [], read_buffers.MODULE_LAYERS: [], steering.MEANS: [],
                                        steering.CLAMP_LAYERS: []}
    with pytest.raises(RuntimeError, match="--compiled-steering needs a decoder model with model.layers"):
        loader.load_model(_vllm_config(), None)
