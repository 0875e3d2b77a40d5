"""Figures of traces (`pip install 'tracewire[plot]'`, matplotlib): the logit lens, per-step
token probabilities, patching heatmaps, attention patterns, steering sweeps.

    fig = tracewire.plot.logit_lens(lens.value, layers=[0, 1, 2, 3], tokens=tokens,
                                    decode=client.tokenizer.decode)
    fig.savefig("lens.png")        # or .svg, .pdf; a notebook shows it inline

Each function returns a matplotlib `Figure`, built without pyplot: no global figure state,
no window, no display needed (it renders with the Agg canvas), so it works the same in a
script, a server, a test and a notebook. Token text is shown as is (newlines and tabs as
\\n / \\t), never parsed as mathtext (a "$" in a token stays a dollar sign).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidArgument
from .extras import require
from .tracing import AttentionPattern, Logprobs, TopK

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .steering_sweep import SweepTable

Decode = Callable[[int], str]


def _figure(width: float, height: float) -> Figure:
    figure_module = require("matplotlib.figure", "plot")
    fig: Figure = figure_module.Figure(figsize=(max(width, 3.0), max(height, 2.0)), layout="constrained")
    return fig


def _label(token: str) -> str:
    return token.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def _token(decode: Decode | None, token_id: int) -> str:
    return _label(decode(token_id)) if decode is not None else f"#{token_id}"


def _ticks(ax: Axes, axis: str, labels: Sequence[str]) -> None:
    """Tick labels taken literally (no mathtext)."""
    positions = list(range(len(labels)))
    if axis == "x":
        ax.set_xticks(positions)
        texts = ax.set_xticklabels(labels)
    else:
        ax.set_yticks(positions)
        texts = ax.set_yticklabels(labels)
    for text in texts:
        text.set_parse_math(False)
    if axis == "x":
        ax.tick_params(axis="x", labelrotation=45)


def _cell(ax: Axes, x: float, y: float, text: str, dark: bool) -> None:
    ax.text(x, y, text, ha="center", va="center", fontsize=7, color="white" if dark else "black", parse_math=False)


def logit_lens(
    lens: TopK,
    *,
    layers: Sequence[int] | None = None,
    tokens: Sequence[str] | None = None,
    decode: Decode | None = None,
    title: str = "logit lens",
) -> Figure:
    """Layers x positions: each cell the layer's top next-token guess, coloured by its
    probability. `lens`: one step's logit-lens read (a TopK of [layers, positions, k]
    logprobs); `layers`: the rows' layer numbers (default: those the read asked for, else
    0..); `tokens`: the columns' text (default: the token the layers read at each position,
    the prompt's and then the drawn ones, which a read from a trace knows once it has run;
    else the position numbers); `decode`: token id -> text (e.g. client.tokenizer.decode;
    default: ids as #id)."""
    values, ids = np.asarray(lens.values), np.asarray(lens.ids)
    if values.ndim != 3:
        raise InvalidArgument(f"lens must be one step's [layers, positions, k] TopK, got shape {values.shape}",
                              field="lens")
    n_layers, n_positions = values.shape[:2]
    probs = np.exp(values[:, :, 0])
    fig = _figure(1.0 + 0.9 * n_positions, 1.0 + 0.45 * n_layers)
    ax = fig.add_subplot()
    image = ax.imshow(probs, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", origin="lower")
    for layer in range(n_layers):
        for position in range(n_positions):
            _cell(ax, position, layer, _token(decode, int(ids[layer, position, 0])), probs[layer, position] < 0.5)
    read_layers = getattr(lens, "layers", ())
    row_labels = layers if layers is not None else read_layers if len(read_layers) == n_layers else range(n_layers)
    _ticks(ax, "y", [str(x) for x in row_labels])
    input_ids = getattr(lens, "input_ids", None)
    if tokens is not None:
        column_labels = [_label(t) for t in tokens]
    elif input_ids is not None and len(input_ids) == n_positions:
        column_labels = [_token(decode, int(t)) for t in input_ids]
    else:
        positions = getattr(lens, "positions", None)
        column_labels = [str(p) for p in (positions if positions is not None else range(n_positions))]
    _ticks(ax, "x", column_labels)
    ax.set_ylabel("layer")
    ax.set_xlabel("position" if tokens is None and input_ids is None else "input token")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="p(top token)")
    return fig


def token_probs(
    steps: Sequence[Logprobs],
    *,
    decode: Decode | None = None,
    title: str = "token probabilities per step",
) -> Figure:
    """Per step the drawn token's probability (a bar, labelled with the token) and the top-k
    alternatives (dots, labelled). `steps`: a saved `.logprobs(top_k)` read."""
    if not steps:
        raise InvalidArgument("token_probs needs at least one step's Logprobs", field="steps")
    fig = _figure(1.0 + 1.1 * len(steps), 4.0)
    ax = fig.add_subplot()
    drawn = [float(np.exp(s.logprob)) for s in steps]
    ax.bar(range(len(steps)), drawn, color="tab:blue", alpha=0.6, label="drawn")
    for x, step in enumerate(steps):
        ax.text(x, drawn[x], _token(decode, step.token_id), ha="center", va="bottom", fontsize=8, parse_math=False)
        others = [(t, float(np.exp(v))) for t, v in step.top.items() if t != step.token_id]
        if others:
            ax.scatter([x + 0.25] * len(others), [p for _, p in others], color="tab:orange", s=12,
                       label="alternatives" if x == 0 else None)
        for token_id, p in others:
            ax.text(x + 0.32, p, _token(decode, token_id), fontsize=6, va="center", color="dimgray", parse_math=False)
    ax.set_ylim(0.0, 1.08)
    ax.set_xticks(range(len(steps)))
    ax.set_xlabel("step")
    ax.set_ylabel("probability")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=7)
    return fig


