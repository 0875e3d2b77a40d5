/**
 * Activation patching from the TS builder (write.patch / write.addRead), against the shared test
 * server (run.ts starts it with --enforce-eager: module hooks need it).
 *
 * The check needs no reference model: patching every prompt position of layer 0's output
 * (the residual stream after it) of a same-length corrupted prompt with the clean prompt's
 * makes everything downstream the clean run's, so the corrupted invoke's step-0 logits
 * equal the clean one's; one position alone leaves them different.
 */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { Code, TracewireError, createNodeClient, invoke, read, write, type TracewireClient } from "../src/node.js";

const CLEAN = "The capital of France is";
const CORRUPTED = "The capital of Italy is"; // 5 tokens each, differing at position 3
let client: TracewireClient;

before(() => {
  const url = process.env.TRACEWIRE_TEST_URL;
  assert.ok(url, "run the tests with `node dist/test/run.js` (make test-ts)");
  client = createNodeClient(url, { timeoutMs: 120_000 });
});

after(() => client?.close());

function floats(values: unknown): number[] {
  return [...(values as Float32Array)];
}

function maxDiff(a: number[], b: number[]): number {
  return Math.max(...a.map((x, i) => Math.abs(x - (b[i] ?? NaN))));
}

test("the builder's patch and addRead carry a ReadRef", () => {
  const action = write.patch("layers.1", { invoke: 0, name: "clean", positions: [3] }, { positions: [3] });
  assert.equal(action.case, "writeModule");
  const op = action.value.op;
  assert.equal(op?.case, "patch");
  assert.deepEqual(op?.case === "patch" ? [op.value.invoke, op.value.name, [...(op.value.positions ?? [])]] : [], [0, "clean", [3]]);
  const added = write.addRead("layers.1", { invoke: 2, name: "x" }, { scale: 0.5 });
  assert.ok(added.case === "writeModule");
  assert.equal(added.value.op?.case, "addRead");
  assert.equal(added.value.scale, 0.5);
});

test("patching every prompt position of layer 0 gives the clean run's logits, one position does not", async () => {
  const raw = read.logits({ stage: "raw" });
  const { steps } = await client
    .trace([
      invoke(CLEAN).read("clean", read.module("layers.0", { positions: "prompt" }), { steps: 0 }).read("logits", raw),
      invoke(CORRUPTED).write(write.patch("layers.0", { invoke: 0, name: "clean" }, { positions: "prompt" }), { steps: 0 })
        .read("logits", raw),
      invoke(CORRUPTED).write(write.patch("layers.0", { invoke: 0, name: "clean", positions: [3] }, { positions: [3] }),
        { steps: 0 }).read("logits", raw),
      invoke(CORRUPTED).read("logits", raw),
    ], { temperature: 0, maxTokens: 1 })
    .collect();
  const logits = (k: number): number[] => floats(steps.find((s) => s.invokeIndex === k)?.values.logits?.values.data);
  assert.ok(maxDiff(logits(1), logits(0)) < 1e-3, "all positions patched: the clean logits");
  assert.ok(maxDiff(logits(3), logits(0)) > 1e-2, "the prompts differ");
  assert.ok(maxDiff(logits(2), logits(3)) > 1e-3, "position 3 alone changes the logits");
});

test("a reference to a missing read is INVALID_ARGUMENT naming the field", async () => {
  const run = client.trace([
    invoke(CLEAN),
    invoke(CORRUPTED).write(write.patch("layers.0", { invoke: 0, name: "nope" }, { positions: [3] }), { steps: 0 }),
  ], { maxTokens: 1 });
  await assert.rejects(run.collect(), (error: unknown) => {
    assert.ok(error instanceof TracewireError);
    assert.equal(error.code, Code.InvalidArgument);
    assert.equal(error.field, "invokes[1].interventions[0].write_module.patch.name");
    return true;
  });
});
