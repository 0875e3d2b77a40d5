"""The plan compiler: a TraceRequest -> validated engine requests with their plans.

Every check names the offending field path. The result is plain typed data:
one EngineSequence per sampled sequence (n > 1 is fanned out here, the way
vLLM fans it out: sequence i gets seed + i when a seed is set), each carrying
the SequencePlan its worker hooks run. An invoke's interventions compile in
interventions.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from tracewire.v1 import sampling_pb2, service_pb2

from ..shared import plan as P
from ..shared.limits import ModelLimits
from .errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from .interventions import DictionaryLookup, InterventionCompiler
from .patching import InvokeDraft, PatchWait, resolve_patches
from .prompts import Encoder, EnginePrompt, to_engine_prompt
from .sampling import DEFAULT_MAX_TOKENS, fit_max_tokens, to_vllm_kwargs


@dataclass(frozen=True)
class EngineSequence:
    invoke_index: int
    sequence_index: int
    sampling: dict[str, Any]  # vllm.SamplingParams kwargs, extra_args included
    plan: P.SequencePlan | None  # None: nothing for the worker hooks to do


@dataclass(frozen=True)
class CompiledInvoke:
    index: int
    key: str
    prompt: EnginePrompt
    sequences: tuple[EngineSequence, ...]
    max_tokens: int
    skip_special_tokens: bool  # how its text is decoded: the deltas, the final text, text conditions
    cache_salt: str | None = None  # set when module writes change what the KV cache holds


@dataclass(frozen=True)
class CompiledTrace:
    invokes: tuple[CompiledInvoke, ...]
    ops_by_invoke: tuple[tuple[P.Op, ...], ...]
    read_bytes_bound: int
    stream_every_step: bool
    stream_interval_s: float = 0.0
    key: str = ""  # the trace's key (the worker keeps patch sources' values under it)
    # Activation patching: invokes whose engine requests wait for another's step.
    waits: tuple[PatchWait, ...] = ()
    # The most the worker's patch store keeps for this trace (patch_room.py admits it),
    # and the exported read that keeps the most, for messages.
    patch_bytes: int = 0
    patch_source: str = ""
    # A compiled engine's dictionary clamp columns it takes: (module, distinct clamped
    # (dictionary, feature, value)s) each (clamp_room.py admits them).
    clamp_columns: tuple[tuple[str, int], ...] = ()
    # The dictionaries (probes, SAEs) its ops use, as compiled against: a worker failure
    # while one of them was deleted or replaced is the client's race, not the server's fault.
    dictionaries: tuple[P.DictRef, ...] = ()

    @property
    def keeps_values(self) -> bool:
        """Whether workers keep values for this trace (released when it ends)."""
        return bool(self.waits)


MAX_STREAM_INTERVAL_MS = 1000

def merge_sampling(
    base: sampling_pb2.SamplingParams, override: sampling_pb2.SamplingParams
) -> sampling_pb2.SamplingParams:
    """The trace's parameters with the invoke's set fields replacing them."""
    merged = sampling_pb2.SamplingParams()
    merged.CopyFrom(base)
    for desc, value in override.ListFields():  # only set / non-empty fields
        merged.ClearField(desc.name)
        if desc.message_type is not None and desc.message_type.GetOptions().map_entry:
            getattr(merged, desc.name).update(value)
        elif desc.is_repeated:
            getattr(merged, desc.name).extend(value)
        else:
            setattr(merged, desc.name, value)
    return merged


def check_sequences(count: int, count_field: str, n: int, n_field: str, cap: int) -> None:
    """`count` prompts (or invokes) of `n` sequences each must stay within the server's
    cap; the field named is the one that went over it."""
    if count > cap:
        raise InvalidArgument(count_field, f"{count} entries; this server runs at most {cap} "
                              "sequences per request (--max-sequences)")
    if count * n > cap:
        raise InvalidArgument(n_field, f"n = {n} x {count} entries is {count * n} sequences; this "
                              f"server runs at most {cap} per request (--max-sequences)")


def _requested_n(request: service_pb2.TraceRequest, i: int) -> int:
    """Invoke i's n as merge_sampling would give it, without building anything."""
    own = request.invokes[i].sampling_params
    if own.HasField("n"):
        return own.n
    return request.sampling_params.n if request.sampling_params.HasField("n") else 1


