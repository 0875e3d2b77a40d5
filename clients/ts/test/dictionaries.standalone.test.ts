/**
 * Dictionaries (linear probes, SAEs) through the TS builder: read.dictionary,
 * write.dictionary and the dictionary_value conditions build exactly the messages the
 * contract means (intervention.proto's ReadDictionary, WriteDictionary,
 * DictionaryThreshold), compared as protobuf JSON; bad arguments are refused before
 * sending. No server (dictionaries.test.ts runs them against one).
 */

import assert from "node:assert/strict";
import { test } from "node:test";
import { create, toJson } from "@bufbuild/protobuf";
import {
  Code,
  TracewireError,
  anyOf,
  dictionaryValue,
  featureActive,
  invoke,
  not,
  probeAbove,
  probeBelow,
  read,
  rowReads,
  toStep,
  traceRequest,
  write,
  v1,
} from "../src/index.js";
import { float32Tensor } from "../src/tensors.js";

function interventions(builder: ReturnType<typeof invoke>): unknown[] {
  const request = traceRequest(builder, { maxTokens: 4 });
  return (toJson(v1.TraceRequestSchema, request) as { invokes: { interventions: unknown[] }[] }).invokes[0]!.interventions;
}

const EVERY = { all: {} };
const NEW = { newToken: {} };

test("read.dictionary: every value, topK, features, reconstruction error, at the module's positions", () => {
  const got = interventions(
    invoke("The capital of France is")
      .read("p", read.dictionary("refusal"))
      .read("top", read.dictionary("res-l3", { module: "layers.3", topK: 20 }))
      .read("ids", read.dictionary("res-l3", { features: [1, 2] }))
      .read("err", read.dictionary("res-l1", { positions: [-2, -1], reconstructionError: true }), { steps: 0 })
      .read("all", read.dictionary("res-l2", { positions: "all", features: 7 })),
  );
  assert.deepEqual(got, [
    { name: "p", steps: EVERY, readDictionary: { dictionary: "refusal", positions: NEW } },
    { name: "top", steps: EVERY, readDictionary: { dictionary: "res-l3", module: "layers.3", positions: NEW, topK: { k: 20 } } },
    { name: "ids", steps: EVERY, readDictionary: { dictionary: "res-l3", positions: NEW, features: { ids: [1, 2] } } },
    {
      name: "err",
      steps: { list: { steps: [0] } },
      readDictionary: { dictionary: "res-l1", positions: { promptList: { positions: [-2, -1] } }, reconstructionError: {} },
    },
    { name: "all", steps: EVERY, readDictionary: { dictionary: "res-l2", positions: { all: {} }, features: { ids: [7] } } },
  ]);
});

test("write.dictionary: steer, clamp, ablate under a dictionary condition; stops on a probe", () => {
  const got = interventions(
    invoke("The capital of France is")
      .write(write.dictionary("res-l3", 1234, { steer: 4 }))
      .write(write.dictionary("res-l3", [5, 7], { clamp: 2.5, module: "layers.3" }), { steps: { start: 1, stop: 3 } })
      .write(write.dictionary("res-l3", 9, { ablate: true, positions: [4] }), { when: featureActive("res-l3", 9) })
      .write(write.dictionary("refusal", 1, { steer: -3 }))
      .stop({ when: anyOf(probeAbove("refusal", 0.9), not(probeBelow("refusal", 0.25, 2))) }),
  );
  const threshold = (dictionary: string, feature: number, comparison: string, value: number) => ({
    dictionaryValue: { dictionary, ...(feature ? { feature } : {}), threshold: { comparison, ...(value ? { value } : {}) } },
  });
  assert.deepEqual(got, [
    { steps: EVERY, writeDictionary: { dictionary: "res-l3", positions: NEW, features: [1234], steer: 4 } },
    {
      steps: { range: { start: 1, stop: 3 } },
      writeDictionary: { dictionary: "res-l3", module: "layers.3", positions: NEW, features: [5, 7], clamp: 2.5 },
    },
    {
      steps: EVERY,
      condition: threshold("res-l3", 9, "COMPARISON_GREATER", 0),
      writeDictionary: { dictionary: "res-l3", positions: { promptList: { positions: [4] } }, features: [9], ablate: {} },
    },
    { steps: EVERY, writeDictionary: { dictionary: "refusal", positions: NEW, features: [1], steer: -3 } },
    {
      steps: EVERY,
      condition: {
        anyOf: {
          conditions: [
            threshold("refusal", 0, "COMPARISON_GREATER", 0.9),
            { not: threshold("refusal", 2, "COMPARISON_LESS", 0.25) },
          ],
        },
      },
      stop: {},
    },
  ]);
  assert.deepEqual(
    toJson(v1.ConditionSchema, dictionaryValue("res-l3", 3, "<=", -1)),
    threshold("res-l3", 3, "COMPARISON_LESS_EQUAL", -1),
  );
});

test("bad dictionary arguments are refused before sending", () => {
  const refused = (build: () => unknown, message: RegExp): void => {
    assert.throws(build, (e: unknown) => e instanceof TracewireError && e.code === Code.InvalidArgument && message.test(e.message));
  };
  refused(() => read.dictionary("res", { topK: 3, features: [1] }), /one of topK, features, reconstructionError/);
  refused(() => read.dictionary("res", { features: [] }), /features must be integer ids/);
  refused(() => read.dictionary("res", { features: [1, 1] }), /without duplicates/);
  refused(() => write.dictionary("res", 1.5, { steer: 1 }), /features must be integer ids/);
  refused(() => write.dictionary("res", 1, {}), /exactly one of steer, clamp, ablate/);
  refused(() => write.dictionary("res", 1, { steer: 1, ablate: true }), /exactly one of steer, clamp, ablate/);
  refused(() => write.dictionary("res", 1, { clamp: Number.NaN }), /clamp must be finite/);
});

test("dictionary reads over prompt positions decode as rows at every step", () => {
  const request = traceRequest(
    invoke("x")
      .read("new", read.dictionary("p"))
      .read("all", read.dictionary("p", { positions: "all" }))
      .read("top", read.dictionary("sae", { positions: "all", topK: 1 })),
  );
  const rows = rowReads(request).get(0);
  assert.deepEqual([...(rows ?? [])].sort(), ["all", "top"]);
  const value = (values: number[], shape: number[], ids?: number[]) =>
    create(v1.ReadValueSchema, {
      values: float32Tensor(values, shape),
      ...(ids
        ? { tokenIds: { dtype: v1.Dtype.INT32, shape: shape.map(BigInt), data: new Uint8Array(new Int32Array(ids).buffer) } }
        : {}),
    });
  const step1 = toStep(
    create(v1.StepResultSchema, {
      step: 1,
      values: { new: value([0.5, 0.25], [2]), all: value([0.5, 0.25], [2]), top: value([3], [1], [9]) },
    }),
    rows,
  );
  assert.deepEqual(step1.values.new?.values.shape, [2]);
  assert.deepEqual(step1.values.all?.values.shape, [1, 2]);
  assert.deepEqual(step1.values.top?.tokenIds?.shape, [1, 1]);
  assert.deepEqual(Array.from(step1.values.top?.tokenIds?.data as Int32Array), [9]);
});
