"""The three Python projects build without setuptools deprecation warnings: a license as a
TOML table (`{ text = ... }`) printed one on every install, `make serve`'s included."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

# setuptools' own build backend, as pip calls it, writing only the metadata (no build).
BUILD_METADATA = "from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel('meta'))"


@pytest.mark.parametrize("project", [".", "clients/python", "contract/python"])
def test_builds_without_deprecation_warnings(project: str, tmp_path: Path) -> None:
    copy = tmp_path / "project"
    # A copy: building in place would leave *.egg-info in the checkout. The server's
    # pyproject.toml finds its packages under service/src.
    shutil.copytree(ROOT / project, copy, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", "node_modules", ".venv", "clients", "contract", "models", "bench"))
    (copy / "meta").mkdir()
    result = subprocess.run([sys.executable, "-c", BUILD_METADATA], cwd=copy,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    metadata = next((copy / "meta").glob("*.dist-info")) / "METADATA"
    assert "License-Expression: Apache-2.0" in metadata.read_text().splitlines()
