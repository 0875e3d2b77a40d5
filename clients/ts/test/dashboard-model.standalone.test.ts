/**
 * The dashboard's logit-lens and steering logic (examples/dashboard/src/model.ts: pure, no
 * DOM), on steps shaped as the server sends them (dashboard.test.ts checks the same views end
 * to end against the real server's values). No server.
 */

import assert from "node:assert/strict";
import { test } from "node:test";
import { lensColors } from "../examples/dashboard/src/format.js";
import {
  allLayers,
  inputTokenAt,
  LENS,
  lensColumns,
  lensFeature,
  moduleFeature,
  norm,
  readableLayers,
  RESIDUAL,
  sideOf,
  steeringInvokes,
  steeringVector,
  vectorInvokes,
  withLens,
} from "../examples/dashboard/src/model.js";
import { Dtype, invoke, traceRequest, v1, type ReadResult, type Step } from "../src/node.js";

function step(values: Record<string, ReadResult>, at = 0, invokeIndex = 0): Step {
  return { invokeIndex, sequenceIndex: 0, step: at, tokenId: 7, text: "x", stopped: false, values, engineTime: undefined };
}

function tensor(shape: number[], data: number[], dtype = Dtype.FLOAT32) {
  return { dtype, shape, data: dtype === Dtype.INT32 ? Int32Array.from(data) : Float32Array.from(data) };
}

/** GetModelInfo's fields the views read, for a 4-layer model. */
function info(engineMode: v1.EngineMode, readableLayers: number[] = [], steerableLayers: number[] = [],
              stageFirstLayers: number[] = [0]) {
  return { engineMode, numLayers: 4, readableLayers, steerableLayers, stageFirstLayers };
}

function reasonOf(found: ReturnType<typeof moduleFeature>): string {
  assert.equal(found.available, false, JSON.stringify(found));
  return found.available ? "" : found.reason;
}

test("moduleFeature: eager runs the lens and steering on every layer; without read buffers it says why and which flag", () => {
  assert.deepEqual(moduleFeature("The logit lens", info(v1.EngineMode.EAGER)), { available: true, layers: [0, 1, 2, 3] });
  assert.deepEqual(moduleFeature("Steering", info(v1.EngineMode.EAGER), true), { available: true, layers: [0, 1, 2, 3] });
  for (const [mode, name] of [
    [v1.EngineMode.COMPILED, "COMPILED"],
    [v1.EngineMode.COMPILED_STEERING, "COMPILED_STEERING"],
    [v1.EngineMode.UNSPECIFIED, "UNSPECIFIED"],
  ] as const) {
    const reason = reasonOf(moduleFeature("The logit lens", info(mode, [], [0, 1])));
    assert.ok(reason.startsWith("The logit lens needs module reads;"), reason);
    assert.ok(reason.includes(`this server is ${name}, reading no layers`), reason);
    assert.ok(reason.includes('Start it with --compiled-reads (make serve ENGINE_ARGS="--compiled-reads")'), reason);
    assert.ok(reason.includes("--enforce-eager"), reason);
  }
  // steering on a plain compiled server: both flags missing
  const both = reasonOf(moduleFeature("Steering", info(v1.EngineMode.COMPILED), true));
  assert.ok(both.includes("needs module reads and writes") && both.includes("Start it with --compiled-reads --compiled-steering"), both);
});

test("lensFeature: every readable layer, and under pipeline parallelism the last stage's only", () => {
  assert.deepEqual(lensFeature(info(v1.EngineMode.EAGER)), { available: true, layers: [0, 1, 2, 3] });
  assert.deepEqual(lensFeature(info(v1.EngineMode.EAGER, [], [], [0, 2])), { available: true, layers: [2, 3] });
  assert.deepEqual(lensFeature(info(v1.EngineMode.EAGER, [], [], [])), { available: true, layers: [0, 1, 2, 3] });
  assert.deepEqual(lensFeature(info(v1.EngineMode.COMPILED, [2, 0])), { available: true, layers: [0, 2] });
  assert.ok(reasonOf(lensFeature(info(v1.EngineMode.COMPILED))).includes("The logit lens needs module reads"));
});

