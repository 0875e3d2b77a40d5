/**
 * The dashboard (examples/dashboard) end to end in a real browser: Debian's Chromium,
 * headless, driven by playwright-core, loads the built page from a localhost origin and
 * talks to the real server's HTTP port (127.0.0.1: another origin, so CORS is exercised).
 * `make dashboard` is run too (its Vite dev server, the URL it prints).
 *
 * run.ts starts the server; `make test-ts` builds the page (vite build) first. No mocks.
 */

import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdirSync, readFileSync, statSync } from "node:fs";
import { createServer, type Server } from "node:http";
import { createServer as createTcpServer } from "node:net";
import { extname, join, normalize, sep } from "node:path";
import { after, before, test } from "node:test";
import { chromium, type Browser, type Page } from "playwright-core";
import { formatProb, tokenLabel, unreachableMessage } from "../examples/dashboard/src/format.js";
import { createNodeClient, DictionaryKind, invoke, read, write, type Dictionary, type TracewireClient } from "../src/node.js";
import { REPO } from "./server.js";

const HTTP_URL = process.env.TRACEWIRE_TEST_HTTP_URL;
const GRPC_URL = process.env.TRACEWIRE_TEST_URL;
const CHROMIUM = process.env.TRACEWIRE_CHROMIUM ?? "/usr/bin/chromium";
const DIST = join(REPO, "clients/ts/examples/dashboard/dist");
const OUTPUT = join(REPO, "clients/ts/test-output");
const PARIS = 806;
const FRANCE = "The capital of France is";
const SPAIN = "The capital of Spain is";
// Enough steps for the lens to have several generated columns, few enough to stay quick.
const LENS_STEPS = 6;
const STEER_LAYER = 2;
const STRONG = 8;
const STEPS = 24;
// A run long enough to be caught while it streams (a few seconds here).
const LONG = 400;
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
let client: TracewireClient;
let modelInfo: Awaited<ReturnType<TracewireClient["modelInfo"]>> | undefined;
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
  assert.ok(GRPC_URL, "run the tests with `node dist/test/run.js` (make test-ts)");
  client = createNodeClient(GRPC_URL);
  ({ server: site, url: siteUrl } = await serveStatic(DIST));
  // launch() gives the browser a fresh, empty --user-data-dir of its own and removes it on close.
  browser = await chromium.launch({ executablePath: CHROMIUM, args: CHROMIUM_ARGS, timeout: TIMEOUT_MS });
  page = await browser.newPage({ viewport: { width: 1100, height: 1000 } });
  page.setDefaultTimeout(TIMEOUT_MS);
  page.on("pageerror", (error) => pageErrors.push(String(error)));
});

after(async () => {
  client?.close();
  await browser?.close();
  await new Promise<void>((done) => (site ? site.close(() => done()) : done()));
});

