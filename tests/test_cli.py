"""The `tracewire` CLI as a newcomer meets it: greedy by default, `--json` carrying token
ids, a logit-lens table whose cells are never cut, coloured only on a terminal."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

from tracewire.cli import _Cell, _lens_layers, _table
from tracewire.rpcs import ModelInfo

PROMPT = "The capital of France is"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def cli(target: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    return subprocess.run([sys.executable, "-m", "tracewire.cli", "--target", target, *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_generate_is_greedy_by_default(server, client):
    """Without --temperature every seed gives the greedy text (vLLM's default, temperature 1,
    would sample: Mongolia for France); --temperature still samples."""
    (greedy,) = client.generate(PROMPT, temperature=0.0, max_tokens=12)
    for seed in range(4):
        run = cli(server.target, "generate", PROMPT, "--max-tokens", "12", "-s", f"seed={seed}", "--json")
        assert run.returncode == 0, run.stderr
        (line,) = run.stdout.splitlines()
        assert json.loads(line)["outputs"][0]["token_ids"] == greedy.outputs[0].token_ids
    (hot,) = client.generate(PROMPT, temperature=1.5, seed=3, max_tokens=12)
    run = cli(server.target, "generate", PROMPT, "--max-tokens", "12", "--temperature", "1.5", "--seed", "3",
              "--json")
    assert json.loads(run.stdout)["outputs"][0]["token_ids"] == hot.outputs[0].token_ids


def test_help_says_the_default_is_greedy():
    for command in ("generate", "trace"):
        run = subprocess.run([sys.executable, "-m", "tracewire.cli", command, "--help"],
                             capture_output=True, text=True, timeout=60)
        assert "default 0: greedy" in " ".join(run.stdout.split()), run.stdout


def test_trace_json_final_line_has_token_ids(server, client):
    run = cli(server.target, "trace", PROMPT, "--max-tokens", "6", "--json")
    assert run.returncode == 0, run.stderr
    *steps, final = [json.loads(line) for line in run.stdout.splitlines()]
    (greedy,) = client.generate(PROMPT, temperature=0.0, max_tokens=6)
    assert final["token_ids"] == [s["token_id"] for s in steps] == greedy.outputs[0].token_ids
    assert final["text"] == greedy.outputs[0].text and final["finish_reason"] == "stop"


def test_table_sizes_columns_to_content_and_colours_without_skewing_them():
    header = ["layer", "'The'", "' capital'"]
    rows = [["0", _Cell("' Constantinople'", 0.75), _Cell("' of'", 0.05)],
            ["12", _Cell("' x'", 1.0), _Cell("' a very long token indeed'", 0.2)]]
    plain = _table(header, rows, colour=False)
    coloured = _table(header, rows, colour=True)
    assert "' Constantinople' 0.75" in plain[1] and "' a very long token indeed' 0.20" in plain[2]
    assert [ANSI.sub("", line) for line in coloured] == plain
    assert "\x1b[1;32m0.75\x1b[0m" in coloured[1] and "\x1b[2m0.05\x1b[0m" in coloured[1]
    assert "\x1b[33m0.20\x1b[0m" in coloured[2]
    # Each column as wide as its widest cell, two spaces apart; layers right-aligned.
    assert plain == [
        "layer  'The'                   ' capital'",
        "    0  ' Constantinople' 0.75  ' of' 0.05",
        "   12  ' x' 1.00               ' a very long token indeed' 0.20",
    ]


def lens_cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_lens_cells_are_whole_and_plain_off_a_terminal(eager):
    run = cli(eager.target, "lens", PROMPT)
    assert run.returncode == 0, run.stderr
    assert "\x1b" not in run.stdout
    header, *rows = run.stdout.splitlines()
    assert lens_cells(header) == ["layer", "'The'", "' capital'", "' of'", "' France'", "' is'"]
    assert len(rows) == 4
    for row in rows:
        layer, *cells = lens_cells(row)
        assert len(cells) == 5 and layer.isdigit()
        assert all(re.fullmatch(r"'.+' [01]\.\d\d", c) for c in cells), cells
    assert lens_cells(rows[-1])[-1].startswith("' Paris' ")


def test_lens_colours_probabilities_on_a_terminal(eager):
    controller, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    proc = subprocess.Popen([sys.executable, "-m", "tracewire.cli", "--target", eager.target, "lens", PROMPT,
                             "--layers", "0,3"], stdout=terminal, stderr=subprocess.PIPE, env=env)
    os.close(terminal)
    out = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(controller)
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    text = out.decode()
    assert re.search(r"' Paris' \x1b\[[0-9;]+m[01]\.\d\d\x1b\[0m", text), text
    plain = [lens_cells(ANSI.sub("", line)) for line in text.splitlines()]
    assert [row[0] for row in plain] == ["layer", "0", "3"]


def test_the_lens_defaults_to_the_layers_the_server_lenses():
    """Every layer on an eager server; a compiled one's readable layers; under pipeline
    parallelism the last stage's (lm_head is there: the server refuses the others)."""
    def info(mode: str, readable: list[int], stages: list[int]) -> ModelInfo:
        return ModelInfo("m", "A", 2048, [0], None, 512, "float32", 6, 256, 1, [], "v", "s", engine_mode=mode,
                         readable_layers=readable, pipeline_parallel_size=len(stages), stage_first_layers=stages)

    assert _lens_layers(info("eager", [], [0])) == [0, 1, 2, 3, 4, 5]
    assert _lens_layers(info("compiled", [4, 1], [0])) == [1, 4]
    assert _lens_layers(info("eager", [], [0, 3])) == [3, 4, 5]
    assert _lens_layers(info("unspecified", [], [0])) == [0, 1, 2, 3, 4, 5]  # an older server: all
