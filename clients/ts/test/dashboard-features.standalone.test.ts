/**
 * The dashboard's feature strip logic (examples/dashboard/src/model.ts: stripChoices,
 * stripDictionary, withFeatures, featureStrip): pure, on dictionaries and steps shaped as
 * the server sends them. No server (dashboard.test.ts shows the strip end to end).
 */

import assert from "node:assert/strict";
import { test } from "node:test";
import { create, toJson } from "@bufbuild/protobuf";
import {
  FEATURE_TOP_K,
  FEATURES,
  featureStrip,
  stripChoices,
  stripDictionary,
  stripUnavailable,
  withFeatures,
} from "../examples/dashboard/src/model.js";
import { DictionaryKind, invoke, traceRequest, v1, type Dictionary, type ReadResult, type Step } from "../src/index.js";

function dictionary(name: string, kind: DictionaryKind, size: number, labels: string[] = []): Dictionary {
  return create(v1.DictionarySchema, { name, size, spec: { kind, module: "layers.2", labels } });
}

const PROBE = dictionary("refusal", DictionaryKind.PROBE, 2);
const SAE = dictionary("res-l2", DictionaryKind.SAE, 8, ["zero", "one", "two", "three", "", "five", "six", "seven"]);
const SMALL = dictionary("tiny-sae", DictionaryKind.SAE, 3);

function step(values: Record<string, ReadResult>): Step {
  return { invokeIndex: 0, sequenceIndex: 0, step: 2, tokenId: 7, text: "x", stopped: false, values, engineTime: undefined };
}

/** GetModelInfo's fields stripChoices reads, for a 4-layer model. */
function info(engineMode: v1.EngineMode, readableLayers: number[] = []) {
  return { engineMode, numLayers: 4, readableLayers, steerableLayers: [], stageFirstLayers: [0] };
}

test("the strip offers the server's SAEs it can read, in its order: eager, or on a compiled server's readable layers", () => {
  const EMBED = create(v1.DictionarySchema, { name: "emb-sae", size: 4, spec: { kind: DictionaryKind.SAE, module: "embed_tokens" } });
  const L1 = create(v1.DictionarySchema, { name: "res-l1", size: 4, spec: { kind: DictionaryKind.SAE, module: "layers.1" } });
  const listed = [PROBE, SAE, L1, SMALL, EMBED];
  const names = (choices: Dictionary[]) => choices.map((d) => d.name);
  assert.deepEqual(names(stripChoices(listed, info(v1.EngineMode.EAGER))), ["res-l2", "res-l1", "tiny-sae", "emb-sae"]);
  assert.deepEqual(stripChoices(listed, info(v1.EngineMode.COMPILED)), []);
  assert.deepEqual(stripChoices(listed, info(v1.EngineMode.COMPILED_STEERING)), []);
  // --compiled-reads 0,2: the SAEs on layers.2, not layers.1's, nor embed_tokens' (never readable compiled)
  assert.deepEqual(names(stripChoices(listed, info(v1.EngineMode.COMPILED, [0, 2]))), ["res-l2", "tiny-sae"]);
  assert.deepEqual(names(stripChoices(listed, info(v1.EngineMode.COMPILED_STEERING, [1]))), ["res-l1"]);
  assert.deepEqual(stripChoices([PROBE], info(v1.EngineMode.EAGER)), []);
  const choices = stripChoices(listed, info(v1.EngineMode.EAGER));
  assert.equal(stripDictionary(choices)?.name, "res-l2");
  assert.equal(stripDictionary(choices, "tiny-sae")?.name, "tiny-sae");
  assert.equal(stripDictionary(choices, "gone")?.name, "res-l2");
  assert.equal(stripDictionary([], "res-l2"), undefined);
});

test("stripUnavailable: SAEs the server lists but cannot read are named, with the flags that would serve them", () => {
  const L1 = create(v1.DictionarySchema, { name: "res-l1", size: 4, spec: { kind: DictionaryKind.SAE, module: "layers.1" } });
  assert.equal(
    stripUnavailable([PROBE, SAE, L1], info(v1.EngineMode.COMPILED)),
    "The feature strip needs a read of layers.2, layers.1 (where the SAEs res-l2, res-l1 read); this server is COMPILED, " +
      "reading no layers (GetModelInfo readable_layers). Start it with --compiled-reads (make serve " +
      'ENGINE_ARGS="--compiled-reads") to keep compiled graphs, or --enforce-eager (make serve ENGINE_ARGS=--enforce-eager) for every module.',
  );
  assert.match(stripUnavailable([SAE], info(v1.EngineMode.COMPILED, [0, 1])) ?? "", /^The feature strip needs a read of layers\.2 \(where the SAE res-l2 reads\); this server is COMPILED, reading layers 0, 1 /);
  // one it can read: the strip shows; no SAE at all (a probe): nothing to miss
  assert.equal(stripUnavailable([SAE, L1], info(v1.EngineMode.COMPILED, [1])), undefined);
  assert.equal(stripUnavailable([SAE], info(v1.EngineMode.EAGER)), undefined);
  assert.equal(stripUnavailable([PROBE], info(v1.EngineMode.COMPILED)), undefined);
  assert.equal(stripUnavailable([], info(v1.EngineMode.COMPILED)), undefined);
});

test("withFeatures adds a top-k read of the dictionary (k at most its size), nothing without one", () => {
  const json = (dict: Dictionary | undefined) =>
    toJson(v1.TraceRequestSchema, traceRequest(withFeatures(invoke("hi"), dict))) as {
      invokes: { interventions?: unknown[] }[];
    };
  assert.deepEqual(json(SAE).invokes[0]?.interventions, [
    {
      name: FEATURES,
      steps: { all: {} },
      readDictionary: { dictionary: "res-l2", positions: { newToken: {} }, topK: { k: FEATURE_TOP_K } },
    },
  ]);
  assert.deepEqual(json(SMALL).invokes[0]?.interventions?.[0], {
    name: FEATURES,
    steps: { all: {} },
    readDictionary: { dictionary: "tiny-sae", positions: { newToken: {} }, topK: { k: 3 } },
  });
  assert.equal(json(undefined).invokes[0]?.interventions, undefined);
});

test("featureStrip: the step's active top features with their labels, largest first", () => {
  const top: ReadResult = {
    values: { dtype: v1.Dtype.FLOAT32, shape: [4], data: new Float32Array([2.5, 1.25, 0.5, 0]) },
    tokenIds: { dtype: v1.Dtype.INT32, shape: [4], data: new Int32Array([5, 4, 1, 3]) },
  };
  assert.deepEqual(featureStrip(step({ [FEATURES]: top }), SAE), [
    { feature: 5, value: 2.5, label: "five" },
    { feature: 4, value: 1.25, label: "#4" }, // an empty label: the id
    { feature: 1, value: 0.5, label: "one" },
  ]);
  assert.deepEqual(featureStrip(step({ [FEATURES]: top }), SMALL)?.map((c) => c.label), ["#5", "#4", "#1"]);
  assert.equal(featureStrip(step({}), SAE), undefined);
});
