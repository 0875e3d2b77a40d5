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
- `text_contains` is exact over the whole text: each check scans only the text added since
  the last one (plus the needle's length), and a needle once found stays found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class TextScan:
    """One sequence's text conditions: compiled patterns and how far each needle was
    looked for. The text passed in only ever grows."""

    _patterns: dict[str, Any] = field(default_factory=dict)
    _scanned: dict[str, int] = field(default_factory=dict)  # needle -> text length looked at; -1: found

    def contains(self, text: str, needle: str) -> bool:
        scanned = self._scanned.get(needle, 0)
        if scanned < 0:
            return True
        if needle in text[max(0, scanned - len(needle) + 1):]:
            self._scanned[needle] = -1
            return True
        self._scanned[needle] = len(text)
        return False

    def matches(self, text: str, pattern: str) -> bool:
        compiled = self._patterns.get(pattern)
        if compiled is None:
            compiled = self._patterns[pattern] = compile_pattern(pattern)
        start = len(text) - TEXT_WINDOW
        if start <= 0:
            return compiled.search(text) is not None
        # One character of context before the window: `^` does not match at the window's
        # start, and `\b` sees the character before it.
        return compiled.search(text[start - 1:], 1) is not None
