"""What a compiled engine's graph carries when no --compiled-* flag says: the default.

Module interventions on a compiled (CUDA-graph) engine are served by hooks built into
the graph at load time: steering tables and read buffers (shared/steering.py,
shared/read_buffers.py). They cost device memory the KV cache would otherwise get, in
proportion to the model's widths and the engine's largest pass, so the server cannot
give every model all of them. The default, for a server started without any of the
--compiled-* flags: each kind of hook, in the order a researcher reaches for them (layer
writes, layer reads, head and neuron writes, head and neuron reads, attention queries
and keys, then the other modules' writes and reads, and dictionary clamps only where every
kind before them fit: they cost time in every pass rather than memory, as mean ablation in
the write tables does, which comes on the same terms), on every layer,
as long as the running total stays within `--graph-hook-bytes` (2 GiB). A small model
gets all of them; a large one the cheap ones, and the start log names the flag and the
bytes of each kind left off. Any flag given means exactly what the flags say.

The estimate is taken before the engine starts (the compiled graph's shape, and
vLLM's compile cache key, must be known then) from the model's config, with the
largest pass vLLM defaults to on any device unless the engine's own flags set it (an
upper bound: smaller devices get smaller defaults) and the config's dtype unless --dtype
sets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..shared import read_buffers, steering
from ..shared.limits import CLAMP_COLUMNS, CLAMP_FEATURES

DEFAULT_BUDGET_BYTES = 2 << 30
# vLLM's largest defaults (arg_utils: 16384 batched tokens, 1024 sequences, on H100-class
# and larger devices) and its largest CUDA graph (512 tokens), for flags left unset.
DEFAULT_TOKENS = 16384
DEFAULT_SEQS = 1024
LARGEST_GRAPH = 512
INDEX_BYTES = 8  # a row's slot number (int64) in each table's index


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The widths the hooks are sized by (of the whole model: no tensor-parallel split)."""

    num_layers: int
    hidden: int
    unit_width: int  # heads x head_dim (o_proj's input) + intermediate size (down_proj's)
    attention_width: int  # (heads + KV heads) x head_dim: an attention module's queries and keys
    dtype_bytes: int


@dataclasses.dataclass(frozen=True)
class PassSize:
    tokens: int  # rows of the largest forward pass
    seqs: int  # sequences the scheduler holds (steering.SlotCounts: the table slots)

    @property
    def slots(self) -> int:
        return steering.SlotCounts(self.seqs).total


@dataclasses.dataclass(frozen=True)
class HookKind:
    flag: str
    key: str  # the engine's additional_config key (steering.py, read_buffers.py)
    what: str
    units: bool  # heads and neurons: served at tensor-parallel size 1 only
    layer_bytes: Callable[[ModelShape, PassSize], int]
    # sites a layer has (module kinds: its attention and MLP outputs), and sites besides
    # the layers' (the embeddings and the final norm), each costing layer_bytes
    sites_per_layer: int = 1
    other_sites: int = 0
    # taken by default only when every kind before it was (its cost is time, every pass)
    after_all: bool = False

    @property
    def writes(self) -> bool:
        """Write tables (which the default gives mean ablation too: no memory of its own)."""
        return self.key in (steering.LAYERS, steering.UNIT_LAYERS, steering.MODULE_LAYERS)

    def bytes(self, shape: ModelShape, size: PassSize) -> int:
        """On every layer."""
        return (shape.num_layers * self.sites_per_layer + self.other_sites) * self.layer_bytes(shape, size)


def _table_bytes(m: ModelShape, p: PassSize) -> int:
    """A hidden-size write table's (SteeringTables: a scale and a vector a slot, and the index)."""
    return m.dtype_bytes * p.slots * (m.hidden + 1) + INDEX_BYTES * p.tokens


def _buffer_bytes(m: ModelShape, p: PassSize) -> int:
    """A hidden-size read buffer's."""
    return m.dtype_bytes * p.tokens * m.hidden


