"""Traces: an nnsight-like block that builds a declarative plan, sent when it exits.

    with client.trace("The capital of France is", temperature=0.0, max_tokens=8) as tracer:
        logits = tracer.all().logits.save()          # one [vocab] array per step
        drawn = tracer.all().samples.save()          # one token id per step
        tracer.iter[0].samples = berlin_id           # force the draw at step 0
        tracer.iter[:8].stop(when=tw.sampled_in(period_id))
    print(tracer.result.outputs[0].text, len(logits))

Nothing inside the block runs per step in Python: each line adds an intervention
to the request, and the saved handles fill up when the block exits (or as a
`client.stream_trace(tracer)` stream goes by).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import dictionary_ops
from .conditions import Condition
from .errors import InvalidArgument
from .outputs import RequestOutput, request_output
from .prompts import PromptLike, to_prompt
from .sampling import check_keywords, sampling_params
from .tensors import from_numpy, to_numpy
from .v1 import intervention_pb2 as ipb
from .v1 import service_pb2, trace_pb2

Runner = Callable[[service_pb2.TraceRequest], Iterator[service_pb2.TraceResponse]]
DEFAULT_MAX_TOKENS = 16  # vLLM's


class TraceWarning(UserWarning):
    """The server's warnings about a trace, e.g. a selected step the generation never reached."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn_at_caller(message: str) -> None:
    """Warn at the first frame outside this package: the user's line that ran the trace,
    however it ran (a `with` block's exit, `.run()`, iterating `stream_trace`, the async
    client's `async with` / `async for`), each reaching here through a different number
    of SDK frames. (warnings.warn's skip_file_prefixes would do this from Python 3.12.)"""
    frame = sys._getframe(0)
    level = 1  # this function's frame: warnings.warn's stacklevel=1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    warnings.warn(message, TraceWarning, stacklevel=level)


class TopK(NamedTuple):
    """The k largest logits at one step, largest first."""

    values: np.ndarray[Any, Any]
    ids: np.ndarray[Any, Any]


class Logprobs(NamedTuple):
    """The drawn token's logprob and the top-k logprobs at one step."""

    token_id: int
    logprob: float
    top: dict[int, float]


class AttentionPattern(NamedTuple):
    """Attention weights at one step: `weights` [layers, positions, heads, K] float32 (layers
    and heads in the order asked for, query positions ascending), `keys` the key position
    of each weight (same shape; -1 past the keys a query sees), `positions` the query
    positions [positions]. Top-k: K = k, largest first. Full rows: K = the last query
    position + 1, keys a read-only broadcast of arange(K); keys a query does not see (after
    it, or outside a sliding window) weigh 0."""

    weights: np.ndarray[Any, Any]
    keys: np.ndarray[Any, Any]
    positions: np.ndarray[Any, Any]


class LensRead(TopK):
    """A logit-lens read at one step: a `TopK` of [layers, positions, k] that also says what
    it read, for labels (tracewire.plot.logit_lens uses them): `layers`, the model's layer
    numbers in the order asked for; `positions`, the sequence position of each column; and
    `input_ids`, the token at each of those positions (what the layers read there: the
    prompt's tokens, then the drawn ones). The last two are filled once the invoke's output
    has come (None before: a text prompt's token ids come with it)."""

    layers: tuple[int, ...] = ()
    positions: tuple[int, ...] | None = None
    input_ids: tuple[int, ...] | None = None


class PatternRead(AttentionPattern):
    """An attention-pattern read at one step: an `AttentionPattern` that also says what it
    read: `layers` and `heads`, the model's layer and head numbers in the order asked for
    (heads empty: all of them, in order); and `input_ids`, the sequence's tokens from position
    0 to the last query (the prompt's, then the drawn ones), filled once the invoke's output
    has come (None before). tracewire.plot.attention uses them."""

    layers: tuple[int, ...] = ()
    heads: tuple[int, ...] = ()
    input_ids: tuple[int, ...] | None = None


