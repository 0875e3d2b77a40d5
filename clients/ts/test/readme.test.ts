/**
 * The README's TypeScript snippets run as written against the real server, from Node: each
 * block that imports the client is written out as an ES module inside this package (so
 * `@tracewire/client` resolves to this build, as it would once installed), its documented
 * addresses pointed at the test server's ports, and run with node. Blocks without an
 * import are fragments (option shapes) and are not run. The stop example must stop: its
 * stop at step 3 fires (greedy decoding would run on) and no warning comes back.
 */

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { REPO } from "./server.js";

const GRPC_URL = process.env.TRACEWIRE_TEST_URL;
const HTTP_URL = process.env.TRACEWIRE_TEST_HTTP_URL;
const HERE = dirname(fileURLToPath(import.meta.url));

interface Snippet {
  readonly line: number;
  readonly code: string;
}

/** The ```ts blocks of a Markdown file that import the client. */
function snippets(path: string): Snippet[] {
  const found: Snippet[] = [];
  let current: string[] | undefined;
  let start = 0;
  readFileSync(path, "utf8").split("\n").forEach((line, i) => {
    if (current === undefined && line.trim() === "```ts") {
      current = [];
      start = i + 2;
    } else if (current !== undefined && line.trim() === "```") {
      const code = current.join("\n") + "\n";
      if (/from "@tracewire\/client(\/node)?"/.test(code)) found.push({ line: start, code });
      current = undefined;
    } else if (current !== undefined) {
      current.push(line);
    }
  });
  return found;
}

/** Runs a snippet as a module of this package; its stdout lines. */
function run(snippet: Snippet): string[] {
  assert.ok(GRPC_URL && HTTP_URL, "run the tests with `node dist/test/run.js` (make test-ts)");
  const code = snippet.code
    .replaceAll("http://127.0.0.1:50051", GRPC_URL)
    .replaceAll("http://127.0.0.1:8080", HTTP_URL);
  const dir = join(HERE, "readme-snippets");
  mkdirSync(dir, { recursive: true });
  const file = join(dir, `README-${snippet.line}.mjs`);
  writeFileSync(file, code);
  const result = spawnSync(process.execPath, [file], { encoding: "utf8", timeout: 300_000 });
  assert.equal(result.status, 0, `README.md:${snippet.line}\n${code}\n${result.stderr}`);
  assert.doesNotMatch(result.stderr, /warn/i, result.stderr);
  return result.stdout.trimEnd().split("\n");
}

const README = join(REPO, "README.md");

test("the README has its runnable TypeScript snippets", () => {
  assert.equal(snippets(README).length, 2, JSON.stringify(snippets(README).map((s) => s.line)));
});

test("the browser snippet streams the top-3 logits over the Connect protocol", () => {
  const [snippet] = snippets(README).filter((s) => s.code.includes("createWebClient"));
  assert.ok(snippet);
  const out = run(snippet).join("\n");
  // " Paris", ".", EOS: each step's number, text and a Float32Array of 3 (printed over lines)
  const steps = [...out.matchAll(/^(\d+) (.*?) ?Float32Array\(3\)/gm)].map((m) => [m[1], m[2]]);
  assert.deepEqual(steps, [["0", " Paris"], ["1", "."], ["2", ""]], out);
});

test("the Node snippet's stop at step 3 fires, with no warning", () => {
  const [snippet] = snippets(README).filter((s) => s.code.includes("createNodeClient"));
  assert.ok(snippet);
  const lines = run(snippet);
  assert.equal(lines[0], " Paris.");
  const steps = lines.slice(1, -1);
  // as the README's comment says: the raw row at the forced step, " there" (441) first
  assert.equal(steps[0], '0 " a" false Int32Array(3) [ 441, 1315, 1059 ]');
  assert.deepEqual(
    steps.map((l) => /^(\d) (".*") (true|false) Int32Array\(3\) \[ \d+, \d+, \d+ \]$/.exec(l)?.slice(1)),
    [["0", '" a"', "false"], ["1", '" ball"', "false"], ["2", '" named"', "false"], ["3", '" Max"', "true"]],
    lines.join("\n"),
  );
  assert.equal(lines.at(-1), '" a ball named Max" 0'); // the text cut at the stop; no warnings
});
