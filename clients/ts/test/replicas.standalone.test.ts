/**
 * Several replicas behind one Node client (docs/deployment.md: Replicas; src/replicas.ts): calls go
 * round-robin over the target's servers, and a call refused with UNAVAILABLE before any
 * response is retried on the next one, so a replica draining after SIGTERM sheds its traffic
 * without failing a call. The same scenario as tests/test_replicas.py for the Python SDK.
 *
 * Two servers of its own on the tiny model (the shared server's engine flags; a drain grace
 * long enough for the traces in flight, and an access log each to count what each served);
 * the docs' and clients/ts/README.md's replica snippets run against them too.
 */

import assert from "node:assert/strict";
import { mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { createNodeClient, invoke, read, replicaAddresses, type TracewireClient } from "../src/node.js";
import { REPO, startServer, type RunningServer } from "./server.js";
import { runSnippet, snippets } from "./snippets.js";

const PROMPT = "Once upon a time";
// Long enough that the replica being stopped still has traces in flight for a while.
const SAMPLING = { temperature: 0, maxTokens: 48, ignoreEos: true };
const WORKERS = 4;

interface Replica {
  readonly server: RunningServer;
  readonly accessLog: string;
}

let a: Replica;
let b: Replica;

before(async () => {
  const start = async (): Promise<Replica> => {
    const accessLog = join(mkdtempSync(join(tmpdir(), "tracewire-replica-")), "access.log");
    // (eager: routing does not depend on the engine kind; it starts without torch.compile)
    const server = await startServer({ extraArgs: ["--enforce-eager", "--access-log", accessLog, "--grace-period", "60"] });
    return { server, accessLog };
  };
  // One after the other: two engines starting at once on two cores only slow each other.
  a = await start();
  b = await start();
});

after(async () => {
  await Promise.all([a?.server.stop(), b?.server.stop()]);
});

/** The server's Trace calls by status code, from its access log. */
function tracesByCode(replica: Replica): Record<string, number> {
  const counts: Record<string, number> = {};
  for (const line of readFileSync(replica.accessLog, "utf8").split("\n")) {
    if (!line) continue;
    const entry = JSON.parse(line) as { method: string; code: string };
    if (entry.method.endsWith("/Trace")) counts[entry.code] = (counts[entry.code] ?? 0) + 1;
  }
  return counts;
}

async function oneTrace(client: TracewireClient): Promise<number[]> {
  const { steps } = await client.trace(invoke(PROMPT).read("sample", read.sample()), SAMPLING).collect();
  return steps.map((s) => s.tokenId);
}

const sleep = (ms: number): Promise<void> => new Promise((done) => setTimeout(done, ms));

test("replicas: the docs' and clients/ts/README.md's snippets run against the two replicas", { timeout: 300_000 }, () => {
  const found = [join(REPO, "docs", "deployment.md"), join(REPO, "clients/ts/README.md")].flatMap((path) =>
    snippets(path).filter((s) => s.code.includes("ipv4:")),
  );
  assert.equal(found.length, 2, JSON.stringify(found.map((s) => `${s.path}:${s.line}`)));
  for (const snippet of found) {
    const lines = runSnippet(snippet, { "127.0.0.1:50051,127.0.0.1:50052": `${a.server.target},${b.server.target}` });
    assert.deepEqual(lines, ["[ ' Paris.', ' Madrid.' ]"]);
  }
});

test("replicas: a draining replica sheds its traffic without failing a call; both served", { timeout: 600_000 }, async () => {
  const client = createNodeClient(`ipv4:${a.server.target},${b.server.target}`, { timeoutMs: 300_000 });
  try {
    const expected = await oneTrace(client); // greedy: every trace, on either replica, draws the same
    assert.equal(expected.length, SAMPLING.maxTokens);
    const outcomes: (number[] | Error)[] = [];
    let load = true;
    const keepTracing = async (): Promise<void> => {
      while (load) {
        outcomes.push(await oneTrace(client).catch((e: unknown) => (e instanceof Error ? e : new Error(String(e)))));
      }
    };
    const workers = Array.from({ length: WORKERS }, keepTracing);

    const deadline = Date.now() + 180_000;
    while (!(tracesByCode(a).OK && tracesByCode(b).OK)) {
      assert.ok(Date.now() < deadline, JSON.stringify([tracesByCode(a), tracesByCode(b)]));
      await sleep(200);
    }
    const stoppedAt = outcomes.length;
    const exitCode = await b.server.stop(); // SIGTERM: b drains (finishes its traces, refuses new ones), then exits
    const afterStop = outcomes.length;
    await sleep(2_000); // and a little more load on a alone
    load = false;
    await Promise.all(workers);

    const failures = outcomes.filter((o): o is Error => o instanceof Error);
    assert.deepEqual(failures.slice(0, 3).map(String), []);
    for (const o of outcomes) assert.deepEqual(o, expected);
    assert.ok(outcomes.length > afterStop && afterStop > stoppedAt, JSON.stringify([stoppedAt, afterStop, outcomes.length]));
    assert.equal(exitCode, 0);
    const onB = tracesByCode(b);
    // b refused the traces it met while draining, and each of them was retried on a
    assert.ok((onB.UNAVAILABLE ?? 0) >= 1, JSON.stringify(onB));
    assert.equal((tracesByCode(a).OK ?? 0) + (onB.OK ?? 0), outcomes.length + 1);
  } finally {
    client.close();
  }
});

test("replicaAddresses: gRPC's address lists and URL lists name replicas; one address names one server", () => {
  assert.deepEqual(replicaAddresses("ipv4:10.0.0.1:50051,10.0.0.2:50051"), ["10.0.0.1:50051", "10.0.0.2:50051"]);
  assert.deepEqual(replicaAddresses("ipv6:[::1]:50051,[::1]:50052"), ["[::1]:50051", "[::1]:50052"]);
  assert.deepEqual(replicaAddresses(["http://a:1", "https://b:2"]), ["http://a:1", "https://b:2"]);
  for (const one of ["127.0.0.1:50051", "http://localhost:50051", "ipv4:10.0.0.1:50051"]) {
    assert.equal(replicaAddresses(one).length, 1, one);
  }
  assert.throws(() => replicaAddresses("ipv4:10.0.0.1,10.0.0.2:50051"), /target: "10\.0\.0\.1" in .* is not a\.b\.c\.d:port/);
  assert.throws(() => replicaAddresses([]), /target: an empty list/);
  assert.throws(() => replicaAddresses("dns:///tracewire.default.svc:50051"), /a dns: name has no fixed list of addresses; createNodeClient resolves it/);
});