class Saved(list[Any]):
    """A saved read: one value per step reached, in step order (`.steps` says which).

    With n > 1 sequences it holds one such list per sequence instead. `.value` is the
    only value of a one-step read.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.steps: list[int] = []
        # Activation patching: the invoke a saved module read belongs to (what `.patch()`
        # on another invoke's module references); None for other reads.
        self.invoke: int | None = None

    @property
    def value(self) -> Any:
        if len(self) != 1:
            raise ValueError(f"{self.name!r} holds {len(self)} values, not one")
        return self[0]


@dataclass(frozen=True)
class Step:
    """One streamed step of one sequence."""

    invoke_index: int
    sequence_index: int
    step: int
    token_id: int
    text: str
    values: dict[str, Any]
    stopped: bool


def _selector(steps: int | slice | Sequence[int] | None) -> tuple[ipb.StepSelector, int | None, int]:
    """The proto selector, the last selected step (None: open) and the first."""
    if steps is None:
        return ipb.StepSelector(all=ipb.AllSteps()), None, 0
    if isinstance(steps, int):
        steps = [steps]
    if isinstance(steps, slice):
        if steps.step not in (None, 1):
            raise InvalidArgument("step slices cannot have a stride; list the steps instead")
        start = 0 if steps.start is None else steps.start
        if start < 0 or (steps.stop is not None and steps.stop < 0):
            raise InvalidArgument(f"steps must be >= 0, got {steps}")
        if steps.stop is not None and steps.stop < start:
            raise InvalidArgument(f"step slice stop < start: {steps}")
        rng = ipb.StepRange(start=start)
        if steps.stop is not None:
            rng.stop = steps.stop
        last = None if steps.stop is None else steps.stop - 1
        return ipb.StepSelector(range=rng), last, start
    listed = [int(s) for s in steps]
    if not listed or min(listed) < 0:
        raise InvalidArgument(f"steps must be a non-empty list of steps >= 0, got {listed}")
    return ipb.StepSelector(list=ipb.StepList(steps=listed)), max(listed), min(listed)


def _positions(positions: str | slice | Sequence[int]) -> ipb.Positions:
    if isinstance(positions, str):
        kinds = {
            "new": ipb.Positions(new_token=ipb.NewToken()),
            "prompt": ipb.Positions(all_prompt=ipb.AllPrompt()),
            "all": ipb.Positions(all=ipb.AllPositions()),
        }
        if positions not in kinds:
            raise InvalidArgument(f"positions must be 'new', 'prompt', 'all', a slice or a list; got {positions!r}")
        return kinds[positions]
    if isinstance(positions, slice):
        if positions.step not in (None, 1):
            raise InvalidArgument("position slices cannot have a stride; list the positions instead")
        rng = ipb.PositionRange(start=positions.start or 0)
        if positions.stop is not None:
            rng.stop = positions.stop
        return ipb.Positions(prompt_range=rng)
    return ipb.Positions(prompt_list=ipb.PositionList(positions=[int(p) for p in positions]))


class _Decode:
    """How a read's values come back to Python."""

    @staticmethod
    def logits(value: trace_pb2.ReadValue) -> Any:
        return to_numpy(value.values)

    @staticmethod
    def top_k(value: trace_pb2.ReadValue) -> Any:
        return TopK(to_numpy(value.values), to_numpy(value.token_ids))

    @staticmethod
    def rows(value: trace_pb2.ReadValue) -> Any:
        """A module read over positions: always [positions, hidden]. (The server sends a
        read of "all" positions after step 0 as the new token's [hidden] row alone.)"""
        values = to_numpy(value.values)
        return values if values.ndim == 2 else values.reshape(1, -1)

    @staticmethod
    def lens(value: trace_pb2.ReadValue) -> Any:
        """A logit-lens read: a TopK whatever top_k. Full rows (top_k=0) come without ids:
        theirs are the vocabulary in order, a read-only broadcast of arange(vocab) (no
        memory of its own)."""
        values = to_numpy(value.values)
        if value.HasField("token_ids"):
            return TopK(values, to_numpy(value.token_ids))
        return TopK(values, np.broadcast_to(np.arange(values.shape[-1], dtype=np.int32), values.shape))

    @staticmethod
    def pattern(value: trace_pb2.ReadValue) -> Any:
        """An attention-pattern read: an AttentionPattern (full rows get their keys as a
        broadcast of arange, no memory of its own)."""
        weights = to_numpy(value.values)
        if value.HasField("token_ids"):
            keys = to_numpy(value.token_ids)
        else:
            keys = np.broadcast_to(np.arange(weights.shape[-1], dtype=np.int32), weights.shape)
        return AttentionPattern(weights, keys, to_numpy(value.positions))

    @staticmethod
    def unit_rows(value: trace_pb2.ReadValue) -> Any:
        """A heads / neurons read over positions: always [positions, ...]. (The server
        sends a read of "all" positions after step 0 as the new token's row alone,
        without positions.)"""
        values = to_numpy(value.values)
        return values if value.HasField("positions") else values[None]

    @staticmethod
    def unit_top_k(value: trace_pb2.ReadValue) -> Any:
        """Top-k neurons: a TopK of [k] (new token, mean) or [positions, k]."""
        return TopK(to_numpy(value.values), to_numpy(value.token_ids))

    @staticmethod
    def unit_top_k_rows(value: trace_pb2.ReadValue) -> Any:
        top = TopK(to_numpy(value.values), to_numpy(value.token_ids))
        return top if value.HasField("positions") else TopK(top.values[None], top.ids[None])

    @staticmethod
    def sample(value: trace_pb2.ReadValue) -> Any:
        return int(to_numpy(value.values))

    @staticmethod
    def logprobs(value: trace_pb2.ReadValue) -> Any:
        vals, ids = to_numpy(value.values), to_numpy(value.token_ids)
        top = {int(i): float(v) for i, v in zip(ids[1:], vals[1:], strict=True)}
        return Logprobs(int(ids[0]), float(vals[0]), top)


class _Read:
    """Something that can be saved: `.save()` adds the read to the trace."""

    def __init__(self, view: StepView, build: Callable[[ipb.Intervention], None],
                 decode: Callable[[trace_pb2.ReadValue], Any]) -> None:
        self._view, self._build, self._decode = view, build, decode

    def save(self, name: str | None = None) -> Saved:
        return self._view._invoke._add_read(self._view, self._build, self._decode, name)


