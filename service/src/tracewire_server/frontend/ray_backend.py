"""`--distributed-executor-backend ray` that cannot start here, said in one line at start.

vLLM finds out only inside the engine core, ~20 s and ~50 lines of traceback later: its
CPU build names no Ray device ("ValueError: current platform cpu does not support ray"),
and without the ray package its config fails validation ("Failed to import Ray"). Both
are known before the engine starts, from the platform and the installed packages.
"""

from __future__ import annotations

import importlib.util

FLAG = "--distributed-executor-backend"


def ray_problem(backend: object, device_name: str, ray_device_key: str) -> str | None:
    """Why `backend` (the flag's value: None, a name, or an executor class) cannot run on
    this vLLM platform (`device_name`, its `ray_device_key`), or None."""
    if backend != "ray":
        return None
    if not ray_device_key:
        return (
            f"{FLAG} ray: vLLM's {device_name} build has no Ray support (its platform names no "
            f"Ray device, and vLLM refuses to start: 'current platform {device_name} does not "
            f"support ray'); use {FLAG} mp on one machine, or vLLM's CUDA or ROCm build for a Ray "
            "cluster (deploy/README.md: Multi-node with Ray)"
        )
    if importlib.util.find_spec("ray") is None:
        return (
            f"{FLAG} ray: the ray package is not installed here; install the same ray version "
            "on every node of the cluster (pip install 'ray[default]'; deploy/README.md: "
            "Multi-node with Ray)"
        )
    return None


def platform_ray_problem(backend: object) -> str | None:
    """ray_problem for the platform vLLM runs on in this process."""
    if backend != "ray":  # vLLM's platform is resolved only when it matters
        return None
    from .vllm_compat import platform_ray_device

    return ray_problem(backend, *platform_ray_device())
