"""Every runnable snippet of the docs (README.md, the site's pages under docs/ and
clients/python/README.md) runs as written against a real server and does what its text says.

The session's `--enforce-eager` server (conftest's `eager`) serves them all (the
hidden-states snippets need it; it serves everything a compiled one does). Each Python block
runs on its own, in a namespace of its own (a reader may copy any one alone), all of them in
one interpreter, TraceWarnings as errors, each `print(...)  # claim` checked against what it
printed (tests/snippets.py).
Shell blocks run with bash, the documented ports pointed at the test server's; blocks that
start servers or build things (`make ...`, `python -m tracewire_server`, bench/) are the
other tests' business. The TypeScript blocks run in clients/ts/test/readme.test.ts.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import ROOT
from snippets import Block, blocks, claim_holds, print_claims, run_python

README = ROOT / "README.md"
DOCS = ROOT / "docs"
SDK_README = ROOT / "clients" / "python" / "README.md"
BUF = ROOT / "clients" / "ts" / "node_modules" / ".bin" / "buf"
# Blocks that start a server, install or build: not snippets a reader runs against one.
NOT_CLIENT_SIDE = ("python -m tracewire_server", "bash bench/", "make proto")
# Lines that set up what the tests already have (a running server, the installed SDK).
SET_UP = ("make ", "pip install ")


def replacements(server) -> dict[str, str]:
    http = server.http_url.removeprefix("http://")
    return {"127.0.0.1:50051": server.target, "127.0.0.1:8080": http}


def pages() -> list[Path]:
    """Every page whose blocks a reader runs: the README, the site's pages, the SDK's README."""
    return [README, *sorted(DOCS.rglob("*.md")), SDK_README]


def page_blocks(lang: str) -> list[Block]:
    return [block for path in pages() for block in blocks(path, lang)]


# -- Python ----------------------------------------------------------------------------


def plaintext_blocks() -> list[Block]:
    """The Python blocks a plaintext server answers: all but docs/security.md's, which needs
    TLS and a token (test_security.py runs it against such a server)."""
    return [b for b in page_blocks("python") if "tracewire.Tls" not in b.code]


def test_python_snippets_run_and_print_what_they_claim(eager, tmp_path):
    snippets = plaintext_blocks()
    assert len(snippets) >= 12, [b.name for b in snippets]
    run = run_python(snippets, tmp_path, replacements(eager))
    assert run.returncode == 0, run.stderr
    assert "Warning" not in run.stderr, run.stderr
    checked = 0
    for block in snippets:
        for line, claim in print_claims(block):
            printed = run.prints.get((block.name, line))
            assert printed, f"{block.name}+{line}: print never ran"
            assert claim_holds(claim, printed[0]), f"{block.name}+{line}: printed {printed[0]!r}, README says {claim!r}"
            checked += 1
    assert checked >= 20


def test_the_readme_has_a_first_trace_and_links_to_the_site():
    """The README is the front door: the two make commands, a first trace from Python and
    from the CLI, and links into the site's pages that exist."""
    text = README.read_text()
    assert "make serve" in text and "make test" in text and "make docs" in text
    assert [b for b in blocks(README, "python") if "client.trace(" in b.code]
    assert [b for b in blocks(README, "bash") if "tracewire trace " in b.code]
    linked = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(linked) >= 8, linked
    assert all((ROOT / path).is_file() for path in linked), [p for p in linked if not (ROOT / p).is_file()]


def test_readme_trace_shows_what_the_model_wanted_at_the_forced_step(eager, tmp_path):
    """The README's Python trace forces " Berlin" at step 0; the values it prints for that
    step are the row before the force (" Paris" first), not the forced row (only " Berlin")."""
    (trace,) = [b for b in blocks(README, "python") if "before_writes" in b.code]
    run = run_python([trace], tmp_path, replacements(eager))
    assert run.returncode == 0, run.stderr
    (line,) = [n for n, text in enumerate(trace.code.splitlines(), 1) if "top[0].ids" in text]
    (printed,) = run.prints[(trace.name, line)]
    assert printed.startswith("[' Paris'"), printed
    assert len(eval(printed)) == 3