class LogitsRef(_Read):
    """`view.logits`: the row the sampler draws from, after vLLM's processing and this
    trace's writes (a forced token reads 0 at its id, -inf elsewhere); read and stop
    conditions see it. `.raw`: lm_head's output. `.before_writes`: after vLLM's processing
    (logit_bias, penalties, ...), before this trace's writes: exactly the row that write
    conditions (`argmax_in`, `prob`, `entropy` on a write's `.when`) decide from."""

    def __init__(self, view: StepView, stage: ipb.LogitsStage) -> None:
        self._stage = stage

        def full(iv: ipb.Intervention) -> None:
            iv.read_logits.CopyFrom(ipb.ReadLogits(stage=stage, full=ipb.FullRow()))

        super().__init__(view, full, _Decode.logits)

    @property
    def raw(self) -> LogitsRef:
        """lm_head's output, before any processing."""
        return LogitsRef(self._view, ipb.LOGITS_STAGE_RAW)

    @property
    def before_writes(self) -> LogitsRef:
        """vLLM's processed row before this trace's writes (what write conditions see)."""
        return LogitsRef(self._view, ipb.LOGITS_STAGE_BEFORE_WRITES)

    def top_k(self, k: int) -> _Read:
        def build(iv: ipb.Intervention) -> None:
            iv.read_logits.CopyFrom(ipb.ReadLogits(stage=self._stage, top_k=ipb.TopK(k=k)))

        return _Read(self._view, build, _Decode.top_k)

    def select(self, token_ids: Iterable[int]) -> _Read:
        ids = [int(t) for t in token_ids]

        def build(iv: ipb.Intervention) -> None:
            iv.read_logits.CopyFrom(ipb.ReadLogits(stage=self._stage, token_ids=ipb.TokenSet(token_ids=ids)))

        return _Read(self._view, build, _Decode.logits)

    # writes (the sampler then draws from the result)
    def replace(self, values: Any) -> None:
        self._view._write(write_logits=ipb.WriteLogits(replace=from_numpy(values)))

    def add(self, values: Any) -> None:
        self._view._write(write_logits=ipb.WriteLogits(add=from_numpy(values)))

    def bias(self, biases: Mapping[int, float]) -> None:
        self._view._write(
            write_logits=ipb.WriteLogits(bias=ipb.TokenBias(bias={int(k): float(v) for k, v in biases.items()}))
        )

    def mask(self, token_ids: int | Iterable[int]) -> None:
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        self._view._write(write_logits=ipb.WriteLogits(mask=ipb.TokenSet(token_ids=ids)))

    def __iadd__(self, values: Any) -> _Added:
        return _Added(values)


@dataclass(frozen=True)
class _Added:
    """`view.logits += vector`: Python calls __iadd__ then assigns the result back."""

    values: Any


class SamplesRef(_Read):
    """`view.samples`: the token drawn at each selected step."""

    def __init__(self, view: StepView) -> None:
        super().__init__(view, lambda iv: iv.read_sample.CopyFrom(ipb.ReadSample()), _Decode.sample)

    def force(self, token_id: int) -> None:
        self._view._write(force_sample=ipb.ForceSample(token_id=int(token_id)))


