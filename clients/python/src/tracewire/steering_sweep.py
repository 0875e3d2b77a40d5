"""Steering sweeps: one batched trace per coefficient over a prompt set, as a tidy table.

    rows = tracewire.steering_sweep.sweep(client, prompts, vector, layer=1,
                                          coefficients=[0, 2, 4, 8], watch={"paris": paris_id})
    for row in rows:
        print(row.coefficient, row.prompt, row.text, row.metrics)

Each coefficient c is one trace of one invoke per prompt (the engine batches them), adding
c * vector to layer `layer`'s output at `positions` of every step. Every row carries the
generated text and its metrics: `mean_logprob` (the mean logprob of the generated tokens
under the steered model: how fluent it stays), `logit[NAME]` for each watched token (its
raw step-0 logit: how far the steering pushed it), and any `metrics` functions of the
text. The coefficients run `concurrency` traces at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidArgument
from .extras import require

if TYPE_CHECKING:
    from .client import Client


@dataclass(frozen=True)
class SweepRow:
    coefficient: float
    prompt: str
    text: str
    token_ids: list[int]
    metrics: dict[str, float]


class SweepTable(list[SweepRow]):
    """The rows, coefficient-major then prompt order."""

    def metric(self, name: str) -> list[float]:
        """One metric's column."""
        if self and name not in self[0].metrics:
            raise InvalidArgument(f"no metric {name!r}; the rows have {sorted(self[0].metrics)}", field="name")
        return [row.metrics[name] for row in self]

    def to_pandas(self) -> Any:
        """A pandas DataFrame, one column per metric (needs pandas)."""
        pd = require("pandas", "pandas")
        return pd.DataFrame([{"coefficient": r.coefficient, "prompt": r.prompt, "text": r.text, **r.metrics}
                             for r in self])


def sweep(
    client: Client,
    prompts: Sequence[str],
    vector: Any,
    *,
    layer: int,
    coefficients: Sequence[float],
    positions: str | slice | Sequence[int] = "new",
    watch: Mapping[str, int] | None = None,
    metrics: Mapping[str, Callable[[str], float]] | None = None,
    concurrency: int = 4,
    **sampling: Any,
) -> SweepTable:
    """The sweep's rows (see the module's docstring); `sampling`: each trace's sampling
    parameters (greedy, max_tokens=16 unless given)."""
    if isinstance(prompts, str) or not prompts:
        raise InvalidArgument("prompts must be a non-empty list of prompts", field="prompts")
    if not coefficients:
        raise InvalidArgument("coefficients must not be empty", field="coefficients")
    if concurrency < 1:
        raise InvalidArgument(f"concurrency must be >= 1, got {concurrency}", field="concurrency")
    direction = np.asarray(vector, dtype=np.float32)
    watched = dict(watch or {})
    scorers = dict(metrics or {})
    sampling = {"temperature": 0.0, "max_tokens": 16, **sampling}

    def one(coefficient: float) -> list[SweepRow]:
        return _coefficient_rows(client, prompts, direction, layer, float(coefficient), positions, watched,
                                 scorers, sampling)

    with ThreadPoolExecutor(max_workers=min(concurrency, len(coefficients))) as pool:
        return SweepTable(row for rows in pool.map(one, coefficients) for row in rows)


def _coefficient_rows(
    client: Client,
    prompts: Sequence[str],
    vector: np.ndarray[Any, Any],
    layer: int,
    coefficient: float,
    positions: str | slice | Sequence[int],
    watched: dict[str, int],
    scorers: dict[str, Callable[[str], float]],
    sampling: dict[str, Any],
) -> list[SweepRow]:
    ids = list(watched.values())
    with client.trace(**sampling) as tracer:
        reads = []
        for prompt in prompts:
            with tracer.invoke(prompt) as inv:
                if coefficient != 0.0:
                    inv.all().module(f"layers.{layer}", positions=positions).add(vector, scale=coefficient)
                logprobs = inv.all().logprobs().save("logprobs")
                logits = inv.iter[0].logits.raw.select(ids).save("watched") if ids else None
                reads.append((inv, logprobs, logits))
    rows = []
    for prompt, (inv, logprobs, logits) in zip(prompts, reads, strict=True):
        assert inv.result is not None
        completion = inv.result.outputs[0]
        scores = {"mean_logprob": float(np.mean([lp.logprob for lp in logprobs])) if logprobs else float("nan")}
        if logits is not None:
            scores.update({f"logit[{name}]": float(v) for name, v in zip(watched, logits.value, strict=True)})
        scores.update({name: float(score(completion.text)) for name, score in scorers.items()})
        rows.append(SweepRow(coefficient, prompt, completion.text, list(completion.token_ids), scores))
    return rows


__all__ = ["SweepRow", "SweepTable", "sweep"]