test("dashboard: stream a trace, force a candidate at step 0, see the continuation change", { timeout: 300_000 }, async () => {
  try {
    // localhost (the page) vs 127.0.0.1 (the API): a cross-origin page, allowed by the default CORS.
    await page.goto(`${siteUrl}/?server=${encodeURIComponent(HTTP_URL ?? "")}`);
    // The page asks the server (GetModelInfo) on load, before any Run.
    await page.waitForSelector("#status[data-state='idle']");
    const info = await client.modelInfo();
    assert.equal(await page.textContent("#status"), `ready: ${info.model} (${info.architecture}, ${info.dtype}), vLLM ${info.vllmVersion}`);
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
    await checkLabels(page, client);
    await checkProbabilities(page);
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

    // A value the server refuses: the control says what is wrong, the banner has the full status.
    await page.fill("#top-k", "100000");
    await page.click("#run");
    await page.waitForSelector("#status[data-state='error'][data-run='3']");
    assert.equal(await page.isVisible("#error"), true);
    assert.equal(await page.getAttribute("#error", "data-status"), "INVALID_ARGUMENT");
    const field = (await page.getAttribute("#error", "data-field")) ?? "";
    assert.match(field, /read_logprobs\.top_k$/);
    assert.equal(await page.getAttribute("#error", "data-control"), "top-k");
    await checkFieldError(page, "top-k", /^top-k: must be in \[0, \d+\] \(the vocabulary\), got 100000$/);
    const banner = (await page.textContent("#error")) ?? "";
    assert.ok(banner.includes("INVALID_ARGUMENT") && banner.includes(`${field}: must be in`), banner);
    await page.screenshot({ path: screenshotPath("dashboard-error.png") });

    await page.fill("#top-k", "5");
    await page.fill("#max-tokens", "0");
    await page.click("#run");
    await page.waitForSelector("#status[data-state='error'][data-run='4']");
    await checkFieldError(page, "max-tokens", /^max tokens: must be >= 1, got 0$/);
    assert.equal(await page.locator(".field-error").count(), 1, "the top-k note stays after top-k was fixed");
    assert.equal(await page.getAttribute("#top-k", "aria-invalid"), null);

    // Greedy without ignore-EOS ends on EOS: shown by name, in the rows and the text.
    await page.fill("#max-tokens", "64");
    await page.uncheck("#ignore-eos");
    await page.click("#run");
    await waitRun(page, 5);
    assert.equal(await page.isVisible("#error"), false);
    assert.equal(await page.locator(".field-error").count(), 0);
    assert.equal(await page.getAttribute("#max-tokens", "aria-invalid"), null);
    const rows = await stepRows(page);
    const last = rows.at(-1);
    assert.ok(last && info.eosTokenIds.includes(last.tokenId), `the run did not end on EOS: ${JSON.stringify(rows.map((r) => r.tokenId))}`);
    const eos = tokenLabel(await client.detokenize([last.tokenId], { skipSpecialTokens: false }), last.tokenId, {
      eos: info.eosTokenIds,
      bos: info.bosTokenId,
    });
    assert.match(eos.text, /^⟨EOS/);
    await waitLabel(page, last.step, eos.text);
    assert.equal(await page.getAttribute(`.step[data-step='${last.step}'] .chosen`, "data-special"), "true");
    const piece = page.locator(`#text .piece[data-step='${last.step}']`);
    await page.waitForFunction((s) => document.querySelector(`#text .piece[data-step='${s}']`)?.hasAttribute("data-special"), last.step);
    // EOS adds no text; its marker is drawn by CSS (::after), so the text stays what the model generated.
    assert.equal(await piece.textContent(), "");
    assert.equal(await piece.getAttribute("data-special"), eos.text);
    const marker = await piece.evaluate((el) => getComputedStyle(el, "::after").content);
    assert.equal(marker, JSON.stringify(eos.text));
    assert.ok(((await piece.boundingBox())?.width ?? 0) > 0, "the EOS marker takes no space");
    await page.screenshot({ path: screenshotPath("dashboard-eos.png"), fullPage: true });

    assert.deepEqual(pageErrors, []);
  } catch (error) {
    await page.screenshot({ path: screenshotPath("dashboard-failure.png"), fullPage: true }).catch(() => undefined);
    throw error;
  }
});

