"""The SDK's optional dependencies (pyproject's extras), imported when first used, with the
install line when they are missing."""

from __future__ import annotations

import importlib
from typing import Any


def require(module: str, extra: str) -> Any:
    """Import `module`, which the `extra` extra installs."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{module} is not installed; it comes with: pip install 'tracewire[{extra}]'") from e
