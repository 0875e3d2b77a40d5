/**
 * The docs' TypeScript snippets (the site's pages under docs/, and the README's, which has
 * none now) run as written against the real server, from Node
 * (test/snippets.ts says how). The stop example must stop: its stop at step 3 fires (greedy
 * decoding would run on) and no warning comes back. The Security section's snippet needs a
 * TLS server with tokens: auth.standalone.test.ts runs it; the Replicas snippets (an "ipv4:"
 * address list) need two servers: replicas.standalone.test.ts runs them.
 */

import assert from "node:assert/strict";
import { readdirSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { REPO } from "./server.js";
import { runSnippet, snippets, type Snippet } from "./snippets.js";

const GRPC_URL = process.env.TRACEWIRE_TEST_URL;
const HTTP_URL = process.env.TRACEWIRE_TEST_HTTP_URL;

/** Runs a snippet against the shared test server; its stdout lines. */
function run(snippet: Snippet): string[] {
  assert.ok(GRPC_URL && HTTP_URL, "run the tests with `node dist/test/run.js` (make test-ts)");
  return runSnippet(snippet, { "http://127.0.0.1:50051": GRPC_URL, "http://127.0.0.1:8080": HTTP_URL });
}

const README = join(REPO, "README.md");
const DOCS = join(REPO, "docs");
/** The README and every page of the docs site. */
const PAGES = [README, ...readdirSync(DOCS, { recursive: true, encoding: "utf8" })
  .filter((name) => name.endsWith(".md")).sort().map((name) => join(DOCS, name))];

/** The snippets against one plaintext server (the Security one needs TLS, the Replicas one two servers). */
function plaintext(paths = PAGES): Snippet[] {
  return paths.flatMap(snippets).filter((s) => !s.code.includes("tls:") && !s.code.includes("ipv4:"));
}

test("the docs have their runnable TypeScript snippets", () => {
  const all = PAGES.flatMap(snippets);
  assert.equal(all.length, 4, JSON.stringify(all.map((s) => `${s.path}:${s.line}`)));
  assert.equal(plaintext().length, 2);
});

test("the browser snippet streams the top-3 logits over the Connect protocol", () => {
  const [snippet] = plaintext().filter((s) => s.code.includes("createWebClient"));
  assert.ok(snippet);
  const out = run(snippet).join("\n");
  // " Paris", ".", EOS: each step's number, text and a Float32Array of 3 (printed over lines)
  const steps = [...out.matchAll(/^(\d+) (.*?) ?Float32Array\(3\)/gm)].map((m) => [m[1], m[2]]);
  assert.deepEqual(steps, [["0", " Paris"], ["1", "."], ["2", ""]], out);
});

test("the Node snippet's stop at step 3 fires, with no warning", () => {
  const [snippet] = plaintext().filter((s) => s.code.includes("createNodeClient"));
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

const TS_README = join(REPO, "clients/ts/README.md");

test("clients/ts/README.md's snippets run: the Node one forces ' Berlin' and stops at the period", () => {
  assert.equal(snippets(TS_README).length, 4, JSON.stringify(snippets(TS_README).map((s) => s.line)));
  const found = plaintext([TS_README]);
  assert.equal(found.length, 3, JSON.stringify(found.map((s) => s.line)));
  const [node, ...others] = found;
  assert.ok(node && node.code.includes("write.force(berlin)"), node?.code);
  const lines = run(node);
  assert.equal(lines[0], " Paris.");
  // each step: its number, text, top-3 values and ids; the force at 0, the stop at "."
  assert.match(lines[1] ?? "", /^0 " Berlin" Float32Array\(3\)/, lines.join("\n"));
  assert.ok(lines.some((l) => l.startsWith(" Berlin. [] {")), lines.join("\n"));
  for (const snippet of others) run(snippet); // the browser clients' forms, the packed project's program
});