test("moduleFeature on compiled servers: the lens on the readable layers, steering on those it also writes", () => {
  // --compiled-reads 2,0 (as listed, in any order): the lens reads those, ascending, and only those
  const reads = info(v1.EngineMode.COMPILED, [2, 0]);
  assert.deepEqual(moduleFeature("The logit lens", reads), { available: true, layers: [0, 2] });
  assert.deepEqual(readableLayers(reads), [0, 2]);
  assert.deepEqual(readableLayers(info(v1.EngineMode.EAGER, [1])), [0, 1, 2, 3]);
  // reads without writes: steering names the missing --compiled-steering and what is read
  const noWrites = reasonOf(moduleFeature("Steering", reads, true));
  assert.ok(noWrites.includes("reading layers 0, 2 (GetModelInfo readable_layers) and writing no layers"), noWrites);
  assert.ok(noWrites.includes("Start it with --compiled-steering (") && !noWrites.includes("with --compiled-reads"), noWrites);
  // writes without reads (--compiled-steering alone): the lens and steering name --compiled-reads
  const writesOnly = info(v1.EngineMode.COMPILED_STEERING, [], [1, 2]);
  assert.ok(reasonOf(moduleFeature("Steering", writesOnly, true)).includes("Start it with --compiled-reads ("));
  // both flags: steering offers the layers in both lists
  const graph = info(v1.EngineMode.COMPILED_STEERING, [0, 1, 2], [1, 2, 3]);
  assert.deepEqual(moduleFeature("Steering", graph, true), { available: true, layers: [1, 2] });
  assert.deepEqual(moduleFeature("The logit lens", graph), { available: true, layers: [0, 1, 2] });
  // both, but no layer in common
  const apart = reasonOf(moduleFeature("Steering", info(v1.EngineMode.COMPILED_STEERING, [0, 1], [2, 3]), true));
  assert.ok(apart.includes("needs a read and a write of the same layer"), apart);
  assert.ok(apart.includes("reading layers 0, 1") && apart.includes("writing layers 2, 3"), apart);
  assert.ok(apart.includes("Give --compiled-reads and --compiled-steering a common layer") && apart.includes("--enforce-eager"), apart);
});

test("lensColumns: [layers, positions, 1] logprobs and ids as one column per position, cells by layer", () => {
  // 2 layers x 3 prompt positions (step 0), top-1; values are logprobs
  const lens = {
    values: tensor([2, 3, 1], [Math.log(0.5), Math.log(0.25), 0, Math.log(0.1), Math.log(0.9), Math.log(0.3)]),
    tokenIds: tensor([2, 3, 1], [11, 12, 13, 21, 22, 23], Dtype.INT32),
    positions: tensor([3], [0, 1, 2], Dtype.INT32),
  };
  const columns = lensColumns(step({ [LENS]: lens }), [1, 3]);
  assert.deepEqual(columns.map((c) => c.position), [0, 1, 2]);
  assert.deepEqual(columns[1]?.cells.map((c) => [c.layer, c.position, c.tokenId]), [[1, 1, 12], [3, 1, 22]]);
  assert.ok(Math.abs((columns[1]?.cells[1]?.prob ?? 0) - 0.9) < 1e-6);
  assert.ok(Math.abs((columns[2]?.cells[0]?.prob ?? 0) - 1) < 1e-6);
  // a later step: the new token's position alone
  const later = lensColumns(step({ [LENS]: { ...lens, values: tensor([2, 1, 1], [-1, -2]), tokenIds: tensor([2, 1, 1], [5, 6], Dtype.INT32), positions: tensor([1], [3], Dtype.INT32) } }, 1), [1, 3]);
  assert.deepEqual(later.map((c) => c.cells.map((x) => [x.position, x.tokenId])), [[[3, 5], [3, 6]]]);
  assert.deepEqual(lensColumns(step({}), [0]), []);
  assert.throws(() => lensColumns(step({ [LENS]: lens }), [0, 1, 2]), /the lens has 2 layers, 3 were asked for/);
  assert.throws(() => lensColumns(step({ [LENS]: { values: lens.values } }), [1, 3]), /without token ids or positions/);
});

