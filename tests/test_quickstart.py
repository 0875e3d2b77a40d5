"""README's quick start as written: after `make serve`, the SDK and the CLI are reached the
way it says (activating .venv), from a shell that has neither on its PATH."""

from __future__ import annotations

import os
import re
import subprocess

from conftest import ROOT, ServerProcess


def readme_block(starting_with: str) -> str:
    """The README's fenced bash block whose first line is `starting_with`."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if b.startswith(starting_with)]
    return block


def test_activating_the_venv_reaches_the_cli_and_the_sdk(server: ServerProcess) -> None:
    block = readme_block("source .venv/bin/activate\n")
    # A new user's shell: no venv on PATH, no PYTHONPATH into the checkout.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env["TRACEWIRE_TARGET"] = server.target
    before = subprocess.run(["bash", "-c", "command -v tracewire"], capture_output=True, text=True, env=env)
    assert before.returncode != 0, before.stdout  # not there without the README's step
    result = subprocess.run(["bash", "-e", "-c", block], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "' Paris'" in result.stdout, result.stdout  # the CLI's tokenize table
    assert re.fullmatch(r"\d+\.\d+\.\d+", lines[-1]), lines  # the SDK's version
