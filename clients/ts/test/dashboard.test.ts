/**
 * The dashboard (examples/dashboard) end to end in a real browser: Debian's Chromium,
 * headless, driven by playwright-core, loads the built page from a localhost origin and
 * talks to the real server's HTTP port (127.0.0.1: another origin, so CORS is exercised).
 *
 * run.ts starts the server; `make test-ts` builds the page (vite build) first. No mocks.
 */

import assert from "node:assert/strict";
import { existsSync, mkdirSync, readFileSync, statSync } from "node:fs";
import { createServer, type Server } from "node:http";
import { extname, join, normalize, sep } from "node:path";
import { after, before, test } from "node:test";
import { chromium, type Browser, type Page } from "playwright-core";
import { REPO } from "./server.js";

const HTTP_URL = process.env.TRACEWIRE_TEST_HTTP_URL;
const CHROMIUM = process.env.TRACEWIRE_CHROMIUM ?? "/usr/bin/chromium";
const DIST = join(REPO, "clients/ts/examples/dashboard/dist");
const OUTPUT = join(REPO, "clients/ts/test-output");
const PARIS = 806;
const STEPS = 24;
const TIMEOUT_MS = 120_000;
// What the machine's closed network needs: no background connections, no sync, no QUIC.
const CHROMIUM_ARGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];

let site: Server;
let siteUrl: string;
let browser: Browser;
let page: Page;
const pageErrors: string[] = [];

before(async () => {
  assert.ok(HTTP_URL, "run the tests with `node dist/test/run.js` (make test-ts)");
  assert.ok(
    existsSync(CHROMIUM),
    `no Chromium at ${CHROMIUM}: install Debian's (apt-get install -y chromium) or set TRACEWIRE_CHROMIUM`,
  );
  assert.ok(
    existsSync(join(DIST, "index.html")),
    `the dashboard is not built (${DIST}): make test-ts builds it, or cd examples/dashboard && npm ci && npm run build`,
  );
  ({ server: site, url: siteUrl } = await serveStatic(DIST));
  // launch() gives the browser a fresh, empty --user-data-dir of its own and removes it on close.
  browser = await chromium.launch({ executablePath: CHROMIUM, args: CHROMIUM_ARGS, timeout: TIMEOUT_MS });
  page = await browser.newPage({ viewport: { width: 1100, height: 1000 } });
  page.setDefaultTimeout(TIMEOUT_MS);
  page.on("pageerror", (error) => pageErrors.push(String(error)));
});

after(async () => {
  await browser?.close();
  await new Promise<void>((done) => (site ? site.close(() => done()) : done()));
});

test("dashboard: stream a trace, force a candidate at step 0, see the continuation change", { timeout: 300_000 }, async () => {
  try {
    // localhost (the page) vs 127.0.0.1 (the API): a cross-origin page, allowed by the default CORS.
    await page.goto(`${siteUrl}/?server=${encodeURIComponent(HTTP_URL ?? "")}`);
    await page.waitForSelector("#status[data-state='idle']");
    assert.equal(await page.textContent("#server"), `${HTTP_URL} (connect)`);

    await page.fill("#prompt", "The capital of France is");
    await page.fill("#max-tokens", String(STEPS));
    await page.fill("#top-k", "5");
    await page.check("#ignore-eos");
    await recordRowTimes(page);
    await page.click("#run");
    await waitRun(page, 1);

    // Streamed: rows appeared over the generation's time, not all at once at the end.
    const times = await page.evaluate(() => (window as unknown as { rowTimes: number[] }).rowTimes);
    assert.equal(times.length, STEPS);
    const spread = (times.at(-1) ?? 0) - (times[0] ?? 0);
    assert.ok(spread > 20, `all ${STEPS} rows were drawn within ${spread.toFixed(1)} ms: not streamed`);

    const first = await stepRows(page);
    assert.equal(first.length, STEPS);
    assert.equal(first[0]?.tokenId, PARIS);
    await waitLabel(page, 0, '" Paris"');
    await checkCandidates(page);
    const textBefore = await continuation(page);
    assert.match(textBefore, /^ Paris/);

    // Force the second most likely token at step 0.
    const alternative = page.locator(".step[data-step='0'] .candidate[data-chosen='false']").first();
    const forcedId = Number(await alternative.getAttribute("data-token-id"));
    assert.notEqual(forcedId, PARIS);
    await alternative.click();
    await waitRun(page, 2);

    const second = await stepRows(page);
    assert.equal(second.length, STEPS);
    assert.equal(second[0]?.tokenId, forcedId);
    assert.equal(second[0]?.forced, "true");
    // The forced step keeps what the model thought there: " Paris" most likely, the forced one chosen.
    const forcedRow = await page.$$eval(".step[data-step='0'] .candidate", (cs) =>
      cs.map((c) => [Number((c as HTMLElement).dataset.tokenId), (c as HTMLElement).dataset.chosen] as const),
    );
    assert.deepEqual(forcedRow[0], [PARIS, "false"]);
    assert.ok(forcedRow.some(([id, chosen]) => id === forcedId && chosen === "true"), JSON.stringify(forcedRow));
    const textAfter = await continuation(page);
    assert.notEqual(textAfter, textBefore);
    assert.equal(await page.isVisible("#previous"), true);
    assert.ok((await page.textContent("#previous"))?.includes(textBefore));
    await page.screenshot({ path: screenshotPath("dashboard.png"), fullPage: true });

    // A value the server refuses: the banner names the status and the field.
    await page.fill("#top-k", "100000");
    await page.click("#run");
    await page.waitForSelector("#status[data-state='error'][data-run='3']");
    assert.equal(await page.isVisible("#error"), true);
    assert.equal(await page.getAttribute("#error", "data-status"), "INVALID_ARGUMENT");
    assert.match((await page.getAttribute("#error", "data-field")) ?? "", /top_k/);
    await page.screenshot({ path: screenshotPath("dashboard-error.png") });

    assert.deepEqual(pageErrors, []);
  } catch (error) {
    await page.screenshot({ path: screenshotPath("dashboard-failure.png"), fullPage: true }).catch(() => undefined);
    throw error;
  }
});

