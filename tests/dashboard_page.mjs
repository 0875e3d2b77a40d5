// Drives the dashboard (clients/ts/examples/dashboard, built) in headless Chromium for
// test_dashboard_compiled.py: opens it on a server, optionally runs a prompt, and prints what
// the page shows (as JSON) after saving a screenshot. playwright-core comes from the TS
// client's node_modules (`make setup` installs it), the browser is Debian's Chromium, launched
// with the flags clients/ts/test/dashboard.test.ts uses.
//
//   node tests/dashboard_page.mjs '{"chromium": "/usr/bin/chromium", "url": "...", "screenshot": "x.png",
//                                   "run": {"prompt": "...", "maxTokens": 4, "topK": 5}}'

import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const REPO = join(dirname(fileURLToPath(import.meta.url)), "..");
const { chromium } = createRequire(join(REPO, "clients/ts/package.json"))("playwright-core");
const ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync"];
const TIMEOUT_MS = 120_000;

const spec = JSON.parse(process.argv[2]);
const browser = await chromium.launch({ executablePath: spec.chromium, args: ARGS, timeout: TIMEOUT_MS });
const errors = [];
try {
  const page = await browser.newPage({ viewport: { width: 1100, height: 1000 } });
  page.setDefaultTimeout(TIMEOUT_MS);
  page.on("pageerror", (error) => errors.push(String(error)));
  await page.goto(spec.url);
  await page.waitForSelector("#status:is([data-state='idle'], [data-state='error'], [data-state='offline'])");
  // the dictionaries (the feature strip) are asked for after the model info
  await page.waitForLoadState("networkidle");
  if (spec.run) {
    await page.fill("#prompt", spec.run.prompt);
    await page.fill("#max-tokens", String(spec.run.maxTokens));
    await page.fill("#top-k", String(spec.run.topK));
    await page.check("#ignore-eos");
    await page.click("#run");
    await page.waitForSelector("#status[data-run='1']:is([data-state='done'], [data-state='error'])");
    await page.waitForFunction(() => Array.from(document.querySelectorAll("[data-label-for]")).every((el) => !/^#\d+$/.test(el.textContent ?? "")));
  }
  const shown = await page.evaluate(() => {
    const text = (selector) => document.querySelector(selector)?.textContent ?? null;
    const data = (selector, name) => document.querySelector(selector)?.getAttribute(`data-${name}`) ?? null;
    return {
      state: data("#status", "state"),
      status: text("#status"),
      error: document.getElementById("error")?.hidden ? null : text("#error"),
      lensAvailable: data("#lens-note", "available"),
      lensNote: text("#lens-note"),
      lensRows: Array.from(document.querySelectorAll("#lens tr[data-layer]"), (tr) => Number(tr.getAttribute("data-layer"))),
      lensCells: document.querySelectorAll("#lens td.lens-cell").length,
      steerAvailable: data("#steer-note", "available"),
      steerNote: text("#steer-note"),
      steerLayers: Array.from(document.querySelectorAll("#steer-layer option"), (o) => o.value),
      steerDisabled: document.getElementById("steer-run")?.disabled ?? null,
      featuresShown: !document.getElementById("features-panel")?.hidden,
      dictionaries: Array.from(document.querySelectorAll("#dictionary option"), (o) => o.value),
      steps: document.querySelectorAll(".step").length,
      features: document.querySelectorAll(".features").length,
      featuresNote: document.getElementById("features-note")?.hidden ? null : text("#features-note"),
    };
  });
  await page.screenshot({ path: spec.screenshot, fullPage: true });
  console.log(JSON.stringify({ ...shown, pageErrors: errors }));
} finally {
  await browser.close();
}