class StepView:
    """The selected steps of one invoke, optionally under a condition."""

    def __init__(self, invoke: Invoke, steps: int | slice | Sequence[int] | None,
                 condition: Condition | None = None) -> None:
        self._invoke = invoke
        self._steps = steps
        self._selector, self.last, self.first = _selector(steps)
        self._condition = condition

    def when(self, condition: Condition) -> StepView:
        """Only act at these steps when `condition` holds (evaluated on the server)."""
        both = condition if self._condition is None else self._condition & condition
        return StepView(self._invoke, self._steps, both)

    def _intervention(self, name: str = "") -> ipb.Intervention:
        iv = ipb.Intervention(name=name, steps=self._selector)
        if self._condition is not None:
            iv.condition.CopyFrom(self._condition.message)
        return iv

    def _write(self, **action: Any) -> None:
        iv = self._intervention()
        for key, value in action.items():
            getattr(iv, key).CopyFrom(value)
        self._invoke._add(iv, self)

    @property
    def logits(self) -> LogitsRef:
        return LogitsRef(self, ipb.LOGITS_STAGE_PROCESSED)

    @logits.setter
    def logits(self, values: Any) -> None:
        if isinstance(values, _Added):
            self.logits.add(values.values)
        elif not isinstance(values, LogitsRef):
            self.logits.replace(values)

    @property
    def samples(self) -> SamplesRef:
        return SamplesRef(self)

    @samples.setter
    def samples(self, token_id: Any) -> None:
        if not isinstance(token_id, SamplesRef):
            self.samples.force(int(token_id))

    def logprobs(self, top_k: int = 0) -> _Read:
        """The drawn token's logprob and the `top_k` largest logprobs."""

        def build(iv: ipb.Intervention) -> None:
            iv.read_logprobs.CopyFrom(ipb.ReadLogprobs(top_k=top_k))

        return _Read(self, build, _Decode.logprobs)

    def module(self, path: str, *, positions: str | slice | Sequence[int] = "new", mean: bool = False) -> ModuleRef:
        """A module's output (for decoder layers "layers.i": the residual stream after it),
        to `.save()` or to write (`.add(vector, scale)`, `.replace(vector)`, `.zero()`,
        `.mean_ablate()`).

        positions: "new" (the token processed at each step), "prompt" (every prompt
        position, at step 0), "all" (the prompt at step 0, then the new token), a slice or
        a list of prompt positions (negative counts from the end). mean=True averages a
        read over the positions server-side.

        Shapes of a saved read, one rule per read: "new" gives [hidden] per step; any other
        positions give [positions, hidden] at every step ("all": [prompt_len, hidden] at
        step 0, then [1, hidden]); mean=True gives [hidden].
        An eager server (--enforce-eager) reads and writes every module; a compiled one
        what its graph keeps (`client.model_info()`: readable_layers, unit_readable_layers,
        readable_modules for reads; steerable_layers, unit_steerable_layers,
        steerable_modules, compiled_mean_ablation, clamp_layers for writes: `make serve`
        gives a small model all of them). The rest it refuses with FailedPrecondition
        naming the field and the flag that would serve it.
        """
        return ModuleRef(self, path, _positions(positions), mean)

    @property
    def model(self) -> _ModuleProxy:
        """`view.model.layers[i].output` reads / writes layer i's output at the new token."""
        return _ModuleProxy(self)

    def logit_lens(
        self, layers: int | Sequence[int], *, positions: str | slice | Sequence[int] = "new", top_k: int = 5
    ) -> _Read:
        """Final norm + lm_head on these layers' residual streams, as logprobs: per step
        always a `TopK`, values and ids of shape [layers, positions, k], positions 1 for
        "new" (and for "all" after step 0). top_k=0 gives the full rows, k = vocab, with
        ids a read-only broadcast of arange(vocab). Served by an eager server on every
        layer, and by a compiled one started with --compiled-reads on the layers
        `client.model_info().readable_layers` lists."""
        selected = _positions(positions)
        layer_list = [layers] if isinstance(layers, int) else [int(x) for x in layers]

        def build(iv: ipb.Intervention) -> None:
            iv.read_logit_lens.CopyFrom(ipb.ReadLogitLens(layers=layer_list, positions=selected, top_k=top_k))

        def decode(value: trace_pb2.ReadValue) -> LensRead:
            top = _Decode.lens(value)
            read = LensRead(top.values, top.ids)
            read.layers = tuple(layer_list)
            if value.HasField("positions"):
                read.positions = tuple(int(p) for p in to_numpy(value.positions))
            return read

        return _Read(self, build, decode)

    def attention(
        self,
        layers: int | Sequence[int],
        *,
        heads: Sequence[int] | None = None,
        positions: str | slice | Sequence[int] = "new",
        top_k: int = 5,
    ) -> _Read:
        """Attention patterns: the attention weights of query `positions` over the keys, at
        these decoder layers and query heads (None: all), computed on the server from the
        model's own post-rotary q / k (its scale, causal mask, sliding window, soft-cap,
        GQA). Per step an `AttentionPattern`: weights and key positions [layers, positions,
        heads, top_k], or full rows with top_k=0 ([..., last query position + 1]).
        positions as for `module()`: "new" (the token processed at each step: the query
        at position prompt_len - 1 + step), "prompt", "all", a slice or a list. Needs an
        eager server (--enforce-eager); the server keeps the keys it needs per sequence,
        counted against max_read_bytes with the values."""
        selected = _positions(positions)
        layer_list = [layers] if isinstance(layers, int) else [int(x) for x in layers]
        head_list = [] if heads is None else [int(h) for h in heads]

        def build(iv: ipb.Intervention) -> None:
            iv.read_attention_pattern.CopyFrom(
                ipb.ReadAttentionPattern(layers=layer_list, heads=head_list, positions=selected, top_k=top_k)
            )

        def decode(value: trace_pb2.ReadValue) -> PatternRead:
            pattern = _Decode.pattern(value)
            read = PatternRead(pattern.weights, pattern.keys, pattern.positions)
            read.layers, read.heads = tuple(layer_list), tuple(head_list)
            return read

        return _Read(self, build, decode)

    def stop(self) -> None:
        """End the sequence at the first of these steps (where the condition holds)."""
        self._write(stop=ipb.Stop())