/** Wait until run `run` ends; a failure shows the page's banner in the assertion. */
async function waitRun(page: Page, run: number): Promise<void> {
  await page.waitForSelector(`#status[data-run='${run}']:is([data-state='done'], [data-state='error'])`);
  const state = await page.getAttribute("#status", "data-state");
  assert.equal(state, "done", `run ${run} failed: ${await page.textContent("#error")}`);
}

interface Row {
  readonly step: number;
  readonly tokenId: number;
  readonly forced: string | undefined;
}

async function stepRows(page: Page): Promise<Row[]> {
  return page.$$eval(".step", (rows) =>
    rows.map((row) => {
      const el = row as HTMLElement;
      return { step: Number(el.dataset.step), tokenId: Number(el.dataset.tokenId), forced: el.dataset.forced };
    }),
  );
}

/** The generated text (the prompt's span excluded). */
async function continuation(page: Page): Promise<string> {
  return page.$$eval("#text .piece", (pieces) => pieces.map((p) => p.textContent ?? "").join(""));
}

/** Token labels come from Detokenize after the row is drawn. */
async function waitLabel(page: Page, step: number, label: string): Promise<void> {
  await page.waitForFunction(
    ([s, l]) => document.querySelector(`.step[data-step='${s}'] .chosen`)?.textContent === l,
    [step, label] as const,
  );
}

/** Every step shows k candidates with probabilities in (0, 1], most likely first, drawn as bars. */
async function checkCandidates(page: Page): Promise<void> {
  const rows = await page.$$eval(".step", (steps) =>
    steps.map((step) =>
      Array.from(step.querySelectorAll<HTMLElement>(".candidate"), (c) => ({
        prob: Number(c.dataset.prob),
        barWidth: c.querySelector<HTMLElement>(".bar")?.getBoundingClientRect().width ?? 0,
        // The bar is absolutely positioned: its percentage is of the padding box.
        width: c.clientWidth,
        chosen: c.dataset.chosen === "true",
      })),
    ),
  );
  for (const [step, candidates] of rows.entries()) {
    assert.equal(candidates.length, 5, `step ${step}`);
    const probs = candidates.map((c) => c.prob);
    assert.ok(probs.every((p) => p > 0 && p <= 1), `step ${step}: ${probs.join(", ")}`);
    assert.ok(probs.reduce((a, b) => a + b, 0) <= 1 + 1e-4, `step ${step}: top-k sums past 1`);
    assert.deepEqual(probs, [...probs].sort((a, b) => b - a), `step ${step}: not most likely first`);
    assert.equal(candidates[0]?.chosen, true, `step ${step}: greedy draws the most likely token`);
    const top = candidates[0];
    assert.ok(top && Math.abs(top.barWidth - top.width * top.prob) < 1.5, `step ${step}: bar width ${top?.barWidth}`);
  }
}

/** Record when each step row is added (performance.now), to tell streaming from buffering. */
async function recordRowTimes(page: Page): Promise<void> {
  await page.evaluate(() => {
    const times: number[] = [];
    (window as unknown as { rowTimes: number[] }).rowTimes = times;
    const steps = document.getElementById("steps");
    new MutationObserver((records) => {
      for (const record of records) {
        record.addedNodes.forEach(() => times.push(performance.now()));
      }
    }).observe(steps as Node, { childList: true });
  });
}

function screenshotPath(name: string): string {
  mkdirSync(OUTPUT, { recursive: true });
  return join(OUTPUT, name);
}

const TYPES: Record<string, string> = {
  ".html": "text/html; charset=utf-8",
  ".js": "text/javascript; charset=utf-8",
  ".css": "text/css; charset=utf-8",
  ".map": "application/json",
  ".svg": "image/svg+xml",
};

/** A tiny static server over the built page, on 127.0.0.1 (reached as localhost). */
async function serveStatic(root: string): Promise<{ server: Server; url: string }> {
  const server = createServer((request, response) => {
    const path = new URL(request.url ?? "/", "http://localhost").pathname;
    const file = normalize(join(root, path === "/" ? "index.html" : decodeURIComponent(path)));
    if (!file.startsWith(root + sep) || !existsSync(file) || !statSync(file).isFile()) {
      response.writeHead(404).end();
      return;
    }
    response.writeHead(200, { "content-type": TYPES[extname(file)] ?? "application/octet-stream" });
    response.end(readFileSync(file));
  });
  await new Promise<void>((done) => server.listen(0, "127.0.0.1", done));
  const address = server.address();
  assert.ok(address && typeof address === "object");
  return { server, url: `http://localhost:${address.port}` };
}