def patching(
    heatmap: Any,
    *,
    layers: Sequence[int] | None = None,
    tokens: Sequence[str] | None = None,
    metric: str = "logit difference",
    title: str = "activation patching",
) -> Figure:
    """`tracewire.patching.sweep`'s [layers, positions] result: each cell the metric of the
    run patched there, on a diverging scale centred at 0 (values written in)."""
    values = np.asarray(heatmap, dtype=np.float32)
    if values.ndim != 2:
        raise InvalidArgument(f"heatmap must be [layers, positions], got shape {values.shape}", field="heatmap")
    bound = float(np.abs(values).max()) or 1.0
    fig = _figure(1.5 + 0.9 * values.shape[1], 1.0 + 0.45 * values.shape[0])
    ax = fig.add_subplot()
    image = ax.imshow(values, cmap="RdBu", vmin=-bound, vmax=bound, aspect="auto", origin="lower")
    for (layer, position), v in np.ndenumerate(values):
        _cell(ax, position, layer, f"{v:.2f}", bool(abs(v) > 0.6 * bound))
    _ticks(ax, "y", [str(x) for x in (layers if layers is not None else range(values.shape[0]))])
    _ticks(ax, "x", [_label(t) for t in tokens] if tokens is not None else [str(p) for p in range(values.shape[1])])
    ax.set_ylabel("layer")
    ax.set_xlabel("patched position")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=metric)
    return fig


