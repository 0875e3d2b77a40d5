/**
 * The clients against a server of its own with TLS and --auth-tokens (the shared test server
 * has neither): createNodeClient's `tls` and `token`, and createWebClient's token header.
 * The certificates come from tests/certs.py (Python's cryptography; Node cannot issue them).
 * The docs' Security snippet (docs/security.md) runs here too, against this server.
 */

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { Code, TracewireError, createNodeClient, createWebClient, invoke } from "../src/node.js";
import { PYTHON, REPO, startServer, type RunningServer } from "./server.js";
import { runSnippet, snippets } from "./snippets.js";

const TOKEN = "ts-tenant-0123456789abcdef";
const dir = mkdtempSync(join(tmpdir(), "tracewire-ts-auth-"));
let server: RunningServer;
let ca: Buffer;

before(async () => {
  execFileSync(PYTHON, ["-c", "import sys, pathlib; sys.path.insert(0, 'tests'); import certs; certs.make_pki(pathlib.Path(sys.argv[1]))", dir],
    { cwd: REPO });
  ca = readFileSync(join(dir, "ca.pem"));
  writeFileSync(join(dir, "tokens"), `# tenant token\nts ${TOKEN}\n`);
  // (eager: TLS and tokens do not depend on the engine kind, and an eager engine starts
  // without torch.compile, ~30% less of a core)
  server = await startServer({
    extraArgs: ["--enforce-eager", "--tls-cert", join(dir, "server.pem"), "--tls-key", join(dir, "server.key"), "--auth-tokens", join(dir, "tokens")],
    client: { tls: { ca }, token: TOKEN },
  });
});

after(async () => {
  await server?.stop();
});

async function codeOf(call: Promise<unknown>): Promise<Code | "ok"> {
  try {
    await call;
    return "ok";
  } catch (error) {
    assert.ok(error instanceof TracewireError, String(error));
    return error.code;
  }
}

test("TLS and a token: the Node client is served", async () => {
  assert.match(server.url, /^https:\/\//);
  const client = createNodeClient(server.target, { tls: { ca }, token: TOKEN, timeoutMs: 120_000 });
  try {
    const [out] = await client.generate("The capital of France is", { temperature: 0, maxTokens: 4 });
    assert.match(out?.outputs[0]?.text ?? "", /^ Paris/);
    const tokens: string[] = [];
    for await (const step of client.trace(invoke("The capital of France is"), { temperature: 0, maxTokens: 3 })) tokens.push(step.text);
    assert.equal(tokens.length, 3);
  } finally {
    client.close();
  }
});

test("without a token, or with a wrong one, calls are UNAUTHENTICATED", async () => {
  for (const token of [undefined, `${TOKEN}x`]) {
    const client = createNodeClient(server.target, { tls: { ca }, ...(token ? { token } : {}), timeoutMs: 30_000 });
    try {
      assert.equal(await codeOf(client.modelInfo()), Code.Unauthenticated);
      assert.equal(await codeOf(client.generate("hi", { maxTokens: 1 })), Code.Unauthenticated);
    } finally {
      client.close();
    }
  }
});

test("plaintext gRPC to the TLS port fails", async () => {
  const client = createNodeClient(server.url.replace("https://", "http://"), { token: TOKEN, timeoutMs: 10_000 });
  try {
    assert.notEqual(await codeOf(client.modelInfo()), "ok");
  } finally {
    client.close();
  }
});

test("the web client sends the token as an authorization header", async () => {
  const seen: string[] = [];
  const fetch: typeof globalThis.fetch = async (_input, init) => {
    seen.push(new Headers(init?.headers).get("authorization") ?? "");
    return new Response(JSON.stringify({ code: "unauthenticated", message: "stub" }), {
      status: 401,
      headers: { "content-type": "application/json" },
    });
  };
  const client = createWebClient("https://tracewire.invalid", { protocol: "connect", useJson: true, token: TOKEN, fetch });
  assert.equal(await codeOf(client.modelInfo()), Code.Unauthenticated);
  assert.deepEqual(seen, [`Bearer ${TOKEN}`]);
});

test("the docs' Security snippet runs as written against a TLS server with tokens", () => {
  const [snippet, ...more] = snippets(join(REPO, "docs", "security.md")).filter((s) => s.code.includes("tls:"));
  assert.ok(snippet && more.length === 0);
  writeFileSync(join(dir, "my.token"), `${TOKEN}\n`); // beside ca.pem: the snippet reads both
  const lines = runSnippet(snippet, { "https://host:50051": server.url, "https://host:8080": server.httpUrl }, dir);
  assert.deepEqual(lines, ["2048"]);
});
