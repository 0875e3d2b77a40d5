/**
 * The client as another project uses it (README "Use it from another project"): `npm pack`
 * the built package, install the tarball into a scratch project outside the repository, and
 * run a small TypeScript program there against the real server (run.ts's, TRACEWIRE_TEST_URL).
 *
 * Offline: the machine reaches no registry, so the client's runtime dependencies are packed
 * from this package's node_modules (the exact versions package-lock.json pins) and installed
 * from their tarballs with `npm install --offline`.
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";
import { after, test } from "node:test";
import { promisify } from "node:util";
import { createNodeClient } from "../src/node.js";
import { REPO } from "./server.js";

const run = promisify(execFile);
const URL = process.env.TRACEWIRE_TEST_URL;
const PACKAGE = join(REPO, "clients/ts");
const TSC = join(PACKAGE, "node_modules/.bin/tsc");
const FRANCE = "The capital of France is";

// What a user writes in their own project: only the package's public entry points.
const PROGRAM = `import { createNodeClient, invoke, read } from "@tracewire/client/node";

export async function capital(url: string): Promise<{ text: string; tokens: number[] }> {
  const client = createNodeClient(url);
  try {
    const run = client.trace(invoke(${JSON.stringify(FRANCE)}).read("top", read.logprobs(3)), { temperature: 0, maxTokens: 4 });
    const tokens: number[] = [];
    for await (const step of run) {
      tokens.push(step.tokenId);
    }
    const { outputs } = await run.result();
    return { text: outputs[0]?.outputs[0]?.text ?? "", tokens };
  } finally {
    client.close();
  }
}
`;

const MAIN = `import { capital } from "./out/capital.js";
console.log(JSON.stringify(await capital(process.argv[2])));
`;

const TSCONFIG = {
  compilerOptions: {
    target: "ES2022",
    module: "NodeNext",
    moduleResolution: "NodeNext",
    strict: true,
    outDir: "out",
    // The user's own choice; the package's .d.ts mention Node's http2 types, which this
    // scratch project does not install.
    skipLibCheck: true,
    types: [],
    lib: ["ES2022", "DOM"],
  },
  files: ["capital.ts"],
};

let scratch: string | undefined;

after(() => {
  if (scratch) {
    rmSync(scratch, { recursive: true, force: true });
  }
});

test("pack: npm pack, install the tarball into a project outside the repo, call the server from it", { timeout: 180_000 }, async () => {
  assert.ok(URL, "run the tests with `node dist/test/run.js` (make test-ts)");
  assert.ok(existsSync(join(PACKAGE, "dist/src/node.js")), "build first: npm run build");
  scratch = mkdtempSync(join(tmpdir(), "tracewire-pack-"));
  assert.ok(relative(REPO, scratch).startsWith(".."), `${scratch} is inside the repository`);

  const tarball = await pack(PACKAGE, scratch);
  const manifest = JSON.parse(readFileSync(join(PACKAGE, "package.json"), "utf8")) as { dependencies: Record<string, string> };
  const deps = await Promise.all(Object.keys(manifest.dependencies).map((name) => pack(join(PACKAGE, "node_modules", name), scratch ?? "")));

  writeFileSync(join(scratch, "package.json"), JSON.stringify({ name: "scratch", private: true, type: "module" }));
  await run("npm", ["install", "--offline", "--no-audit", "--no-fund", "--loglevel=error", ...[tarball, ...deps].map((t) => `./${t}`)], {
    cwd: scratch,
  });
  const installed = JSON.parse(readFileSync(join(scratch, "node_modules/@tracewire/client/package.json"), "utf8")) as { name: string };
  assert.equal(installed.name, "@tracewire/client");
  // Only the built package travels: no sources, tests or generated-from-proto TypeScript.
  assert.deepEqual(readdirSync(join(scratch, "node_modules/@tracewire/client")).sort(), ["README.md", "dist", "package.json"]);

  // Type-checked against the installed package's .d.ts (strict, NodeNext), then run.
  writeFileSync(join(scratch, "capital.ts"), PROGRAM);
  writeFileSync(join(scratch, "tsconfig.json"), JSON.stringify(TSCONFIG));
  writeFileSync(join(scratch, "main.mjs"), MAIN);
  await run(TSC, ["-p", "tsconfig.json"], { cwd: scratch });
  const { stdout } = await run(process.execPath, ["main.mjs", URL], { cwd: scratch, timeout: 120_000 });
  const got = JSON.parse(stdout) as { text: string; tokens: number[] };

  // The same request from this repository's client: the installed copy gives the same tokens.
  const client = createNodeClient(URL);
  try {
    const [want] = await client.generate(FRANCE, { temperature: 0, maxTokens: 4 });
    assert.equal(got.text, want?.outputs[0]?.text);
    assert.deepEqual(got.tokens, want?.outputs[0]?.tokenIds);
    assert.match(got.text, /^ Paris/);
  } finally {
    client.close();
  }
});

/** `npm pack` a package folder into `into`; the tarball's file name. */
async function pack(folder: string, into: string): Promise<string> {
  const { stdout } = await run("npm", ["pack", folder, "--pack-destination", into, "--ignore-scripts", "--json", "--loglevel=error"], {
    cwd: into,
  });
  const [entry] = JSON.parse(stdout) as { filename: string }[];
  assert.ok(entry, `npm pack ${folder} printed no tarball`);
  return entry.filename;
}