class _Compiler:
    def __init__(
        self,
        limits: ModelLimits,
        encoder: Encoder,
        server_max_read_bytes: int,
        fault_injection: bool,
        route: int = 0,
        max_sequences: int = 256,
        dictionaries: DictionaryLookup | None = None,
    ):
        self.max_sequences = max_sequences
        self.limits = limits
        self.route = route  # the frontend process this trace's records go to
        self.encoder = encoder
        self.server_max_read_bytes = server_max_read_bytes
        self.interventions = InterventionCompiler(limits, fault_injection, dictionaries or _no_dictionaries)
        self.prompt_len = 0  # of the invoke being compiled

    # -- whole request -------------------------------------------------------

    def trace(self, request: service_pb2.TraceRequest, trace_key: str) -> CompiledTrace:
        if not request.invokes:
            raise InvalidArgument("invokes", "at least one invoke is required")
        self.check_sequences(request)
        # The trace's own values first, so an error names the message that holds it.
        to_vllm_kwargs(request.sampling_params, self.limits, "sampling_params")
        drafts, bound, lens_rows = [], 0, 0
        scratch = 0  # the largest attention-pattern read's transient blocks: one at a time
        for i, invoke in enumerate(request.invokes):
            field = f"invokes[{i}]"
            prompt = to_engine_prompt(invoke.prompt, self.encoder, self.limits, f"{field}.prompt")
            params = merge_sampling(request.sampling_params, invoke.sampling_params)
            kwargs = to_vllm_kwargs(params, self.limits, f"{field}.sampling_params")
            # An error names the message the value came from: the invoke's, else the trace's.
            where = f"{field}.sampling_params" if invoke.sampling_params.HasField("max_tokens") else "sampling_params"
            kwargs = fit_max_tokens(kwargs, len(prompt.token_ids), self.limits, where, f"{field}.prompt")
            n = kwargs.pop("n", 1)
            max_tokens = kwargs.get("max_tokens", DEFAULT_MAX_TOKENS)
            self.prompt_len = len(prompt.token_ids)
            ops = self.interventions.ops(invoke.interventions, f"{field}.interventions", self.prompt_len,
                                         max_tokens)
            if any(P.runs_whole_prompt(op.action) for op in ops):
                # Prompt positions served from the prefix cache never run through the
                # model: compute them again for this request.
                kwargs["skip_reading_prefix_cache"] = True
            bound += n * sum(self.read_bytes(op, max_tokens) for op in ops)
            scratch = max([scratch, *(op.action.scratch_bytes() for op in ops
                                      if isinstance(op.action, P.ReadAttentionPattern))])
            lens_rows += n * sum(self.lens_rows(op) for op in ops)
            if lens_rows > self.limits.max_lens_rows:
                raise InvalidArgument(
                    f"{field}.interventions",
                    f"the trace's logit-lens reads put up to {lens_rows} residual streams (layers x positions x "
                    f"sequences) through lm_head at one step, over this model's limit of "
                    f"{self.limits.max_lens_rows}; read fewer layers or prompt positions, or split the trace")
            drafts.append((prompt, kwargs, InvokeDraft(self.prompt_len, n, max_tokens, ops)))
        bound += scratch
        # Writes taking another invoke's read: resolved with every invoke at hand.
        patches = resolve_patches([d for _, _, d in drafts], self.limits, trace_key)
        invokes, all_ops = [], []
        patch_bytes, largest = 0, (0, "")
        for i, ((prompt, kwargs, draft), ops, exports) in enumerate(
                zip(drafts, patches.ops, patches.exports, strict=True)):
            n, max_tokens = draft.n, draft.max_tokens
            self.prompt_len = draft.prompt_len
            # The reads kept on the server for other invokes' writes cost their bytes again
            # (whole rows: a head / neuron read keeps every unit, whichever it returns), and
            # take that room in the worker's patch store.
            for j, op in enumerate(ops):
                if op.name in exports:
                    kept = self.read_bytes(_whole_rows(op), max_tokens)
                    patch_bytes += kept
                    if kept > largest[0]:
                        largest = (kept, f"invokes[{i}].interventions[{j}] (read {op.name!r})")
            all_ops.append(ops)
            stages = self.pipeline_stages(ops, exports, f"invokes[{i}]")
            key = f"{trace_key}/{i}"
            skip_special = bool(kwargs.get("skip_special_tokens", True))
            sequences = []
            for s in range(n):
                seq_kwargs = dict(kwargs)
                if "seed" in seq_kwargs:
                    seq_kwargs["seed"] = seq_kwargs["seed"] + s
                # Without ops the worker has nothing to do: no plan, no records; the
                # step results come from vLLM's token stream alone.
                plan = P.SequencePlan(key=f"{key}/{s}", ops=ops, route=self.route,
                                      skip_special_tokens=skip_special, exports=exports,
                                      trace=trace_key if exports else "", invoke=i if exports else 0,
                                      stages=stages) if ops else None
                if plan is not None:
                    seq_kwargs["extra_args"] = {P.EXTRA_ARGS_KEY: P.encode_plan(plan)}
                sequences.append(EngineSequence(i, s, seq_kwargs, plan))
            # (a patched write's reference carries the trace key: no other trace shares its blocks)
            salt = P.kv_cache_salt(ops, len(prompt.token_ids), skip_special)
            invokes.append(CompiledInvoke(i, key, prompt, tuple(sequences), max_tokens, skip_special, salt))

        bound += patch_bytes
        cap = self.server_max_read_bytes
        asked = request.options.max_read_bytes
        if asked < 0:
            raise InvalidArgument("options.max_read_bytes", "must be >= 0")
        budget = min(asked, cap) if asked else cap
        if bound > budget:
            raise ResourceExhausted(
                f"the trace's reads could return up to {bound} bytes (reads x selected steps x "
                f"sequences{f', with {scratch} bytes of attention-pattern scratch' if scratch else ''}), "
                f"over the limit of {budget} bytes; read fewer steps, top-k instead "
                "of full rows, or raise options.max_read_bytes (server cap "
                f"{cap} bytes, --max-read-bytes)"
            )
        every = request.options.stream_every_step if request.options.HasField(
            "stream_every_step") else True
        interval_ms = request.options.stream_interval_ms
        if interval_ms > MAX_STREAM_INTERVAL_MS:
            raise InvalidArgument(
                "options.stream_interval_ms", f"must be <= {MAX_STREAM_INTERVAL_MS}, got {interval_ms}"
            )
        return CompiledTrace(tuple(invokes), tuple(all_ops), bound, every, interval_ms / 1000,
                             key=trace_key, waits=patches.waits, patch_bytes=patch_bytes,
                             patch_source=largest[1], clamp_columns=_clamp_columns(all_ops, self.limits),
                             dictionaries=tuple(dict.fromkeys(_dictionary_refs(all_ops))))

    def check_sequences(self, request: service_pb2.TraceRequest) -> None:
        """Every invoke's n, summed, within the cap: before any per-sequence work."""
        cap = self.max_sequences
        check_sequences(len(request.invokes), "invokes", 1, "invokes", cap)
        total = 0
        for i in range(len(request.invokes)):
            n = _requested_n(request, i)
            if n < 1:
                continue  # to_vllm_kwargs names it
            total += n
            if total > cap:
                own = request.invokes[i].sampling_params.HasField("n")
                field = f"invokes[{i}].sampling_params.n" if own else "sampling_params.n"
                raise InvalidArgument(field, f"the trace's invokes ask for {total} sequences by "
                                      f"invoke {i}; this server runs at most {cap} per request "
                                      "(--max-sequences)")

    def pipeline_stages(self, ops: tuple[P.Op, ...], exports: frozenset[str], field: str) -> tuple[int, ...]:
        """Each op's pipeline stage (SequencePlan.stages; empty without stages). A read
        other invokes patch from is kept where it ran: only the last stage keeps them."""
        if self.limits.pipeline_parallel_size <= 1:
            return ()
        stages = tuple(self.interventions.stage(op.action) for op in ops)
        for op, stage in zip(ops, stages, strict=True):
            if op.name in exports and stage != self.limits.last_stage:
                raise FailedPrecondition(
                    f"{field}.interventions: read {op.name!r} is a patch source on pipeline stage {stage}; "
                    "patch operands are kept on the last stage only")
        return stages

    def lens_rows(self, op: P.Op) -> int:
        """The streams a logit-lens op puts through lm_head at its busiest step: each of
        its layers at each prompt position it reads (or at the new token)."""
        action = op.action
        if not isinstance(action, P.ReadLogitLens):
            return 0
        return len(action.layers) * max(1, len(action.positions.prompt_positions(self.prompt_len)))

    def read_bytes(self, op: P.Op, max_tokens: int) -> int:
        """Upper bound on the bytes one sequence's op returns over the generation."""
        action = op.action
        if not isinstance(action, P.READS):
            return 0
        bound = action.read_bound(self.limits, self.prompt_len)
        if bound.prompt is not None:  # prompt positions: once, at step 0 (then the new token for "all")
            return bound.held + bound.prompt + bound.per_step * max(0, max_tokens - 1)
        per_step = bound.per_step
        last = op.steps.last()
        if op.steps.steps is not None:
            steps = sum(1 for s in op.steps.steps if s < max_tokens)
        else:
            end = max_tokens if last is None else min(last + 1, max_tokens)
            steps = max(0, end - op.steps.start)
        return bound.held + per_step * steps


