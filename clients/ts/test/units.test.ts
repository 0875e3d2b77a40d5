/**
 * Attention heads and MLP neurons through the TS builder, against the shared test server (run.ts
 * starts it with --enforce-eager: module hooks need it), checked against
 * HF transformers' o_proj / down_proj inputs on the same weights (fixtures/hf_units.py).
 * Tolerances: reads 1e-4, logits under a write 2e-3 (as tests/test_heads_neurons.py).
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { promisify } from "node:util";
import { Code, TracewireError, createNodeClient, invoke, read, write, type TracewireClient } from "../src/node.js";
import { PYTHON, REPO } from "./server.js";

const FRANCE = "The capital of France is";
const STEPS = 3;
const HEAD_DIM = 64;
let client: TracewireClient;

before(() => {
  const url = process.env.TRACEWIRE_TEST_URL;
  assert.ok(url, "run the tests with `node dist/test/run.js` (make test-ts)");
  client = createNodeClient(url, { timeoutMs: 300_000 });
});

after(() => client?.close());

interface HFUnits {
  heads1: number[][][]; // [positions][heads][headDim]
  act2: number[][]; // [positions][neurons]
  zeroed_logits: number[];
}

async function hf(ids: readonly number[]): Promise<HFUnits> {
  const script = join(REPO, "clients/ts/test/fixtures/hf_units.py");
  const { stdout } = await promisify(execFile)(PYTHON, [script, JSON.stringify(ids)], { maxBuffer: 64 << 20 });
  return JSON.parse(stdout) as HFUnits;
}

function assertClose(actual: ArrayLike<number>, expected: readonly number[], atol: number, what: string): void {
  assert.equal(actual.length, expected.length, `${what}: length`);
  for (let i = 0; i < expected.length; i++) {
    const a = actual[i] as number;
    const e = expected[i] as number;
    assert.ok(Math.abs(a - e) <= atol, `${what}[${i}]: ${a} vs ${e}`);
  }
}

test("model info lists heads and neurons with their shapes", async () => {
  const info = await client.modelInfo();
  assert.deepEqual([info.numAttentionHeads, info.numKeyValueHeads, info.headDim, info.intermediateSize], [4, 2, 64, 640]);
  const heads = info.modules.find((m) => m.path === "layers.1.self_attn.heads");
  assert.equal(heads?.kind, "attention_heads");
  assert.deepEqual(heads?.shape, [4, 64]);
  assert.deepEqual(info.modules.find((m) => m.path === "layers.2.mlp.act")?.shape, [640]);
});

test("head and neuron reads equal HF's o_proj / down_proj inputs", async () => {
  const run = client.trace(
    invoke(FRANCE)
      .read("prompt", read.module("layers.1.self_attn.heads", { positions: "prompt", units: [2, 0] }), { steps: 0 })
      .read("heads", read.module("layers.1.self_attn.heads", { units: [3] }))
      .read("top", read.module("layers.2.mlp.act", { topK: 4 })),
    { temperature: 0, maxTokens: STEPS, ignoreEos: true },
  );
  const { steps, outputs } = await run.collect();
  const tokens = outputs[0]?.outputs[0]?.tokenIds ?? [];
  const prompt = (await client.tokenize(FRANCE)).tokenIds;
  const ref = await hf([...prompt, ...tokens.slice(0, -1)]);
  const n = prompt.length;
  const first = steps[0]?.values.prompt;
  assert.deepEqual(first?.values.shape, [n, 2, HEAD_DIM]);
  assertClose(first?.values.data as Float32Array,
    ref.heads1.slice(0, n).flatMap((row) => [...(row[2] ?? []), ...(row[0] ?? [])]), 1e-4, "prompt heads [2, 0]");
  assert.equal(steps.length, STEPS);
  steps.forEach((step, s) => {
    const heads = step.values.heads;
    assert.deepEqual(heads?.values.shape, [1, HEAD_DIM]);
    assertClose(heads?.values.data as Float32Array, ref.heads1[n - 1 + s]?.[3] ?? [], 1e-4, `step ${s} head 3`);
    const row = ref.act2[n - 1 + s] ?? [];
    const order = row.map((v, i) => [v, i] as const).sort((a, b) => b[0] - a[0]).slice(0, 4);
    assert.deepEqual(Array.from(step.values.top?.tokenIds?.data ?? [], Number), order.map(([, i]) => i));
    assertClose(step.values.top?.values.data as Float32Array, order.map(([v]) => v), 1e-4, `step ${s} top-4 neurons`);
  });
});

test("zeroing heads 1 and 3 of layer 1 gives HF's logits under the same hook", async () => {
  const run = client.trace(
    invoke(FRANCE)
      .write(write.zero("layers.1.self_attn.heads", { positions: "all", units: [1, 3] }))
      .read("raw", read.logits({ stage: "raw" })),
    { temperature: 0, maxTokens: 1, ignoreEos: true },
  );
  const { steps } = await run.collect();
  const prompt = (await client.tokenize(FRANCE)).tokenIds;
  const ref = await hf(prompt);
  assertClose(steps[0]?.values.raw?.values.data as Float32Array, ref.zeroed_logits, 2e-3, "logits");
});

test("a head id past the model's heads is INVALID_ARGUMENT naming the field", async () => {
  const request = invoke(FRANCE).read("h", read.module("layers.1.self_attn.heads", { units: [4] }));
  await assert.rejects(client.trace(request, { maxTokens: 1 }).result(), (error: unknown) => {
    assert.ok(error instanceof TracewireError);
    assert.equal(error.code, Code.InvalidArgument);
    assert.match(error.message, /interventions\[0\]\.read_module\.units\.ids\.ids\[0\]/);
    return true;
  });
});
