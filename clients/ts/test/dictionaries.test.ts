/**
 * Dictionaries (linear probes, SAEs) through the TS client against the shared test server
 * (run.ts starts it eager, with the shipped models/tracewire-tiny/dictionaries), checked
 * against HF transformers with the dictionaries' weights applied in torch
 * (fixtures/hf_dictionaries.py). Tolerances: reads 1e-4, logits under a write 2e-3 (as
 * tests/test_dictionaries_sdk.py).
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readdirSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { promisify } from "node:util";
import { createNodeClient, DictionaryKind, invoke, read, write, type Dictionary, type TracewireClient } from "../src/node.js";
import { PYTHON, REPO } from "./server.js";

const FRANCE = "The capital of France is";
const STEPS = 4;
const SHIPPED = process.env.TRACEWIRE_TEST_DICTIONARIES ?? join(REPO, "models/tracewire-tiny/dictionaries");
let client: TracewireClient;

before(() => {
  const url = process.env.TRACEWIRE_TEST_URL;
  assert.ok(url, "run the tests with `node dist/test/run.js` (make test-ts)");
  client = createNodeClient(url, { timeoutMs: 300_000 });
});

after(() => client?.close());

interface HFDictionaries {
  probe: number[][]; // [positions][k]
  steered_logits: number[];
}

/** The probe on every position of `ids`; the logits at `position` with the SAE feature steered there. */
async function hf(
  ids: readonly number[],
  probe: string,
  sae: string,
  steer: { feature: number; alpha: number; position: number },
): Promise<HFDictionaries> {
  const script = join(REPO, "clients/ts/test/fixtures/hf_dictionaries.py");
  const args = [script, JSON.stringify(ids), probe, sae, ...[steer.feature, steer.alpha, steer.position].map(String)];
  const { stdout } = await promisify(execFile)(PYTHON, args, { maxBuffer: 64 << 20 });
  return JSON.parse(stdout) as HFDictionaries;
}

function assertClose(actual: ArrayLike<number>, expected: readonly number[], atol: number, what: string): void {
  assert.equal(actual.length, expected.length, `${what}: length`);
  for (let i = 0; i < expected.length; i++) {
    const a = actual[i] as number;
    const e = expected[i] as number;
    assert.ok(Math.abs(a - e) <= atol, `${what}[${i}]: ${a} vs ${e}`);
  }
}

async function shipped(): Promise<{ probe: Dictionary; sae: Dictionary }> {
  const listed = await client.listDictionaries();
  const names = readdirSync(SHIPPED).filter((f) => f.endsWith(".json")).map((f) => f.slice(0, -".json".length));
  assert.deepEqual(listed.map((d) => d.name).sort(), names.sort(), "ListDictionaries lists the shipped dictionaries");
  const probe = listed.find((d) => d.spec?.kind === DictionaryKind.PROBE);
  const sae = listed.find((d) => d.spec?.kind === DictionaryKind.SAE);
  assert.ok(probe && sae, "the shipped dictionaries hold a probe and an SAE");
  return { probe, sae };
}

test("a probe read at every step and a feature steer equal HF with the dictionaries' weights", async () => {
  const { probe, sae } = await shipped();
  const feature = 0;
  const alpha = 8;
  const reads = await client
    .trace(invoke(FRANCE).read("probe", read.dictionary(probe.name, { module: probe.spec?.module })), {
      temperature: 0,
      maxTokens: STEPS,
      ignoreEos: true,
    })
    .collect();
  const steered = await client
    .trace(
      invoke(FRANCE)
        .write(write.dictionary(sae.name, feature, { steer: alpha }))
        .read("raw", read.logits({ stage: "raw" })),
      { temperature: 0, maxTokens: 1, ignoreEos: true },
    )
    .collect();
  const tokens = reads.outputs[0]?.outputs[0]?.tokenIds ?? [];
  const prompt = (await client.tokenize(FRANCE)).tokenIds;
  // the steer at step 0 acts at the new token: the prompt's last position
  const ref = await hf([...prompt, ...tokens.slice(0, -1)], probe.name, sae.name, { feature, alpha, position: prompt.length - 1 });
  assert.equal(reads.steps.length, STEPS);
  reads.steps.forEach((step, s) => {
    const values = step.values.probe?.values;
    assert.deepEqual(values?.shape, [probe.size]);
    assertClose(values?.data as Float32Array, ref.probe[prompt.length - 1 + s] ?? [], 1e-4, `step ${s} probe`);
  });
  assertClose(steered.steps[0]?.values.raw?.values.data as Float32Array, ref.steered_logits, 2e-3, "steered logits");
});
