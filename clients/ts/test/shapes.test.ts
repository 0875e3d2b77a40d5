/** The shape rule for decoded module reads (no server needed): one shape per read. */

import assert from "node:assert/strict";
import { test } from "node:test";
import { create } from "@bufbuild/protobuf";
import { float32Tensor, invoke, read, rowReads, toStep, traceRequest } from "../src/index.js";
import { StepResultSchema } from "../src/gen/tracewire/v1/trace_pb.js";

const HIDDEN = 4;

function stepWith(step: number, values: Record<string, number[][] | number[]>) {
  const entries = Object.entries(values).map(([name, rows]) => {
    const flat = rows.flat();
    const tensor = float32Tensor(flat);
    tensor.shape = Array.isArray(rows[0]) ? [BigInt(rows.length), BigInt(HIDDEN)] : [BigInt(HIDDEN)];
    return [name, { values: tensor }] as const;
  });
  return create(StepResultSchema, { step, values: Object.fromEntries(entries) });
}

test("module reads over positions are [positions, hidden] at every step; new-token and mean reads [hidden]", () => {
  const request = traceRequest([
    invoke("a")
      .read("all", read.module("layers.1", { positions: "all" }))
      .read("listed", read.module("layers.1", { positions: [0, 2] }))
      .read("new", read.module("layers.1"))
      .read("mean", read.module("layers.1", { positions: "prompt", mean: true }))
      .read("top", read.logits({ topK: 2 })),
    invoke("b").read("new", read.module("layers.1", { positions: "new" })),
  ]);
  const rows = rowReads(request);
  assert.deepEqual([...(rows.get(0) ?? [])].sort(), ["all", "listed"]);
  assert.equal(rows.get(1), undefined);

  const row = [1, 2, 3, 4];
  const first = toStep(stepWith(0, { all: [row, row, row], listed: [row, row], new: row, mean: row }), rows.get(0));
  assert.deepEqual(first.values.all?.values.shape, [3, HIDDEN]);
  assert.deepEqual(first.values.listed?.values.shape, [2, HIDDEN]);
  assert.deepEqual(first.values.new?.values.shape, [HIDDEN]);
  assert.deepEqual(first.values.mean?.values.shape, [HIDDEN]);
  // After step 0 the server sends a read of "all" positions as the new token's row alone.
  const later = toStep(stepWith(1, { all: row, new: row }), rows.get(0));
  assert.deepEqual(later.values.all?.values.shape, [1, HIDDEN]);
  assert.deepEqual([...(later.values.all?.values.data ?? [])], row);
  assert.deepEqual(later.values.new?.values.shape, [HIDDEN]);
});
