"""Decoder-layer writes built into compiled graphs and CUDA graphs (`--compiled-steering`).

Python forward hooks cannot fire inside a compiled / CUDA-graph forward pass, and
vLLM compiles (and captures) the model while the engine starts, before tracewire's
per-request hooks are installed. So the writes are made part of the graph itself,
as data-driven code that every forward pass runs:

    stream' = a[slot] * stream + b[slot]          after each decoder layer

with persistent device tables: `slots[token, layer]` picks each flat token row's
slot, and slot 0 (every row without a write) is a = 1, b = 0, which leaves the
bf16 / fp32 stream bit for bit as it was. An add is (1, s*v), a replace (0, v), a
zero (0, 0). The graph reads the tables; the host only changes their contents
between forward passes (`SlotPlanner`), so graph replay picks up each step's
writes with no recapture.

The tables are attached while the model loads: `--compiled-steering` (and
`--compiled-reads`: read_buffers.py) swaps the engine's load format for this
module's loader, which loads the model with the configured format and then
registers one forward hook per steerable decoder layer (all, or those
`--compiled-steering LAYERS` names). Dynamo traces those hooks into the compiled
graph on the first (profiling) forward pass.

Attention heads and MLP neurons (`--compiled-unit-steering`) are written the same way,
on o_proj's and down_proj's inputs, by forward pre-hooks (UnitTables):

    input' = a[slot] * input + b[slot]            before o_proj / down_proj

with `a` and `b` as wide as the input, so a write changes only its units' columns:
zeroing head h is a = 0, b = 0 on h's head_dim columns and a = 1, b = 0 elsewhere.
Both kinds of table compose a slot's writes (`compose`) and are filled by SlotPlanner.

The other addressable modules (`--compiled-module-steering`: the embeddings, attention and
MLP outputs, the final norm) get SteeringTables of their own, a forward hook each on the
module's output: `out' = a[slot] * out + b[slot]`, planned by one more SlotPlanner.

Mean ablation (`--compiled-mean-ablation`, and in the default hooks) replaces a write's rows
with their mean over the rows it selects in the pass, as the eager hooks do: an in-graph
reduction, so each row's index entry also says where its group's rows begin and end
(`pack`), and the graph takes the groups' sums from one running sum over the pass's rows:

    z = mean of x over the row's group (rows start..end that are in a group), else x
    stream' = a[slot] * z + b[slot]

A request's rows are contiguous in the pass, and one mean write per request and module
a pass keeps its group's rows apart from any other group's (steering_slots.py refuses the
rest, for that request only). The other writes at those rows compose into the slot as
ever: the same at every row of the group (also checked), so a*mean(x)+b = mean(a*x+b).

Dictionary clamps and ablations (`--compiled-dictionary-clamps`) set SAE features of a row to
a value keeping the reconstruction error, `x + sum_f (value - a_f(x)) * W_dec[f]`, with a_f(x)
the feature's activation of the row as written so far. A layer table with clamps has
CLAMP_COLUMNS feature columns, each holding one (dictionary, feature, value)'s encoder column,
bias, threshold, decoder row and value (float32), shared by every slot that clamps it; a slot
names its (at most CLAMP_FEATURES) columns, and the graph computes every row's activations of
all the columns in one small matmul, keeps its slot's, and adds their decoder rows back:

    stream'' = stream' + sum_k (value_k - act(enc_k . stream' + bias_k)) * dec_k

The frontend admits a trace's columns before it starts (clamp_room.py), so a table never runs
out for a trace it admitted.

Activation patching is a replace (or, add_read, an add) whose vector differs row by row:
the source's stored row for that token (worker/patch_store.py). Such a row takes a patch
slot of its own for one forward pass (`SlotPlanner.patch_slot`), composed like any other,
and given back before the next pass: the graph is the same, only more slots are filled.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from vllm.model_executor.model_loader import get_model_loader, register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from . import plan as P
from . import read_buffers
from .graph_layers import hook_layers, hooked_layers, max_tokens, module_sites
from .limits import CLAMP_COLUMNS, CLAMP_FEATURES

# Under vLLM's logger: it configures the handlers in the worker processes, where this runs.
log = logging.getLogger(f"vllm.{__name__}")

LOAD_FORMAT = "tracewire_steering"
# model_loader_extra_config keys: the format (and its own extra config) that loads the weights.
INNER_FORMAT = "tracewire_inner_load_format"
INNER_EXTRA = "tracewire_inner_extra_config"
# vllm_config.additional_config key: the decoder layers that get tables, or "all". Also
# what keeps vLLM's compile cache apart: its key leaves the load format out, and engines
# with other tables (or none) would otherwise load each other's compiled graphs.
LAYERS = "tracewire_steering_tables"
# ... and the decoder layers whose heads and neurons get tables (UnitTables).
UNIT_LAYERS = "tracewire_unit_steering_tables"
# ... and the decoder layers whose attention and MLP outputs get tables (with the
# embeddings' and the final norm's: graph_layers.module_sites).
MODULE_LAYERS = "tracewire_module_steering_tables"
# ... and the decoder layers whose tables get dictionary clamp columns (a subset of LAYERS').
CLAMP_LAYERS = "tracewire_clamp_columns"
# ... and True: the write tables take mean groups (mean ablation, `pack`).
MEANS = "tracewire_mean_ablation"
# Set when the server chose the hooks itself (no --compiled-* flag: graph_hooks.py): a
# model without the decoder stack they attach to starts without them instead of failing.
DEFAULTED = "tracewire_graph_hooks_defaulted"


def wrap_load_format(load_format: str, extra: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """Engine-arg values that load with `load_format` through the steering loader."""
    return LOAD_FORMAT, {INNER_FORMAT: str(load_format), INNER_EXTRA: dict(extra or {})}


def layers_of(additional_config: dict[str, Any] | None, key: str = LAYERS) -> list[int] | str | None:
    """The layers an engine's config gives tables: a list, "all", or None (no tables)."""
    return (additional_config or {}).get(key)


