"""Declarative conditions: data the server evaluates, never code.

    import tracewire as tw
    tw.sampled_in(period_id)                 # the drawn token is one of these
    tw.argmax_in(paris_id)                   # the most likely token is one of these
    tw.text_contains(".")                    # the text so far contains
    tw.text_matches(r"[.!?]$")               # ... or matches a regex (RE2, searched)
    tw.prob() < 0.1                          # the drawn token's probability
    tw.prob(paris_id) > 0.5                  # a given token's probability
    tw.entropy() > 2.5                       # entropy (nats) of the distribution
    tw.probe_above("refusal", 0.9)           # a probe's output 0 (dictionaries; see below)
    tw.feature_active("res-l3", 1234)        # an SAE feature's activation > 0
    (a & b), (a | b), ~a                     # combinators

Writes act before the draw, so their conditions cannot look at the drawn token, and
argmax_in / prob / entropy on a write see the row before any of the step's writes (what
`view.logits.before_writes` reads). Reads and stops are decided after the draw, on the row
drawn from (`view.logits`, the writes included).
"""

from __future__ import annotations

from collections.abc import Iterable

from .dictionary_ops import check_name, feature_ids, finite
from .v1 import intervention_pb2 as ipb


class Condition:
    """A condition, combinable with &, | and ~."""

    def __init__(self, message: ipb.Condition) -> None:
        self.message = message

    def __and__(self, other: Condition) -> Condition:
        return Condition(ipb.Condition(all_of=ipb.Conditions(conditions=[self.message, other.message])))

    def __or__(self, other: Condition) -> Condition:
        return Condition(ipb.Condition(any_of=ipb.Conditions(conditions=[self.message, other.message])))

    def __invert__(self) -> Condition:
        negated = ipb.Condition()
        getattr(negated, "not").CopyFrom(self.message)
        return Condition(negated)

    def __bool__(self) -> bool:
        raise TypeError(
            "a tracewire condition is evaluated on the server, not in Python: pass it as "
            "when=... instead of using it in `if`"
        )

    def __repr__(self) -> str:
        return f"Condition({self.message})".replace("\n", " ")


def _ids(token_ids: int | Iterable[int]) -> list[int]:
    return [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]


def sampled_in(token_ids: int | Iterable[int]) -> Condition:
    return Condition(ipb.Condition(sampled_in=ipb.TokenSet(token_ids=_ids(token_ids))))


def argmax_in(token_ids: int | Iterable[int]) -> Condition:
    return Condition(ipb.Condition(argmax_in=ipb.TokenSet(token_ids=_ids(token_ids))))


def text_contains(text: str) -> Condition:
    """The text so far (as streamed to you) contains `text` (at most 1024 characters)."""
    return Condition(ipb.Condition(text_contains=text))


def text_matches(pattern: str) -> Condition:
    """The text so far matches `pattern`: RE2 syntax (no backreferences or lookaround), at
    most 1024 characters, searched in the last 4096 characters of the text."""
    return Condition(ipb.Condition(text_matches=pattern))


class _Measure:
    """A quantity compared to a threshold: `prob() < 0.1`, `entropy() >= 2`."""

    def __init__(self, token_id: int | None, entropy: bool) -> None:
        self._token_id = token_id
        self._entropy = entropy

    def _compare(self, comparison: ipb.Comparison, value: float) -> Condition:
        threshold = ipb.Threshold(comparison=comparison, value=float(value))
        if self._entropy:
            return Condition(ipb.Condition(entropy=threshold))
        tp = ipb.TokenProbability(threshold=threshold)
        if self._token_id is not None:
            tp.token_id = self._token_id
        return Condition(ipb.Condition(token_probability=tp))

    def __gt__(self, value: float) -> Condition:
        return self._compare(ipb.COMPARISON_GREATER, value)

    def __ge__(self, value: float) -> Condition:
        return self._compare(ipb.COMPARISON_GREATER_EQUAL, value)

    def __lt__(self, value: float) -> Condition:
        return self._compare(ipb.COMPARISON_LESS, value)

    def __le__(self, value: float) -> Condition:
        return self._compare(ipb.COMPARISON_LESS_EQUAL, value)


def prob(token_id: int | None = None) -> _Measure:
    """The probability of `token_id` (default: the drawn token) under the sampler's logits."""
    return _Measure(token_id, entropy=False)


def entropy() -> _Measure:
    """The entropy, in nats, of the sampler's distribution."""
    return _Measure(None, entropy=True)


# -- dictionaries (linear probes, SAEs): closed-loop control inside the engine ------------
#
# A dictionary value is taken at the new token's position of the dictionary's module. Reads
# and stops at step s see the value step s's forward pass computed (at the last prompt
# position for s = 0, else at the token drawn at step s - 1): what a `.probe()` /
# `.features(ids=...)` read at "new" positions returns at step s. Writes are decided before
# step s's forward pass, so they see step s - 1's value, one step late; at step 0 there is
# none and the condition is false (its `~` true).


def _dictionary_threshold(dictionary: str, feature: int, comparison: ipb.Comparison, value: float) -> Condition:
    check_name(dictionary, "dictionary")
    (index,) = feature_ids(feature, f"dictionary {dictionary!r}: feature")
    threshold = ipb.Threshold(comparison=comparison, value=finite(value, f"dictionary {dictionary!r}: threshold"))
    return Condition(ipb.Condition(dictionary_value=ipb.DictionaryThreshold(
        dictionary=dictionary, feature=index, threshold=threshold)))


def probe_above(dictionary: str, threshold: float, output: int = 0) -> Condition:
    """Probe `dictionary`'s output `output` (after its activation) is > threshold."""
    return _dictionary_threshold(dictionary, output, ipb.COMPARISON_GREATER, threshold)


def probe_below(dictionary: str, threshold: float, output: int = 0) -> Condition:
    """Probe `dictionary`'s output `output` (after its activation) is < threshold."""
    return _dictionary_threshold(dictionary, output, ipb.COMPARISON_LESS, threshold)


def feature_active(dictionary: str, feature: int, threshold: float = 0.0) -> Condition:
    """SAE `dictionary`'s feature `feature` has an activation > threshold."""
    return _dictionary_threshold(dictionary, feature, ipb.COMPARISON_GREATER, threshold)


class _DictionaryMeasure:
    """A dictionary value compared to a threshold: `dictionary_value("res-l3", 12) >= 2.0`."""

    def __init__(self, dictionary: str, feature: int) -> None:
        self._dictionary, self._feature = dictionary, feature

    def __gt__(self, value: float) -> Condition:
        return _dictionary_threshold(self._dictionary, self._feature, ipb.COMPARISON_GREATER, value)

    def __ge__(self, value: float) -> Condition:
        return _dictionary_threshold(self._dictionary, self._feature, ipb.COMPARISON_GREATER_EQUAL, value)

    def __lt__(self, value: float) -> Condition:
        return _dictionary_threshold(self._dictionary, self._feature, ipb.COMPARISON_LESS, value)

    def __le__(self, value: float) -> Condition:
        return _dictionary_threshold(self._dictionary, self._feature, ipb.COMPARISON_LESS_EQUAL, value)


def dictionary_value(dictionary: str, feature: int) -> _DictionaryMeasure:
    """A probe output (after its activation) or an SAE feature activation, to compare with
    >, >=, <, <= (probe_above / probe_below / feature_active are the common cases)."""
    return _DictionaryMeasure(dictionary, feature)
