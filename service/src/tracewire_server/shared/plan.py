"""The plan: what the worker hooks do for one engine request, as typed data.

`compile_trace` (in trace_compiler.py) validates a TraceRequest and produces
one SequencePlan per engine request; the plan travels to the worker inside
SamplingParams.extra_args as msgpack bytes and is decoded there once. Nothing
in a plan is executable: it is a list of ops over a closed set of actions and
conditions.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from typing import ClassVar, Literal, NamedTuple, Union

import msgspec

from .limits import PATTERN_BLOCK_ELEMENTS, PATTERN_SCRATCH_COPIES, ModelLimits

EXTRA_ARGS_KEY = "tracewire"

Comparison = Literal[">", ">=", "<", "<="]


class StepSet(msgspec.Struct, frozen=True):
    """Steps an op is active at: [start, stop) (stop None: open) or an explicit set."""

    start: int = 0
    stop: int | None = None
    steps: frozenset[int] | None = None

    def contains(self, step: int) -> bool:
        if self.steps is not None:
            return step in self.steps
        return step >= self.start and (self.stop is None or step < self.stop)

    def last(self) -> int | None:
        """The last selected step, or None when the selection is open-ended."""
        if self.steps is not None:
            return max(self.steps) if self.steps else None
        return None if self.stop is None else self.stop - 1


# -- conditions ---------------------------------------------------------------


class SampledIn(msgspec.Struct, frozen=True, tag="sampled_in"):
    token_ids: frozenset[int]


class ArgmaxIn(msgspec.Struct, frozen=True, tag="argmax_in"):
    token_ids: frozenset[int]


class TextContains(msgspec.Struct, frozen=True, tag="text_contains"):
    text: str


class TextMatches(msgspec.Struct, frozen=True, tag="text_matches"):
    pattern: str


class TokenProbability(msgspec.Struct, frozen=True, tag="token_probability"):
    token_id: int | None  # None: the drawn token
    comparison: Comparison
    value: float


class Entropy(msgspec.Struct, frozen=True, tag="entropy"):
    comparison: Comparison
    value: float


class DictRef(msgspec.Struct, frozen=True):
    """A dictionary (probe or SAE, shared/dictionary_spec.py) as a plan refers to it: by
    name and generation (the worker fails the request if the name now holds another
    generation), with what the compiler resolved from it."""

    name: str
    generation: int
    module: str  # the module whose output it reads and writes
    size: int  # probe outputs (k) or SAE features (d)


class DictionaryValue(msgspec.Struct, frozen=True, tag="dictionary_value"):
    """A dictionary value (probe output, SAE feature) at the new token against a threshold:
    reads and stops see this step's, writes the previous step's (false at step 0)."""

    dictionary: DictRef
    feature: int
    comparison: Comparison
    value: float

    def read_name(self) -> str:
        """The name of the internal read (condition_reads) whose value this compares: one
        per dictionary generation and feature, whichever ops ask."""
        return f"{CONDITION_READ_PREFIX}{self.dictionary.name}#{self.dictionary.generation}:{self.feature}"


# Names of the reads a plan makes for its conditions (never returned): no client name
# starts with it (the compiler refuses names with control characters).
CONDITION_READ_PREFIX = "\x00dictionary:"


class AllOf(msgspec.Struct, frozen=True, tag="all_of"):
    conditions: tuple[Condition, ...]


class AnyOf(msgspec.Struct, frozen=True, tag="any_of"):
    conditions: tuple[Condition, ...]


class Not(msgspec.Struct, frozen=True, tag="not"):
    condition: Condition


Condition = Union[
    SampledIn, ArgmaxIn, TextContains, TextMatches, TokenProbability, Entropy, AllOf, AnyOf, Not,
    DictionaryValue,
]


# -- actions ------------------------------------------------------------------

# The row a logits read sees, in the order the sampler's row passes them: lm_head's
# output; after vLLM's processing, before tracewire's writes (what write conditions
# see); after the writes (what the sampler draws from).
LogitsStage = Literal["raw", "before_writes", "processed"]

# Where the worker computes a read (each read type says, as its `source`):
#   "logits"   one device computation over every row reading it (equal reads: one
#              computation), from the sampler's row at the read's `stage`
#              (worker/logits_reads.py);
#   "modules"  module outputs copied out during the forward pass, at `positions`,
#              from the modules `module_reads` names (worker/module_reads.py);
#   "sample"   the drawn token itself.
ReadSource = Literal["logits", "modules", "sample"]


class ReadBound(NamedTuple):
    """An upper bound on the bytes one sequence's read returns (the compiler sums them
    against --max-read-bytes): `per_step` at each selected step; for reads of prompt
    positions, `prompt` at step 0 and then `per_step` at each later step. `held`: bytes
    the worker keeps for the sequence while it runs (an attention pattern's key cache),
    counted once against the same budget."""

    per_step: int
    prompt: int | None = None
    held: int = 0


class ReadLogits(msgspec.Struct, frozen=True, tag="read_logits"):
    stage: LogitsStage
    top_k: int | None = None  # the k largest, with ids
    token_ids: tuple[int, ...] | None = None  # these ids, in order
    # neither: the full row

    source: ClassVar[ReadSource] = "logits"

    def read_bound(self, limits: ModelLimits, prompt_len: int) -> ReadBound:
        if self.top_k is not None:
            return ReadBound(8 * self.top_k)  # values and ids
        if self.token_ids is not None:
            return ReadBound(8 * len(self.token_ids))
        return ReadBound(4 * limits.vocab_size)


class ReadSample(msgspec.Struct, frozen=True, tag="read_sample"):
    source: ClassVar[ReadSource] = "sample"

    def read_bound(self, limits: ModelLimits, prompt_len: int) -> ReadBound:
        return ReadBound(4)


class ReadLogprobs(msgspec.Struct, frozen=True, tag="read_logprobs"):
    """The drawn token's logprob, then the top k with their ids (of the sampler's row)."""

    top_k: int

    source: ClassVar[ReadSource] = "logits"
    stage: ClassVar[LogitsStage] = "processed"

    def read_bound(self, limits: ModelLimits, prompt_len: int) -> ReadBound:
        return ReadBound(8 * (1 + self.top_k))


PositionsKind = Literal["new_token", "all_prompt", "prompt_range", "prompt_list", "all"]


class Positions(msgspec.Struct, frozen=True):
    """Token positions of a module's output: the new token at each step, or prompt
    positions (at step 0; negative values count from the prompt's end)."""

    kind: PositionsKind = "new_token"
    start: int = 0
    stop: int | None = None
    items: tuple[int, ...] = ()

    def prompt_positions(self, prompt_len: int) -> list[int]:
        """The selected prompt positions (ascending) for a prompt of `prompt_len` tokens."""
        if self.kind in ("all_prompt", "all"):
            return list(range(prompt_len))
        if self.kind == "prompt_range":
            return list(range(prompt_len))[slice(self.start, self.stop)]
        if self.kind == "prompt_list":
            return sorted({p % prompt_len for p in self.items})
        return []

    def new_token_only(self, step: int) -> bool:
        """Whether a read at `step` sees the new token alone: always for "new_token", and
        for "all" after the prompt's step 0."""
        return self.kind == "new_token" or (self.kind == "all" and step > 0)

    def read_bound(self, width: int, prompt_len: int) -> ReadBound:
        """The bound of a read of `width` bytes per position at these positions."""
        if self.kind == "new_token":
            return ReadBound(width)
        prompt = len(self.prompt_positions(prompt_len)) * width
        return ReadBound(width if self.kind == "all" else 0, prompt)  # (after step 0: "all" reads the new token)


# -- units: attention heads and MLP neurons ------------------------------------------

# Unit-addressed modules: a module input viewed as units per token position.
#   "heads"    layers.L.self_attn.heads: o_proj's input, [num_attention_heads, head_dim];
#   "neurons"  layers.L.mlp.act: down_proj's input, [intermediate_size].
UnitKind = Literal["heads", "neurons"]
HEADS_SUFFIX = ".self_attn.heads"
NEURONS_SUFFIX = ".mlp.act"


@functools.lru_cache(maxsize=4096)  # (per traced row and step; paths are the model's modules)
def unit_kind(path: str) -> UnitKind | None:
    """Which units a module path addresses; None for an ordinary module."""
    if path.startswith("layers.") and path.count(".") == 3:
        if path.endswith(HEADS_SUFFIX):
            return "heads"
        if path.endswith(NEURONS_SUFFIX):
            return "neurons"
    return None


def module_shape(path: str, limits: ModelLimits) -> tuple[int, ...]:
    """A module's output shape per token position (GetModelInfo's ModuleInfo.shape)."""
    kind = unit_kind(path)
    if kind == "heads":
        return (limits.num_attention_heads, limits.head_dim)
    if kind == "neurons":
        return (limits.intermediate_size,)
    return (limits.hidden_size,)


class Units(msgspec.Struct, frozen=True):
    """The units a read of a unit-addressed module returns per position: these ids in
    this order (None: every unit), or the `top_k` largest (neurons), largest first."""

    ids: tuple[int, ...] | None = None
    top_k: int | None = None

    def read_width(self, path: str, limits: ModelLimits) -> int:
        """Bytes per position: float32 values (and int32 ids for top-k)."""
        shape = module_shape(path, limits)
        if self.top_k is not None:
            return 8 * self.top_k
        count = len(self.ids) if self.ids is not None else shape[0]
        return 4 * count * (shape[1] if len(shape) > 1 else 1)


class ReadModule(msgspec.Struct, frozen=True, tag="read_module"):
    module: str
    positions: Positions
    mean: bool = False
    units: Units | None = None  # unit-addressed modules only (unit_kind)

    source: ClassVar[ReadSource] = "modules"

    def module_reads(self, name: str) -> list[tuple[str, str]]:
        """(key, module path) of the module output this read gathers: its own."""
        return [(name, self.module)]

    def read_bound(self, limits: ModelLimits, prompt_len: int) -> ReadBound:
        units = self.units or Units()
        width = units.read_width(self.module, limits) if unit_kind(self.module) else 4 * limits.hidden_size
        if self.mean:
            return ReadBound(width)  # one row, whatever the positions
        return self.positions.read_bound(width, prompt_len)


class ReadLogitLens(msgspec.Struct, frozen=True, tag="read_logit_lens"):
    """Final norm + lm_head on decoder layers' residual streams, as logprobs."""

    layers: tuple[int, ...]  # non-negative layer indices
    positions: Positions
    top_k: int  # 0: full rows

    source: ClassVar[ReadSource] = "modules"

    def module_reads(self, name: str) -> list[tuple[str, str]]:
        """(key, module path) of each layer whose stream this read gathers."""
        return [(f"{name}@{layer}", f"layers.{layer}") for layer in self.layers]

    def read_bound(self, limits: ModelLimits, prompt_len: int) -> ReadBound:
        # top-k: values + ids (8 bytes an entry); full rows: values only
        width = len(self.layers) * (8 * self.top_k if self.top_k else 4 * limits.vocab_size)
        return self.positions.read_bound(width, prompt_len)


class ReadAttentionPattern(msgspec.Struct, frozen=True, tag="read_attention_pattern"):
    """Attention weights of query positions over key positions, per decoder layer and
    query head, from the layer's own post-rotary q / k (worker/attention_patterns.py):
    [layers, positions, heads, top_k or keys]."""

    layers: tuple[int, ...]  # non-negative, distinct
    heads: tuple[int, ...]  # query heads, distinct, in the order the values come back in
    positions: Positions  # the query positions
    top_k: int  # 0: full rows (keys 0 .. the last query position)
    # Set by the compiler from the model and the request, so the worker allocates and
    # the budget counts the same bytes:
    kv_heads: tuple[int, ...]  # the KV heads `heads` read (GQA), ascending: the key cache's
    head_dim: int
    max_len: int  # prompt_len + max_tokens: the most positions a sequence's key cache holds

    source: ClassVar[ReadSource] = "modules"

    def module_reads(self, name: str) -> list[tuple[str, str]]:
        """(key, module path) of each layer's attention this read computes at."""
        return [(f"{name}@{layer}", f"layers.{layer}.self_attn.attn") for layer in self.layers]

    def key_cache_bytes(self) -> int:
        """The worker's float32 copy of the keys the read needs, for the whole generation."""
        return 4 * len(self.layers) * len(self.kv_heads) * self.head_dim * self.max_len

    def scratch_bytes(self) -> int:
        """The worker's transient float32 blocks while it computes the weights (limits.py's
        PATTERN_BLOCK_ELEMENTS): a block holds at most that many elements, or one query
        row where a row alone is more (its heads' scores, or its keys padded for the
        batch, over max_len keys); at most max_len rows a pass. Blocks are computed one
        after another and freed, whichever sequence or layer they are for: the compiler
        counts the largest once per trace."""
        row = max(len(self.heads), len(self.kv_heads) * self.head_dim) * self.max_len
        return PATTERN_SCRATCH_COPIES * 4 * max(row, min(PATTERN_BLOCK_ELEMENTS, row * self.max_len))

    def read_bound(self, limits: ModelLimits, prompt_len: int) -> ReadBound:
        # top-k: values + key positions (8 bytes an entry); full rows: values over at most
        # max_len keys (the new token's row grows by one key a step)
        width = len(self.layers) * len(self.heads) * (8 * self.top_k if self.top_k else 4 * self.max_len)
        bound = self.positions.read_bound(width, prompt_len)
        return bound._replace(held=self.key_cache_bytes())


class ReadDictionary(msgspec.Struct, frozen=True, tag="read_dictionary"):
    """A dictionary on its module's output at positions (worker/dictionaries.py): every
    value ([size]), the `top_k` largest with their ids, chosen `features`, or (SAEs) the
    reconstruction error's norm ([1])."""

    dictionary: DictRef
    positions: Positions
    top_k: int | None = None
    features: tuple[int, ...] | None = None
    error: bool = False
    # A condition's value (DictionaryValue.read_name): computed, kept on the worker for the
    # conditions, never returned.
    internal: bool = False

    source: ClassVar[ReadSource] = "modules"

    def module_reads(self, name: str) -> list[tuple[str, str]]:
        """(key, module path) of the module output it gathers: its dictionary's module."""
        return [(name, self.dictionary.module)]

    def width(self) -> int:
        """Bytes per position returned: float32 values (and int32 ids for top-k)."""
        if self.error:
            return 4
        if self.top_k is not None:
            return 8 * self.top_k
        return 4 * (len(self.features) if self.features is not None else self.dictionary.size)

    def read_bound(self, limits: ModelLimits, prompt_len: int) -> ReadBound:
        if self.internal:
            return ReadBound(0)  # never returned
        return self.positions.read_bound(self.width(), prompt_len)


class DictionaryEdit(msgspec.Struct, frozen=True):
    """A module write along dictionary directions: "steer" adds value * direction of each
    feature (SAE: W_dec[f], probe: W[f]); "clamp" (SAEs) sets each feature's activation to
    value, keeping the reconstruction error: x + sum_f (value - a_f(x)) * W_dec[f]."""

    dictionary: DictRef
    features: tuple[int, ...]
    value: float


class ForceSample(msgspec.Struct, frozen=True, tag="force_sample"):
    token_id: int


class ReplaceLogits(msgspec.Struct, frozen=True, tag="replace_logits"):
    values: bytes  # float32 [vocab], little-endian


class AddLogits(msgspec.Struct, frozen=True, tag="add_logits"):
    values: bytes  # float32 [vocab], little-endian


class BiasLogits(msgspec.Struct, frozen=True, tag="bias_logits"):
    bias: dict[int, float]


class MaskLogits(msgspec.Struct, frozen=True, tag="mask_logits"):
    token_ids: tuple[int, ...]


ModuleEdit = Literal["add", "replace", "zero", "mean", "patch", "add_read", "steer", "clamp"]
# What a compiled engine's steering tables express (stream' = a * stream + b, steering.py;
# a patch is a replace, an add_read an add, by the source's row; a mean, with mean groups,
# takes the mean of its rows first; a clamp, with clamp columns, adds its features' change
# last).
COMPILED_EDITS: tuple[ModuleEdit, ...] = ("add", "replace", "zero", "steer", "patch", "add_read", "mean", "clamp")


def is_decoder_layer(path: str) -> bool:
    """`layers.N`: a decoder layer's output, the residual stream after it."""
    return path.startswith("layers.") and path.count(".") == 1


def module_order(path: str) -> tuple[int, str]:
    """A sort key for module paths: the embeddings, the layers by number (each layer's own
    modules after it, by name), then the final norm and lm_head."""
    parts = path.split(".")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return (int(parts[1]), path)
    return (-1 if path == "embed_tokens" else 1 << 30, path)


def layer_number(path: str) -> int:
    return int(path.split(".")[1])


class ReadRef(msgspec.Struct, frozen=True):
    """Activation patching: another invoke's module read in the same trace as a write's
    operand ("patch" / "add_read"). The source's worker keeps the read's rows (device
    tensors) in its PatchStore under (trace, invoke, name, step) before it sends that
    step's record; the target's write takes `rows` of them at the same step. Nothing
    here says what the rows are rows of: a patch is "these stored rows replace the
    target's selected rows of its address", whatever the address."""

    trace: str  # the trace's key ("" until the trace compiler resolves the reference)
    invoke: int  # the source invoke
    name: str  # the source's read
    positions: tuple[int, ...] = ()  # as asked: the source's prompt positions (empty: all)
    rows: tuple[int, ...] = ()  # resolved: indices into the source read's rows (empty: all, in order)


class WriteModule(msgspec.Struct, frozen=True, tag="write_module"):
    """Change a module's output at positions (for decoder layers: the residual stream)."""

    module: str
    positions: Positions
    edit: ModuleEdit
    vector: bytes = b""  # float32 [hidden] for add / replace (unit writes: see `units`)
    scale: float = 1.0
    # Unit-addressed modules only (unit_kind): the heads / neurons written, None: every
    # unit. `vector` is then float32 [units, head_dim] or [head_dim] (heads; the latter
    # for every chosen head alike), [units] (neurons).
    units: tuple[int, ...] | None = None
    ref: ReadRef | None = None  # the operand of "patch" / "add_read"
    dictionary: DictionaryEdit | None = None  # the operand of "steer" / "clamp"


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    pass


class InjectFault(msgspec.Struct, frozen=True, tag="inject_fault"):
    """Raise inside the worker hook (only when the server runs with
    --enable-fault-injection): proves a failing intervention fails its own
    trace only."""

    message: str


Read = Union[
    ReadLogits, ReadSample, ReadLogprobs, ReadModule, ReadLogitLens, ReadAttentionPattern, ReadDictionary
]
Write = Union[ForceSample, ReplaceLogits, AddLogits, BiasLogits, MaskLogits, InjectFault, WriteModule]
Action = Union[
    ReadLogits,
    ReadSample,
    ReadLogprobs,
    ReadModule,
    ReadLogitLens,
    ReadAttentionPattern,
    ReadDictionary,
    ForceSample,
    ReplaceLogits,
    AddLogits,
    BiasLogits,
    MaskLogits,
    InjectFault,
    WriteModule,
    Stop,
]
READS = (ReadLogits, ReadSample, ReadLogprobs, ReadModule, ReadLogitLens, ReadAttentionPattern, ReadDictionary)
# The reads of the logits source: each one's equal reads are one computation.
LogitsRead = Union[ReadLogits, ReadLogprobs]
HIDDEN_READS = (ReadModule, ReadLogitLens, ReadAttentionPattern, ReadDictionary)
HIDDEN_OPS = (ReadModule, ReadLogitLens, ReadAttentionPattern, ReadDictionary, WriteModule)
WRITES = (ForceSample, ReplaceLogits, AddLogits, BiasLogits, MaskLogits, InjectFault, WriteModule)
LOGITS_WRITES = (ForceSample, ReplaceLogits, AddLogits, BiasLogits, MaskLogits, InjectFault)


class Op(msgspec.Struct, frozen=True):
    name: str
    steps: StepSet
    condition: Condition | None
    action: Action

    def selects(self, step: int) -> bool:
        """Active at `step`: selected, and reads of prompt positions only at step 0 (the
        prefill is the only time the prompt runs through the model)."""
        if (
            step > 0
            and isinstance(self.action, HIDDEN_OPS)
            and self.action.positions.kind not in ("new_token", "all")
        ):
            return False
        return self.steps.contains(step)


class SequencePlan(msgspec.Struct, frozen=True):
    """Everything the worker does for one engine request (one sequence)."""

    key: str  # joins the worker's records with the server's request
    ops: tuple[Op, ...]
    # Which frontend process gets this request's records (0 with a single frontend).
    route: int = 0
    # How text conditions decode the text so far: as the client's text deltas are.
    skip_special_tokens: bool = True
    # Activation patching: the reads of this request other invokes' writes take as operands
    # (the worker keeps their rows under (trace, invoke, name, step) until the trace ends).
    exports: frozenset[str] = frozenset()
    trace: str = ""  # the trace's key, with exports
    invoke: int = 0  # this request's invoke, with exports
    # Pipeline parallelism: the stage each op runs on (the one holding its module; the
    # last for the others), op for op; empty: one stage. Each stage's worker runs its own
    # ops and sends their values; the server joins a step's parts (parts_at).
    stages: tuple[int, ...] = ()

    def on_stage(self, stage: int) -> SequencePlan:
        """The plan as pipeline stage `stage`'s worker runs it: its own ops."""
        if not self.stages:
            return self
        ops = tuple(op for op, at in zip(self.ops, self.stages, strict=True) if at == stage)
        return msgspec.structs.replace(self, ops=ops, stages=())

    def parts_at(self, step: int) -> int:
        """How many records make the step's: one from each stage with an op selected then."""
        if not self.stages:
            return 1 if self.active_at(step) else 0
        return len({at for op, at in zip(self.ops, self.stages, strict=True) if op.selects(step)})

    def active_at(self, step: int) -> tuple[Op, ...]:
        """The ops selected at `step`. The worker sends a record for a step exactly
        when this is non-empty, and the server waits for one exactly then."""
        return tuple(op for op in self.ops if op.selects(step))

    def needs_text(self) -> bool:
        return any(_uses_text(op.condition) for op in self.ops)

    def text_needles(self) -> frozenset[str]:
        """The strings of every text_contains in the plan's conditions."""
        return frozenset(c.text for op in self.ops for c in _leaves(op.condition) if isinstance(c, TextContains))


def runs_whole_prompt(action: Action) -> bool:
    """Whether a read needs prompt positions to run through the model (then its request
    skips reading the prefix cache, whose positions never do): reads of prompt
    positions, and attention patterns at any position (their keys)."""
    if isinstance(action, ReadAttentionPattern):
        return True
    return isinstance(action, HIDDEN_READS) and action.positions.kind != "new_token"


def conditions_use_logits(ops: tuple[Op, ...]) -> bool:
    """Whether any op's condition is computed from the sampler's row (the worker then
    keeps a copy of that row until the draw is known)."""
    return any(_uses_logits(op.condition) for op in ops)


def _leaves(condition: Condition | None) -> Iterator[Condition]:
    """The leaves of a condition tree."""
    if condition is None:
        return
    if isinstance(condition, (AllOf, AnyOf)):
        for c in condition.conditions:
            yield from _leaves(c)
    elif isinstance(condition, Not):
        yield from _leaves(condition.condition)
    else:
        yield condition


def _any_leaf(condition: Condition | None, leaf: Callable[[Condition], bool]) -> bool:
    """Whether `leaf` holds for any leaf of the condition tree."""
    return any(leaf(c) for c in _leaves(condition))


def _uses_text(condition: Condition | None) -> bool:
    return _any_leaf(condition, lambda c: isinstance(c, (TextContains, TextMatches)))


def uses_drawn_token(condition: Condition | None) -> bool:
    """Whether the condition needs the token drawn at this step."""
    return _any_leaf(
        condition,
        lambda c: isinstance(c, SampledIn) or (isinstance(c, TokenProbability) and c.token_id is None),
    )


def dictionary_values(condition: Condition | None) -> Iterator[DictionaryValue]:
    """The dictionary leaves of a condition tree."""
    return (c for c in _leaves(condition) if isinstance(c, DictionaryValue))


def condition_reads(ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """The internal reads that compute `ops`' dictionary conditions' values: one per
    dictionary and feature, at the new token, at every step from 0 to the last one any op
    asking for it selects (a write at step s looks at step s - 1's value)."""
    lasts: dict[str, tuple[DictionaryValue, int | None]] = {}
    for op in ops:
        for leaf in dictionary_values(op.condition):
            key = leaf.read_name()
            last = op.steps.last()
            if key in lasts:
                before = lasts[key][1]
                last = None if before is None or last is None else max(before, last)
            lasts[key] = (leaf, last)
    return tuple(
        Op(key, StepSet(0, None if last is None else last + 1), None,
           ReadDictionary(leaf.dictionary, Positions(), features=(leaf.feature,), internal=True))
        for key, (leaf, last) in lasts.items()
    )


def known_before_forward(condition: Condition) -> bool:
    """Whether every leaf is decidable before the forward pass: text conditions, and
    dictionary values (the previous step's)."""
    return not _any_leaf(condition, lambda c: not isinstance(c, (TextContains, TextMatches, DictionaryValue)))


def _uses_logits(condition: Condition | None) -> bool:
    return _any_leaf(condition, lambda c: isinstance(c, (ArgmaxIn, TokenProbability, Entropy)))


def kv_cache_salt(ops: tuple[Op, ...], prompt_len: int, skip_special_tokens: bool) -> str | None:
    """vLLM's `cache_salt` for a request with module writes; None without them.

    vLLM's prefix cache keys KV blocks by token ids, but a module write changes the keys
    and values of every position after the one it touches. So a request with writes must
    neither read blocks computed without them nor leave blocks for requests without them.
    The salt names everything that decides what was written where: the writes with their
    steps and conditions (and how text conditions decode), and the prompt length (which step computed a cached position;
    the token ids themselves are in vLLM's block hash). Identical steered requests share
    their blocks; no other request hits them, and they hit no one else's.
    """
    writes = tuple((op.steps, op.condition, op.action) for op in ops if isinstance(op.action, WriteModule))
    if not writes:
        return None
    return "tracewire:" + hashlib.sha256(_CANONICAL.encode((prompt_len, skip_special_tokens, writes))).hexdigest()


_ENCODER = msgspec.msgpack.Encoder()
# Sets and dicts in sorted order: equal plans encode to equal bytes.
_CANONICAL = msgspec.msgpack.Encoder(order="deterministic")
_DECODER = msgspec.msgpack.Decoder(SequencePlan)


def encode_plan(plan: SequencePlan) -> bytes:
    return _ENCODER.encode(plan)


def decode_plan(data: bytes) -> SequencePlan:
    return _DECODER.decode(data)
