"""The researcher's workflow (issue 27): client.map, client.collect / `tracewire collect`,
steering sweeps, tracewire.plot, the HTML rendering of traces and the example notebook.

map runs on the session's shared server; everything reading hidden states (collections of
layers, the logit lens, steering, patching, attention patterns) on one --enforce-eager
server for this module. Values are checked against transformers on the same weights
(reference.py) and against the same trace run alone; figures are saved as PNGs under
tests/output/ (git-ignored) and checked for what they show.
"""

from __future__ import annotations

import asyncio
import base64
import csv
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import tracewire as tw
import tracewire.collect
import tracewire.patching
import tracewire.plot
import tracewire.steering_sweep
from conftest import ROOT, free_port
from test_hidden_states import hf_module_outputs
from tracewire import cli
from tracewire.prompt_sources import read_prompts

OUTPUT = ROOT / "tests" / "output"
NOTEBOOK = ROOT / "clients" / "python" / "examples" / "workflow.ipynb"
PROMPTS = ["The capital of France is", "The capital of Japan is", "Once upon a time", "1, 2, 3,",
           "The capital of Italy is", "Hello, my name is", "The sky is"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def eclient(eager):
    with tw.Client(eager.target, timeout=300) as c:
        yield c


def save_png(fig, name: str) -> Path:
    OUTPUT.mkdir(exist_ok=True)
    path = OUTPUT / f"{name}.png"
    fig.savefig(path, dpi=80)
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000, name
    return path


def texts_of(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


# -- map ---------------------------------------------------------------------------------


def test_map_in_order_with_errors_per_item_and_unavailable_retried(client, server, hf):
    """Greedy draws equal transformers' per prompt, in input order; an empty prompt
    (INVALID_ARGUMENT) and an engine fault (INTERNAL) fail their items alone, once; an
    UNAVAILABLE is retried with a fresh trace; the async client's map returns the same."""
    flaky = {"left": 1}

    def build(tracer):
        if tracer.request().invokes[0].prompt.text == PROMPTS[2] and flaky["left"]:
            flaky["left"] -= 1
            raise tw.Unavailable("the server went away (simulated)")
        if tracer.request().invokes[0].prompt.text == "fault":
            tracer.iter[0].logits.top_k(1).save("__fault__:boom")   # raises in the engine
        return tracer.all().samples.save()

    prompts = [PROMPTS[0], [], PROMPTS[2], "fault", PROMPTS[3]]
    results = client.map(prompts, build, concurrency=3, temperature=0.0, max_tokens=4, ignore_eos=True)
    assert [item.index for item in results] == list(range(5))
    assert [item.prompt for item in results] == prompts
    assert [item.ok for item in results] == [True, False, True, False, True]
    assert isinstance(results[1].error, tw.InvalidArgument) and results[1].attempts == 1
    assert isinstance(results[3].error, tw.Internal) and results[3].attempts == 1
    assert results[2].attempts == 2 and flaky["left"] == 0
    for item in (results[0], results[2], results[4]):
        assert list(item.value) == hf.greedy(hf.encode(item.prompt), 4), item.prompt
    with pytest.raises(tw.InvalidArgument):
        results.values()

    async def run_async():
        async with tw.AsyncClient(server.target, timeout=300) as aclient:
            return await aclient.map(PROMPTS[:4], lambda t: t.all().samples.save(), concurrency=2,
                                     temperature=0.0, max_tokens=4, ignore_eos=True)

    async_results = asyncio.run(run_async())
    assert [list(v) for v in async_results.values()] == [hf.greedy(hf.encode(p), 4) for p in PROMPTS[:4]]

    # Nobody listening: every attempt is UNAVAILABLE, retried, then kept as the item's error.
    with tw.Client(f"127.0.0.1:{free_port()}", timeout=5) as dead:
        (item,) = dead.map(["hi"], lambda t: None, retries=1)
    assert isinstance(item.error, tw.Unavailable) and item.attempts == 2
    with pytest.raises(tw.InvalidArgument, match="concurrency"):
        client.map(PROMPTS, lambda t: None, concurrency=0)


# -- collect -----------------------------------------------------------------------------


class Interrupted(Exception):
    pass


def test_collect_resumes_after_an_interruption_and_holds_the_traced_values(eclient, hf, tmp_path):
    """7 prompts in shards of 2 from a JSONL file. A run stopped after 2 shards (and a shard
    cut off mid-write, left as its temporary file) resumes: the 2 shards are skipped, the
    rest written, and the result equals an uninterrupted run's. The values equal the same
    reads of a trace run alone and transformers' hidden states; safetensors holds the same."""
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": i, "text": p}) + "\n" for i, p in enumerate(PROMPTS)))
    plan = dict(layers=[1, 2], positions="prompt", logits_top_k=3, samples=True, max_tokens=2, shard_size=2)

    whole = eclient.collect(source, tmp_path / "whole", **plan)
    assert whole.complete and whole.count == 7 and [s["count"] for s in whole.shards] == [2, 2, 2, 1]
    info = eclient.model_info()
    assert (whole.model, whole.server_version) == (info.model, info.server_version)
    assert whole.fields["layers.1"] == {"dtype": "float32", "shape": [None, info.hidden_size]}

    heard = []

    def stop_after_two(shard):
        heard.append((shard.number, shard.skipped))
        if len(heard) == 2:
            raise Interrupted

    out = tmp_path / "resumed"
    with pytest.raises(Interrupted):
        eclient.collect(source, out, on_shard=stop_after_two, **plan)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shard-00000.parquet", "shard-00001.parquet"]
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    (out / "shard-00002.parquet.tmp").write_bytes(b"half a shard")
    heard.clear()
    resumed = eclient.collect(source, out, on_shard=lambda s: heard.append((s.number, s.skipped)), **plan)
    assert heard == [(0, True), (1, True), (2, False), (3, False)]
    assert not (out / "shard-00002.parquet.tmp").exists()
    assert resumed.to_json() == whole.to_json()

    a, b = tracewire.collect.load(tmp_path / "whole"), tracewire.collect.load(out)
    assert a.prompts() == b.prompts() == PROMPTS
    assert a.texts() == b.texts()
    for name in whole.fields:
        for x, y in zip(a.field(name), b.field(name), strict=True):
            np.testing.assert_array_equal(x, y, err_msg=name)

    # The same reads, one trace alone, and transformers' hidden states at layers 1 and 2.
    prompt = PROMPTS[5]
    with eclient.trace(prompt, temperature=0.0, max_tokens=2) as tracer:
        rows = tracer.iter[0].module("layers.1", positions="prompt").save()
        top = tracer.all().logits.top_k(3).save()
    collected = a.field("layers.1")[5]
    np.testing.assert_allclose(collected, rows.value, atol=1e-5)
    np.testing.assert_array_equal(a.field("logits.ids")[5], np.stack([t.ids for t in top]))
    ids = hf.encode(prompt)
    assert a.field("prompt_token_ids")[5].tolist() == ids
    with torch.no_grad():
        states = hf.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    np.testing.assert_allclose(collected, states[2][0].numpy(), atol=1e-4)
    np.testing.assert_allclose(a.field("layers.2")[5], states[3][0].numpy(), atol=1e-4)
    assert a.field("samples")[5].tolist() == hf.greedy(ids, 2)

    st = eclient.collect(PROMPTS, tmp_path / "st", storage="safetensors", **plan)
    assert sorted(s["file"] for s in st.shards)[-1] == "shard-00003.safetensors"
    c = tracewire.collect.load(tmp_path / "st")
    for name in whole.fields:
        for x, y in zip(a.field(name), c.field(name), strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, err_msg=name)

    # Another plan into the same folder is refused, naming what differs; nothing is touched.
    with pytest.raises(tw.InvalidArgument, match="plan") as refused:
        eclient.collect(source, out, **{**plan, "layers": [3]})
    assert refused.value.field == "output"


def test_prompts_from_csv_parquet_and_text_and_the_collect_cli(eclient, eager, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with (tmp_path / "p.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "question"])
        writer.writerows([[1, "a, \"quoted\" prompt"], [2, "line\nbreak"]])
    assert list(read_prompts(tmp_path / "p.csv", "question")) == ["a, \"quoted\" prompt", "line\nbreak"]
    pq.write_table(pa.table({"prompt": PROMPTS[:3], "n": [1, 2, 3]}), tmp_path / "p.parquet")
    assert list(read_prompts(tmp_path / "p.parquet")) == PROMPTS[:3]
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert list(read_prompts(tmp_path / "p.txt")) == ["one", "two"]
    with pytest.raises(tw.InvalidArgument, match="no column 'nope'") as bad:
        list(read_prompts(tmp_path / "p.csv", "nope"))
    assert bad.value.field == "column"

    code = cli.main(["--target", eager.target, "collect", str(tmp_path / "p.parquet"), str(tmp_path / "out"),
                     "--layers", "3", "--positions", "last", "--format", "safetensors", "--shard-size", "2"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prompts"] == 3 and summary["shards"] == 2
    last = tracewire.collect.load(tmp_path / "out").field("layers.3")
    with eclient.trace(PROMPTS[2], temperature=0.0, max_tokens=1) as tracer:
        row = tracer.iter[0].module("layers.3", positions=[-1]).save()
    assert last[2].shape == (1, 256)
    np.testing.assert_allclose(last[2], row.value, atol=1e-5)


def test_collect_on_a_compiled_server_without_hooks_reads_logits_and_refuses_layers(bare, hf, tmp_path):
    with tw.Client(bare.target, timeout=300) as client:
        manifest = client.collect(PROMPTS[:3], tmp_path / "logits", samples=True, max_tokens=3, ignore_eos=True)
        assert set(manifest.fields) == {"prompt_token_ids", "samples"} and manifest.engine_mode == "compiled"
        samples = tracewire.collect.load(tmp_path / "logits").field("samples")
        assert [s.tolist() for s in samples] == [hf.greedy(hf.encode(p), 3) for p in PROMPTS[:3]]
        flags = "--enforce-eager, or a compiled one with --compiled-reads"   # (no read buffers: either serves)
        with pytest.raises(tw.FailedPrecondition, match=flags) as refused:
            client.collect(PROMPTS[:3], tmp_path / "layers", layers=[1])
        assert refused.value.field == "layers" and not (tmp_path / "layers" / "manifest.json").exists()


def test_collect_on_the_default_server_reads_every_layer(client, hf, tmp_path):
    """`make serve`'s server keeps every layer in its graph: collect reads layers.3 too."""
    manifest = client.collect(PROMPTS[:2], tmp_path / "acts", layers=[1, 3], positions="prompt")
    assert manifest.engine_mode == "compiled_steering" and manifest.complete
    acts = tracewire.collect.load(tmp_path / "acts")
    for k, prompt in enumerate(PROMPTS[:2]):
        with torch.no_grad():
            states = hf.model(torch.tensor([hf.encode(prompt)]), output_hidden_states=True).hidden_states
        np.testing.assert_allclose(acts.field("layers.1")[k], states[2][0].numpy(), atol=1e-4, err_msg=prompt)
        # (the last layer's output is before the final norm: HF's last hidden state is after it)
        np.testing.assert_allclose(acts.field("layers.3")[k], hf_module_outputs(hf, hf.encode(prompt))["layers.3"],
                                   atol=1e-4, err_msg=prompt)


def test_collect_and_the_cli_lens_on_a_compiled_server_with_read_buffers(graph, hf, tmp_path, capsys):
    """conftest's `graph` server: compiled, --compiled-reads 0,1,2. collect reads those
    layers (transformers' hidden states); a plan naming layer 3 too is refused before any
    prompt runs, naming layer 3 and the flag; the CLI's lens reads the readable layers by
    default (transformers' final norm + lm_head on them)."""
    with tw.Client(graph.target, timeout=300) as gclient:
        manifest = gclient.collect(PROMPTS[:3], tmp_path / "acts", layers=[0, 2], positions="prompt")
        assert manifest.engine_mode == "compiled_steering" and manifest.complete
        with pytest.raises(tw.FailedPrecondition, match=r"layers \[3\] are not readable.*layers \[0, 1, 2\] only "
                           r"\(--compiled-reads LAYERS\)") as refused:
            gclient.collect(PROMPTS[:3], tmp_path / "more", layers=[1, 3])
        assert refused.value.field == "layers" and not (tmp_path / "more" / "manifest.json").exists()
    acts = tracewire.collect.load(tmp_path / "acts")
    for k, prompt in enumerate(PROMPTS[:3]):
        with torch.no_grad():
            states = hf.model(torch.tensor([hf.encode(prompt)]), output_hidden_states=True).hidden_states
        np.testing.assert_allclose(acts.field("layers.0")[k], states[1][0].numpy(), atol=1e-4, err_msg=prompt)
        np.testing.assert_allclose(acts.field("layers.2")[k], states[3][0].numpy(), atol=1e-4, err_msg=prompt)

    assert cli.main(["--target", graph.target, "lens", PROMPTS[0], "--json"]) == 0
    lens = json.loads(capsys.readouterr().out)
    assert [row["layer"] for row in lens["layers"]] == [0, 1, 2]
    with torch.no_grad():
        states = hf.model(torch.tensor([hf.encode(PROMPTS[0])]), output_hidden_states=True).hidden_states
        for row in lens["layers"]:
            probs = torch.softmax(hf.model.lm_head(hf.model.model.norm(states[row["layer"] + 1][0])), -1)
            top = probs.max(-1)
            assert [cell["token"] for cell in row["top"]] == [hf.tokenizer.decode([int(i)]) for i in top.indices]
            np.testing.assert_allclose([cell["p"] for cell in row["top"]], top.values.numpy(), atol=1e-4)


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)   # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'tracewire\[plot\]'"):
        tracewire.plot.patching(np.zeros((2, 2)))


# -- steering, figures, HTML -------------------------------------------------------------


def test_steering_sweep_and_the_figures(eclient, eager, hf, tmp_path):
    vector = np.random.default_rng(0).standard_normal(256)
    paris = hf.encode(" Paris")[0]
    prompts = PROMPTS[:2]
    rows = tracewire.steering_sweep.sweep(eclient, prompts, vector, layer=1, coefficients=[0, 4, 8],
                                          watch={"paris": paris}, max_tokens=8)
    assert [(r.coefficient, r.prompt) for r in rows] == [(c, p) for c in (0, 4, 8) for p in prompts]
    for row in rows[:2]:   # coefficient 0: the model unsteered, as transformers decodes it
        ids = hf.encode(row.prompt)
        assert row.token_ids == hf.greedy(ids, 8, eos=0)
        assert row.metrics["logit[paris]"] == pytest.approx(float(hf.next_logits(ids)[paris]), abs=2e-3)
    steered = rows.metric("logit[paris]")
    assert steered[4] < steered[2] < steered[0]           # the direction pushes ' Paris' down on France
    assert rows[2].text != rows[0].text                    # README: ' Paris. The capital of Hungary ...'
    assert all(r.metrics["mean_logprob"] <= 0 for r in rows)
    fig = tracewire.plot.steering(rows, metric="logit[paris]")
    assert len(fig.axes[0].lines) == 2
    save_png(fig, "steering_sweep")

    prompt = "The capital of France is"
    ids = hf.encode(prompt)
    tokens = [hf.tokenizer.decode([t]) for t in ids]
    with eclient.trace(prompt, temperature=0.0, max_tokens=4) as tracer:
        lens = tracer.iter[0].logit_lens([0, 1, 2, 3], positions="prompt", top_k=1).save()
        probs = tracer.all().logprobs(top_k=3).save()
        pattern = tracer.iter[0].attention(1, positions="prompt", top_k=0).save()
    fig = tracewire.plot.logit_lens(lens.value, layers=[0, 1, 2, 3], tokens=tokens, decode=eclient.tokenizer.decode)
    cells = texts_of(fig)
    assert len(cells) == 4 * len(ids)
    # the last layer's cell at the last position: transformers' next token after the prompt
    assert cells[-1] == hf.tokenizer.decode([int(hf.next_logits(ids).argmax())])
    image = fig.axes[0].images[0].get_array()
    np.testing.assert_allclose(image[3, -1], float(torch.softmax(hf.next_logits(ids), -1).max()), atol=1e-3)
    save_png(fig, "logit_lens")

    fig = tracewire.plot.token_probs(probs, decode=eclient.tokenizer.decode)
    bars = [b.get_height() for b in fig.axes[0].patches]
    assert bars == pytest.approx([math.exp(p.logprob) for p in probs])
    assert texts_of(fig)[0] == " Paris"
    save_png(fig, "token_probs")

    fig = tracewire.plot.attention(pattern.value, tokens=tokens)
    matrix = fig.axes[0].images[0].get_array()
    assert matrix.shape == (len(ids), len(ids))
    np.testing.assert_allclose(np.nansum(matrix, axis=1), 1.0, atol=1e-4)   # each query's weights sum to 1
    assert np.ma.getmaskarray(matrix)[0, 1:].all()                                    # causal: query 0 sees key 0 only
    save_png(fig, "attention_pattern")

    rome = hf.encode(" Rome")[0]
    heatmap = tracewire.patching.sweep(eclient, prompt, "The capital of Italy is", layers=[0, 1, 2, 3],
                                       positions=[2, 3, 4], metric=(paris, rome))
    fig = tracewire.plot.patching(heatmap, layers=[0, 1, 2, 3], tokens=tokens[2:])
    assert texts_of(fig) == [f"{v:.2f}" for v in heatmap.ravel()]
    save_png(fig, "patching")

    out = tmp_path / "lens.png"
    assert cli.main(["--target", eager.target, "lens", prompt, "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    shutil.copy(out, OUTPUT / "cli_lens.png")

    html = tracer._repr_html_()
    assert html.count("<tr>") == 1 + len(probs) + 1 + 3         # tokens table (header + 4 steps), reads table
    for step in probs:
        assert f"{math.exp(step.logprob):.3f}" in html
    with eclient.trace("<b>bold</b> & 'quoted'", temperature=0.0, max_tokens=1) as tricky:
        pass
    shown = tricky._repr_html_()
    assert "<b>bold" not in shown and "&lt;b&gt;bold&lt;/b&gt; &amp;" in shown


# -- the notebook ------------------------------------------------------------------------


def test_example_notebook_runs_headless_and_draws_its_figures(eager, monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.setenv("TRACEWIRE_TARGET", eager.target)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits this process's environment: the server's address, and the path
    # that imports this checkout's tracewire.
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o.data["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 5                                   # lens, probabilities, attention, sweep, patching
    assert any("text/html" in o.get("data", {}) and "<table" in o.data["text/html"] for o in outputs)
    OUTPUT.mkdir(exist_ok=True)
    for n, data in enumerate(images):
        png = base64.b64decode(data)
        assert png[:8] == PNG
        (OUTPUT / f"notebook_{n}.png").write_bytes(png)
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "4 prompts, 2 shards; (1, 256)" in printed