test("dashboard: the logit-lens heatmap shows what the client's own lens read returns", { timeout: 300_000 }, async () => {
  const lensPage = await openReady({ width: 1400, height: 900 });
  try {
    assert.equal(await lensPage.getAttribute("#lens-note", "data-available"), "true");
    await lensPage.fill("#prompt", FRANCE);
    await lensPage.fill("#max-tokens", String(LENS_STEPS));
    await lensPage.check("#ignore-eos");
    await lensPage.click("#run");
    await waitRun(lensPage, 1);

    // The same read through the TS client: every layer's top-1 at every position ("all").
    const info = await client.modelInfo();
    const layers = Array.from({ length: info.numLayers }, (_, i) => i);
    const own = await client
      .trace(invoke(FRANCE).read("lens", read.logitLens(layers, { positions: "all", topK: 1 })), {
        temperature: 0,
        maxTokens: LENS_STEPS,
        ignoreEos: true,
      })
      .collect();
    const expected = new Map<string, { tokenId: number; prob: number }>();
    for (const step of own.steps) {
      const lens = step.values.lens;
      assert.ok(lens?.tokenIds && lens.positions);
      const [, count = 0] = lens.values.shape;
      layers.forEach((layer, l) =>
        Array.from(lens.positions!.data, Number).forEach((position, p) => {
          const at = l * count + p;
          expected.set(`${layer}:${position}`, { tokenId: Number(lens.tokenIds!.data[at]), prob: Math.exp(Number(lens.values.data[at])) });
        }),
      );
    }
    const prompt = (await client.tokenize(FRANCE)).tokenIds;
    // positions 0 .. P-1 at step 0, then one per later step
    assert.equal(expected.size, info.numLayers * (prompt.length + LENS_STEPS - 1));

    await lensPage.waitForFunction(() => Array.from(document.querySelectorAll("#lens [data-label-for]")).every((el) => !/^#\d+$/.test(el.textContent ?? "")));
    const cells = await lensPage.$$eval("#lens td.lens-cell", (tds) =>
      tds.map((td) => {
        const el = td as HTMLElement;
        return {
          key: `${el.dataset.layer}:${el.dataset.position}`,
          tokenId: Number(el.dataset.tokenId),
          prob: Number(el.dataset.prob),
          label: el.querySelector(".lens-token")?.textContent ?? "",
          background: getComputedStyle(el).backgroundColor,
        };
      }),
    );
    assert.equal(cells.length, expected.size);
    const specials = { eos: info.eosTokenIds, bos: info.bosTokenId };
    for (const cell of cells) {
      const want = expected.get(cell.key);
      assert.ok(want, `cell ${cell.key} is not in the client's read`);
      assert.equal(cell.tokenId, want.tokenId, cell.key);
      assert.ok(Math.abs(cell.prob - want.prob) < 1e-6, `${cell.key}: ${cell.prob} vs ${want.prob}`);
      const text = await client.detokenize([cell.tokenId], { skipSpecialTokens: false });
      assert.equal(cell.label, tokenLabel(text, cell.tokenId, specials).text, cell.key);
    }
    // The last layer at the last prompt position is the model's own guess: " Paris", drawn at step 0.
    const last = info.numLayers - 1;
    assert.equal(expected.get(`${last}:${prompt.length - 1}`)?.tokenId, PARIS);
    // Probability as colour: the most and least likely cells differ in shade.
    const byProb = [...cells].sort((x, y) => x.prob - y.prob);
    assert.notEqual(byProb[0]?.background, byProb.at(-1)?.background);
    // Rows: the last layer on top; the bottom row names the token each column reads.
    const rows = await lensPage.$$eval("#lens tr", (trs) => trs.map((tr) => (tr as HTMLElement).dataset.layer ?? "inputs"));
    assert.deepEqual(rows, [...layers.map(String).reverse(), "inputs"]);
    const inputs = await lensPage.$$eval("#lens th.lens-input", (ths) => ths.map((th) => Number((th as HTMLElement).dataset.tokenId)));
    const drawn = (await stepRows(lensPage)).map((r) => r.tokenId);
    assert.deepEqual(inputs, [...prompt, ...drawn.slice(0, -1)]);
    await lensPage.locator("#lens-section").screenshot({ path: screenshotPath("dashboard-lens.png") });
    assert.deepEqual(pageErrors, []);
  } catch (error) {
    await lensPage.screenshot({ path: screenshotPath("dashboard-lens-failure.png"), fullPage: true }).catch(() => undefined);
    throw error;
  } finally {
    await lensPage.close();
  }
});

test("dashboard: steering from a prompt pair: equal to the plain continuation at 0, the client's own steered run at 8", { timeout: 300_000 }, async () => {
  const steerPage = await openReady({ width: 1100, height: 1000 });
  try {
    assert.equal(await steerPage.getAttribute("#steer-note", "data-available"), "true");
    await steerPage.fill("#prompt", FRANCE);
    await steerPage.fill("#max-tokens", String(LENS_STEPS));
    await steerPage.check("#ignore-eos");
    await steerPage.selectOption("#steer-layer", String(STEER_LAYER));
    await steerPage.fill("#steer-a", SPAIN);
    await steerPage.fill("#steer-b", FRANCE);
    await setCoefficient(steerPage, 0);
    await steerPage.click("#steer-run");
    await waitSteer(steerPage, 1);
    const sampling = { temperature: 0, maxTokens: LENS_STEPS, ignoreEos: true };
    const [plainOut] = await client.generate(FRANCE, sampling);
    const plain = plainOut?.outputs[0]?.text ?? "";
    assert.match(plain, /^ Paris/);
    assert.deepEqual(await sides(steerPage), { plain, steered: plain });

    // The vector as the client reads it: layer 2's output, mean over the prompt, Spain minus France.
    const mean = read.module(`layers.${STEER_LAYER}`, { positions: "prompt", mean: true });
    const reads = await client
      .trace([invoke(SPAIN).read("r", mean, { steps: 0 }), invoke(FRANCE).read("r", mean, { steps: 0 })], { temperature: 0, maxTokens: 1 })
      .collect();
    const [a, b] = [0, 1].map((i) => reads.steps.find((s) => s.invokeIndex === i)?.values.r?.values.data as Float32Array);
    assert.ok(a && b && a.length === info().hiddenSize);
    const vector = Float32Array.from(a, (x, i) => x - (b[i] ?? 0));
    const vectorNorm = Math.hypot(...vector);
    assert.ok(Math.abs(Number(await steerPage.getAttribute("#steer-status", "data-norm")) - vectorNorm) < 1e-4 * vectorNorm);

    // Releasing the slider re-runs with the vector already read.
    await setCoefficient(steerPage, STRONG);
    await waitSteer(steerPage, 2);
    const shown = await sides(steerPage);
    const steered = await client.trace(invoke(FRANCE).write(write.steer(`layers.${STEER_LAYER}`, vector, { scale: STRONG })), sampling).result();
    const want = steered.outputs[0]?.outputs[0]?.text ?? "";
    assert.equal(shown.plain, plain);
    assert.equal(shown.steered, want);
    assert.notEqual(shown.steered, plain);
    assert.match(shown.steered, /Madrid/); // towards A: Spain's capital
    assert.equal(await steerPage.textContent("#steer-steered-title"), `steered (coefficient ${STRONG}, |vector| ${vectorNorm.toFixed(2)})`);
    await steerPage.locator("#steering").screenshot({ path: screenshotPath("dashboard-steering.png") });
    assert.deepEqual(pageErrors, []);
  } catch (error) {
    await steerPage.screenshot({ path: screenshotPath("dashboard-steering-failure.png"), fullPage: true }).catch(() => undefined);
    throw error;
  } finally {
    await steerPage.close();
  }
});

test("dashboard: the feature strip shows each step's top SAE features with their labels", { timeout: 300_000 }, async () => {
  const strip = await openReady({ width: 1100, height: 1000 });
  try {
    // run.ts starts the server with the shipped dictionaries: the picker offers the SAEs, the first chosen.
    const listed = await client.listDictionaries();
    const saes = listed.filter((d) => d.spec?.kind === DictionaryKind.SAE);
    assert.ok(saes.length > 0, "the test server lists no SAE (run.ts passes --dictionaries)");
    const sae = saes[0] as Dictionary;
    await strip.waitForSelector("#features-panel:not([hidden])");
    assert.deepEqual(await strip.$$eval("#dictionary option", (os) => os.map((o) => (o as HTMLOptionElement).value)), saes.map((d) => d.name));
    assert.equal(await strip.inputValue("#dictionary"), sae.name);

    const steps = 6;
    await strip.fill("#prompt", FRANCE);
    await strip.fill("#max-tokens", String(steps));
    await strip.check("#ignore-eos");
    await strip.click("#run");
    await waitRun(strip, 1);
    // The same read through the client: the strip is its active features, largest first, labelled.
    const reference = await client
      .trace(invoke(FRANCE).read("f", read.dictionary(sae.name, { topK: 5 })), {
        temperature: 0,
        maxTokens: steps,
        ignoreEos: true,
      })
      .collect();
    const shown = await strip.$$eval(".features", (rows) =>
      rows.map((row) => ({
        step: Number((row as HTMLElement).dataset.step),
        dictionary: (row as HTMLElement).dataset.dictionary,
        chips: Array.from(row.querySelectorAll<HTMLElement>(".feature"), (c) => ({
          feature: Number(c.dataset.feature),
          value: Number(c.dataset.value),
          label: c.querySelector(".feature-label")?.textContent ?? "",
        })),
      })),
    );
    assert.equal(shown.length, steps);
    const labels = sae.spec?.labels ?? [];
    let labelled = 0;
    for (const [s, row] of shown.entries()) {
      assert.equal(row.step, s);
      assert.equal(row.dictionary, sae.name);
      const read = reference.steps[s]?.values.f;
      const ids = Array.from(read?.tokenIds?.data ?? [], Number);
      const values = Array.from(read?.values.data ?? [], Number);
      const active = ids.filter((_, i) => (values[i] ?? 0) > 0);
      assert.ok(active.length > 0, `step ${s}: no active feature to show`);
      assert.deepEqual(row.chips.map((c) => c.feature), active, `step ${s}`);
      for (const chip of row.chips) {
        assert.equal(chip.label, labels[chip.feature] || `#${chip.feature}`);
        if (labels[chip.feature]) labelled++;
      }
    }
    assert.ok(labelled > 0, "no chip showed a label: the shipped SAE has labels");
    await strip.screenshot({ path: screenshotPath("dashboard-features.png"), fullPage: true });
    assert.deepEqual(pageErrors, []);
  } catch (error) {
    await strip.screenshot({ path: screenshotPath("dashboard-features-failure.png"), fullPage: true }).catch(() => undefined);
    throw error;
  } finally {
    await strip.close();
  }
});

test("dashboard: what the page says before any run, for a run of no candidates, and after a run that failed", { timeout: 300_000 }, async () => {
  const empty = await openReady({ width: 1100, height: 1000 });
  try {
    // Before any run: each place says what will be there, none is a blank box or an empty grid.
    assert.equal(await empty.isVisible("#steps-empty"), true);
    assert.match((await empty.textContent("#steps-empty")) ?? "", /^No run yet: type a prompt above and press Run\./);
    assert.equal(await empty.locator(".step").count(), 0);
    assert.equal(await empty.isVisible("#lens"), false);
    for (const side of ["#steer-plain", "#steer-steered"]) {
      assert.equal(await empty.textContent(side), "press Steer to compare");
    }
    assert.equal(await empty.isVisible("#features-note"), false); // the eager server reads the SAE: no note
    await empty.screenshot({ path: screenshotPath("dashboard-empty.png"), fullPage: true });

    // top-k 0: the rows read only the drawn token; each says so where the candidates would be.
    await empty.fill("#prompt", FRANCE);
    await empty.fill("#max-tokens", "3");
    await empty.fill("#top-k", "0");
    await empty.check("#ignore-eos");
    await empty.click("#run");
    await waitRun(empty, 1);
    assert.equal(await empty.isVisible("#steps-empty"), false);
    assert.equal(await empty.locator(".step").count(), 3);
    assert.equal(await empty.locator(".candidate").count(), 0);
    assert.deepEqual(
      await empty.$$eval(".step .candidates", (cs) => cs.map((c) => c.textContent)),
      Array(3).fill("no candidates read (top-k 0): only the drawn token's probability"),
    );
    await empty.screenshot({ path: screenshotPath("dashboard-top-k-0.png"), fullPage: true });

    // A run the server refuses before its first step: the banner says why, and no empty lens grid is left.
    await empty.fill("#top-k", "5");
    await empty.fill("#prompt", "");
    await empty.click("#run");
    await empty.waitForSelector("#status[data-state='error'][data-run='2']");
    assert.equal(await empty.getAttribute("#error", "data-status"), "INVALID_ARGUMENT");
    assert.equal(await empty.isVisible("#lens"), false);
    assert.equal(await empty.locator("#lens td.lens-cell").count(), 0);
    await empty.screenshot({ path: screenshotPath("dashboard-refused.png"), fullPage: true });

    // While a trace streams (a long one, so the page is caught midway): rows so far, the status
    // naming the step, the lens growing a column per step.
    await empty.fill("#prompt", FRANCE);
    await empty.fill("#max-tokens", String(LONG));
    // Seen by a MutationObserver, at the DOM change that makes the fifth row: a poll (a timer's
    // or animation frames') can miss the whole run on a loaded machine, where the page's
    // thread gets its turn only after the last step has been drawn.
    await empty.evaluate(() => {
      const page = window as unknown as { midway?: object };
      page.midway = undefined;
      const observer = new MutationObserver(() => {
        const rows = document.querySelectorAll(".step").length;
        if (rows < 5) return;
        const status = document.getElementById("status");
        page.midway = { state: status?.dataset.state, status: status?.textContent, rows };
        observer.disconnect();
      });
      observer.observe(document.body, { subtree: true, childList: true, characterData: true, attributes: true });
    });
    await empty.click("#run");
    const seen = await empty.waitForFunction(() => (window as unknown as { midway?: object }).midway ?? false);
    const midway = (await seen.jsonValue()) as { state: string; status: string; rows: number };
    await empty.screenshot({ path: screenshotPath("dashboard-streaming.png"), fullPage: true });
    assert.equal(midway.state, "running", JSON.stringify(midway));
    assert.match(midway.status ?? "", /^running: step \d+$/);
    assert.ok(midway.rows >= 5 && midway.rows < LONG, JSON.stringify(midway));
    await waitRun(empty, 3);
    assert.equal(await empty.locator(".step").count(), LONG);
    assert.deepEqual(pageErrors, []);
  } catch (error) {
    await empty.screenshot({ path: screenshotPath("dashboard-empty-failure.png"), fullPage: true }).catch(() => undefined);
    throw error;
  } finally {
    await empty.close();
  }
});

test("dashboard: no server at ?server= shows at once (before any Run), and says how to start one", { timeout: 120_000 }, async () => {
  const offline = await browser.newPage({ viewport: { width: 1100, height: 600 } });
  try {
    const closed = `http://127.0.0.1:${await freePort()}`;
    await offline.goto(`${siteUrl}/?server=${encodeURIComponent(closed)}`);
    await offline.waitForSelector("#status[data-state='offline']");
    const status = (await offline.textContent("#status")) ?? "";
    assert.ok(status.includes(`no server at ${closed}`) && status.includes("make serve"), status);
    assert.equal(await offline.isVisible("#error"), true);
    // One line naming the server and how to point the page at another (the client's UnreachableError).
    assert.equal(await offline.getAttribute("#error", "data-status"), "UNAVAILABLE");
    assert.equal(
      await offline.textContent("#error .error-message"),
      unreachableMessage(closed, "the request failed: nothing listens there, or its CORS does not allow this page's origin"),
    );
    assert.ok((await offline.textContent("#error .error-hint"))?.includes(closed));
    await offline.screenshot({ path: screenshotPath("dashboard-offline.png") });
  } finally {
    await offline.close();
  }
});

test("dashboard: `make dashboard DASHBOARD_PORT=...` prints the URL for the running server, and the page opens ready", { timeout: 180_000 }, async () => {
  assert.ok(HTTP_URL);
  const port = await freePort();
  const httpPort = new URL(HTTP_URL).port;
  // -o setup: the checkout is set up already (make test-ts did it); the dashboard target itself runs.
  const make = spawn("make", ["--no-print-directory", "-o", "setup", "dashboard", `DASHBOARD_PORT=${port}`, "HOST=127.0.0.1", `HTTP_PORT=${httpPort}`], {
    cwd: REPO,
    detached: true, // its own group: vite is a grandchild
    stdio: ["ignore", "pipe", "pipe"],
    env: { ...process.env, NO_COLOR: "1" },
  });
  const dev = await browser.newPage({ viewport: { width: 1100, height: 600 } });
  try {
    const output = await waitOutput(make, /Local:.*:(\d+)/);
    const expected = `http://127.0.0.1:${port}/?server=http://127.0.0.1:${httpPort}`;
    assert.ok(output.includes(`dashboard: open ${expected}\n`), output);
    assert.ok(!output.includes("nothing answers"), output);
    await dev.goto(expected);
    await dev.waitForSelector("#status[data-state='idle']");
    assert.equal(await dev.textContent("#server"), `http://127.0.0.1:${httpPort} (connect)`);
    await dev.screenshot({ path: screenshotPath("dashboard-make.png") });
  } finally {
    await dev.close();
    await stopGroup(make);
  }
});

/** A page of the dashboard on the test server, once its server check says ready. */
async function openReady(viewport: { width: number; height: number }): Promise<Page> {
  const opened = await browser.newPage({ viewport });
  opened.setDefaultTimeout(TIMEOUT_MS);
  opened.on("pageerror", (error) => pageErrors.push(String(error)));
  await opened.goto(`${siteUrl}/?server=${encodeURIComponent(HTTP_URL ?? "")}`);
  await opened.waitForSelector("#status[data-state='idle']");
  modelInfo ??= await client.modelInfo();
  return opened;
}

function info(): Awaited<ReturnType<TracewireClient["modelInfo"]>> {
  assert.ok(modelInfo);
  return modelInfo;
}

/** Set the slider as a user does: input while dragging, change on release. */
async function setCoefficient(page: Page, value: number): Promise<void> {
  await page.$eval(
    "#steer-coef",
    (el, v) => {
      const input = el as HTMLInputElement;
      input.value = String(v);
      input.dispatchEvent(new Event("input", { bubbles: true }));
      input.dispatchEvent(new Event("change", { bubbles: true }));
    },
    value,
  );
  assert.equal(await page.textContent("#steer-coef-value"), String(value));
}

async function waitSteer(page: Page, run: number): Promise<void> {
  await page.waitForSelector(`#steer-status[data-run='${run}']:is([data-state='done'], [data-state='error'])`);
  const state = await page.getAttribute("#steer-status", "data-state");
  assert.equal(state, "done", `steering run ${run} failed: ${await page.textContent("#error")}`);
}

/** The two continuations (the prompt's span excluded). */
async function sides(page: Page): Promise<{ plain: string; steered: string }> {
  const text = (id: string): Promise<string> => page.$$eval(`#${id} .piece`, (pieces) => pieces.map((p) => p.textContent ?? "").join(""));
  return { plain: await text("steer-plain"), steered: await text("steer-steered") };
}

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

/**
 * Every token label shows the whole token: no ellipsis, nothing cut (long ones wrap), the
 * tooltip repeats it, and the text is the token's, as Detokenize gives it.
 */
async function checkLabels(page: Page, client: TracewireClient): Promise<void> {
  await page.waitForFunction(() => Array.from(document.querySelectorAll(".step [data-label-for]")).every((el) => !/^#\d+$/.test(el.textContent ?? "")));
  const labels = await page.$$eval(".step [data-label-for]", (els) =>
    els.map((el) => {
      const e = el as HTMLElement;
      return {
        tokenId: Number(e.dataset.labelFor),
        text: e.textContent ?? "",
        title: e.title,
        cut: e.scrollWidth > e.clientWidth + 1 || e.scrollHeight > e.clientHeight + 1,
        ellipsis: getComputedStyle(e).textOverflow === "ellipsis",
      };
    }),
  );
  assert.ok(labels.length > STEPS * 5, `only ${labels.length} labels`);
  const info = await client.modelInfo();
  const specials = { eos: info.eosTokenIds, bos: info.bosTokenId };
  const ids = [...new Set(labels.map((l) => l.tokenId))];
  const texts = new Map(await Promise.all(ids.map(async (id) => [id, await client.detokenize([id], { skipSpecialTokens: false })] as const)));
  for (const label of labels) {
    const want = tokenLabel(texts.get(label.tokenId) ?? "", label.tokenId, specials).text;
    assert.equal(label.text, want, `token ${label.tokenId}`);
    assert.ok(!label.cut && !label.ellipsis, `token ${label.tokenId}'s label ${label.text} is cut`);
    assert.equal(label.title, `${want} (token ${label.tokenId})`);
  }
}

/** Each probability as formatProb writes it: small ones in scientific notation, never "0.00%". */
async function checkProbabilities(page: Page): Promise<void> {
  const shown = await page.$$eval(".candidate", (cs) => cs.map((c) => [Number((c as HTMLElement).dataset.prob), c.querySelector(".prob")?.textContent ?? ""] as const));
  for (const [prob, text] of shown) {
    assert.equal(text, formatProb(prob));
    assert.notEqual(text, "0.00%");
  }
  // This model puts some top-5 candidates under 0.1% in 24 steps: they read as e.g. 3.1e-4.
  assert.ok(shown.some(([prob, text]) => prob < 1e-3 && /^\d\.\de-\d+$/.test(text)), JSON.stringify(shown.slice(0, 10)));
}

/** The note next to `control` (after its label), the control marked invalid and described by it. */
async function checkFieldError(page: Page, control: string, message: RegExp): Promise<void> {
  const note = page.locator(`.field-error[data-control='${control}']`);
  assert.equal(await note.count(), 1);
  assert.match((await note.textContent()) ?? "", message);
  assert.equal(await page.getAttribute(`#${control}`, "aria-invalid"), "true");
  assert.equal(await page.getAttribute(`#${control}`, "aria-describedby"), `${control}-error`);
  const beside = await page.evaluate((id) => {
    const label = document.getElementById(id)?.closest("label");
    return label?.nextElementSibling?.id;
  }, control);
  assert.equal(beside, `${control}-error`);
  assert.equal(await note.isVisible(), true);
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

async function freePort(): Promise<number> {
  const server = createTcpServer();
  await new Promise<void>((done) => server.listen(0, "127.0.0.1", done));
  const address = server.address();
  assert.ok(address && typeof address === "object");
  await new Promise<void>((done) => server.close(() => done()));
  return address.port;
}

/** The process's stdout + stderr once `pattern` appears in it (or a failure with what it printed). */
async function waitOutput(child: ChildProcess, pattern: RegExp): Promise<string> {
  let output = "";
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no ${pattern} within 60 s:\n${output}`)), 60_000);
    const onData = (chunk: Buffer): void => {
      // Vite colours its banner when it thinks a terminal is there (CI=true does it): the
      // escape codes would sit between "Local:" and the port.
      output += chunk.toString().replace(/\u001b\[[0-9;]*m/g, "");
      if (pattern.test(output)) {
        clearTimeout(timer);
        resolve(output);
      }
    };
    child.stdout?.on("data", onData);
    child.stderr?.on("data", onData);
    child.on("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`make dashboard exited (${code}):\n${output}`));
    });
  });
}

/** SIGTERM to the process group we started (make, npm, vite), and wait for make to go. */
async function stopGroup(child: ChildProcess): Promise<void> {
  if (child.pid === undefined || child.exitCode !== null) {
    return;
  }
  const exited = new Promise<void>((done) => child.once("exit", () => done()));
  process.kill(-child.pid, "SIGTERM");
  await exited;
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