# -- shell -----------------------------------------------------------------------------


def shell_blocks() -> list[Block]:
    """The client-side shell blocks, without their set-up lines (`make serve`, `pip install`)."""
    runnable = []
    for block in page_blocks("bash"):
        if any(marker in block.code for marker in NOT_CLIENT_SIDE):
            continue
        lines = [line for line in block.code.splitlines() if not line.startswith(SET_UP)]
        if any(line.strip() and not line.lstrip().startswith("#") for line in lines):
            runnable.append(Block(block.path, block.line, block.lang, "\n".join(lines) + "\n"))
    return runnable


def run_shell(block: Block, server) -> str:
    code = block.code
    for old, new in replacements(server).items():
        code = code.replace(old, new)
    env = dict(os.environ, BUF=str(BUF), TRACEWIRE_TARGET=server.target,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{block.name}:\n{code}\n{proc.stderr}"
    return proc.stdout


def json_documents(text: str) -> list[dict]:
    """buf curl prints one pretty-printed JSON object per message."""
    decoder, docs, i = json.JSONDecoder(), [], 0
    while (i := _skip_space(text, i)) < len(text):
        doc, i = decoder.raw_decode(text, i)
        docs.append(doc)
    return docs


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def shell_block(containing: str) -> Block:
    (block,) = shell_blocks_with(containing)
    return block


def shell_blocks_with(containing: str) -> list[Block]:
    found = [b for b in shell_blocks() if containing in b.code]
    assert found, f"no client-side shell block contains {containing!r}"
    return found


# What the tests below find their blocks by: each test checks what its blocks claim.
CHECKED = ("source .venv/bin/activate", "force_sample", "base64 -d", "curl -s", "--protocol connect",
           "each layer's top next-token guess", "tracewire collect", "--top-k 5 --max-tokens 8")


def test_every_client_side_shell_block_is_run_here(eager):
    """Each block a test below checks is found by it; any other block runs here, and must
    succeed (a new one deserves a test of what it claims)."""
    for marker in CHECKED:
        shell_blocks_with(marker)
    for block in shell_blocks():
        if not any(marker in block.code for marker in CHECKED):
            run_shell(block, eager)


def test_activating_the_venv_reaches_the_cli_and_the_sdk(eager):
    """The quick start's block, from a new user's shell: no venv on PATH, no PYTHONPATH into
    the checkout. Without the README's step there is no `tracewire`; with it the CLI and the
    SDK answer."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env["TRACEWIRE_TARGET"] = eager.target
    before = subprocess.run(["bash", "-c", "command -v tracewire"], capture_output=True, text=True, env=env)
    assert before.returncode != 0, before.stdout
    for block in shell_blocks_with("source .venv/bin/activate"):
        result = subprocess.run(["bash", "-e", "-c", block.code], capture_output=True, text=True, timeout=120,
                                cwd=ROOT, env=env)
        assert result.returncode == 0, f"{block.name}: {result.stderr}"
        lines = result.stdout.strip().splitlines()
        assert "' Paris'" in result.stdout, result.stdout  # the CLI's tokenize table, or its trace table
        if "tracewire.__version__" in block.code:
            assert re.fullmatch(r"\d+\.\d+\.\d+", lines[-1]), lines  # the SDK's version


def test_buf_curl_trace_stops_at_step_3(eager):
    """The reflection example forces " a", and its stop at step 3 is what ends the
    generation (greedy goes on past 16 tokens): four steps, the last stopped, no warning."""
    docs = json_documents(run_shell(shell_block("force_sample"), eager))
    generate, trace = docs[0], docs[1:]
    assert generate["outputs"][0]["outputs"][0]["text"] == " Paris."
    steps = [r for d in trace if "steps" in d for r in d["steps"]["results"]]
    assert [s.get("step", 0) for s in steps] == [0, 1, 2, 3]
    assert [bool(s.get("stopped")) for s in steps] == [False, False, False, True]
    (result,) = [d["invokeResult"]["output"]["outputs"][0] for d in trace if "invokeResult" in d]
    assert result["text"] == " a ball named Max" and result["finishReason"] == "FINISH_REASON_STOP"
    (end,) = [d["end"] for d in trace if "end" in d]
    assert "warnings" not in end, end["warnings"]
    # The base64 the README decodes is this step 0's `top` (from this float32 server): the
    # same ids, the same values but for float32's last bits (CPUs round matmuls differently)
    top = steps[0]["values"]["top"]
    values, ids = re.findall(r"echo (\S+) \| base64 -d", shell_block("base64 -d").code)
    assert ids == top["tokenIds"]["data"]
    shown, served = (np.frombuffer(base64.b64decode(data), "<f4") for data in (values, top["values"]["data"]))
    np.testing.assert_allclose(served, shown, rtol=1e-5)


def test_unstopped_the_buf_curl_trace_would_run_on(eager):
    import tracewire as tw

    with tw.Client(eager.target, timeout=60) as client:
        prompt = client.tokenizer.encode("Once upon a time") + [276]
        (out,) = client.generate([prompt], temperature=0.0, max_tokens=15)
    assert out.outputs[0].finish_reason == "length"


def test_base64_decoding_prints_what_the_readme_says(eager):
    out = run_shell(shell_block("base64 -d"), eager).splitlines()
    assert out[0].split() == ["17.046825", "9.906333", "9.862729"]
    assert out[1].split() == ["441", "1315", "1059"]
    assert [round(v, 4) for v in json.loads(out[2])] == [17.0468, 9.9063, 9.8627]
    code = shell_block("base64 -d").code
    assert "17.046825 9.906333 9.862729" in code and "441 1315 1059" in code


def test_connect_curl(eager):
    out = run_shell(shell_block("curl -s"), eager)
    generate, health = json_documents(out)
    assert generate["outputs"][0]["outputs"][0]["text"] == " Paris."
    assert health == {"status": "SERVING"}


def test_buf_curl_connect_trace(eager):
    docs = json_documents(run_shell(shell_block("--protocol connect"), eager))
    steps = [r for d in docs if "steps" in d for r in d["steps"]["results"]]
    assert [s.get("tokenId", 0) for s in steps] == [806, 14, 0]   # " Paris" "." EOS
    assert all(s["values"]["top"]["values"]["shape"] == ["3"] for s in steps)


def test_tracewire_lens(eager):
    lines = run_shell(shell_block("each layer's top next-token guess"), eager).splitlines()
    header, rows = lines[0], lines[1:]
    assert header.split()[0] == "layer" and "' France'" in header
    assert len(rows) == 4 and all("' Paris'" in row.split("  ")[-1] for row in rows[1:])


def test_tracewire_lens_plot_and_collect(eager):
    """docs/tutorials/collecting.md's shell block: the lens table (and its heatmap), then a
    collection of the two JSONL prompts whose summary names its fields."""
    out = run_shell(shell_block("tracewire collect"), eager).splitlines()
    assert out[0].split()[0] == "layer" and "' Paris'" in out[-2]
    summary = json.loads(out[-1])
    assert summary["prompts"] == 2 and summary["shards"] == 1
    assert summary["fields"]["layers.1"] == {"dtype": "float32", "shape": [None, 256]}
    assert summary["fields"]["logits.ids"] == {"dtype": "int32", "shape": [None, 5]}


def test_tracewire_trace_tables(eager):
    traces = shell_blocks_with("--top-k 5 --max-tokens 8")
    assert len(traces) >= 3, [b.name for b in traces]   # the README's, getting started's, the SDK's
    # (pages that show the same command word for word: it runs once, a CLI start is seconds)
    for block in {b.code: b for b in traces}.values():
        out = run_shell(block, eager)
        assert "' Paris'" in out and "The capital of France is Paris." in out, block.name
