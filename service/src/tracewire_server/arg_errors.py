"""Command-line mistakes in one line: argparse's default prints the whole usage first,
and with every vLLM engine option that is ~260 lines above the one that matters."""

from __future__ import annotations

import argparse
import difflib
import sys
import types
from typing import NoReturn


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make `parser.error` print one line (the problem, a close option name if there is
    one, and where the options are listed) and exit 2, as argparse's does."""

    def error(self: argparse.ArgumentParser, message: str) -> NoReturn:
        sys.stderr.write(f"{describe(self, message)}\n")
        sys.exit(2)

    parser.error = types.MethodType(error, parser)  # type: ignore[method-assign]


def describe(parser: argparse.ArgumentParser, message: str) -> str:
    hint = f"run '{parser.prog} --help' for every option"
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return f"tracewire: {message} ({hint})"
    unknown = [word for word in message[len(prefix):].split() if word.startswith("-")]
    if not unknown:  # a stray value, not an option
        return f"tracewire: unexpected argument(s): {message[len(prefix):]} ({hint})"
    known = list(parser._option_string_actions)
    names = []
    for word in unknown:
        flag = word.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        names.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
    return f"tracewire: unknown option {', '.join(names)}; {hint}"
