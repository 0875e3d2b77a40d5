/**
 * One real tracewire server (real vLLM engine, CPU build) for the whole Node test run,
 * started the way tests/conftest.py starts it: `python -m tracewire_server` in a
 * subprocess on a free port, polled until GetModelInfo answers.
 */

import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, openSync, readFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { createNodeClient, type NodeClientOptions } from "../src/node.js";

/** The repository root (this file runs from clients/ts/dist/test/). */
export const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");
export const PYTHON = process.env.TRACEWIRE_PYTHON ?? join(REPO, ".venv/bin/python");
const MODEL = process.env.TRACEWIRE_TEST_MODEL ?? join(REPO, "models/tracewire-tiny");
// float32 so the values compare with the Python SDK's at tight tolerances.
const ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "32"];
const START_TIMEOUT_MS = 600_000;
const STOP_TIMEOUT_MS = 120_000;

export interface RunningServer {
  /** The gRPC port (HTTP/2). */
  readonly url: string;
  /** The HTTP port (--http-port): Connect protocol and gRPC-Web, for browsers. */
  readonly httpUrl: string;
  readonly target: string;
  readonly logPath: string;
  stop(): Promise<number | null>;
}

/** A server of its own for a test file: more flags, and how to reach it (TLS, a token). */
export interface ServerOptions {
  readonly extraArgs?: readonly string[];
  /** How the readiness poll connects; with `tls`, the URLs are https://. */
  readonly client?: NodeClientOptions;
}

/**
 * Ports are free when picked but can be taken before the server binds them (vLLM's engines
 * pick random free ports too): then the server says "cannot listen on" and we try others.
 */
export async function startServer(options: ServerOptions = {}): Promise<RunningServer> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await startServerOnce(options);
    } catch (error) {
      if (attempt >= 3 || !String(error).includes("cannot listen on")) throw error;
    }
  }
}

async function startServerOnce(options: ServerOptions): Promise<RunningServer> {
  const port = await freePort();
  let httpPort = await freePort();
  while (httpPort === port) httpPort = await freePort();
  const logPath = join(mkdtempSync(join(tmpdir(), "tracewire-ts-")), `server-${port}.log`);
  const log = openSync(logPath, "w");
  const env = {
    ...process.env,
    VLLM_CPU_KVCACHE_SPACE: process.env.VLLM_CPU_KVCACHE_SPACE ?? "1",
    VLLM_LOGGING_LEVEL: process.env.VLLM_LOGGING_LEVEL ?? "WARNING",
  };
  const args = ["-m", "tracewire_server", "--model", MODEL, "--host", "127.0.0.1", "--port", String(port),
    "--http-port", String(httpPort), ...ENGINE_ARGS, ...(options.extraArgs ?? [])];
  // Its own process group: the engine core is a child of the server, and a hard kill must reach it too.
  const child = spawn(PYTHON, args, { cwd: REPO, env, stdio: ["ignore", log, log], detached: true });
  const target = `127.0.0.1:${port}`;
  const scheme = options.client?.tls ? "https" : "http";
  const server: RunningServer = {
    url: `${scheme}://${target}`,
    httpUrl: `${scheme}://127.0.0.1:${httpPort}`,
    target,
    logPath,
    stop: () => stopProcess(child),
  };
  try {
    await waitServing(child, server, options.client ?? {});
  } catch (error) {
    await stopProcess(child);
    throw error;
  }
  return server;
}

async function waitServing(child: ChildProcess, server: RunningServer, options: NodeClientOptions): Promise<void> {
  const client = createNodeClient(server.url, { ...options, timeoutMs: 2_000 });
  const deadline = Date.now() + START_TIMEOUT_MS;
  try {
    await pollModelInfo(child, server, client, deadline);
  } finally {
    client.close();
  }
}

async function pollModelInfo(
  child: ChildProcess,
  server: RunningServer,
  client: ReturnType<typeof createNodeClient>,
  deadline: number,
): Promise<void> {
  while (Date.now() < deadline) {
    if (child.exitCode !== null || child.signalCode !== null) {
      throw new Error(`server exited (${child.exitCode ?? child.signalCode}):\n${tail(server.logPath)}`);
    }
    try {
      await client.modelInfo();
      return;
    } catch {
      await sleep(500); // not listening yet, or UNAVAILABLE while the engine starts
    }
  }
  throw new Error(`server not serving after ${START_TIMEOUT_MS / 1000} s:\n${tail(server.logPath)}`);
}

/** SIGTERM (the server drains and stops its engine), then SIGKILL the whole group if it hangs. */
async function stopProcess(child: ChildProcess): Promise<number | null> {
  if (child.exitCode !== null || child.signalCode !== null) {
    return child.exitCode;
  }
  const exited = new Promise<number | null>((done) => child.once("exit", (code) => done(code)));
  child.kill("SIGTERM");
  const timer = setTimeout(() => {
    if (child.pid !== undefined) {
      process.kill(-child.pid, "SIGKILL");
    }
  }, STOP_TIMEOUT_MS);
  try {
    return await exited;
  } finally {
    clearTimeout(timer);
  }
}

function freePort(): Promise<number> {
  return new Promise((done, fail) => {
    const probe = createServer();
    probe.once("error", fail);
    probe.listen(0, "127.0.0.1", () => {
      const address = probe.address();
      probe.close(() => (typeof address === "object" && address ? done(address.port) : fail(new Error("no port"))));
    });
  });
}

function tail(path: string): string {
  return readFileSync(path, "utf8").split("\n").slice(-60).join("\n");
}

function sleep(ms: number): Promise<void> {
  return new Promise((done) => setTimeout(done, ms));
}
