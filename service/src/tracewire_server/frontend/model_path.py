"""A `--model` that names a local directory which is not there, said as such.

vLLM passes any value it cannot open as a directory to the Hugging Face hub, so a
mistyped path ends ~65 lines later in "Repo id must be in the form 'repo_name' or
'namespace/repo_name'". Hub ids are `name` or `namespace/name`; a value is taken for a
local path when it cannot be one: it starts with '/', '.', or '~', ends with '/', has
more than one '/', or its first part is a directory here (`models/tracewire-tiny`,
as `make serve` passes it). Anything else is passed on to vLLM as a hub id.
"""

from __future__ import annotations

from pathlib import Path


def looks_like_path(value: str) -> bool:
    if value.startswith(("/", ".", "~")) or value.endswith("/") or value.count("/") > 1:
        return True
    head, sep, _ = value.partition("/")
    return bool(sep) and Path(head).is_dir()


def model_problem(value: str) -> str | None:
    """Why `value` cannot be the local model it names, or None (it is one, or a hub id)."""
    if not looks_like_path(value):
        return None
    path = Path(value).expanduser()
    if not path.exists():
        return (
            f"--model {value}: no such directory ({path.absolute()}); give the directory that "
            "holds the model's config.json, or a hub id like 'namespace/name'"
        )
    if path.is_dir() and not any((path / name).is_file() for name in ("config.json", "params.json")):
        return f"--model {value}: {path.absolute()} holds no config.json: not a model directory"
    return None  # a model directory, or a file vLLM reads itself (a GGUF)
