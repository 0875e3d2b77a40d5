/**
 * A client pointed where no server is: every call fails with an UnreachableError (UNAVAILABLE)
 * whose message is one line naming the target and how to give another, from the Node client
 * (gRPC) and the web client (gRPC-Web and Connect over fetch, here Node's). Against a real
 * closed port (picked free, nothing listening) and a name that does not resolve; no server.
 * The browser's side (Chromium's fetch) is in dashboard.test.ts.
 */

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdirSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { test } from "node:test";
import { Code, createNodeClient, createWebClient, invoke, read, TracewireError, UnreachableError, type TracewireClient } from "../src/node.js";

const HERE = dirname(fileURLToPath(import.meta.url));
const REFUSED = "connection refused: nothing listens there";
const NODE_HOW = `createNodeClient("http://HOST:PORT"), the server's gRPC port (--port)`;
const WEB_HOW = `createWebClient("http://HOST:PORT"), the server's HTTP port (--http-port)`;

async function closedPort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((done) => server.listen(0, "127.0.0.1", done));
  const address = server.address();
  assert.ok(address && typeof address === "object");
  await new Promise<void>((done) => server.close(() => done()));
  return address.port;
}

function line(target: string, reason: string, how: string): string {
  return `cannot reach a tracewire server at ${target} (${reason}): start one (make serve), or pass its address: ${how}`;
}

/** Each kind of call (unary, server stream, trace) fails with the one line. */
async function checkCalls(client: TracewireClient, message: string, target: string): Promise<void> {
  const check = (error: unknown): true => {
    assert.ok(error instanceof UnreachableError, String(error));
    assert.ok(error instanceof TracewireError);
    assert.equal(error.code, Code.Unavailable);
    assert.equal(error.status, "UNAVAILABLE");
    assert.equal(error.message, message);
    assert.equal(error.target, target);
    assert.ok(!error.message.includes("\n"));
    assert.equal(error.cause, undefined); // nothing for Node to dump under it
    return true;
  };
  await assert.rejects(client.modelInfo(), check);
  await assert.rejects(client.generate("The capital of France is", { maxTokens: 1 }), check);
  await assert.rejects(
    (async () => {
      for await (const _ of client.generateStream("hi", { maxTokens: 1 })) void _;
    })(),
    check,
  );
  const run = client.trace(invoke("hi").read("top", read.logprobs(2)), { maxTokens: 1 });
  await assert.rejects(run.collect(), check);
}

test("the Node client: a closed port and an unresolvable name, one line each", async () => {
  const port = await closedPort();
  for (const target of [`http://127.0.0.1:${port}`, `127.0.0.1:${port}`]) {
    const client = createNodeClient(target);
    try {
      await checkCalls(client, line(target, REFUSED, NODE_HOW), target);
    } finally {
      client.close();
    }
  }
  const nowhere = "http://no-such-host.invalid:50051";
  const client = createNodeClient(nowhere);
  try {
    await checkCalls(client, line(nowhere, "the name does not resolve", NODE_HOW), nowhere);
  } finally {
    client.close();
  }
});

test("replicas: every address refused is one line naming the list", async () => {
  const [a, b] = [await closedPort(), await closedPort()];
  const target = `ipv4:127.0.0.1:${a},127.0.0.1:${b}`;
  const client = createNodeClient(target);
  try {
    await checkCalls(client, line(target, REFUSED, NODE_HOW), target);
  } finally {
    client.close();
  }
});

test("the web client (fetch), gRPC-Web and Connect: one line naming the URL and createWebClient", async () => {
  const target = `http://127.0.0.1:${await closedPort()}`;
  for (const protocol of ["grpc-web", "connect"] as const) {
    await checkCalls(createWebClient(target, { protocol }), line(target, REFUSED, WEB_HOW), target);
  }
});

test("run as a program, an uncaught refusal prints the one line and no chain of socket errors", async () => {
  const target = `http://127.0.0.1:${await closedPort()}`;
  // Inside this package, so "@tracewire/client/node" resolves to this build (as test/snippets.ts runs the README's).
  const dir = join(HERE, "unreachable-program");
  mkdirSync(dir, { recursive: true });
  const file = join(dir, "main.mjs");
  writeFileSync(
    file,
    `import { createNodeClient } from "@tracewire/client/node";\n` +
      `const client = createNodeClient(${JSON.stringify(target)});\n` +
      `const [out] = await client.generate("The capital of France is", { temperature: 0, maxTokens: 8 });\n` +
      `console.log(out.outputs[0].text);\n`,
  );
  try {
    const result = spawnSync(process.execPath, [file], { encoding: "utf8", timeout: 60_000 });
    assert.equal(result.status, 1, result.stderr);
    assert.equal(result.stdout, "");
    const message = line(target, REFUSED, NODE_HOW);
    assert.ok(result.stderr.includes(`UnreachableError [TracewireError]: ${message}\n`), result.stderr);
    assert.ok(!result.stderr.includes("[cause]"), result.stderr);
    assert.ok(!result.stderr.includes("ECONNREFUSED"), result.stderr);
    // Node's own frame: the source line, the message, the stack (~10 lines), the error's fields.
    assert.ok(result.stderr.trim().split("\n").length <= 20, result.stderr);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