# In default order. The sizes are those steering.py and read_buffers.py allocate.
KINDS = (
    HookKind("--compiled-steering", steering.LAYERS, "layer writes", False, _table_bytes),
    HookKind("--compiled-reads", read_buffers.LAYERS, "layer reads", False, _buffer_bytes),
    HookKind("--compiled-unit-steering", steering.UNIT_LAYERS, "head and neuron writes", True,
             lambda m, p: m.dtype_bytes * 2 * p.slots * m.unit_width + 2 * INDEX_BYTES * p.tokens),
    HookKind("--compiled-unit-reads", read_buffers.UNIT_LAYERS, "head and neuron reads", True,
             lambda m, p: m.dtype_bytes * p.tokens * m.unit_width),
    # (heads split across tensor-parallel ranks, as units: at --tensor-parallel-size 1 only)
    HookKind("--compiled-pattern-reads", read_buffers.PATTERN_LAYERS, "attention-pattern reads", True,
             lambda m, p: m.dtype_bytes * p.tokens * m.attention_width),
    # The embeddings', attention and MLP outputs', final norm's (graph_layers.module_sites)
    HookKind("--compiled-module-steering", steering.MODULE_LAYERS, "module writes", False, _table_bytes,
             sites_per_layer=2, other_sites=2),
    HookKind("--compiled-module-reads", read_buffers.MODULE_LAYERS, "module reads", False, _buffer_bytes,
             sites_per_layer=2, other_sites=2),
    # Little memory, but two matmuls a layer in every pass: small models only (and on the
    # layer tables: --compiled-steering's layers)
    HookKind("--compiled-dictionary-clamps", steering.CLAMP_LAYERS, "dictionary clamps", False,
             lambda m, p: 4 * (CLAMP_COLUMNS + 1) * (2 * m.hidden + 3) + INDEX_BYTES * p.slots * CLAMP_FEATURES,
             after_all=True),
)


@dataclasses.dataclass(frozen=True)
class DefaultHooks:
    chosen: tuple[tuple[HookKind, int], ...]  # (kind, bytes on every layer), in KINDS order
    left: tuple[tuple[HookKind, int], ...]  # what did not fit the budget

    @property
    def reserved(self) -> int:
        return sum(size for _, size in self.chosen)

    @property
    def means(self) -> bool:
        """Whether the write tables take mean ablations: like the clamps, a cost in every
        pass rather than memory (a running sum per table), so only where every kind fit."""
        return not self.left and any(k.writes for k, _ in self.chosen)

    def describe(self, budget: int) -> str:
        """The start log's line."""
        if self.chosen:
            means = " (with mean ablation)" if self.means else ""
            head = (f"compiled graph hooks on every layer: {', '.join(k.what for k, _ in self.chosen)}{means} "
                    f"({_mib(self.reserved)} of --graph-hook-bytes {_mib(budget)})")
        else:
            head = f"no compiled graph hooks fit --graph-hook-bytes {_mib(budget)}"
        if not self.left:
            return head
        left = "; ".join(f"{k.what}: {k.flag} [LAYERS] ({_mib(size)} for all layers)" for k, size in self.left)
        means = "; mean ablation: --compiled-mean-ablation" if any(k.writes for k, _ in self.chosen) else ""
        return f"{head}; left off: {left}{means}"


def choose(shape: ModelShape, size: PassSize, budget: int, units: bool = True) -> DefaultHooks:
    """Each kind on every layer while the total fits `budget`; `units`: whether heads and
    neurons can be served at all (not under tensor parallelism: what the compiler refuses
    there gets no memory)."""
    chosen: list[tuple[HookKind, int]] = []
    left: list[tuple[HookKind, int]] = []
    total = 0
    for kind in KINDS:
        if kind.units and not units:
            continue
        cost = kind.bytes(shape, size)
        if kind.after_all and left:
            left.append((kind, cost))
            continue
        if total + cost <= budget:
            chosen.append((kind, cost))
            total += cost
        else:
            left.append((kind, cost))
    return DefaultHooks(tuple(chosen), tuple(left))


def shape_of(hf_config: Any, dtype: str) -> ModelShape:
    """The widths of a Hugging Face config (its text model's, for multimodal ones);
    `dtype`: the engine's --dtype ("auto": the config's)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hidden = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(text, "head_dim", 0) or (hidden // heads if heads else 0))
    intermediate = int(getattr(text, "intermediate_size", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
    return ModelShape(num_layers=int(text.num_hidden_layers), hidden=hidden,
                      unit_width=heads * head_dim + intermediate, attention_width=(heads + kv_heads) * head_dim,
                      dtype_bytes=_dtype_bytes(dtype, text))


def pass_size(max_num_batched_tokens: int | None, max_num_seqs: int | None) -> PassSize:
    """The engine's flags (None: unset), as the buffers are sized (graph_layers.max_tokens:
    the largest pass or CUDA graph, whichever has more rows)."""
    tokens = max(int(max_num_batched_tokens or DEFAULT_TOKENS), LARGEST_GRAPH)
    return PassSize(tokens=tokens, seqs=int(max_num_seqs or DEFAULT_SEQS))


def _dtype_bytes(dtype: str, text_config: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        name = str(getattr(text_config, "dtype", None) or getattr(text_config, "torch_dtype", None)
                   or "bfloat16").removeprefix("torch.")
    return 4 if name in ("float32", "float") else 8 if name == "float64" else 2


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.0f} MiB"
