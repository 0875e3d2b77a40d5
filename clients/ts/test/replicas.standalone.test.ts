/**
 * Several replicas behind one Node client (docs/deployment.md: Replicas; src/replicas.ts): calls go
 * round-robin over the target's servers, and a call refused with UNAVAILABLE before any
 * response is retried on the next one, so a replica draining after SIGTERM sheds its traffic
 * without failing a call. The same scenario as tests/test_replicas.py for the Python SDK.
 *
 * Two servers of its own on the tiny model (the shared server's engine flags; a drain grace
 * long enough for the traces in flight, and an access log each to count what each served);
 * the docs' and clients/ts/README.md's replica snippets run against them too. A held trace
 * (heldTrace, as tests/held_trace.py) keeps the stopped replica draining while the other serves
 * DRAINED_ON_A traces alone: without it a quick CI machine finished that replica's traces
 * before any call met the drain.
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
// Traces a serves alone, begun after b got SIGTERM, while b is held draining.
const DRAINED_ON_A = 24;
// The held trace: each step's whole logits rows, raw and processed (16 KiB a step for the tiny
// model), 16 MiB over HELD_STEPS steps. Unread, most of it waits in the server's per-trace
// buffer (64 MiB here), so the trace stays in flight however fast the machine generates.
const HELD_STEPS = 1000;
const HELD_TRACE_ARGS = ["--max-model-len", "1024", "--trace-buffer-bytes", String(64 << 20)];

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
    const server = await startServer({
      extraArgs: ["--enforce-eager", "--access-log", accessLog, "--grace-period", "60", ...HELD_TRACE_ARGS],
    });
    return { server, accessLog };
  };
  // One after the other: two engines starting at once on two cores only slow each other.
  a = await start();
  b = await start();
});

after(async () => {
  await Promise.all([a?.server.stop(), b?.server.stop()]);
});

/**
 * The server's Trace calls by status code, from its access log; with `startedAfter` (ms since
 * the epoch), only the calls that began after it (the log's time is the call's end).
 */
function tracesByCode(replica: Replica, startedAfter?: number): Record<string, number> {
  const counts: Record<string, number> = {};
  for (const line of readFileSync(replica.accessLog, "utf8").split("\n")) {
    if (!line) continue;
    const entry = JSON.parse(line) as { method: string; code: string; time: string; duration_ms: number };
    const began = Date.parse(entry.time) - entry.duration_ms;
    if (entry.method.endsWith("/Trace") && (startedAfter === undefined || began > startedAfter)) {
      counts[entry.code] = (counts[entry.code] ?? 0) + 1;
    }
  }
  return counts;
}

async function oneTrace(client: TracewireClient): Promise<number[]> {
  const { steps } = await client.trace(invoke(PROMPT).read("sample", read.sample()), SAMPLING).collect();
  return steps.map((s) => s.tokenId);
}

const sleep = (ms: number): Promise<void> => new Promise((done) => setTimeout(done, ms));

interface HeldTrace {
  /** Resolves once the first step has arrived: the trace runs in the engine. */
  readonly started: Promise<void>;
  /** Read the rest. */
  release(): void;
  /** Its steps, once read to the end. */
  readonly steps: Promise<number>;
}

/** A trace on a connection of its own to `target` that reads nothing after its first step until released. */
function heldTrace(target: string): HeldTrace {
  const client = createNodeClient(target, { timeoutMs: 120_000 });
  let started!: () => void;
  let release!: () => void;
  const startedP = new Promise<void>((done) => (started = done));
  const released = new Promise<void>((done) => (release = done));
  const rows = invoke("The capital of France is").read("row", read.logits()).read("raw", read.logits({ stage: "raw" }));
  const steps = (async () => {
    let count = 0;
    try {
      for await (const step of client.trace(rows, { temperature: 0, maxTokens: HELD_STEPS, ignoreEos: true })) {
        // both whole rows, every step: [vocab] each
        assert.deepEqual([step.values.row?.values.shape.length, step.values.raw?.values.shape], [1, step.values.row?.values.shape]);
        if (count++ === 0) {
          started();
          await released;
        }
      }
      return count;
    } finally {
      started();
      client.close();
    }
  })();
  steps.catch(() => undefined); // awaited by the test; a failure must not go unobserved before that
  return { started: startedP, release, steps };
}

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
    const held = heldTrace(b.server.target); // in flight on b, unread: b drains until it is released
    await held.started;
    const stoppedAt = outcomes.length;
    const signalled = Date.now();
    let exited = false;
    const stopped = b.server.stop().finally(() => (exited = true)); // SIGTERM: b drains (finishes its traces, refuses new ones), then exits
    while ((tracesByCode(a, signalled).OK ?? 0) < DRAINED_ON_A) {
      // a alone serves
      assert.ok(Date.now() < deadline, JSON.stringify(tracesByCode(a, signalled)));
      await sleep(50);
    }
    assert.ok(!exited); // b was draining all that time
    held.release();
    const exitCode = await stopped;
    const afterStop = outcomes.length;
    await sleep(2_000); // and a little more load on a alone
    load = false;
    await Promise.all(workers);

    assert.equal(await held.steps, HELD_STEPS);
    const failures = outcomes.filter((o): o is Error => o instanceof Error);
    assert.deepEqual(failures.slice(0, 3).map(String), []);
    for (const o of outcomes) assert.deepEqual(o, expected);
    assert.ok(outcomes.length > afterStop && afterStop > stoppedAt, JSON.stringify([stoppedAt, afterStop, outcomes.length]));
    assert.equal(exitCode, 0);
    const onB = tracesByCode(b);
    // b refused the traces it met while draining (none began there after the signal was
    // served), and each of them was retried on a; benched after each refusal (1 s, doubling),
    // it met few: those sent before the first refusal came back, then one a cooldown
    const refused = tracesByCode(b, signalled);
    assert.deepEqual(Object.keys(refused), ["UNAVAILABLE"], JSON.stringify(refused));
    assert.ok(refused.UNAVAILABLE! <= 4 * WORKERS, JSON.stringify(refused));
    // every trace served once: the first, the held one, and the load's
    assert.equal((tracesByCode(a).OK ?? 0) + (onB.OK ?? 0), outcomes.length + 2);
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
