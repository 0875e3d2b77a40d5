"""A real browser on the HTTP port: headless Chromium runs a page served from another
origin (localhost:N vs the API's 127.0.0.1:M, so CORS preflights happen) that calls the
API with fetch() in the Connect protocol and reads a Trace as a stream.

Needs Chromium (`make test` installs Debian's `chromium` when missing): without it the test
fails with that message rather than skipping.
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import free_port
from test_http import step_results

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# What a Connect-ES createConnectTransport does on the wire, written out with fetch():
# unary JSON POSTs, and a server stream as 5-byte envelopes read from response.body.
PAGE = """<!doctype html><html><body><script>
const base = "%(api)s/tracewire.v1.TraceService/";
const H = {"content-type": "application/json", "connect-protocol-version": "1"};
function envelope(obj) {
  const body = new TextEncoder().encode(JSON.stringify(obj));
  const env = new Uint8Array(5 + body.length);
  new DataView(env.buffer).setUint32(1, body.length); env.set(body, 5); return env;
}
async function run() {
  const out = {};
  try {
    let r = await fetch(base + "Tokenize",
                        {method: "POST", headers: H, body: JSON.stringify({text: "The capital of France is"})});
    out.tokenize = await r.json();
    const req = {samplingParams: {temperature: 0, maxTokens: 24, ignoreEos: true},
                 invokes: [{prompt: {text: "The capital of France is"},
                            interventions: [{name: "top", readLogits: {topK: {k: 3}}}]}]};
    r = await fetch(base + "Trace", {method: "POST", body: envelope(req), headers: {
      "content-type": "application/connect+json", "connect-protocol-version": "1", "connect-timeout-ms": "60000"}});
    const reader = r.body.getReader();
    let buf = new Uint8Array(0), reads = 0, end = null; const events = [];
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      reads++;
      const b = new Uint8Array(buf.length + value.length); b.set(buf); b.set(value, buf.length); buf = b;
      while (buf.length >= 5) {
        const n = new DataView(buf.buffer, buf.byteOffset).getUint32(1);
        if (buf.length < 5 + n) break;
        const msg = JSON.parse(new TextDecoder().decode(buf.subarray(5, 5 + n)));
        if (buf[0] & 2) end = msg; else events.push(msg);
        buf = buf.subarray(5 + n);
      }
    }
    out.trace = {status: r.status, reads, events, end};
    r = await fetch(base + "Generate", {method: "POST", headers: H, body: JSON.stringify({prompts: []})});
    out.error = {status: r.status, body: await r.json()};
  } catch (e) { out.exception = String(e); }
  await fetch("/result", {method: "POST", body: JSON.stringify(out)});
}
run();
</script></body></html>
"""


def _serve_page(page: str, port: int, results: list[dict]) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = page.encode()
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # the page reports what it saw
            results.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_browser_calls_unary_and_streams_a_trace_cross_origin(server, stub, tmp_path: Path):
    import trace_requests as T

    if CHROMIUM is None:
        pytest.fail("Chromium is not installed: `make test` installs it (Debian: apt-get install chromium)")
    results: list[dict] = []
    port = free_port()
    httpd = _serve_page(PAGE % {"api": server.http_url}, port, results)
    browser = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--remote-debugging-port=0",
         f"http://localhost:{port}/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = 120
        while not results and deadline > 0 and browser.poll() is None:
            threading.Event().wait(0.2)
            deadline -= 0.2
    finally:
        browser.kill()
        browser.wait(timeout=30)
        httpd.shutdown()
    assert results, "the page never reported"
    (out,) = results
    assert "exception" not in out, out["exception"]  # e.g. a CORS refusal surfaces as a TypeError

    assert out["tokenize"]["tokens"] == ["The", " capital", " of", " France", " is"]

    trace = out["trace"]
    assert trace["status"] == 200 and trace["end"] == {}, trace["end"]
    # one step per event, or batches of steps where the contract batches them
    steps = [s for e in trace["events"]
             for s in ([e["step"]] if "step" in e else e.get("steps", {}).get("results", []))]
    assert [s.get("step", 0) for s in steps] == list(range(24))
    assert trace["reads"] > 1  # streamed as produced, not one buffered body
    request = T.trace(T.invoke("The capital of France is", T.iv("top", read_logits=T.logits(k=3))),
                      temperature=0.0, max_tokens=24, ignore_eos=True)
    over_grpc = step_results(list(stub.Trace(request, timeout=120)))
    assert [s.get("tokenId", 0) for s in steps] == [s.token_id for s in over_grpc]
    assert "".join(s.get("textDelta", "") for s in steps) == "".join(s.text_delta for s in over_grpc)

    assert out["error"]["status"] == 400
    assert out["error"]["body"]["code"] == "invalid_argument"
    assert out["error"]["body"]["message"].startswith("prompts")
