"""One invoke's interventions -> plan ops, validated: actions, step selectors, positions,
conditions. Kept apart from the trace-level compiler (compiler.py: invokes, sampling, sequences,
the read-bytes budget) because it knows the intervention messages and nothing of the request
around them; every error names the intervention's field path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
from tracewire.v1 import intervention_pb2 as ipb

from ..shared import plan as P
from ..shared import textmatch
from ..shared.dictionary_spec import DictionaryInfo
from ..shared.limits import CLAMP_FEATURES, ModelLimits
from .errors import FailedPrecondition, InvalidArgument
from .tensors import float_vector
from .units import read_units, require_units, unit_operand, write_units

# The server's dictionaries by name (frontend/dictionaries.py's registry; None: unknown).
DictionaryLookup = Callable[[str], DictionaryInfo | None]

# With --enable-fault-injection (tests only), an intervention named
# "__fault__:<message>" raises <message> inside the worker hook at its steps.
FAULT_PREFIX = "__fault__:"

_STAGES: dict[int, P.LogitsStage] = {
    ipb.LOGITS_STAGE_UNSPECIFIED: "processed",
    ipb.LOGITS_STAGE_RAW: "raw",
    ipb.LOGITS_STAGE_BEFORE_WRITES: "before_writes",
    ipb.LOGITS_STAGE_PROCESSED: "processed",
}

_COMPARISONS = {
    ipb.COMPARISON_GREATER: ">",
    ipb.COMPARISON_GREATER_EQUAL: ">=",
    ipb.COMPARISON_LESS: "<",
    ipb.COMPARISON_LESS_EQUAL: "<=",
}


class InterventionCompiler:
    def __init__(self, limits: ModelLimits, fault_injection: bool,
                 dictionaries: DictionaryLookup = lambda name: None) -> None:
        self.limits = limits
        self.dictionaries = dictionaries  # the server's registry (dictionaries.py): name -> info
        self.fault_injection = fault_injection
        self.prompt_len = 0  # of the invoke being compiled
        self.max_tokens = 0  # of the invoke being compiled (attention patterns' key caches)

    def ops(self, interventions: Any, field: str, prompt_len: int, max_tokens: int = 0) -> tuple[P.Op, ...]:
        """An invoke's interventions -> its plan's ops (`prompt_len` bounds prompt positions;
        `max_tokens` the positions an attention pattern's keys come from)."""
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        ops: list[P.Op] = []
        names: dict[str, int] = {}
        for j, iv in enumerate(interventions):
            f = f"{field}[{j}]"
            action = self.action(iv, f)
            name = iv.name
            if self.fault_injection and name.startswith(FAULT_PREFIX):
                action = P.InjectFault(name.removeprefix(FAULT_PREFIX))
            if isinstance(action, P.READS) and not name:
                raise InvalidArgument(f"{f}.name", "reads need a name to return values under")
            if name:
                if not name.isprintable():
                    raise InvalidArgument(f"{f}.name", "must not contain control characters")
                if name in names:
                    raise InvalidArgument(
                        f"{f}.name", f"duplicate name {name!r} (also {field}[{names[name]}])"
                    )
                names[name] = j
            condition = self.condition(iv.condition, f"{f}.condition") if iv.HasField(
                "condition") else None
            if isinstance(action, P.WriteModule) and condition is not None and not P.known_before_forward(condition):
                raise InvalidArgument(
                    f"{f}.condition",
                    "a module write acts inside the forward pass, before this step's logits exist: "
                    "only text conditions (text_contains, text_matches) and dictionary values (the previous "
                    "step's) can gate it",
                )
            if isinstance(action, P.WRITES) and P.uses_drawn_token(condition):
                raise InvalidArgument(
                    f"{f}.condition",
                    "a write acts before the draw, so its condition cannot use the drawn token "
                    "(sampled_in, token_probability without token_id)",
                )
            steps = self.steps(iv.steps, f"{f}.steps") if iv.HasField("steps") else P.StepSet()
            self.require_stage(action, condition, f"{f}.{iv.WhichOneof('action')}", f"{f}.condition")
            ops.append(P.Op(name or f"#{j}", steps, condition, action))
        # Dictionary conditions' values: reads of their own, computed and never returned.
        return tuple(ops) + P.condition_reads(tuple(ops))

    def steps(self, sel: ipb.StepSelector, field: str) -> P.StepSet:
        kind = sel.WhichOneof("kind")
        if kind == "range":
            start = sel.range.start
            stop = sel.range.stop if sel.range.HasField("stop") else None
            if start < 0:
                raise InvalidArgument(f"{field}.range.start", f"must be >= 0, got {start}")
            if stop is not None and stop < start:
                raise InvalidArgument(
                    f"{field}.range.stop", f"must be >= start ({start}), got {stop}"
                )
            return P.StepSet(start=start, stop=stop)
        if kind == "list":
            for k, s in enumerate(sel.list.steps):
                if s < 0:
                    raise InvalidArgument(f"{field}.list.steps[{k}]", f"must be >= 0, got {s}")
            if not sel.list.steps:
                raise InvalidArgument(f"{field}.list.steps", "must not be empty")
            return P.StepSet(steps=frozenset(sel.list.steps))
        return P.StepSet()  # all (or unset)

    def token(self, token: int, field: str) -> int:
        if not 0 <= token < self.limits.vocab_size:
            raise InvalidArgument(
                field, f"token id {token} is outside the vocabulary [0, {self.limits.vocab_size})"
            )
        return token

    def tokens(self, ids: Any, field: str) -> tuple[int, ...]:
        if not len(ids):
            raise InvalidArgument(field, "must not be empty")
        return tuple(self.token(t, f"{field}[{k}]") for k, t in enumerate(ids))

    def top_k(self, k: int, field: str, allow_zero: bool = False) -> int:
        low = 0 if allow_zero else 1
        if not low <= k <= self.limits.vocab_size:
            raise InvalidArgument(
                field, f"must be in [{low}, {self.limits.vocab_size}] (the vocabulary), got {k}"
            )
        return k

    def action(self, iv: ipb.Intervention, field: str) -> P.Action:
        kind = iv.WhichOneof("action")
        if kind is None:
            raise InvalidArgument(f"{field}.action", "set one action (a read, a write or stop)")
        f = f"{field}.{kind}"
        if kind == "read_logits":
            r = iv.read_logits
            stage = _STAGES[r.stage]  # (bounds.py refused values the proto does not define)
            which = r.WhichOneof("selection")
            if which == "top_k":
                return P.ReadLogits(stage, top_k=self.top_k(r.top_k.k, f"{f}.top_k.k"))
            if which == "token_ids":
                return P.ReadLogits(
                    stage, token_ids=self.tokens(r.token_ids.token_ids, f"{f}.token_ids.token_ids")
                )
            return P.ReadLogits(stage)
        if kind == "read_sample":
            return P.ReadSample()
        if kind == "read_logprobs":
            return P.ReadLogprobs(self.top_k(iv.read_logprobs.top_k, f"{f}.top_k", True))
        if kind == "force_sample":
            return P.ForceSample(self.token(iv.force_sample.token_id, f"{f}.token_id"))
        if kind == "write_logits":
            return self.write_logits(iv.write_logits, f)
        if kind == "stop":
            return P.Stop()
        if kind == "read_module":
            return self.read_module(iv.read_module, f)
        if kind == "read_logit_lens":
            return self.read_logit_lens(iv.read_logit_lens, f)
        if kind == "write_module":
            return self.write_module(iv.write_module, f)
        if kind == "read_attention_pattern":
            return self.read_attention_pattern(iv.read_attention_pattern, f)
        if kind == "read_dictionary":
            return self.read_dictionary(iv.read_dictionary, f)
        if kind == "write_dictionary":
            return self.write_dictionary(iv.write_dictionary, f)
        raise InvalidArgument(f"{field}.action", f"unknown action {kind!r}")

    def require_eager(self, field: str) -> None:
        if not self.limits.module_interventions:
            raise FailedPrecondition(
                f"{field}: module hooks do not run inside compiled / CUDA-graph steps; this server "
                "runs its engine compiled. Start it with --enforce-eager to serve module interventions"
                + ("" if self.limits.steerable_layers else
                   " (or --compiled-steering for add / replace / zero writes on decoder layers)")
                + ("" if self.limits.readable_layers else
                   " (or --compiled-reads for reads of decoder layers)")
                + ("" if self.limits.unit_readable_layers else
                   " (or --compiled-unit-reads for reads of attention heads and MLP neurons)")
                + ("" if self.limits.unit_steerable_layers else
                   " (or --compiled-unit-steering for add / replace / zero writes of them)")
                + ("" if self.limits.pattern_readable_layers else
                   " (or --compiled-pattern-reads for attention patterns)")
                + ("" if self.limits.readable_modules else
                   " (or --compiled-module-reads for reads of embed_tokens, attention and MLP outputs, norm)")
                + ("" if self.limits.steerable_modules else
                   " (or --compiled-module-steering for writes of them)")
            )

    def require_reads(self, field: str) -> None:
        """Module reads at all: an eager engine, or a compiled one with read buffers."""
        limits = self.limits
        if not limits.readable_layers and not limits.unit_readable_layers and not limits.readable_modules:
            self.require_eager(field)

    def require_readable(self, module: str, field: str) -> None:
        """Eager engines read any module; compiled ones with --compiled-reads the decoder
        layers their graph keeps (`field` names the module or layer)."""
        if self.limits.module_interventions:
            return
        self.require_reads(field)
        if P.unit_kind(module):
            units = self.limits.unit_readable_layers
            if P.layer_number(module) not in units:
                kept = _kept_on(units)
                raise FailedPrecondition(
                    f"{field}: this server keeps attention heads and MLP neurons in read buffers {kept}, "
                    f"not {module!r} (--compiled-unit-reads LAYERS, or --enforce-eager)"
                )
            return
        readable = self.limits.readable_layers
        if not P.is_decoder_layer(module):
            if module not in self.limits.readable_modules:
                raise FailedPrecondition(
                    f"{field}: this server keeps module outputs in read buffers "
                    f"{_kept_at(self.limits.readable_modules)}, not {module!r} (--compiled-module-reads LAYERS, "
                    "or --enforce-eager)"
                )
            return
        if P.layer_number(module) not in readable:
            kept = _kept_on(readable)
            raise FailedPrecondition(
                f"{field}: this server keeps read buffers of residual streams {kept}, not on "
                f"{module!r} (--compiled-reads LAYERS)"
            )

    def stage(self, action: P.Action) -> int:
        """The pipeline stage an op runs on: the one holding its module (the last for ops
        on the logits and the sample; 0 without stages)."""
        if isinstance(action, P.HIDDEN_READS):
            return self.limits.stage_of(action.module_reads("")[0][1])
        if isinstance(action, P.WriteModule):
            return self.limits.stage_of(action.module)
        return self.limits.last_stage

    def require_stage(self, action: P.Action, condition: P.Condition | None, field: str,
                      condition_field: str) -> None:
        """Under pipeline parallelism a module intervention runs on the stage holding its
        module; what needs the last stage there is refused: the logit lens (lm_head), a
        condition (decided where the sample is drawn, and dictionary conditions read their
        module there), a patch operand (kept where its read ran), a pattern over layers of
        several stages."""
        limits = self.limits
        if limits.pipeline_parallel_size <= 1:
            return
        if isinstance(action, P.ReadLogitLens):
            for layer in action.layers:
                if why := limits.pipeline_stage_refusal(f"layers.{layer}", "the logit lens (lm_head)"):
                    raise FailedPrecondition(f"{field}.layers: {why}")
        if isinstance(action, P.ReadAttentionPattern) and len({limits.stage_of(f"layers.{layer}")
                                                                 for layer in action.layers}) > 1:
            raise FailedPrecondition(f"{field}.layers: an attention-pattern read's layers must be on one "
                                     f"pipeline stage (stages start at layers {list(limits.stage_first_layers)})")
        stage = self.stage(action)
        if stage != limits.last_stage:
            module = action.module if isinstance(action, P.WriteModule) else action.module_reads("")[0][1]
            if condition is not None:
                raise FailedPrecondition(
                    f"{condition_field}: conditions are decided on the last pipeline stage (pipeline_parallel_size "
                    f"{limits.pipeline_parallel_size}), and {module!r} is on stage {stage}: unconditioned only")
            if isinstance(action, P.WriteModule) and action.ref is not None:
                raise FailedPrecondition(
                    f"{field}: patch operands are kept on the last pipeline stage only, and {module!r} is on "
                    f"stage {stage}")
        for leaf in P.dictionary_values(condition):
            name = leaf.dictionary.name
            if why := limits.pipeline_stage_refusal(leaf.dictionary.module, f"dictionary {name!r}'s condition"):
                raise FailedPrecondition(f"{condition_field}: {why}")

    def require_writable(self, module: str, edit: str | None, field: str) -> None:
        """Eager engines write any module; compiled ones with --compiled-steering only
        what their graph tables express."""
        if self.limits.module_interventions:
            return
        limits = self.limits
        if not limits.steerable_layers and not limits.unit_steerable_layers and not limits.steerable_modules:
            self.require_eager(field)
        if P.unit_kind(module):
            units = self.limits.unit_steerable_layers
            if P.layer_number(module) not in units:
                kept = _kept_on(units)
                raise FailedPrecondition(
                    f"{field}.module: this server has write tables for attention heads and MLP neurons {kept}, "
                    f"not {module!r} (--compiled-unit-steering LAYERS, or --enforce-eager)"
                )
        elif not P.is_decoder_layer(module):
            if module not in self.limits.steerable_modules:
                raise FailedPrecondition(
                    f"{field}.module: this server has write tables for module outputs "
                    f"{_kept_at(self.limits.steerable_modules)}, not {module!r} (--compiled-module-steering "
                    "LAYERS, or --enforce-eager)"
                )
        elif P.layer_number(module) not in self.limits.steerable_layers:
            steerable = self.limits.steerable_layers
            kept = _kept_on(steerable)
            raise FailedPrecondition(
                f"{field}.module: this server has steering tables {kept}, not on "
                f"{module!r} (--compiled-steering LAYERS)"
            )
        if edit not in P.COMPILED_EDITS:
            raise FailedPrecondition(
                f"{field}.op: this server's compiled engine serves add, replace, zero, mean, patch and add_read "
                f"writes and dictionary steers, not {edit!r}; start it with --enforce-eager for it"
            )
        if edit == "mean" and not self.limits.compiled_means:
            raise FailedPrecondition(
                f"{field}.op: this server's compiled graph takes no mean ablations (--compiled-mean-ablation, "
                "or --enforce-eager)"
            )

    def read_logit_lens(self, r: ipb.ReadLogitLens, field: str) -> P.Action:
        num_layers = self.limits.num_layers
        if not r.layers:
            raise InvalidArgument(f"{field}.layers", "name at least one layer")
        layers = []
        for k, layer in enumerate(r.layers):
            if not -num_layers <= layer < num_layers:
                raise InvalidArgument(f"{field}.layers[{k}]", f"layer {layer} is outside [0, {num_layers})")
            layers.append(layer % num_layers)
        self.require_reads(field)
        for k, layer in enumerate(layers):
            self.require_readable(f"layers.{layer}", f"{field}.layers[{k}]")
        positions = self.positions(r.positions, f"{field}.positions") if r.HasField("positions") else P.Positions()
        top_k = self.top_k(r.top_k, f"{field}.top_k", allow_zero=True)
        return P.ReadLogitLens(tuple(layers), positions, top_k)

    def read_attention_pattern(self, r: ipb.ReadAttentionPattern, field: str) -> P.Action:
        limits = self.limits
        layers = self.distinct_layers(r.layers, f"{field}.layers")
        heads_count, kv_count = limits.num_attention_heads, limits.num_key_value_heads
        seen: dict[int, int] = {}  # head -> its index in the field
        for k, head in enumerate(r.heads):
            if not 0 <= head < heads_count:
                raise InvalidArgument(f"{field}.heads[{k}]", f"head {head} is outside [0, {heads_count}) "
                                      "(the model's query heads)")
            if head in seen:
                raise InvalidArgument(f"{field}.heads[{k}]", f"duplicate head {head} (also heads[{seen[head]}])")
            seen[head] = k
        heads = list(seen) or list(range(heads_count))
        if not 0 <= r.top_k <= limits.max_model_len:
            raise InvalidArgument(f"{field}.top_k", f"must be in [0, {limits.max_model_len}] (the model's "
                                  f"context; 0 returns full rows), got {r.top_k}")
        positions = self.positions(r.positions, f"{field}.positions") if r.HasField("positions") else P.Positions()
        if why := limits.attention_patterns_refusal():
            raise FailedPrecondition(f"{field}: {why}")
        if not limits.module_interventions:  # compiled: the layers whose q / k the graph keeps
            kept = limits.pattern_readable_layers
            for k, layer in enumerate(layers):
                if layer not in kept:
                    raise FailedPrecondition(
                        f"{field}.layers[{k}]: this server keeps attention queries and keys in read buffers "
                        f"{_kept_on(kept)}, not on layer {layer} (--compiled-pattern-reads LAYERS, or --enforce-eager)")
        group = heads_count // kv_count  # query heads per KV head
        return P.ReadAttentionPattern(
            tuple(layers), tuple(heads), positions, r.top_k,
            kv_heads=tuple(sorted({h // group for h in heads})),
            head_dim=limits.head_dim,
            max_len=self.prompt_len + self.max_tokens,
        )

    def distinct_layers(self, values: Any, field: str) -> list[int]:
        """Decoder layer indices (negative: from the end), at least one, none twice."""
        num_layers = self.limits.num_layers
        if not values:
            raise InvalidArgument(field, "name at least one layer")
        layers: list[int] = []
        for k, layer in enumerate(values):
            if not -num_layers <= layer < num_layers:
                raise InvalidArgument(f"{field}[{k}]", f"layer {layer} is outside [0, {num_layers})")
            if layer % num_layers in layers:
                raise InvalidArgument(f"{field}[{k}]", f"layer {layer} is named twice")
            layers.append(layer % num_layers)
        return layers

    def write_module(self, w: ipb.WriteModule, field: str) -> P.Action:
        self.module_path(w.module, f"{field}.module")
        require_units(self.limits, w.module, f"{field}.module")  # (before the engine's: TP refuses on any)
        self.require_writable(w.module, w.WhichOneof("op"), field)
        if P.unit_kind(w.module) or w.HasField("units"):
            return self.write_units(w, field)
        positions = self.positions(w.positions, f"{field}.positions") if w.HasField("positions") else P.Positions()
        scale = w.scale if w.HasField("scale") else 1.0
        if not math.isfinite(scale):
            raise InvalidArgument(f"{field}.scale", "must be finite")
        op = w.WhichOneof("op")
        if op in ("add", "replace"):
            vector = float_vector(getattr(w, op), self.limits.hidden_size, f"{field}.{op}")
            return P.WriteModule(w.module, positions, op, vector.astype("<f4").tobytes(), scale)
        if op in ("zero", "mean"):
            return P.WriteModule(w.module, positions, op)
        if op in ("patch", "add_read"):
            return self.read_ref_write(w, op, positions, scale, field)
        raise InvalidArgument(f"{field}.op", "set add, replace, zero, mean, patch or add_read")

    def read_ref_write(
        self, w: ipb.WriteModule, op: P.ModuleEdit, positions: P.Positions, scale: float, field: str
    ) -> P.Action:
        """A patch / add_read: what one write alone can check; the reference itself
        (the source invoke, its read, counts, steps, cycles) is resolved across the
        trace's invokes (patching.py)."""
        ref = getattr(w, op)
        f = f"{field}.{op}"
        if positions.kind == "all":
            raise InvalidArgument(f"{field}.positions", "a patch takes either prompt positions (at step 0) "
                                  "or the new token (at each step), not both: use two writes")
        if ref.invoke < 0:
            raise InvalidArgument(f"{f}.invoke", f"must be >= 0, got {ref.invoke}")
        if not ref.name:
            raise InvalidArgument(f"{f}.name", "name the source invoke's read_module")
        if positions.kind == "new_token" and ref.positions:
            raise InvalidArgument(f"{f}.positions", "a write at the new token takes the source's new-token "
                                  "row of the same step: leave positions unset")
        ref_op = P.ReadRef("", ref.invoke, ref.name, tuple(ref.positions))
        return P.WriteModule(w.module, positions, op, scale=scale if op == "add_read" else 1.0, ref=ref_op)

    def write_units(self, w: ipb.WriteModule, field: str) -> P.Action:
        """A write of attention heads / MLP neurons (units.py checks the units)."""
        units = write_units(self.limits, w, field)
        require_units(self.limits, w.module, f"{field}.module")
        positions = self.positions(w.positions, f"{field}.positions") if w.HasField("positions") else P.Positions()
        scale = w.scale if w.HasField("scale") else 1.0
        if not math.isfinite(scale):
            raise InvalidArgument(f"{field}.scale", "must be finite")
        op = w.WhichOneof("op")
        if op in ("add", "replace"):
            operand = unit_operand(self.limits, w, units, op, field)
            return P.WriteModule(w.module, positions, op, operand, scale, units=units)
        if op in ("zero", "mean"):
            return P.WriteModule(w.module, positions, op, units=units)
        if op in ("patch", "add_read"):  # the chosen units, from the source's same units
            return msgspec.structs.replace(self.read_ref_write(w, op, positions, scale, field), units=units)
        raise InvalidArgument(f"{field}.op", "set add, replace, zero, mean, patch or add_read")

    def module_path(self, path: str, field: str) -> None:
        if path not in self.limits.modules:
            known = ", ".join(sorted(self.limits.modules, key=P.module_order)[:8])
            raise InvalidArgument(field, f"unknown module {path!r}; GetModelInfo lists them ({known}, ...)")

    def read_module(self, r: ipb.ReadModule, field: str) -> P.Action:
        # What the request says is checked before what this server serves: an address that
        # does not exist is "unknown module" on every engine kind, never "start it eager".
        self.module_path(r.module, f"{field}.module")
        self.require_reads(field)
        self.require_readable(r.module, f"{field}.module")
        positions = self.positions(r.positions, f"{field}.positions") if r.HasField("positions") else P.Positions()
        units = read_units(self.limits, r, field)
        require_units(self.limits, r.module, f"{field}.module")
        return P.ReadModule(r.module, positions, mean=r.reduction == ipb.REDUCTION_MEAN, units=units)

    def positions(self, p: ipb.Positions, field: str) -> P.Positions:
        kind = p.WhichOneof("kind")
        n = self.prompt_len
        if kind == "prompt_range":
            stop = p.prompt_range.stop if p.prompt_range.HasField("stop") else None
            for name, value in (("start", p.prompt_range.start), ("stop", stop)):
                if value is not None and not -n <= value <= n:
                    raise InvalidArgument(
                        f"{field}.prompt_range.{name}", f"{value} is outside the prompt's {n} positions"
                    )
            selected = P.Positions("prompt_range", start=p.prompt_range.start, stop=stop)
            if not selected.prompt_positions(n):
                raise InvalidArgument(f"{field}.prompt_range", "selects no prompt position")
            return selected
        if kind == "prompt_list":
            if not p.prompt_list.positions:
                raise InvalidArgument(f"{field}.prompt_list.positions", "must not be empty")
            for k, value in enumerate(p.prompt_list.positions):
                if not -n <= value < n:
                    raise InvalidArgument(
                        f"{field}.prompt_list.positions[{k}]", f"{value} is outside the prompt's {n} positions"
                    )
            return P.Positions("prompt_list", items=tuple(p.prompt_list.positions))
        if kind == "all_prompt":
            return P.Positions("all_prompt")
        if kind == "all":
            return P.Positions("all")
        return P.Positions()

    def write_logits(self, w: ipb.WriteLogits, field: str) -> P.Action:
        op = w.WhichOneof("op")
        vocab = self.limits.vocab_size
        if op == "replace":
            values = float_vector(w.replace, vocab, f"{field}.replace")
            return P.ReplaceLogits(values.astype("<f4").tobytes())
        if op == "add":
            values = float_vector(w.add, vocab, f"{field}.add")
            return P.AddLogits(values.astype("<f4").tobytes())
        if op == "bias":
            if not w.bias.bias:
                raise InvalidArgument(f"{field}.bias.bias", "must not be empty")
            for token, value in w.bias.bias.items():
                self.token(token, f"{field}.bias.bias[{token}]")
                if not math.isfinite(value):
                    raise InvalidArgument(f"{field}.bias.bias[{token}]", "must be finite")
            return P.BiasLogits(dict(w.bias.bias))
        if op == "mask":
            return P.MaskLogits(self.tokens(w.mask.token_ids, f"{field}.mask.token_ids"))
        raise InvalidArgument(f"{field}.op", "set replace, add, bias or mask")

    def condition(self, c: ipb.Condition, field: str) -> P.Condition:
        kind = c.WhichOneof("kind")
        f = f"{field}.{kind}"
        if kind == "sampled_in":
            return P.SampledIn(frozenset(self.tokens(c.sampled_in.token_ids, f"{f}.token_ids")))
        if kind == "argmax_in":
            return P.ArgmaxIn(frozenset(self.tokens(c.argmax_in.token_ids, f"{f}.token_ids")))
        if kind == "text_contains":
            try:
                textmatch.check_needle(c.text_contains)
            except textmatch.PatternError as e:
                raise InvalidArgument(f, str(e)) from None
            return P.TextContains(c.text_contains)
        if kind == "text_matches":
            try:
                textmatch.compile_pattern(c.text_matches)
            except textmatch.PatternError as e:
                raise InvalidArgument(f, str(e)) from None
            return P.TextMatches(c.text_matches)
        if kind == "token_probability":
            tp = c.token_probability
            token = self.token(tp.token_id, f"{f}.token_id") if tp.HasField("token_id") else None
            cmp, value = self.threshold(tp.threshold, f"{f}.threshold")
            return P.TokenProbability(token, cmp, value)
        if kind == "entropy":
            cmp, value = self.threshold(c.entropy, f)
            return P.Entropy(cmp, value)
        if kind in ("all_of", "any_of"):
            group = getattr(c, kind).conditions
            if not group:
                raise InvalidArgument(f"{f}.conditions", "must not be empty")
            items = tuple(self.condition(x, f"{f}.conditions[{k}]") for k, x in enumerate(group))
            return P.AllOf(items) if kind == "all_of" else P.AnyOf(items)
        if kind == "not":
            return P.Not(self.condition(getattr(c, "not"), f))
        if kind == "dictionary_value":
            dv = c.dictionary_value
            info = self.dictionary(dv.dictionary, "", f)
            feature = self.feature(info, dv.feature, f"{f}.feature")
            cmp, value = self.threshold(dv.threshold, f"{f}.threshold")
            return P.DictionaryValue(dictionary_ref(info), feature, cmp, value)
        raise InvalidArgument(field, "set one condition kind")

    # -- dictionaries (probes, SAEs) ---------------------------------------------------

    def dictionary(self, name: str, module: str, field: str, reads: bool = True) -> DictionaryInfo:
        """The dictionary an intervention names, checked against the module it gave
        (`reads`: and that this server reads that module; writes check their own)."""
        if not name:
            raise InvalidArgument(f"{field}.dictionary", "name a dictionary (ListDictionaries lists them)")
        info = self.dictionaries(name)
        if info is None:
            raise InvalidArgument(f"{field}.dictionary", f"unknown dictionary {name!r}; ListDictionaries lists "
                                  "the server's")
        if module and module != info.module:
            raise InvalidArgument(f"{field}.module", f"dictionary {name!r} reads {info.module!r}, not {module!r}")
        self.require_reads(field)  # (computed from module outputs)
        if reads:
            self.require_readable(info.module, f"{field}.dictionary")
        return info

    def feature(self, info: DictionaryInfo, feature: int, field: str) -> int:
        what = "output" if info.kind == "probe" else "feature"
        if not 0 <= feature < info.size:
            raise InvalidArgument(field, f"{what} {feature} is outside [0, {info.size}) (dictionary {info.name!r})")
        return feature

    def features(self, info: DictionaryInfo, ids: Any, field: str) -> tuple[int, ...]:
        if not len(ids):
            raise InvalidArgument(field, "must not be empty")
        seen: dict[int, int] = {}
        for k, f in enumerate(ids):
            self.feature(info, f, f"{field}[{k}]")
            if f in seen:
                raise InvalidArgument(f"{field}[{k}]", f"duplicate {f} (also [{seen[f]}])")
            seen[f] = k
        return tuple(seen)

    def read_dictionary(self, r: ipb.ReadDictionary, field: str) -> P.Action:
        info = self.dictionary(r.dictionary, r.module, field)
        positions = self.positions(r.positions, f"{field}.positions") if r.HasField("positions") else P.Positions()
        ref = dictionary_ref(info)
        which = r.WhichOneof("selection")
        if which == "top_k":
            if not 1 <= r.top_k.k <= info.size:
                raise InvalidArgument(f"{field}.top_k.k", f"must be in [1, {info.size}] (dictionary "
                                      f"{info.name!r}), got {r.top_k.k}")
            return P.ReadDictionary(ref, positions, top_k=r.top_k.k)
        if which == "features":
            return P.ReadDictionary(ref, positions, features=self.features(info, r.features.ids,
                                                                           f"{field}.features.ids"))
        if which == "reconstruction_error":
            if info.kind != "sae":
                raise InvalidArgument(f"{field}.reconstruction_error", f"{info.name!r} is a probe: only SAEs "
                                      "reconstruct")
            return P.ReadDictionary(ref, positions, error=True)
        return P.ReadDictionary(ref, positions)

    def write_dictionary(self, w: ipb.WriteDictionary, field: str) -> P.Action:
        info = self.dictionary(w.dictionary, w.module, field, reads=False)
        op = w.WhichOneof("op")
        if op is None:
            raise InvalidArgument(f"{field}.op", "set steer, clamp or ablate")
        edit: P.ModuleEdit = "steer" if op == "steer" else "clamp"
        self.require_writable(info.module, edit, field)
        if op != "steer" and info.kind != "sae":
            raise InvalidArgument(f"{field}.{op}", f"{info.name!r} is a probe: probes steer (its rows are "
                                  "directions); clamping and ablating are for SAE features")
        value = 0.0 if op == "ablate" else float(getattr(w, op))
        if not math.isfinite(value):
            raise InvalidArgument(f"{field}.{op}", "must be finite")
        features = self.features(info, w.features, f"{field}.features")
        if edit == "clamp" and not self.limits.module_interventions:
            self.require_compiled_clamp(info, len(features), op, field)
        positions = self.positions(w.positions, f"{field}.positions") if w.HasField("positions") else P.Positions()
        return P.WriteModule(info.module, positions, edit,
                             dictionary=P.DictionaryEdit(dictionary_ref(info), features, value))

    def require_compiled_clamp(self, info: DictionaryInfo, features: int, op: str, field: str) -> None:
        """What a compiled table's clamp columns compute (steering.py): ReLU and JumpReLU SAEs
        on the layers they are on, a write's features within a slot's columns."""
        layers = self.limits.clamp_layers
        if not P.is_decoder_layer(info.module) or P.layer_number(info.module) not in layers:
            raise FailedPrecondition(
                f"{field}.{op}: this server's compiled graph clamps dictionary features {_kept_on(layers)}, not on "
                f"{info.module!r} ({info.name!r}'s module; --compiled-dictionary-clamps LAYERS, or --enforce-eager)")
        if info.sae_activation == "topk":
            raise FailedPrecondition(
                f"{field}.{op}: {info.name!r} is a top-k SAE, whose activations depend on every feature: a compiled "
                "graph clamps ReLU and JumpReLU SAEs' (--enforce-eager serves it)")
        if features > CLAMP_FEATURES:
            raise FailedPrecondition(
                f"{field}.features: a compiled graph clamps at most {CLAMP_FEATURES} features per write, "
                f"not {features}; split them over writes at other positions, or use --enforce-eager")

    def threshold(self, t: ipb.Threshold, field: str) -> tuple[P.Comparison, float]:
        if t.comparison not in _COMPARISONS:
            raise InvalidArgument(f"{field}.comparison", "set a comparison")
        if not math.isfinite(t.value):
            raise InvalidArgument(f"{field}.value", "must be finite")
        return _COMPARISONS[t.comparison], t.value  # type: ignore[return-value]


def dictionary_ref(info: DictionaryInfo) -> P.DictRef:
    """How a plan refers to a dictionary: by name and generation."""
    return P.DictRef(info.name, info.generation, info.module, info.size)


def _kept_on(layers: frozenset[int]) -> str:
    """Where a compiled graph keeps a kind of hook, for the refusals naming it."""
    return f"on layers {', '.join(map(str, sorted(layers)))} only" if layers else "on no layer"


def _kept_at(modules: frozenset[str]) -> str:
    """_kept_on for module sites: their paths, in model order (a few, then a count)."""
    if not modules:
        return "on no module"
    paths = sorted(modules, key=P.module_order)
    shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
    return f"of {shown} only"
