/**
 * The install leaves the client ready: `npm ci` in clients/ts (what `make setup` runs, and a
 * new user's first step) builds dist/ itself (package.json's `prepare`), so the README's
 * examples import `@tracewire/client` and `@tracewire/client/node` with no `npm run build`
 * first. Run on a copy of the package's sources with no dist/ and no node_modules (this
 * checkout's are in use by the other tests); the packages come from npm's cache when it holds
 * them (--prefer-offline), as `make setup` left it. No server.
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { cpSync, existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, test } from "node:test";
import { promisify } from "node:util";
import { REPO } from "./server.js";
import { snippets } from "./snippets.js";

const run = promisify(execFile);
const PACKAGE = join(REPO, "clients/ts");
let scratch: string | undefined;

after(() => {
  if (scratch) rmSync(scratch, { recursive: true, force: true });
});

/** The README's import lines of the client (each snippet's `import ... from "@tracewire/client..."`). */
function readmeImports(): string[] {
  const lines = snippets(join(PACKAGE, "README.md")).flatMap((s) =>
    s.code.split("\n").filter((l) => /^import .* from "@tracewire\/client(\/node)?";$/.test(l)),
  );
  return [...new Set(lines)];
}

test("npm ci builds the client: dist/ is there and the README's imports resolve", { timeout: 300_000 }, async () => {
  scratch = mkdtempSync(join(tmpdir(), "tracewire-install-"));
  const copy = join(scratch, "clients/ts");
  // The package's sources as a fresh clone has them (tsconfig's test/ reads the dashboard's src/ too).
  for (const part of ["package.json", "package-lock.json", "tsconfig.json", "README.md", "src", "test", "examples/dashboard/src"]) {
    cpSync(join(PACKAGE, part), join(copy, part), { recursive: true });
  }
  assert.ok(!existsSync(join(copy, "dist")) && !existsSync(join(copy, "node_modules")));

  // The Makefile's install step ($(NODE_STAMP)), nothing else.
  await run("npm", ["ci", "--no-audit", "--no-fund", "--loglevel=error", "--prefer-offline"], { cwd: copy, timeout: 240_000 });
  for (const built of ["dist/src/index.js", "dist/src/index.d.ts", "dist/src/node.js", "dist/src/node.d.ts"]) {
    assert.ok(existsSync(join(copy, built)), `npm ci left no ${built}: package.json's prepare did not build`);
  }

  const imports = readmeImports();
  assert.ok(imports.some((l) => l.endsWith('from "@tracewire/client/node";')), imports.join("\n"));
  assert.ok(imports.some((l) => l.endsWith('from "@tracewire/client";')), imports.join("\n"));
  // Inside the package, as test/snippets.ts runs the README's snippets: the package's own name resolves to
  // its build. Each line in a program of its own (the snippets import the same names).
  for (const [i, line] of imports.entries()) {
    const names = (/\{([^}]*)\}/.exec(line)?.[1] ?? "").split(",").map((n) => n.trim());
    const program = join(copy, `imports-${i}.mjs`);
    writeFileSync(program, `${line}\nconsole.log(JSON.stringify([${names.join(", ")}].map((x) => typeof x)));\n`);
    const { stdout } = await run(process.execPath, [program], { cwd: copy });
    const kinds = JSON.parse(stdout) as string[];
    assert.equal(kinds.length, names.length);
    assert.ok(kinds.every((k) => k === "function" || k === "object"), `${line}: ${stdout}`); // read / write: objects
  }
});