test("inputTokenAt: the prompt's tokens, then the token drawn at step s for position promptLength + s", () => {
  assert.equal(inputTokenAt(1, [10, 11, 12], [20, 21]), 11);
  assert.equal(inputTokenAt(3, [10, 11, 12], [20, 21]), 20);
  assert.equal(inputTokenAt(4, [10, 11, 12], [20, 21]), 21);
  assert.equal(inputTokenAt(5, [10, 11, 12], [20, 21]), undefined);
  assert.deepEqual(allLayers(4), [0, 1, 2, 3]);
});

test("the lens read and the vector reads: what the trace asks the server", () => {
  const request = traceRequest(withLens(invoke("p"), [0, 2]));
  const lens = request.invokes[0]?.interventions[0]?.action;
  assert.equal(lens?.case, "readLogitLens");
  assert.ok(lens?.case === "readLogitLens" && lens.value.topK === 1 && lens.value.positions?.kind.case === "all");
  assert.deepEqual(lens?.case === "readLogitLens" ? lens.value.layers : [], [0, 2]);

  const reads = traceRequest(vectorInvokes(2, "A", "B"));
  assert.deepEqual(reads.invokes.map((i) => i.prompt?.kind.value), ["A", "B"]);
  for (const inv of reads.invokes) {
    const action = inv.interventions[0]?.action;
    assert.ok(action?.case === "readModule");
    assert.equal(action.value.module, "layers.2");
    assert.equal(action.value.positions?.kind.case, "allPrompt");
    assert.equal(action.value.reduction, v1.Reduction.MEAN);
  }

  const compare = traceRequest(steeringInvokes("P", 1, [1, 2], 4));
  assert.equal(compare.invokes.length, 2);
  assert.equal(compare.invokes[0]?.interventions.length, 0);
  const steer = compare.invokes[1]?.interventions[0]?.action;
  assert.ok(steer?.case === "writeModule" && steer.value.module === "layers.1" && steer.value.scale === 4);
  assert.equal(steer.value.positions?.kind.case, "newToken");
});

test("steeringVector: A's mean residual minus B's; norm; sides by invoke", () => {
  const residual = (data: number[]) => ({ [RESIDUAL]: { values: tensor([3], data) } });
  const vector = steeringVector([step(residual([1, 2, 3]), 0, 0), step(residual([0.5, 2, 5]), 0, 1)]);
  assert.deepEqual(Array.from(vector), [0.5, 0, -2]);
  assert.ok(Math.abs(norm(vector) - Math.sqrt(4.25)) < 1e-6);
  assert.throws(() => steeringVector([step(residual([1]), 0, 0)]), /prompt B came without its "residual" read/);
  assert.throws(() => steeringVector([step(residual([1]), 0, 0), step(residual([1, 2]), 0, 1)]), /differ in width: 1 vs 2/);
  assert.equal(sideOf(step({}, 0, 0)), "plain");
  assert.equal(sideOf(step({}, 0, 1)), "steered");
  assert.throws(() => sideOf(step({}, 0, 2)), /invoke 2/);
});

test("lensColors: deeper blue with probability, white text on the dark end", () => {
  assert.deepEqual(lensColors(0), { background: "hsl(212 70% 97%)", text: "#1d232b" });
  assert.deepEqual(lensColors(1), { background: "hsl(212 70% 35%)", text: "#ffffff" });
  assert.deepEqual(lensColors(0.5), { background: "hsl(212 70% 66%)", text: "#1d232b" });
  assert.deepEqual(lensColors(Number.NaN), lensColors(0));
  assert.deepEqual(lensColors(2), lensColors(1));
});