def attention(
    pattern: AttentionPattern,
    *,
    layer: int | None = None,
    head: int | None = None,
    tokens: Sequence[str] | None = None,
    decode: Decode | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    title: str | None = None,
) -> Figure:
    """Queries x keys: one head's attention weights at one step. `pattern`: one step's
    AttentionPattern read; `layer` / `head`: the model's layer and head numbers, as the read
    named them (default: the read's only layer; its first head), one the read did not cover
    is refused naming it; `layers` / `heads`: the layers / heads the pattern holds, in its
    order, for a pattern that does not say (one from a trace does: default 0.. otherwise);
    `tokens`: the positions' text (keys and queries; default: the sequence's tokens, which a
    read from a trace knows once it has run, through `decode`, token id -> text, e.g.
    client.tokenizer.decode; else the position numbers). A top-k read shows its k weights
    per query, the rest blank."""
    weights, keys = np.asarray(pattern.weights), np.asarray(pattern.keys)
    if weights.ndim != 4:
        raise InvalidArgument(f"pattern must be one step's AttentionPattern, weights of shape {weights.shape}",
                              field="pattern")
    layer_index = _unit_index("layer", layer, layers, getattr(pattern, "layers", ()), weights.shape[0])
    head_index = _unit_index("head", head, heads, getattr(pattern, "heads", ()), weights.shape[2])
    layer_number = _numbers(layers, getattr(pattern, "layers", ()), weights.shape[0])[layer_index]
    head_number = _numbers(heads, getattr(pattern, "heads", ()), weights.shape[2])[head_index]
    queries = [int(q) for q in np.asarray(pattern.positions)]
    n_keys = max(queries) + 1
    matrix = np.full((len(queries), n_keys), np.nan, dtype=np.float32)
    for row in range(len(queries)):
        for key, w in zip(keys[layer_index, row, head_index], weights[layer_index, row, head_index], strict=True):
            if 0 <= key <= queries[row]:  # a key after the query (causal mask) stays blank
                matrix[row, key] = w
    fig = _figure(1.5 + 0.6 * n_keys, 1.0 + 0.45 * len(queries))
    ax = fig.add_subplot()
    image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="magma", aspect="auto")
    input_ids = getattr(pattern, "input_ids", None)
    labels = ([_label(t) for t in tokens] if tokens is not None
              else [_token(decode, int(t)) for t in input_ids] if input_ids is not None else None)
    _ticks(ax, "x", [labels[k] if labels and k < len(labels) else str(k) for k in range(n_keys)])
    _ticks(ax, "y", [labels[q] if labels and q < len(labels) else str(q) for q in queries])
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(title or f"attention, layer {layer_number}, head {head_number}")
    fig.colorbar(image, ax=ax, label="weight")
    return fig


def _numbers(given: Sequence[int] | None, read: Sequence[int], count: int) -> list[int]:
    """The model's numbers of a pattern's layers / heads, in its order: as given, else as the
    read asked for them (heads: none named means all, in order), else 0 .. count - 1."""
    numbers = [int(x) for x in (given if given is not None else read if len(read) == count else range(count))]
    if len(numbers) != count:
        raise InvalidArgument(f"{len(numbers)} numbers given for the pattern's {count}", field="layers")
    return numbers


def _unit_index(name: str, number: int | None, given: Sequence[int] | None, read: Sequence[int], count: int) -> int:
    """Where the model's layer / head `number` sits in the pattern (default: its only layer,
    its first head); refused, naming `name`, when the read did not cover it."""
    numbers = _numbers(given, read, count)
    if number is None:
        if name == "layer" and count > 1:
            raise InvalidArgument(f"layer: this pattern holds layers {numbers}; choose one (layer={numbers[0]}, ...)",
                                  field="layer")
        return 0
    if int(number) not in numbers:
        held = ", ".join(map(str, numbers))
        raise InvalidArgument(f"{name} {number} was not read: this pattern holds {name}s {held} "
                              f"(the model's numbers, as the read named them)", field=name)
    return numbers.index(int(number))


def steering(rows: SweepTable, *, metric: str = "mean_logprob", title: str | None = None) -> Figure:
    """A steering sweep's metric against the coefficient, one curve per prompt."""
    if not rows:
        raise InvalidArgument("steering needs the rows of a sweep", field="rows")
    values = rows.metric(metric)
    fig = _figure(6.0, 4.0)
    ax = fig.add_subplot()
    for prompt in dict.fromkeys(row.prompt for row in rows):
        points = sorted((row.coefficient, v) for row, v in zip(rows, values, strict=True) if row.prompt == prompt)
        ax.plot([c for c, _ in points], [v for _, v in points], marker="o", label=_label(prompt)[:40])
    ax.set_xlabel("coefficient")
    ax.set_ylabel(metric)
    ax.set_title(title or f"steering sweep: {metric}")
    legend = ax.legend(fontsize=7)
    for text in legend.get_texts():
        text.set_parse_math(False)
    return fig


__all__ = ["attention", "logit_lens", "patching", "steering", "token_probs"]
