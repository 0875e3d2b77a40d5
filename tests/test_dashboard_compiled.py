"""The dashboard (clients/ts/examples/dashboard) on compiled servers, in headless Chromium:
what a user sees where the server does not serve every module read. On the session's
compiled server without graph hooks (`bare`: --graph-hook-bytes 0) the lens and steering sections say, in a
sentence, why they are not there and which flag would serve them (no blank section, no raw
status), the feature strip stays hidden, and a run streams its steps; on the compiled one with
read buffers and steering tables on layers 0-2 (`graph`) the lens reads those layers and
steering offers them; on `make serve`'s (`server`: the default hooks, every layer) the lens
reads every layer. The TS suite (clients/ts/test/dashboard.test.ts) covers the eager server.

The page is built here with Vite into this test's folder (the checkout's dist/ is `make
test-ts`'s, which may be running beside pytest), served from localhost (the servers' default
CORS allows it), and driven by tests/dashboard_page.mjs (playwright-core from clients/ts).
Screenshots: tests/output/dashboard-compiled-*.png (git-ignored). No server is started here.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "clients" / "ts" / "examples" / "dashboard"
DRIVER = Path(__file__).with_name("dashboard_page.mjs")
OUTPUT = ROOT / "tests" / "output"
CHROMIUM = os.environ.get("TRACEWIRE_CHROMIUM", "/usr/bin/chromium")
PROMPT = "The capital of France is"
STEPS = 4


def _needs(path: Path, what: str) -> None:
    if not path.exists():
        pytest.fail(f"{path} is missing: {what}", pytrace=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The dashboard, built into a folder of this module's, served on localhost."""
    _needs(Path(CHROMIUM), "the browser tests need Chromium (make chromium; or TRACEWIRE_CHROMIUM)")
    _needs(DASHBOARD / "node_modules" / ".bin" / "vite", "make setup installs the dashboard's tools (npm ci)")
    _needs(ROOT / "clients" / "ts" / "node_modules" / "playwright-core", "make setup installs the TS client's (npm ci)")
    out = tmp_path_factory.mktemp("dashboard") / "dist"
    subprocess.run([str(DASHBOARD / "node_modules" / ".bin" / "vite"), "build", "--outDir", str(out), "--emptyOutDir",
                    "--logLevel", "warn"], cwd=DASHBOARD, check=True, timeout=300)
    handler = functools.partial(_Quiet, directory=str(out))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://localhost:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


def show(site: str, server_url: str, name: str, run: bool = True) -> dict:
    """What the page shows on `server_url` (after a run of PROMPT), and its screenshot."""
    OUTPUT.mkdir(parents=True, exist_ok=True)
    spec = {"chromium": CHROMIUM, "url": f"{site}/?server={server_url}",
            "screenshot": str(OUTPUT / f"dashboard-compiled-{name}.png"),
            "run": {"prompt": PROMPT, "maxTokens": STEPS, "topK": 5} if run else None}
    node = shutil.which("node")
    assert node, "no node on PATH"
    result = subprocess.run([node, str(DRIVER), json.dumps(spec)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    assert shown["pageErrors"] == [], shown["pageErrors"]
    return shown


def test_a_compiled_server_without_reads_says_why_lens_and_steering_are_not_there(site, bare):
    shown = show(site, bare.http_url, "no-reads")
    assert shown["state"] == "done", shown
    assert shown["error"] is None
    assert shown["steps"] == STEPS  # a run streams its steps as on an eager server
    # The lens: a sentence naming the mode, what it reads and the flags that would serve it; no table.
    assert shown["lensAvailable"] == "false"
    note = shown["lensNote"]
    assert note.startswith("Not available: The logit lens needs module reads; this server is COMPILED, "
                           "reading no layers"), note
    assert "--compiled-reads" in note and "--enforce-eager" in note
    assert shown["lensCells"] == 0 and shown["lensRows"] == []
    # Steering: the same, with both flags; its controls off.
    assert shown["steerAvailable"] == "false"
    assert "--compiled-reads --compiled-steering" in shown["steerNote"], shown["steerNote"]
    assert shown["steerDisabled"] is True
    # The feature strip: no picker (nothing it could read), and in its place why: the shipped SAE's layer.
    assert shown["featuresShown"] is False and shown["features"] == 0
    assert shown["featuresNote"].startswith(
        "Not available: The feature strip needs a read of layers.2 (where the SAE res-l2-sae reads); this server is "
        "COMPILED, reading no layers"), shown["featuresNote"]
    assert "--compiled-reads" in shown["featuresNote"]
    for text in (note, shown["steerNote"], shown["featuresNote"], shown["status"]):
        assert "FAILED_PRECONDITION" not in text and "{" not in text


def test_a_compiled_server_with_read_buffers_reads_the_lens_and_steers_on_those_layers(site, graph):
    shown = show(site, graph.http_url, "reads-0-2")
    assert shown["state"] == "done", shown
    assert shown["error"] is None
    assert shown["lensAvailable"] == "true"
    assert shown["lensRows"] == [2, 1, 0]  # the last layer on top; layers.3 has no read buffer
    prompt_tokens = 5
    assert shown["lensCells"] == 3 * (prompt_tokens + STEPS - 1)
    assert shown["steerAvailable"] == "true" and shown["steerDisabled"] is False
    assert shown["steerLayers"] == ["0", "1", "2"]
    # the shipped SAE reads layers.2, which this server reads
    assert shown["featuresShown"] is True and shown["features"] == STEPS
    assert shown["featuresNote"] is None


def test_the_default_server_reads_the_lens_and_steers_on_every_layer(site, server):
    shown = show(site, server.http_url, "default")
    assert shown["state"] == "done" and shown["error"] is None, shown
    assert shown["lensAvailable"] == "true"
    assert shown["lensRows"] == [3, 2, 1, 0]
    assert shown["steerAvailable"] == "true" and shown["steerLayers"] == ["0", "1", "2", "3"]
    assert shown["featuresShown"] is True and shown["featuresNote"] is None
