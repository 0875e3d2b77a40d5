"""Every example script runs against the real server and prints what its docs say."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "clients" / "python" / "examples"
PROMPT = "The capital of France is"


def run_example(server, name: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), server.target],
                          capture_output=True, text=True, timeout=180, cwd=EXAMPLES)
    assert proc.returncode == 0, proc.stderr
    # An example whose selected steps are never reached (a stop that never fires, a read
    # past the end) warns: it does not do what it says.
    assert "TraceWarning" not in proc.stderr, proc.stderr
    return proc.stdout.splitlines()


def test_every_example_is_tested():
    tested = {n.removeprefix("test_") + ".py" for n in globals() if n.startswith("test_")}
    scripts = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    assert scripts <= tested, scripts - tested


def test_text(server, client):
    lines = run_example(server, "text.py")
    (out,) = client.generate(PROMPT, temperature=0.0, max_tokens=32)
    c = out.outputs[0]
    assert lines == [c.text, f"{c.token_ids[:8]} {c.finish_reason}"]


def test_generate(server, client):
    (line,) = run_example(server, "generate.py")
    outs = client.generate([PROMPT, "The capital of Japan is"], temperature=0.0, max_tokens=8)
    assert ast.literal_eval(line) == [o.outputs[0].text for o in outs] == [" Paris.", " Tokyo."]


def test_logprobs(server, hf):
    lines = run_example(server, "logprobs.py")
    greedy = hf.greedy(hf.encode(PROMPT), 4)
    assert len(lines) == 4
    for line, token in zip(lines, greedy, strict=True):
        text, top = line.split(" [(", 1)
        top = "[(" + top
        assert ast.literal_eval(text) == hf.tokenizer.decode([token])
        top = ast.literal_eval(top)
        assert len(top) == 3 and top[0][0] == hf.tokenizer.decode([token])


def test_per_step(server, client):
    lines = run_example(server, "per_step.py")
    (plain,) = client.generate(PROMPT, temperature=0.8, top_p=0.95, seed=0, max_tokens=6)
    assert [int(line.split()[0]) for line in lines] == list(range(len(plain.outputs[0].token_ids)))
    drawn = [ast.literal_eval(line.split(" ", 1)[1].rsplit(" greedy:", 1)[0].rsplit(" ", 1)[0]) for line in lines]
    assert "".join(drawn) == plain.outputs[0].text
    assert all(0 < float(line.split(" greedy:")[0].rsplit(" ", 1)[1]) <= 1 for line in lines)


def test_force(server, hf):
    (line,) = run_example(server, "force.py")
    berlin = hf.encode(" Berlin")[0]
    ids = hf.encode(PROMPT) + [berlin]
    rest = []
    for token in hf.greedy(ids, 7):
        if token == hf.tokenizer.eos_token_id:
            break
        rest.append(token)
    assert line == hf.tokenizer.decode([berlin] + rest)


def test_stop(server, hf):
    """The stop at step 2 is what ends the generation: greedy decoding runs on past it."""
    (line,) = run_example(server, "stop.py")
    ids, rest = line.split("] ", 1)
    text, finish_reason = rest.rsplit(" ", 1)
    prompt = hf.encode("Once upon a time")
    assert hf.tokenizer.eos_token_id not in hf.greedy(prompt, 32)   # unstopped, it would go on
    expected = hf.greedy(prompt, 3)
    assert ast.literal_eval(ids + "]") == expected
    assert ast.literal_eval(text) == hf.tokenizer.decode(expected)
    assert finish_reason == "stop"


def test_conditional(server, hf):
    first, second = run_example(server, "conditional.py")
    greedy = hf.greedy(hf.encode(PROMPT), 32)
    period = hf.encode(".")[0]
    assert ast.literal_eval(first) == hf.tokenizer.decode(greedy[: greedy.index(period) + 1])
    france, japan = ast.literal_eval(second)
    assert france.startswith(" Berlin") and japan.startswith(" Tokyo")


def test_sequences(server, client):
    first, texts = run_example(server, "sequences.py")
    (native,) = client.generate(PROMPT, temperature=1.0, seed=0, max_tokens=8, n=3)
    assert ast.literal_eval(first) == [c.token_ids[0] for c in native.outputs]
    assert ast.literal_eval(texts) == [c.text for c in native.outputs]


def test_invokes(server, client):
    (line,) = run_example(server, "invokes.py")
    (cold,) = client.generate(PROMPT, temperature=0.0, max_tokens=8)
    (hot,) = client.generate(PROMPT, temperature=1.5, seed=1, max_tokens=8)
    assert line == f"{cold.outputs[0].text!r} {hot.outputs[0].text!r}"


def test_prompt_forms(server, client):
    (line,) = run_example(server, "prompt_forms.py")
    (out,) = client.generate(PROMPT, temperature=0.0, max_tokens=4)
    assert line == f"True {out.outputs[0].text!r}"


def test_streaming(server, hf):
    lines = run_example(server, "streaming.py")
    greedy = hf.greedy(hf.encode("Once upon a time"), 12, eos=hf.tokenizer.eos_token_id)
    steps, final = lines[:-1], lines[-1]
    assert [int(s.split()[0]) for s in steps] == list(range(len(greedy)))
    assert ast.literal_eval(final) == hf.tokenizer.decode(greedy, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["text.py"])
def test_examples_need_no_vllm_or_torch(name):
    source = (EXAMPLES / name).read_text()
    assert "import torch" not in source and "vllm" not in source
