"""The SDK as a new user gets it: `pip install ./clients/python` in a fresh virtualenv,
no vLLM and no torch, then an example script against the running server."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fresh_venv_install_runs_examples_without_vllm_or_torch(server, tmp_path, client):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    source = tmp_path / "sdk"  # a copy: building in place would leave build/ in the checkout
    shutil.copytree(ROOT / "clients" / "python", source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(source)],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u, tracewire; "
         "print(u.find_spec('torch') is None, u.find_spec('vllm') is None, tracewire.__version__)"],
        capture_output=True, text=True, timeout=60,
    )
    assert probe.stdout.split() == ["True", "True", "0.1.0"], probe.stderr
    example = subprocess.run(
        [str(python), "generate.py", server.target], capture_output=True, text=True, timeout=120,
        cwd=ROOT / "clients" / "python" / "examples",
    )
    assert example.returncode == 0, example.stderr
    outs = client.generate(["The capital of France is", "The capital of Japan is"], temperature=0.0, max_tokens=8)
    assert example.stdout.strip() == repr([o.outputs[0].text for o in outs])
    cli = subprocess.run([str(env_dir / "bin" / "tracewire"), "--target", server.target, "tokenize", " Paris"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "' Paris'" in cli.stdout, cli.stderr
    assert sys.prefix != str(env_dir)
