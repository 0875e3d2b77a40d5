"""Traces in Jupyter: `Tracer._repr_html_` renders each invoke as a table of its generated
tokens (text, id, probability, the top alternatives when a read or the sampling parameters
asked for them) and a summary of its saved reads. All text is HTML-escaped."""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .outputs import PositionLogprobs
from .tracing import Logprobs, Saved

if TYPE_CHECKING:
    from .tracing import Invoke, Tracer

STYLE = "border-collapse:collapse;font-family:monospace;font-size:12px"
CELL = "border:1px solid #ccc;padding:2px 6px;text-align:left"


def trace_html(tracer: Tracer) -> str:
    if not tracer.invokes:
        return "<p>an empty trace</p>"
    parts = [_invoke_html(inv) for inv in tracer.invokes]
    parts += [f"<p style='color:#a60'>warning: {html.escape(w)}</p>" for w in tracer.warnings]
    return "\n".join(parts)


def _invoke_html(inv: Invoke) -> str:
    result = inv.result
    if result is None:
        return f"<p>invoke {inv.index}: not run yet</p>"
    head = f"<p><b>invoke {inv.index}</b>: {_text(result.prompt or str(result.prompt_token_ids))}</p>"
    tables = [_tokens_table(inv, seq) for seq in range(len(result.outputs))]
    return head + "".join(tables) + _reads_html(inv)


def _tokens_table(inv: Invoke, sequence: int) -> str:
    assert inv.result is not None
    completion = inv.result.outputs[sequence]
    texts = inv.step_tokens.get(sequence, {})
    read = _logprobs_read(inv, sequence)
    rows = []
    for step, token_id in enumerate(completion.token_ids):
        token = _text(texts[step]) if step in texts else "?"
        p, top = _probabilities(step, token_id, read, completion.logprobs)
        rows.append(_row([str(step), token, str(token_id), p, top], escaped=True))
    caption = (f"sequence {sequence}: {_text(completion.text)} "
               f"<span style='color:#888'>({html.escape(str(completion.finish_reason))})</span>")
    header = _row(["step", "token", "id", "p", "top alternatives"], header=True)
    return f"<table style='{STYLE}'><caption style='text-align:left'>{caption}</caption>{header}{''.join(rows)}</table>"


def _probabilities(step: int, token_id: int, read: list[Logprobs] | None,
                   sampled: list[PositionLogprobs] | None) -> tuple[str, str]:
    """The drawn token's probability and the alternatives (escaped HTML): from a saved
    logprobs read, else from the sampling parameters' logprobs (which name their tokens)."""
    if read is not None and step < len(read):
        lp = read[step]
        top = ", ".join(f"#{t} {math.exp(v):.3f}" for t, v in lp.top.items() if t != token_id)
        return f"{math.exp(lp.logprob):.3f}", top
    if sampled is not None and step < len(sampled):
        entries = sampled[step]
        p = f"{math.exp(entries[token_id].logprob):.3f}" if token_id in entries else ""
        top = ", ".join(f"{_text(e.decoded_token or f'#{t}')} {math.exp(e.logprob):.3f}"
                        for t, e in entries.items() if t != token_id)
        return p, top
    return "", ""


def _logprobs_read(inv: Invoke, sequence: int) -> list[Logprobs] | None:
    """The first saved read of Logprobs at every step from 0 (per sequence when n > 1)."""
    for saved in inv.saved_reads():
        values: Any = saved[sequence] if saved and isinstance(saved[0], Saved) else saved
        if values and isinstance(values[0], Logprobs) and list(values.steps) == list(range(len(values))):
            return list(values)
    return None


def _reads_html(inv: Invoke) -> str:
    reads = inv.saved_reads()
    if not reads:
        return ""
    rows = [_row([saved.name, str(len(saved)), _describe(saved[0]) if saved else "-"]) for saved in reads]
    header = _row(["read", "values", "first value"], header=True)
    return f"<table style='{STYLE};margin-top:4px'>{header}{''.join(rows)}</table>"


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array {value.dtype} {list(value.shape)}"
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        arrays = {f: getattr(value, f) for f in value._fields}
        if all(isinstance(a, np.ndarray) for a in arrays.values()):
            return f"{type(value).__name__} " + ", ".join(f"{f} {list(a.shape)}" for f, a in arrays.items())
    return f"{type(value).__name__} {repr(value)[:80]}"


def _text(text: str) -> str:
    """A token or text, escaped, with whitespace made visible."""
    return html.escape(repr(text))


def _row(cells: list[str], *, header: bool = False, escaped: bool = False) -> str:
    tag = "th" if header else "td"
    shown = cells if escaped else [html.escape(c) for c in cells]
    return "<tr>" + "".join(f"<{tag} style='{CELL}'>{c}</{tag}>" for c in shown) + "</tr>"
