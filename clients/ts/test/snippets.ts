/**
 * The ```ts blocks of a Markdown file, run as a reader would: each block that imports the
 * client is written out as an ES module inside this package (so `@tracewire/client`
 * resolves to this build, as it would once installed) and run with node. Blocks without
 * an import are fragments (option shapes) and are not run.
 */

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { basename, dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const HERE = dirname(fileURLToPath(import.meta.url));

export interface Snippet {
  readonly path: string;
  /** The 1-based line of the block's first code line. */
  readonly line: number;
  readonly code: string;
}

/** The ```ts blocks of `path` that import the client. */
export function snippets(path: string): Snippet[] {
  const found: Snippet[] = [];
  let current: string[] | undefined;
  let start = 0;
  readFileSync(path, "utf8").split("\n").forEach((line, i) => {
    if (current === undefined && line.trim() === "```ts") {
      current = [];
      start = i + 2;
    } else if (current !== undefined && line.trim() === "```") {
      const code = current.join("\n") + "\n";
      if (/from "@tracewire\/client(\/node)?"/.test(code)) found.push({ path, line: start, code });
      current = undefined;
    } else if (current !== undefined) {
      current.push(line);
    }
  });
  return found;
}

/**
 * Runs a snippet, each key of `replace` in its code replaced by its value (the documented
 * addresses by a test server's), from the working directory `cwd`; its stdout lines. It
 * must exit 0 and print no warning.
 */
export function runSnippet(snippet: Snippet, replace: Record<string, string>, cwd?: string): string[] {
  let code = snippet.code;
  for (const [from, to] of Object.entries(replace)) code = code.replaceAll(from, to);
  const dir = join(HERE, "readme-snippets");
  mkdirSync(dir, { recursive: true });
  const file = join(dir, `${basename(snippet.path, ".md")}-${snippet.line}.mjs`);
  writeFileSync(file, code);
  const result = spawnSync(process.execPath, [file], { encoding: "utf8", timeout: 300_000, cwd });
  const where = `${basename(snippet.path)}:${snippet.line}`;
  assert.equal(result.status, 0, `${where}\n${code}\n${result.stderr}`);
  assert.doesNotMatch(result.stderr, /warn/i, result.stderr);
  return result.stdout.trimEnd().split("\n");
}