class ModuleRef(_Read):
    """`view.module(path)`: read it (`.save()`) or change it for the selected steps.

    Indexing chooses prompt positions (`ref[4]`, `ref[2:5]`, `ref[[1, 3]]`: acted on at
    step 0, negative counts from the prompt's end). Attention heads
    (`layers.L.self_attn.heads`) and MLP neurons (`layers.L.mlp.act`) are units:
    `.select([0, 2])` chooses some (as `logits.select` chooses token ids), `.top_k(k)`
    the largest neurons. Saved shapes per step: heads [heads, head_dim], neurons [ids]
    at "new" positions (and with mean=True); [positions, heads, head_dim] /
    [positions, ids] at any other positions; `top_k`: a TopK of [k] or [positions, k]."""

    def __init__(self, view: StepView, path: str, positions: ipb.Positions, mean: bool,
                 units: Sequence[int] | None = None) -> None:
        self._path, self._selected, self._mean = path, positions, mean
        self._units = list(units) if units is not None else None

        def build(iv: ipb.Intervention) -> None:
            reduction = ipb.REDUCTION_MEAN if mean else ipb.REDUCTION_UNSPECIFIED
            iv.read_module.CopyFrom(ipb.ReadModule(module=path, positions=positions, reduction=reduction))
            if self._units is not None:
                iv.read_module.units.ids.ids.extend(self._units)

        one_row = mean or positions.WhichOneof("kind") == "new_token"
        unit_module = path.endswith((".self_attn.heads", ".mlp.act"))
        rows = _Decode.unit_rows if unit_module else _Decode.rows
        super().__init__(view, build, _Decode.logits if one_row else rows)

    def _edit(self, **op: Any) -> None:
        write = ipb.WriteModule(module=self._path, positions=self._selected, **op)
        if self._units is not None:
            write.units.ids.extend(self._units)
        self._view._write(write_module=write)

    def select(self, units: int | Sequence[int]) -> ModuleRef:
        """These heads (of `layers.L.self_attn.heads`) or neurons (of `layers.L.mlp.act`),
        in this order, to `.save()` or to write: `.zero()`, `.mean_ablate()`,
        `.replace(t)` / `.add(t, scale)` (heads: t of [head_dim], or [heads, head_dim];
        neurons: a value per id), `.set(values)` (neurons)."""
        ids = [int(units)] if isinstance(units, (int, np.integer)) else [int(u) for u in units]
        return ModuleRef(self._view, self._path, self._selected, self._mean, ids)

    def top_k(self, k: int) -> _Read:
        """The k largest neurons of `layers.L.mlp.act` per position (after the mean with
        mean=True), largest first: a TopK (values, neuron ids)."""
        path, positions, mean = self._path, self._selected, self._mean

        def build(iv: ipb.Intervention) -> None:
            reduction = ipb.REDUCTION_MEAN if mean else ipb.REDUCTION_UNSPECIFIED
            iv.read_module.CopyFrom(ipb.ReadModule(module=path, positions=positions, reduction=reduction,
                                                   units=ipb.UnitSelection(top_k=ipb.TopK(k=k))))

        one_row = mean or positions.WhichOneof("kind") == "new_token"
        return _Read(self._view, build, _Decode.unit_top_k if one_row else _Decode.unit_top_k_rows)

    def set(self, values: Any) -> None:
        """Set the chosen neurons to these values (one per id, or one for all)."""
        count = len(self._units) if self._units is not None else None
        array = np.asarray(values, dtype=np.float32)
        if array.ndim == 0 and count is not None:
            array = np.full(count, array, np.float32)
        self.replace(array)

    def add(self, vector: Any, scale: float = 1.0) -> None:
        """Add scale * vector ([hidden]) at the positions: a steering vector."""
        self._edit(add=from_numpy(vector), scale=float(scale))

    def replace(self, vector: Any) -> None:
        self._edit(replace=from_numpy(vector))

    def zero(self) -> None:
        self._edit(zero=ipb.ZeroAblation())

    def mean_ablate(self) -> None:
        """Set each selected position to the mean over the selected positions."""
        self._edit(mean=ipb.MeanAblation())

    # -- activation patching across invokes --------------------------------------

    def __getitem__(self, positions: int | slice | Sequence[int]) -> ModuleRef:
        """The same module at these prompt positions (acted on at step 0; negative counts
        from the prompt's end): `inv.iter[0].model.layers[3].output[4]`."""
        selected = [positions] if isinstance(positions, int) else positions
        return ModuleRef(self._view, self._path, _positions(selected), False, self._units)

    def save(self, name: str | None = None) -> Saved:
        saved = super().save(name)
        saved.invoke = self._view._invoke.index
        return saved

    def patch(self, source: Saved, positions: Sequence[int] | None = None) -> None:
        """Activation patching: replace the selected positions with another invoke's saved
        module read of this trace (`source`), on the server, at the same step: for prompt
        positions its rows of step 0 (`positions`: which of the source's prompt positions,
        in order; None: all it read), for the new token its row of the same step. The
        invoke then starts once the source has that step (README: Activation patching)."""
        self._edit(patch=_read_ref(source, positions))

    def add_read(self, source: Saved, scale: float = 1.0, positions: Sequence[int] | None = None) -> None:
        """Add scale * another invoke's saved module read (as `.patch()` takes it)."""
        self._edit(add_read=_read_ref(source, positions), scale=float(scale))

    # -- dictionaries (linear probes, SAEs) on this module's output ---------------

    def probe(self, dictionary: str, outputs: int | Sequence[int] | None = None) -> _Read:
        """A linear probe on this module's output (after its activation): per step the
        [k] outputs (or the `outputs` chosen, in order) at "new" positions, [positions, k]
        at any other positions (as `.select()` reads neurons). The dictionary must read
        this module (the server checks; ListDictionaries says which it reads)."""
        return self._dictionary_read(dictionary_ops.read_dictionary(
            dictionary, *self._dictionary_target("probe"), ids=outputs))

    def features(self, dictionary: str, *, top_k: int | None = None, ids: int | Sequence[int] | None = None) -> _Read:
        """An SAE's feature activations on this module's output: `top_k=20` the 20 largest
        per position, a `TopK(values, ids)` ([k] at "new" positions, [positions, k] at
        others, largest first); `ids=[...]` those features' values, in order; neither:
        all d of them (counted against the read budget)."""
        return self._dictionary_read(dictionary_ops.read_dictionary(
            dictionary, *self._dictionary_target("features"), top_k=top_k, ids=ids))

    def reconstruction_error(self, dictionary: str) -> _Read:
        """||x - SAE(x)||_2 of this module's output x: [1] per step at "new" positions,
        [positions, 1] at others."""
        return self._dictionary_read(dictionary_ops.read_dictionary(
            dictionary, *self._dictionary_target("reconstruction_error"), error=True))

    def steer_feature(self, dictionary: str, features: int | Sequence[int], alpha: float) -> None:
        """Add alpha * W_dec[f] for each SAE feature f at these positions and steps."""
        self._view._write(write_dictionary=dictionary_ops.steer(
            dictionary, *self._dictionary_target("steer_feature"), features, alpha))

    def clamp_feature(self, dictionary: str, features: int | Sequence[int], value: float) -> None:
        """Set SAE features' activations to `value`, keeping the reconstruction error:
        x + sum_f (value - a_f(x)) * W_dec[f]."""
        self._view._write(write_dictionary=dictionary_ops.clamp(
            dictionary, *self._dictionary_target("clamp_feature"), features, value))

    def ablate_feature(self, dictionary: str, features: int | Sequence[int]) -> None:
        """Clamp SAE features to 0 (x - sum_f a_f(x) * W_dec[f])."""
        self._view._write(write_dictionary=dictionary_ops.ablate(
            dictionary, *self._dictionary_target("ablate_feature"), features))

    def steer_probe(self, dictionary: str, output: int = 0, alpha: float = 1.0) -> None:
        """Add alpha * W[output], the probe output's (unnormalised) direction."""
        self._view._write(write_dictionary=dictionary_ops.steer(
            dictionary, *self._dictionary_target("steer_probe"), output, alpha))

    def _dictionary_target(self, method: str) -> tuple[str, ipb.Positions]:
        """The module and positions a dictionary op acts on: the whole output, per position."""
        if self._mean:
            raise InvalidArgument(f".{method}(): dictionaries read every position; drop mean=True")
        if self._units is not None:
            raise InvalidArgument(f".{method}(): dictionaries act on the whole module output, not .select()ed units")
        return self._path, self._selected

    def _dictionary_read(self, message: ipb.ReadDictionary) -> _Read:
        def build(iv: ipb.Intervention) -> None:
            iv.read_dictionary.CopyFrom(message)

        one_row = self._selected.WhichOneof("kind") == "new_token"
        if dictionary_ops.selection(message) == "top_k":
            return _Read(self._view, build, _Decode.unit_top_k if one_row else _Decode.unit_top_k_rows)
        return _Read(self._view, build, _Decode.logits if one_row else _Decode.unit_rows)


