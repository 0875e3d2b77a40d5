/**
 * The Node test entry point: start one real server, run every compiled *.test.js
 * against it with node's built-in runner (TRACEWIRE_TEST_URL / TRACEWIRE_TEST_HTTP_URL tell
 * them where: the gRPC port and the HTTP port), stop it. *.standalone.test.js files start
 * servers of their own (other flags); when only they are selected, no shared server starts.
 *
 *   node dist/test/run.js            (npm test / make test-ts build first)
 *   node dist/test/run.js dashboard  (only the test files whose name contains "dashboard")
 */

import { spawn } from "node:child_process";
import { existsSync, readdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { REPO, startServer } from "./server.js";

const here = dirname(fileURLToPath(import.meta.url));
const only = process.argv.slice(2);
const files = readdirSync(here)
  .filter((f) => f.endsWith(".test.js"))
  .filter((f) => only.length === 0 || only.some((name) => f.includes(name)))
  .map((f) => join(here, f));

const started = Date.now();
const shared = files.some((f) => !f.endsWith(".standalone.test.js"));
// Eager: the module hooks (reads, writes, heads, patterns, patching) need it.
// The dictionaries shipped with the default model (a probe, an SAE): dictionaries.test.ts and
// the dashboard's feature strip (TRACEWIRE_TEST_DICTIONARIES: another directory).
const dictionaries = process.env.TRACEWIRE_TEST_DICTIONARIES ?? join(REPO, "models/tracewire-tiny/dictionaries");
const shipped = existsSync(dictionaries) ? ["--dictionaries", dictionaries] : []; // (another model's: none)
const server = shared ? await startServer({ extraArgs: ["--enforce-eager", ...shipped] }) : undefined;
if (server) {
  console.log(`tracewire server at ${server.url}, HTTP port ${server.httpUrl} (up in ${((Date.now() - started) / 1000).toFixed(1)} s, log ${server.logPath})`);
}

let code = 1;
const stopOnSignal = (signal: NodeJS.Signals): void => {
  void (server?.stop() ?? Promise.resolve()).finally(() => process.exit(128 + (signal === "SIGINT" ? 2 : 15)));
};
process.once("SIGINT", stopOnSignal);
process.once("SIGTERM", stopOnSignal);
try {
  // One file at a time: they share one small server on a 2-core machine.
  const runner = spawn(process.execPath, ["--test", "--test-concurrency=1", "--test-reporter=spec", ...files], {
    env: server ? { ...process.env, TRACEWIRE_TEST_URL: server.url, TRACEWIRE_TEST_HTTP_URL: server.httpUrl } : process.env,
    stdio: "inherit",
  });
  code = await new Promise<number>((done) => runner.on("exit", (c) => done(c ?? 1)));
} finally {
  const exitCode = await server?.stop();
  console.log(`server stopped (exit ${exitCode ?? "none started"}); tests took ${((Date.now() - started) / 1000).toFixed(1)} s in all`);
}
process.exit(code);
