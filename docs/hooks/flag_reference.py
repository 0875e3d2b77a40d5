"""mkdocs hook: every flag of `python -m tracewire_server` (tracewire's and vLLM's engine
options), generated from the server's own argparse parser into the page that holds the
marker, so a new flag is documented the moment it exists.

`tracewire_server.__main__.parse_args` builds the parser and parses in one function; the
parser is taken from it at the point it would parse, by handing it a parser class whose
parse_args hands the parser back instead. Nothing else of the server runs. Which flags are
tracewire's is what the parser holds when vLLM's `AsyncEngineArgs.add_cli_args` is called:
everything after that is vLLM's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from markdown_table import cell, table

MARKER = "<!-- generated: server flags -->"
ROOT = Path(__file__).resolve().parents[2]


def on_page_markdown(markdown: str, **_: object) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render(*server_parser()))


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser built")
        self.parser = parser


def server_parser() -> tuple[argparse.ArgumentParser, set[argparse.Action]]:
    """The server's parser, and the actions of tracewire's own flags in it."""
    from tracewire_server import __main__ as server_main
    from tracewire_server.frontend import vllm_compat

    real_parser, real_engine_args = vllm_compat.FlexibleArgumentParser, vllm_compat.AsyncEngineArgs
    own: set[argparse.Action] = set()

    class Capturing(real_parser):  # type: ignore[misc, valid-type]
        def parse_args(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise _Built(self)

    class EngineArgs(real_engine_args):  # type: ignore[misc, valid-type]
        @staticmethod
        def add_cli_args(parser, *args, **kwargs):  # type: ignore[no-untyped-def]
            own.update(parser._actions)
            return real_engine_args.add_cli_args(parser, *args, **kwargs)

    vllm_compat.FlexibleArgumentParser, vllm_compat.AsyncEngineArgs = Capturing, EngineArgs
    try:
        server_main.parse_args([])
    except _Built as built:
        return built.parser, own
    finally:
        vllm_compat.FlexibleArgumentParser, vllm_compat.AsyncEngineArgs = real_parser, real_engine_args
    raise RuntimeError("tracewire_server.__main__.parse_args returned without parsing")


def render(parser: argparse.ArgumentParser, own: set[argparse.Action]) -> str:
    out = ["## tracewire's flags\n"]
    out += _groups(parser, lambda action: action in own and "--help" not in action.option_strings, "###")
    out.append("## vLLM's engine options\n")
    out.append("vLLM's own, as its `AsyncEngineArgs` defines them for this build of vLLM (its docs say more).\n")
    out += _groups(parser, lambda action: action not in own, "###")
    return "\n".join(out)


def _groups(parser: argparse.ArgumentParser, keep, heading: str) -> list[str]:  # type: ignore[no-untyped-def]
    # A plain formatter: the server's own appends "(default: ...)", which has a column here.
    formatter = argparse.HelpFormatter(parser.prog)
    out: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.option_strings and a.help != argparse.SUPPRESS and keep(a)]
        if not actions:
            continue
        out.append(f"{heading} {cell(group.title or 'options')}\n")
        if group.description:
            out.append(cell(group.description) + "\n")
        rows = [[_flags(action), _default(action), cell(_help(formatter, action))] for action in actions]
        out.append(table(["flag", "default", "what"], rows))
    return out


def _flags(action: argparse.Action) -> str:
    metavar = "" if action.nargs == 0 else f" {_metavar(action)}"
    return "<br>".join(f"`{flag}{metavar}`" for flag in action.option_strings)


def _metavar(action: argparse.Action) -> str:
    if isinstance(action.metavar, str):
        return action.metavar
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest.upper()


def _default(action: argparse.Action) -> str:
    default = action.default
    if default in (None, "", [], argparse.SUPPRESS) or action.nargs == 0:
        return ""
    if isinstance(default, str):
        # The embedded default model is an absolute path of this checkout: shown as the
        # checkout-relative path a reader's own checkout has.
        return f"`{default.removeprefix(str(ROOT) + '/')}`"
    return f"`{default!r}`"


def _help(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    if not action.help:
        return ""
    try:
        return formatter._expand_help(action)  # %(default)s and the like, as --help shows them
    except (KeyError, TypeError, ValueError):
        return action.help