def _read_ref(source: Saved, positions: Sequence[int] | None) -> ipb.ReadRef:
    if not isinstance(source, Saved) or source.invoke is None:
        raise InvalidArgument("patch from the value a module read's .save() returned (another invoke's)")
    return ipb.ReadRef(invoke=source.invoke, name=source.name, positions=[int(p) for p in positions or ()])


class _ModuleProxy:
    """nnsight-style module paths: `view.model.layers[3].output` is `view.module("layers.3")`;
    also `.mlp`, `.self_attn`, `model.embed_tokens`, `model.norm`."""

    def __init__(self, view: StepView, path: str = "") -> None:
        self._view, self._path = view, path

    def __getattr__(self, name: str) -> _ModuleProxy:
        if name.startswith("_"):
            raise AttributeError(name)
        return _ModuleProxy(self._view, f"{self._path}.{name}" if self._path else name)

    def __getitem__(self, index: int) -> _ModuleProxy:
        return _ModuleProxy(self._view, f"{self._path}.{int(index)}")

    @property
    def output(self) -> ModuleRef:
        return self._view.module(self._path)

    def pattern(
        self, *, heads: Sequence[int] | None = None, positions: str | slice | Sequence[int] = "new", top_k: int = 5
    ) -> _Read:
        """`view.model.layers[i].self_attn.pattern(heads=[0, 3], top_k=5)`: layer i's
        attention patterns, as `view.attention(i, ...)` reads them."""
        parts = self._path.split(".")
        if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or parts[2] != "self_attn":
            raise InvalidArgument(f"attention patterns are read at model.layers[i].self_attn, not {self._path!r}")
        return self._view.attention(int(parts[1]), heads=heads, positions=positions, top_k=top_k)


class _Iter:
    def __init__(self, invoke: Invoke) -> None:
        self._invoke = invoke

    def __getitem__(self, steps: int | slice | Sequence[int]) -> StepView:
        return StepView(self._invoke, steps)


@dataclass
class _SavedRead:
    saved: Saved
    decode: Callable[[trace_pb2.ReadValue], Any]