def compile_trace(
    request: service_pb2.TraceRequest,
    limits: ModelLimits,
    encoder: Encoder,
    trace_key: str,
    server_max_read_bytes: int,
    fault_injection: bool = False,
    route: int = 0,
    max_sequences: int = 256,
    dictionaries: DictionaryLookup | None = None,
) -> CompiledTrace:
    """`dictionaries`: the server's probes and SAEs by name (None: it has none)."""
    return _Compiler(limits, encoder, server_max_read_bytes, fault_injection, route, max_sequences,
                     dictionaries).trace(request, trace_key)


def _clamp_columns(all_ops: list[tuple[P.Op, ...]], limits: ModelLimits) -> tuple[tuple[str, int], ...]:
    """The clamp columns a trace takes on a compiled engine, by module (none on an eager one)."""
    if limits.module_interventions:
        return ()
    keys: dict[str, set[tuple[str, int, int, float]]] = {}
    for ops in all_ops:
        for op in ops:
            write = op.action
            if isinstance(write, P.WriteModule) and write.edit == "clamp" and write.dictionary is not None:
                ref = write.dictionary.dictionary
                keys.setdefault(write.module, set()).update(
                    (ref.name, ref.generation, f, write.dictionary.value) for f in write.dictionary.features)
    return tuple((module, len(found)) for module, found in sorted(keys.items()))


def _no_dictionaries(name: str) -> None:
    return None


def _dictionary_refs(value: Any) -> Iterator[P.DictRef]:
    """Every DictRef in a plan's plain data (ops, their actions and conditions)."""
    if isinstance(value, P.DictRef):
        yield value
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            yield from _dictionary_refs(getattr(value, name))
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _dictionary_refs(item)


def _whole_rows(op: P.Op) -> P.Op:
    """A module read as the patch store keeps it: every unit of each row."""
    if isinstance(op.action, P.ReadModule) and op.action.units is not None:
        return msgspec.structs.replace(op, action=msgspec.structs.replace(op.action, units=None))
    return op
