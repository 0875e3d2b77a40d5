"""A newcomer's first start, timed: a fresh clone of this checkout, then `make serve`, until
the server logs SERVING.

The README promises a fresh clone reaches SERVING in under 5 minutes on the 2-core VM; this
measures it, with each set-up step's time (the "==> [k/5]" lines `make setup` prints),
for both installers side by side (uv, the default, and USE_UV=0: pip alone). With
--cold-caches pip and uv start from empty caches (every package comes from the registry, as
on a new machine); without it they reuse this machine's, as a second clone would.

    python bench/first_start.py                      # uv and pip, warm caches
    python bench/first_start.py --installers uv --cold-caches

Results: bench/results/first-start-<date>-<host>.json (and a line per run on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^==> \[(\d)/5\] (.*)")
TIMEOUT_S = 1800


@dataclass
class Run:
    installer: str
    cold_caches: bool
    seconds_to_serving: float | None = None
    steps: list[tuple[str, float]] = field(default_factory=list)  # (step line, seconds since start)
    failed: str | None = None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def first_start(installer: str, cold_caches: bool) -> Run:
    run = Run(installer, cold_caches)
    with tempfile.TemporaryDirectory(prefix="tracewire-first-start-") as scratch:
        clone = Path(scratch) / "tracewire"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        env = dict(os.environ, USE_UV="1" if installer == "uv" else "0")
        env.pop("VIRTUAL_ENV", None)
        if cold_caches:
            env.update(UV_CACHE_DIR=f"{scratch}/uv-cache", PIP_CACHE_DIR=f"{scratch}/pip-cache",
                       npm_config_cache=f"{scratch}/npm-cache")
        command = ["make", "serve", f"PORT={free_port()}", f"HTTP_PORT={free_port()}"]
        started = time.monotonic()
        proc = subprocess.Popen(command, cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                elapsed = time.monotonic() - started
                if STEP.match(line):
                    run.steps.append((line.strip(), round(elapsed, 1)))
                    print(f"  {elapsed:6.1f} s  {line.strip()}", flush=True)
                if "SERVING" in line:
                    run.seconds_to_serving = round(elapsed, 1)
                    break
                if elapsed > TIMEOUT_S:
                    run.failed = f"no SERVING in {TIMEOUT_S} s"
                    break
            else:
                run.failed = f"make serve exited ({proc.wait()}) before SERVING"
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--installers", default="uv,pip", help="comma-separated: uv, pip (default both)")
    parser.add_argument("--cold-caches", action="store_true", help="empty pip / uv / npm caches")
    args = parser.parse_args()
    runs = []
    for installer in args.installers.split(","):
        print(f"{installer}: fresh clone -> make serve -> SERVING", flush=True)
        run = first_start(installer, args.cold_caches)
        outcome = run.failed or f"{run.seconds_to_serving} s to SERVING"
        print(f"{installer}: {outcome}")
        runs.append(run)
    now = datetime.now()
    out = ROOT / "bench" / "results" / f"first-start-{now:%Y%m%d-%H%M}-{platform.node()}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "date": now.isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "runs": [asdict(r) for r in runs],
    }, indent=2) + "\n")
    print(f"results: {out.relative_to(ROOT)}")
    return 0 if all(r.failed is None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