class Invoke:
    """One prompt (one engine request) and its interventions, in a trace.

    `defaults`: the trace's sampling parameters, which `sampling` overrides; `check_open`
    raises once the trace has been sent (no more changes).
    """

    def __init__(self, index: int, prompt: PromptLike, sampling: dict[str, Any], *,
                 defaults: Mapping[str, Any], check_open: Callable[[], None]) -> None:
        check_keywords(sampling)
        self._defaults = defaults
        self._check_open = check_open
        self.index = index
        self._prompt = to_prompt(prompt)
        self._sampling = sampling  # overrides of the trace's sampling parameters
        self._interventions: list[ipb.Intervention] = []
        self._reads: dict[str, _SavedRead] = {}
        self.result: RequestOutput | None = None
        # Each generated token's text as streamed, per sequence: {sequence: {step: text}}.
        self.step_tokens: dict[int, dict[int, str]] = {}

    # -- building --------------------------------------------------------------

    def all(self) -> StepView:
        return StepView(self, None)

    @property
    def model(self) -> _ModuleProxy:
        """`tracer.model.layers[3].output.save()`: layer 3's output at every step's new token."""
        return self.all().model

    @property
    def iter(self) -> _Iter:
        return _Iter(self)

    def stop(self, *, when: Condition | None = None, step: int | None = None) -> None:
        """Stop at `step`, or at the first step where `when` holds."""
        if step is None and when is None:
            raise InvalidArgument("stop() needs a step or a condition (when=...)")
        view = StepView(self, None if step is None else [step], when)
        view.stop()

    def max_tokens(self) -> int:
        value = self._setting("max_tokens")
        return DEFAULT_MAX_TOKENS if value is None else int(value)

    def _setting(self, name: str) -> Any:
        """A sampling parameter: this invoke's override, else the trace's (None: unset)."""
        return self._sampling.get(name, self._defaults.get(name))

    def _add(self, iv: ipb.Intervention, view: StepView) -> None:
        self._check_open()
        if view.first >= self.max_tokens():
            raise InvalidArgument(
                f"steps from {view.first} are never reached: max_tokens is {self.max_tokens()} "
                "(steps are 0 .. max_tokens - 1)"
            )
        self._interventions.append(iv)

    def _add_read(self, view: StepView, build: Callable[[ipb.Intervention], None],
                  decode: Callable[[trace_pb2.ReadValue], Any], name: str | None) -> Saved:
        name = name or f"read{len(self._reads)}"
        if name in self._reads:
            raise InvalidArgument(f"duplicate read name {name!r}")
        iv = view._intervention(name)
        build(iv)
        self._add(iv, view)
        saved = Saved(name)
        self._reads[name] = _SavedRead(saved, decode)
        return saved

    def _message(self) -> trace_pb2.Invoke:
        return trace_pb2.Invoke(
            prompt=self._prompt,
            sampling_params=sampling_params(**self._sampling),
            interventions=self._interventions,
        )

    # -- results ---------------------------------------------------------------

    def _n(self) -> int:
        n = self._setting("n")
        return 1 if n is None else int(n)

    def _prepare(self) -> None:
        n = self._n()
        for read in self._reads.values():
            read.saved.clear()
            read.saved.steps.clear()
            if n > 1:
                read.saved.extend(Saved(read.saved.name) for _ in range(n))

    def _record(self, step: trace_pb2.StepResult) -> dict[str, Any]:
        values = {}
        for name, value in step.values.items():
            read = self._reads.get(name)
            if read is None:
                continue
            decoded = read.decode(value)
            values[name] = decoded
            target = read.saved if self._n() == 1 else read.saved[step.sequence_index]
            target.append(decoded)
            target.steps.append(step.step)
        return values

    def _label_reads(self) -> None:
        """Once the output has come: each lens and pattern read learns the tokens at its
        positions (LensRead / PatternRead.input_ids), the prompt's then each sequence's drawn
        ones; a lens read of the new token learns its position (prompt length - 1 + step)."""
        result = self.result
        if result is None:
            return
        prompt = list(result.prompt_token_ids)
        for read in self._reads.values():
            per_sequence = [read.saved] if self._n() == 1 else list(read.saved)
            for sequence, saved in enumerate(per_sequence):
                drawn = result.outputs[sequence].token_ids if sequence < len(result.outputs) else []
                tokens = prompt + list(drawn)
                for step, value in zip(saved.steps, saved, strict=False):
                    if isinstance(value, LensRead):
                        if value.positions is None:
                            value.positions = tuple(len(prompt) - 1 + step + p for p in range(value.values.shape[1]))
                        value.input_ids = tuple(tokens[p] if 0 <= p < len(tokens) else -1 for p in value.positions)
                    elif isinstance(value, PatternRead):
                        last = int(np.max(value.positions)) if np.size(value.positions) else -1
                        value.input_ids = tuple(tokens[: last + 1])

    def saved_reads(self) -> list[Saved]:
        """This invoke's saved reads, in the order they were added."""
        return [read.saved for read in self._reads.values()]

    def __enter__(self) -> Invoke:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        return None