class SteeringTables(torch.nn.Module):
    """The per-module write tables the compiled graph reads (buffers: fixed addresses): one
    table per site, a module whose output is the hidden-size stream written (decoder layers;
    with --compiled-module-steering the embeddings, attention and MLP outputs, final norm)."""

    def __init__(self, sites: list[str], slots: int, max_tokens: int, hidden: int,
                 dtype: torch.dtype, device: torch.device, patch_slots: int = 0, means: bool = False,
                 clamp_sites: list[str] | None = None) -> None:
        """`sites`: module paths, in table order; `slots` in all, the last `patch_slots` of
        them for patched rows (SlotCounts); `means`: rows may be mean-ablated (`pack`);
        `clamp_sites`: the sites with dictionary clamp columns."""
        super().__init__()
        _check_packable(slots, max_tokens)
        self.patch_slots = patch_slots
        self.means = means
        # table -> its clamp columns' index in the clamp buffers (column CLAMP_COLUMNS: zeros)
        self.clamp_of = {sites.index(path): k for k, path in enumerate(clamp_sites or [])}
        width = CLAMP_COLUMNS + 1
        clamps = len(self.clamp_of)
        f32 = dict(dtype=torch.float32, device=device)
        for name, shape in (("clamp_encoders", (clamps, width, hidden)), ("clamp_decoders", (clamps, width, hidden)),
                            ("clamp_biases", (clamps, width)), ("clamp_thresholds", (clamps, width)),
                            ("clamp_values", (clamps, width))):
            self.register_buffer(name, torch.zeros(*shape, **f32), persistent=False)
        self.register_buffer("clamp_columns", torch.full((clamps, slots, CLAMP_FEATURES), CLAMP_COLUMNS,
                                                         dtype=torch.long, device=device), persistent=False)
        self.sites = sites
        # decoder layer numbers among the sites (their output is the residual stream: `apply`)
        self.layers = [P.layer_number(path) for path in sites if P.is_decoder_layer(path)]
        self.streams = [P.is_decoder_layer(path) for path in sites]
        self.names = [f"layer {P.layer_number(path)}" if P.is_decoder_layer(path) else path
                      for path in sites]  # (for messages)
        self.table_of = {path: t for t, path in enumerate(sites)}  # module path -> table
        self.num_slots = slots
        self.register_buffer("scales", torch.ones(len(sites), slots, 1, dtype=dtype, device=device), persistent=False)
        self.register_buffer("vectors", torch.zeros(len(sites), slots, hidden, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("slots", torch.zeros(max_tokens, len(sites), dtype=torch.long, device=device),
                             persistent=False)

    def apply(self, table: int, output: Any) -> Any:
        index = self.slots[: (output[0] if isinstance(output, tuple) else output).shape[0], table]
        slot = index & SLOT_MASK if self.means else index
        a = self.scales[table].index_select(0, slot)
        b = self.vectors[table].index_select(0, slot)
        clamp = self.clamp_of.get(table)  # (a constant where the graph is traced)
        if not isinstance(output, tuple):  # the module returns the stream itself
            out = (_with_means(index, output) if self.means else output) * a + b
            return out if clamp is None else out + self._clamp_delta(clamp, slot, out)
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        if residual is None or not self.streams[table]:  # (the final norm: its normed output)
            out = (_with_means(index, hidden) if self.means else hidden) * a + b
            return (out if clamp is None else out + self._clamp_delta(clamp, slot, out), *output[1:])
        # vLLM's decoder layers return (hidden, residual) with the add deferred to the
        # next norm; the stream is their sum. Only `hidden` changes:
        # a*(h + r) + b - r = a*h + (a - 1)*r + b.
        out = hidden * a + (a - 1) * residual + b
        if self.means:  # a mean row: a * mean(h + r) + b - r
            in_group, mean = _group_means(index, hidden + residual)
            out = torch.where(in_group, mean * a + b - residual, out)
        if clamp is not None:  # on the stream as written so far
            out = out + self._clamp_delta(clamp, slot, out + residual)
        return (out, *output[1:])

    def _clamp_delta(self, clamp: int, slot: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """In the graph: what each row's clamps add, sum_k (value_k - a_k(stream)) * dec_k over
        its slot's columns (the zero column for none), in the stream's dtype."""
        columns = self.clamp_columns[clamp].index_select(0, slot)  # [rows, CLAMP_FEATURES]
        pre = torch.addmm(self.clamp_biases[clamp], stream.float(), self.clamp_encoders[clamp].t())  # [rows, C+1]
        taken = pre.gather(1, columns)
        flat = columns.reshape(-1)
        threshold = self.clamp_thresholds[clamp].index_select(0, flat).view_as(columns)
        value = self.clamp_values[clamp].index_select(0, flat).view_as(columns)
        coefficient = value - torch.where(taken > threshold, taken, 0.0)
        dense = torch.zeros_like(pre).scatter_add_(1, columns, coefficient)
        return (dense @ self.clamp_decoders[clamp]).to(stream.dtype)

    def clamp_rows(self, clamp: int, column: int, rows: ClampRows, k: int) -> None:
        """On the host: put feature k of `rows` into column `column` of clamp table `clamp`."""
        self.clamp_encoders[clamp, column].copy_(rows.encoders[k])
        self.clamp_decoders[clamp, column].copy_(rows.decoders[k])
        self.clamp_biases[clamp, column].copy_(rows.biases[k])
        self.clamp_thresholds[clamp, column].copy_(rows.thresholds[k])
        self.clamp_values[clamp, column].fill_(rows.value)

    def operand_like(self) -> torch.Tensor:
        """A tensor of the tables' device and dtype (what write operands are made as)."""
        return self.vectors

    def compose(self, table: int, slot: int, edits: list[P.WriteModule],
                vector: Callable[[P.WriteModule], torch.Tensor]) -> None:
        """Write `edits` (plan order) into one slot: an add is (1, s*v) (a dictionary steer
        too: v its features' directions times its value; an add_read: v the source's row
        times its scale), a replace (0, v) (a patch: v the source's row), a zero (0, 0),
        each applied to what the ones before left."""
        a, b = 1.0, torch.zeros_like(self.vectors[table, 0])
        for edit in edits:
            if edit.edit == "mean":
                if not self.means:
                    raise ValueError("these tables take no mean ablations")
                continue  # the graph takes the rows' mean first (`pack`): the rest applies to it
            if edit.edit == "clamp":
                continue  # the graph clamps last, from the slot's columns (SlotPlanner takes them)
            if edit.edit in ("add", "steer", "add_read"):
                b = b + vector(edit)
            elif edit.edit in ("replace", "patch"):
                a, b = 0.0, vector(edit)
            elif edit.edit == "zero":
                a, b = 0.0, torch.zeros_like(b)
            else:
                raise ValueError(f"steering tables write {', '.join(P.COMPILED_EDITS)}, not {edit.edit!r}")
        self.scales[table, slot].fill_(a)
        self.vectors[table, slot].copy_(b)


class UnitTables(torch.nn.Module):
    """Write tables on unit addresses' module inputs (o_proj's: heads, down_proj's:
    neurons), one (scales, vectors) pair per address, each as wide as its input: a
    buffer each, for the reason ReadBuffers' docstring gives (read_buffers.py)."""

    def __init__(self, sites: list[tuple[str, int, int]], slots: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device, patch_slots: int = 0, means: bool = False) -> None:
        """`sites`: (unit address, input width, one unit's width) each; `slots`,
        `patch_slots` and `means` as SteeringTables takes them (with means, a slot also
        says which columns its mean ablation takes: masks_t)."""
        super().__init__()
        _check_packable(slots, max_tokens)
        self.patch_slots = patch_slots
        self.means = means
        self.names = [path for path, _, _ in sites]  # unit addresses, in table order
        self.table_of = {path: t for t, path in enumerate(self.names)}
        self.unit_widths = [unit_width for _, _, unit_width in sites]
        self.num_slots = slots
        for t, (_, width, _) in enumerate(sites):
            self.register_buffer(f"scales_{t}", torch.ones(slots, width, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"vectors_{t}", torch.zeros(slots, width, dtype=dtype, device=device),
                                 persistent=False)
            if means:
                self.register_buffer(f"masks_{t}", torch.zeros(slots, width, dtype=dtype, device=device),
                                     persistent=False)
        self.register_buffer("slots", torch.zeros(max_tokens, len(sites), dtype=torch.long, device=device),
                             persistent=False)

    def tables(self, table: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"scales_{table}"), getattr(self, f"vectors_{table}")

    def operand_like(self) -> torch.Tensor:
        return self.tables(0)[1]

    def apply(self, table: int, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """In the graph, a forward pre-hook: the module's input through its rows' slots."""
        x = args[0]
        scales, vectors = self.tables(table)
        index = self.slots[: x.shape[0], table]
        if not self.means:
            return (x * scales.index_select(0, index) + vectors.index_select(0, index), *args[1:])
        slot = index & SLOT_MASK
        in_group, mean = _group_means(index, x)
        taken = getattr(self, f"masks_{table}").index_select(0, slot) > 0  # the mean's columns
        z = torch.where(in_group & taken, mean, x)
        return (z * scales.index_select(0, slot) + vectors.index_select(0, slot), *args[1:])

    def compose(self, table: int, slot: int, edits: list[P.WriteModule],
                vector: Callable[[P.WriteModule], torch.Tensor]) -> None:
        """As SteeringTables.compose, on the chosen units' columns only: a zero is (0, 0)
        there, a replace (0, v), an add (1, s*v) (v: [units or 1, head_dim] for heads,
        [units] for neurons, as the eager unit hooks take it). A patch / add_read's v is the
        source's row of every unit ([input width], the source read's own units): the
        chosen units' columns of it are taken."""
        scales, vectors = self.tables(table)
        unit_width = self.unit_widths[table]
        a = torch.ones_like(scales[0]).view(-1, unit_width)  # [units, unit width]
        b = torch.zeros_like(vectors[0]).view(-1, unit_width)
        mask = torch.zeros_like(a)
        for edit in edits:
            units = list(edit.units) if edit.units is not None else list(range(a.shape[0]))
            index = torch.tensor(units, dtype=torch.long, device=a.device)
            if edit.edit == "mean":  # (the graph takes the mean first: steering_slots.py checks the order)
                if not self.means:
                    raise ValueError("these unit tables take no mean ablations")
                mask[index] = 1
                continue
            if edit.edit == "zero":
                a[index], b[index] = 0, 0
                continue
            if edit.edit in ("patch", "add_read"):
                v = vector(edit).to(b.dtype).view(-1, unit_width).index_select(0, index)
            elif edit.edit in ("add", "replace"):  # (dictionaries never read unit addresses)
                v = vector(edit).to(b.dtype).view(-1, unit_width).expand(len(units), unit_width)
            else:
                raise ValueError(f"unit tables write add / replace / zero / mean / patch / add_read, not {edit.edit!r}")
            if edit.edit in ("add", "add_read"):
                b[index] = b[index] + v
            else:  # replace / patch
                a[index], b[index] = 0, v
        scales[slot].copy_(a.reshape(-1))
        vectors[slot].copy_(b.reshape(-1))
        if self.means:
            getattr(self, f"masks_{table}")[slot].copy_(mask.reshape(-1))


class ClampRows(NamedTuple):
    """What a clamp of some SAE features to `value` needs in a table's columns, float32 on
    the device, a row per feature (worker/dictionaries.py makes them): its encoder column,
    its bias (b_dec folded in where the SAE subtracts it), its activation threshold (0 for
    ReLU) and its decoder row. `keys`: each feature's column key (the dictionary's name and
    generation, the feature, the value)."""

    encoders: torch.Tensor
    biases: torch.Tensor
    thresholds: torch.Tensor
    decoders: torch.Tensor
    value: float
    keys: tuple[tuple[str, int, int, float], ...]


# A row's entry in a table's index (tables with means): its slot in the low bits, then its
# mean group's first flat row, then that group's last row + 1 (0: the row is in no group).
PACK_BITS = 21
SLOT_MASK = (1 << PACK_BITS) - 1


def pack(slot: int, first: int = 0, last: int = -1) -> int:
    """A row's index entry: `slot`, and the rows first..last of its mean group (none: -1)."""
    return slot | first << PACK_BITS | (last + 1) << (2 * PACK_BITS)


def _check_packable(slots: int, max_tokens: int) -> None:
    if slots > SLOT_MASK or max_tokens > SLOT_MASK:
        raise ValueError(f"tables of {slots} slots for {max_tokens}-row passes: at most {SLOT_MASK} each")


def _group_means(index: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In the graph: whether each row is in a mean group ([rows, 1]), and its group's mean
    ([rows, width], x's dtype; anything for the others). One running sum over the pass's
    rows of the groups' members: a group's sum is the difference of it at its ends (fp32)."""
    first = (index >> PACK_BITS) & SLOT_MASK
    end = index >> (2 * PACK_BITS)  # last + 1; 0: no group
    member = (end > 0).unsqueeze(1)
    running = torch.cumsum(torch.where(member, x.float(), 0.0), 0)
    counts = torch.cumsum(member.float(), 0)
    last = (end - 1).clamp_min(0)
    before = (first - 1).clamp_min(0)
    has_before = (first > 0).unsqueeze(1)
    total = running.index_select(0, last) - torch.where(has_before, running.index_select(0, before), 0.0)
    count = counts.index_select(0, last) - torch.where(has_before, counts.index_select(0, before), 0.0)
    return member, (total / count.clamp_min(1.0)).to(x.dtype)


def _with_means(index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    member, mean = _group_means(index, x)
    return torch.where(member, mean, x)


@dataclasses.dataclass(frozen=True)
class SlotCounts:
    """How a table's slots are spent, from the sequences the scheduler holds (max_num_seqs):
    slot 0; two shared slots per sequence (running, or preempted and waiting with its
    slots kept; a request uses more than one only for writes that differ between its rows
    in one pass); and patch slots, held for one forward pass each: a pass's patched rows
    at one table (a row of a source's values each), PATCH_ROWS_PER_SEQ per sequence."""

    seqs: int

    @property
    def shared(self) -> int:
        return 2 * self.seqs

    @property
    def patch(self) -> int:
        return PATCH_ROWS_PER_SEQ * self.seqs

    @property
    def total(self) -> int:
        return 1 + self.shared + self.patch


# Patched rows one forward pass may write at one table, per sequence the scheduler holds (a
# patching sweep's targets patch a position each; a slot spans every layer of its table, so
# each costs the tables' width times their layers): a pass that needs more fails the traces
# whose rows did not fit, saying so (SteeringSlots._patch_slot).
PATCH_ROWS_PER_SEQ = 1


def _slots(vllm_config: Any) -> SlotCounts:
    return SlotCounts(int(vllm_config.scheduler_config.max_num_seqs))


def _means(vllm_config: Any) -> bool:
    return bool((vllm_config.additional_config or {}).get(MEANS))


def attach(model: torch.nn.Module, vllm_config: Any) -> SteeringTables | None:
    """Register the tables on `model`'s decoder layers, all or those the config lists
    (before its first forward pass compiles it); None when it lists none."""
    listed = layers_of(vllm_config.additional_config)
    if listed is None:
        return None
    inner, layers = hooked_layers(model, listed, "--compiled-steering")
    clamped = layers_of(vllm_config.additional_config, CLAMP_LAYERS)
    clamp_layers = hooked_layers(model, clamped, "--compiled-dictionary-clamps")[1] if clamped is not None else []
    if missing := sorted(set(clamp_layers) - set(layers)):
        raise ValueError(f"--compiled-dictionary-clamps lists layers {missing} without --compiled-steering tables")
    tables = _stream_tables(model, vllm_config, [f"layers.{layer}" for layer in layers],
                            [f"layers.{layer}" for layer in clamp_layers])
    inner.tracewire_steering = tables
    hook_layers(inner, layers, tables.apply)
    return tables


def attach_modules(model: torch.nn.Module, vllm_config: Any) -> SteeringTables | None:
    """Register tables on the embeddings, the final norm, and the attention and MLP outputs
    of the layers the config lists (MODULE_LAYERS); None when it lists none."""
    listed = layers_of(vllm_config.additional_config, MODULE_LAYERS)
    if listed is None:
        return None
    inner, layers = hooked_layers(model, listed, "--compiled-module-steering")
    sites = module_sites(inner, layers)
    tables = _stream_tables(model, vllm_config, list(sites))
    inner.tracewire_module_steering = tables
    for table, module in enumerate(sites.values()):
        module.register_forward_hook(lambda module, args, output, table=table: tables.apply(table, output))
    return tables


def _stream_tables(model: torch.nn.Module, vllm_config: Any, sites: list[str],
                   clamp_sites: list[str] | None = None) -> SteeringTables:
    weight = next(model.parameters())
    counts = _slots(vllm_config)
    return SteeringTables(sites, slots=counts.total, max_tokens=max_tokens(vllm_config),
                          hidden=int(vllm_config.model_config.get_hidden_size()),
                          dtype=weight.dtype, device=weight.device, patch_slots=counts.patch,
                          means=_means(vllm_config), clamp_sites=clamp_sites)


def find(model: Any) -> SteeringTables | None:
    return getattr(getattr(model, "model", None), "tracewire_steering", None)


def find_modules(model: Any) -> SteeringTables | None:
    return getattr(getattr(model, "model", None), "tracewire_module_steering", None)


def attach_units(model: torch.nn.Module, vllm_config: Any) -> UnitTables | None:
    """Register unit write tables on the heads and neurons of the layers the config
    lists (before the first forward pass compiles the model); None when it lists none.
    Before the read buffers' pre-hooks (read_buffers.attach): a read sees the write."""
    listed = layers_of(vllm_config.additional_config, UNIT_LAYERS)
    if listed is None:
        return None
    inner, layers = hooked_layers(model, listed, "--compiled-unit-steering")
    inputs = read_buffers.unit_inputs(inner, layers)
    weight = next(model.parameters())
    counts = _slots(vllm_config)
    tables = UnitTables([(path, unit.width, unit.unit_width) for path, (_, unit) in inputs.items()],
                        counts.total, max_tokens(vllm_config), weight.dtype, weight.device, counts.patch,
                        _means(vllm_config))
    inner.tracewire_unit_steering = tables
    for table, (module, _) in enumerate(inputs.values()):
        module.register_forward_pre_hook(lambda module, args, table=table: tables.apply(table, args))
    return tables


def find_units(model: Any) -> UnitTables | None:
    return getattr(getattr(model, "model", None), "tracewire_unit_steering", None)


@register_model_loader(LOAD_FORMAT)
class SteerableLoader(BaseModelLoader):
    """Loads with the configured format, then attaches the steering tables and the read
    buffers (read_buffers.py) the config asks for: the tables' hooks first, so that a
    read sees its layer's writes."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        self.inner = get_model_loader(dataclasses.replace(
            load_config, load_format=extra.get(INNER_FORMAT, "auto"),
            model_loader_extra_config=extra.get(INNER_EXTRA) or {},
        ))

    def download_model(self, model_config: Any) -> None:
        self.inner.download_model(model_config)

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        self.inner.load_weights(model, model_config)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> torch.nn.Module:
        model = self.inner.load_model(vllm_config, model_config, prefix=prefix)
        defaulted = bool((vllm_config.additional_config or {}).get(DEFAULTED))
        for what, attach_one in (("layer writes", attach), ("head and neuron writes", attach_units),
                                 ("module writes", attach_modules),
                                 ("reads", lambda m, c: read_buffers.attach(m, c, max_tokens(c)))):
            try:
                attach_one(model, vllm_config)
            except RuntimeError as e:  # each attach fails before it registers anything
                if not defaulted:
                    raise
                log.warning("tracewire: no compiled %s on this model (%s); the engine serves the rest", what, e)
        return model


def attached(model: Any) -> dict[str, list[Any]]:
    """The decoder layers each kind of graph hook is on in `model` (its config key ->
    layers, ascending; module paths for the module kinds): what the frontend's compiler
    serves, as this worker has it."""
    tables, units, reads = find(model), find_units(model), read_buffers.find(model)
    modules = find_modules(model)
    unit_reads = sorted({_layer_of(path) for path in reads.units}) if reads is not None else []
    return {
        LAYERS: sorted(tables.layers) if tables is not None else [],
        UNIT_LAYERS: sorted({_layer_of(path) for path in units.names}) if units is not None else [],
        read_buffers.LAYERS: sorted(reads.layers) if reads is not None else [],
        read_buffers.UNIT_LAYERS: unit_reads,
        read_buffers.PATTERN_LAYERS: sorted(reads.attention) if reads is not None else [],
        # (module sites: their paths, the embeddings' and final norm's among them)
        MODULE_LAYERS: sorted(modules.sites) if modules is not None else [],
        CLAMP_LAYERS: sorted(P.layer_number(tables.sites[t]) for t in tables.clamp_of) if tables is not None else [],
        # (mean ablation: the kinds of write table that take it)
        MEANS: [key for key, t in ((LAYERS, tables), (UNIT_LAYERS, units), (MODULE_LAYERS, modules))
                if t is not None and t.means],
        read_buffers.MODULE_LAYERS: sorted(reads.modules) if reads is not None else [],
    }


def _layer_of(unit_address: str) -> int:
    return int(unit_address.split(".")[1])  # layers.L.self_attn.heads, layers.L.mlp.act


# -- the host side: filling the tables for each forward pass ---------------------


# A slot's contents: its composed edits, (edit, vector bytes, scale, units, dictionary edit)
# each, in plan order (a dictionary steer's vector is its dictionary's, by name and generation).
SlotKey = tuple[tuple[str, bytes, float, tuple[int, ...] | None, P.DictionaryEdit | None], ...]


class SlotPlanner:
    """Keeps the tables' contents in step with each forward pass's writes.

    A slot holds composed writes at one layer, and every request whose writes there are
    the same (the same vectors and scales, in the same order) shares it: a hundred
    requests steering with one vector hold one slot, and a request that brings a vector
    already in the table costs a dict lookup. A slot is written once and freed when the
    last request using it ends, so steady steering costs one small host-to-device copy
    of the slot indices per forward pass. The indices go through a ring of pinned
    buffers: the copy of one pass may still be pending on the device when the host
    prepares the next.
    """

    RING = 3

    def __init__(self, tables: SteeringTables | UnitTables) -> None:
        self.tables = tables
        self.table_of = tables.table_of  # module path -> table
        max_tokens, num_tables = tables.slots.shape
        pin = tables.slots.device.type == "cuda"
        self.host = [torch.zeros(max_tokens, num_tables, dtype=torch.long, pin_memory=pin) for _ in range(self.RING)]
        self.events: list[Any] = [None] * self.RING
        self.turn = 0
        self.host_rows = [0] * self.RING  # rows of each host buffer that may be nonzero
        self.device_rows = 0  # rows of tables.slots that may be nonzero
        self.assigned: list[dict[SlotKey, int]] = [{} for _ in range(num_tables)]
        self.users: list[dict[int, int]] = [{} for _ in range(num_tables)]  # slot -> requests using it
        shared = tables.num_slots - tables.patch_slots  # slot 0 and the shared ones
        self.free: list[list[int]] = [list(range(shared - 1, 0, -1)) for _ in range(num_tables)]
        self.owned: dict[str, set[tuple[int, SlotKey]]] = {}
        # Patch slots: handed out for one pass, all free again at the next (begin_pass).
        self.patch_range = range(shared, tables.num_slots)
        self.patch_used = [0] * num_tables
        # Clamp columns (SteeringTables with clamp_of): per clamp table, key -> column, the
        # slots using each, the free ones; and each slot's columns.
        clamp_of = getattr(tables, "clamp_of", {})
        self.clamp_of = clamp_of
        self.column_of: list[dict[tuple[str, int, int, float], int]] = [{} for _ in clamp_of]
        self.column_users: list[dict[int, int]] = [{} for _ in clamp_of]
        self.free_columns: list[list[int]] = [list(range(CLAMP_COLUMNS - 1, -1, -1)) for _ in clamp_of]
        self.slot_columns: dict[tuple[int, int], list[int]] = {}

    def begin_pass(self) -> None:
        """A new forward pass: the last one's patch slots are free (the device runs the
        passes in order, so the next pass's writes into them come after the last read)."""
        self.patch_used = [0] * len(self.patch_used)

    def patch_slot(self, table: int, edits: list[P.WriteModule],
                   vector: Callable[[P.WriteModule], torch.Tensor]) -> int | None:
        """A slot for one row whose writes take a patch source's row (a vector of its own,
        so never shared), for this pass only; None when the pass has used them all."""
        if any(edit.edit == "clamp" for edit in edits):
            raise RuntimeError("a patched row takes no dictionary clamp on a compiled engine (--enforce-eager)")
        used = self.patch_used[table]
        if used == len(self.patch_range):
            return None
        slot = self.patch_range[used]
        self.tables.compose(table, slot, edits, vector)  # (may raise: a source's row missing)
        self.patch_used[table] = used + 1  # (only a composed slot is taken)
        return slot

    def slot(self, table: int, owner: str, edits: list[P.WriteModule],
             vector: Callable[[P.WriteModule], torch.Tensor],
             clamp: Callable[[P.WriteModule], ClampRows] | None = None) -> int | None:
        """The slot of `owner`'s `edits` (composed in plan order) at this table; None when
        every slot is taken. `vector(edit)`: the edit's vector on the device (scaled, for
        adds), asked for only when the table does not hold these edits yet; `clamp(edit)`
        a clamp's rows, likewise (its columns: RuntimeError when the table has too few)."""
        key: SlotKey = tuple((e.edit, e.vector, e.scale, e.units, e.dictionary) for e in edits)
        held = self.owned.setdefault(owner, set())
        found = self.assigned[table].get(key)
        if found is not None:
            if (table, key) not in held:
                held.add((table, key))
                self.users[table][found] += 1
            return found
        if not self.free[table]:
            return None
        clamps = [clamp(e) for e in edits if e.edit == "clamp"] if clamp is not None else []
        columns = self._take_columns(table, clamps[0]) if clamps else None  # (before the slot: may raise)
        slot = self.assigned[table][key] = self.free[table].pop()
        self.users[table][slot] = 1
        held.add((table, key))
        if columns is not None:
            self._point_at(table, slot, columns)
        self.tables.compose(table, slot, edits, vector)
        return slot

    def _take_columns(self, table: int, rows: ClampRows) -> list[int]:
        """Columns of this table holding `rows`' features: the ones that hold a key already,
        new ones filled for the rest (each counted as used once more)."""
        k = self.clamp_of.get(table)
        if k is None:
            raise RuntimeError(f"{self.tables.names[table]} has no clamp columns (--compiled-dictionary-clamps)")
        known, free = self.column_of[k], self.free_columns[k]
        needed = [key for key in rows.keys if key not in known]
        if len(needed) > len(free):
            raise RuntimeError(f"more than {CLAMP_COLUMNS} clamped features at {self.tables.names[table]} at once")
        for feature, key in enumerate(rows.keys):
            if key not in known:
                known[key] = column = free.pop()
                self.tables.clamp_rows(k, column, rows, feature)  # type: ignore[union-attr]
        columns = [known[key] for key in rows.keys]
        for column in columns:
            self.column_users[k][column] = self.column_users[k].get(column, 0) + 1
        return columns

    def _point_at(self, table: int, slot: int, columns: list[int]) -> None:
        k = self.clamp_of[table]
        self.slot_columns[(table, slot)] = columns
        entry = torch.full((CLAMP_FEATURES,), CLAMP_COLUMNS, dtype=torch.long)
        entry[: len(columns)] = torch.tensor(columns, dtype=torch.long)
        self.tables.clamp_columns[k, slot].copy_(entry)  # type: ignore[union-attr]

    def _give_back_columns(self, table: int, slot: int) -> None:
        columns = self.slot_columns.pop((table, slot), None)
        if columns is None:
            return
        k = self.clamp_of[table]
        self.tables.clamp_columns[k, slot].fill_(CLAMP_COLUMNS)  # type: ignore[union-attr]
        users = self.column_users[k]
        for column in columns:
            users[column] -= 1
            if not users[column]:
                del users[column]
                self.column_of[k] = {key: c for key, c in self.column_of[k].items() if c != column}
                self.free_columns[k].append(column)

    def release(self, owner: str) -> None:
        """The request ended: the slots nobody else uses are free again."""
        for table, key in self.owned.pop(owner, ()):
            slot = self.assigned[table][key]
            self.users[table][slot] -= 1
            if not self.users[table][slot]:
                del self.users[table][slot], self.assigned[table][key]
                self._give_back_columns(table, slot)
                self.free[table].append(slot)

    def fill(self, rows: list[int], tables: list[int], slots: list[int]) -> None:
        """Point these flat token rows at these slots for the next forward pass (every
        other row at slot 0)."""
        if not rows and self.device_rows == 0:
            return  # nothing written now or in the last pass: every row is on slot 0
        self.turn = (self.turn + 1) % self.RING
        event = self.events[self.turn]
        if event is not None:
            event.synchronize()  # its copy was queued RING passes ago: long done
        host = self.host[self.turn]
        view = host.numpy()
        view[: self.host_rows[self.turn]] = 0
        view[rows, tables] = slots
        used = self.host_rows[self.turn] = max(rows, default=-1) + 1
        count = max(used, self.device_rows)  # also clears what the last pass left
        self.tables.slots[:count].copy_(host[:count], non_blocking=True)
        self.device_rows = used
        if host.is_pinned():
            self.events[self.turn] = torch.cuda.Event(blocking=True)  # a wait sleeps, never spins
            self.events[self.turn].record()
