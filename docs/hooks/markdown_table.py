"""A Markdown table whose cells come from text written for another medium (proto comments,
argparse help): one line per cell, pipes escaped, angle brackets kept from being read as
HTML, backtick spans left as written."""

from __future__ import annotations

import re

_CODE_SPAN = re.compile(r"(`[^`]*`)")


def cell(text: str) -> str:
    flat = " ".join(text.split())
    parts = _CODE_SPAN.split(flat)
    # Outside code spans `<` would open an HTML tag and `*` emphasis ("scale * vector");
    # inside them Markdown shows the characters as they are, so they stay.
    escaped = [
        part if part.startswith("`") else part.replace("<", "&lt;").replace(">", "&gt;").replace("*", r"\*")
        for part in parts
    ]
    return "".join(escaped).replace("|", r"\|")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
