"""The SDK as a new user gets it: `pip install ./contract/python ./clients/python` (the contract
package tracewire.v1, which the SDK depends on, and the SDK) in a fresh virtualenv, no vLLM and
no torch, then an example script against the running server."""

from __future__ import annotations

import os
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
    # A new user's environment: no PYTHONPATH pointing into a checkout (only what pip installed).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # Copies: building in place would leave build/ in the checkout.
    contract, sdk = tmp_path / "contract", tmp_path / "sdk"
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT / "contract" / "python", contract, ignore=ignore)
    shutil.copytree(ROOT / "clients" / "python", sdk, ignore=ignore)
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(contract), str(sdk)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    # Both wheels land in one site-packages/tracewire/ (the SDK's package, the contract's v1/).
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u, sys, tracewire, tracewire.v1.trace_pb2 as t; "
         "print(u.find_spec('torch') is None, u.find_spec('vllm') is None, tracewire.__version__, "
         "tracewire.__path__ == [tracewire.__path__[0]] and t.__file__.startswith(tracewire.__path__[0]) "
         "and tracewire.__path__[0].startswith(sys.prefix))"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env,
    )
    assert probe.stdout.split() == ["True", "True", "0.1.0", "True"], probe.stderr
    example = subprocess.run(
        [str(python), "generate.py", server.target], capture_output=True, text=True, timeout=120,
        cwd=ROOT / "clients" / "python" / "examples", env=env,
    )
    assert example.returncode == 0, example.stderr
    outs = client.generate(["The capital of France is", "The capital of Japan is"], temperature=0.0, max_tokens=8)
    assert example.stdout.strip() == repr([o.outputs[0].text for o in outs])
    cli = subprocess.run([str(env_dir / "bin" / "tracewire"), "--target", server.target, "tokenize", " Paris"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert cli.returncode == 0 and "' Paris'" in cli.stdout, cli.stderr
    assert sys.prefix != str(env_dir)
