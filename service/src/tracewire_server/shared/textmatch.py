"""Text conditions (`text_contains`, `text_matches`): bounded work on the engine's thread.

Conditions are decided on the engine's thread (or its collector), where a slow one stalls
every request. So:
- Patterns are RE2 (google-re2), whose matching is linear in the text: Python's `re`
  backtracks, and `(a+)+b` over 30 characters took minutes. RE2 refuses what it cannot
  match that way (backreferences, lookaround); its syntax is
  https://github.com/google/re2/wiki/Syntax. A pattern is at most MAX_PATTERN_CHARS long
  and compiles within MAX_PATTERN_MEMORY, checked when the trace is compiled.
- `text_matches` searches the last TEXT_WINDOW characters of the text so far, with the
  character before them as context, so `^` and `\\b` mean what they mean in the whole text.
- `text_contains` is exact over the whole text: every needle of the plan is looked for in
  each step's new text (with the needle's length before it), and once found stays found.
- So a sequence keeps only the last TEXT_WINDOW + 1 characters of its text: a step's work
  is bounded by its new text, the window and the needles, however long the text grows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import re2

MAX_PATTERN_CHARS = 1024  # also the longest text_contains needle
MAX_PATTERN_MEMORY = 1 << 20  # bytes RE2 may use for one compiled pattern
TEXT_WINDOW = 4096  # characters of the text so far a text_matches searches


class PatternError(ValueError):
    """A pattern RE2 cannot compile within the bounds."""


def compile_pattern(pattern: str) -> Any:
    """The compiled RE2 pattern; PatternError saying why when there is none."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"is {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    options = re2.Options()
    options.max_mem = MAX_PATTERN_MEMORY
    options.log_errors = False  # (RE2 would log every refused pattern to stderr)
    try:
        return re2.compile(pattern, options)
    except re2.error as e:
        reason = e.args[0] if e.args else e
        if isinstance(reason, bytes):
            reason = reason.decode(errors="replace")
        raise PatternError(f"not a regular expression RE2 can run in linear time: {reason}") from None


def check_needle(needle: str) -> None:
    if not needle:
        raise PatternError("must not be empty")
    if len(needle) > MAX_PATTERN_CHARS:
        raise PatternError(f"is {len(needle)} characters; at most {MAX_PATTERN_CHARS}")


class TextScan:
    """One sequence's text so far, as its text conditions need it: the last TEXT_WINDOW + 1
    characters, which of the plan's needles have appeared anywhere in it, and the compiled
    patterns. `extend` with each step's new text, in order."""

    def __init__(self, needles: Iterable[str] = ()) -> None:
        self._tail = ""
        self._looking = {needle for needle in needles if needle}  # not found yet
        self._found: set[str] = set()
        self._patterns: dict[str, Any] = {}

    def extend(self, delta: str) -> None:
        if not delta:
            return
        text = self._tail + delta
        for needle in tuple(self._looking):
            # A needle that ends in `delta` starts at most len(needle) - 1 characters
            # before it; the tail always holds those (needles are shorter than it).
            if needle in text[max(0, len(self._tail) - len(needle) + 1):]:
                self._looking.discard(needle)
                self._found.add(needle)
        self._tail = text[-(TEXT_WINDOW + 1):]

    def contains(self, needle: str) -> bool:
        """Whether `needle`, one of the needles given at the start, is in the text."""
        return needle in self._found

    def matches(self, pattern: str) -> bool:
        compiled = self._patterns.get(pattern)
        if compiled is None:
            compiled = self._patterns[pattern] = compile_pattern(pattern)
        if len(self._tail) <= TEXT_WINDOW:  # the whole text
            return compiled.search(self._tail) is not None
        # The window, with the character before it as context: `^` does not match at the
        # window's start, and `\b` sees the character before it.
        return compiled.search(self._tail, 1) is not None