class Tracer:
    """A whole trace: its invokes, options and run.

    Given a prompt, the tracer makes that prompt its one invoke and is used as it:
    `all()`, `iter`, `model`, `stop()` and `result` are the invoke's. Without one, prompts
    come from `tracer.invoke(prompt, **overrides)`.
    """

    def __init__(self, runner: Runner, prompt: PromptLike | None = None, **sampling: Any) -> None:
        check_keywords(sampling)
        self._runner = runner
        self._sampling = sampling  # the invokes' defaults
        self._invokes: list[Invoke] = []
        self._sent = False
        self.warnings: list[str] = []
        self.usage: trace_pb2.Usage | None = None
        self._options = trace_pb2.TraceOptions()
        self._prompt_invoke = None if prompt is None else self._add_invoke(prompt, {})

    @property
    def invokes(self) -> list[Invoke]:
        """The trace's invokes, in request order (their `.result` once it has run)."""
        return list(self._invokes)

    def _check_open(self) -> None:
        if self._sent:
            raise InvalidArgument("this trace has already run; start a new one")

    def invoke(self, prompt: PromptLike, **overrides: Any) -> Invoke:
        """Add a prompt; its keywords override the trace's sampling parameters."""
        self._check_open()
        if self._prompt_invoke is not None:
            raise InvalidArgument("this trace was given a prompt; use client.trace() without one for invokes")
        return self._add_invoke(prompt, overrides)

    def _add_invoke(self, prompt: PromptLike, overrides: dict[str, Any]) -> Invoke:
        inv = Invoke(len(self._invokes), prompt, overrides, defaults=self._sampling, check_open=self._check_open)
        self._invokes.append(inv)
        return inv

    # -- the single-prompt form: the prompt's invoke ------------------------------

    def _own(self) -> Invoke:
        if self._prompt_invoke is None:
            raise InvalidArgument(
                "this trace has no prompt of its own: add reads and writes to an invoke "
                "(with tracer.invoke(prompt) as inv: inv.all()...)"
            )
        return self._prompt_invoke

    def all(self) -> StepView:
        return self._own().all()

    @property
    def iter(self) -> _Iter:
        return self._own().iter

    @property
    def model(self) -> _ModuleProxy:
        """`tracer.model.layers[3].output.save()`: layer 3's output at every step's new token."""
        return self._own().model

    def stop(self, *, when: Condition | None = None, step: int | None = None) -> None:
        """Stop at `step`, or at the first step where `when` holds."""
        self._own().stop(when=when, step=step)

    @property
    def result(self) -> RequestOutput | None:
        """The prompt's result once the trace has run (None for a trace of invokes: theirs
        are on each invoke)."""
        return None if self._prompt_invoke is None else self._prompt_invoke.result

    def options(
        self,
        *,
        stream_interval_ms: int | None = None,
        stream_every_step: bool | None = None,
        max_read_bytes: int | None = None,
    ) -> Tracer:
        """Streaming and limits for this trace. `stream_interval_ms`: send step results at
        most that often, coalescing the steps done meanwhile (throughput over per-token
        latency); `stream_every_step=False`: only steps that carry values; `max_read_bytes`:
        refuse the trace up front if its reads could exceed this."""
        self._check_open()
        if stream_interval_ms is not None:
            self._options.stream_interval_ms = stream_interval_ms
        if stream_every_step is not None:
            self._options.stream_every_step = stream_every_step
        if max_read_bytes is not None:
            self._options.max_read_bytes = max_read_bytes
        return self

    def request(self) -> service_pb2.TraceRequest:
        if not self._invokes:
            raise InvalidArgument("a trace needs a prompt: client.trace(prompt) or tracer.invoke(prompt)")
        return service_pb2.TraceRequest(
            sampling_params=sampling_params(**self._sampling),
            invokes=[inv._message() for inv in self._invokes],
            options=self._options,
        )

    # -- running ---------------------------------------------------------------

    def start(self) -> service_pb2.TraceRequest:
        """The request to send; from now on the trace is closed to changes and its saved
        values are empty, ready to fill from `handle`."""
        self._check_open()
        request = self.request()
        self._sent = True
        for inv in self._invokes:
            inv._prepare()
        return request

    def events(self) -> Iterator[Step]:
        """Send the trace and yield each step as it arrives; results fill in meanwhile."""
        for event in self._runner(self.start()):
            yield from self.handle(event)

    def handle(self, event: service_pb2.TraceResponse) -> Iterator[Step]:
        kind = event.WhichOneof("event")
        if kind == "steps":
            for s in event.steps.results:
                values = self._invokes[s.invoke_index]._record(s)
                self._invokes[s.invoke_index].step_tokens.setdefault(s.sequence_index, {})[s.step] = s.text_delta
                yield Step(s.invoke_index, s.sequence_index, s.step, s.token_id, s.text_delta, values, s.stopped)
        elif kind == "invoke_result":
            invoke = self._invokes[event.invoke_result.invoke_index]
            invoke.result = request_output(event.invoke_result.output)
            invoke._label_reads()
        elif kind == "end":
            self.usage = event.end.usage
            for w in event.end.warnings:
                self.warnings.append(w.message)
                _warn_at_caller(w.message)

    def run(self) -> Tracer:
        for _ in self.events():
            pass
        return self

    def _repr_html_(self) -> str:
        """Jupyter: each invoke's tokens and probabilities as a table (notebook.py)."""
        from .notebook import trace_html

        return trace_html(self)

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.run()


__all__ = ["Invoke", "LensRead", "Logprobs", "ModuleRef", "PatternRead", "Saved", "Step", "StepView", "TopK",
           "TraceWarning", "Tracer"]
