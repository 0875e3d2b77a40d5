/**
 * Unknown sampling keys are refused in the client, as the Python SDK, the CLI and the server
 * refuse them: protobuf-es's create() would drop them, and plain JavaScript's
 * `{ temprature: 0 }` would sample at the default temperature. No server: the check runs
 * before anything is sent (the client points at a port nothing listens on).
 */

import assert from "node:assert/strict";
import { test } from "node:test";
import { Code, TracewireError, invoke, samplingParams, traceRequest, type Sampling } from "../src/index.js";
import { createNodeClient } from "../src/node.js";

// What plain JavaScript may pass: the type system does not see it.
const typo = { temprature: 0, maxTokens: 4 } as unknown as Sampling;

function refusedNaming(field: string, hint: string): (e: unknown) => boolean {
  return (e: unknown) => {
    assert.ok(e instanceof TracewireError, String(e));
    assert.equal(e.code, Code.InvalidArgument);
    assert.equal(e.status, "INVALID_ARGUMENT");
    assert.equal(e.field, field);
    assert.match(e.message, new RegExp(`unknown sampling parameter "${field}"\\. Did you mean "${hint}"\\?`));
    assert.match(e.message, /Valid ones: .*maxTokens/);
    return true;
  };
}

test("samplingParams, invoke and traceRequest refuse an unknown key naming it", () => {
  assert.throws(() => samplingParams(typo), refusedNaming("temprature", "temperature"));
  assert.throws(() => invoke("Hi", typo), refusedNaming("temprature", "temperature"));
  assert.throws(() => traceRequest(invoke("Hi"), typo), refusedNaming("temprature", "temperature"));
  assert.throws(() => samplingParams({ maxToken: 3 } as unknown as Sampling), refusedNaming("maxToken", "maxTokens"));
});

test("known keys and SamplingParams messages pass unchanged", () => {
  const message = samplingParams({ temperature: 0, maxTokens: 4, seed: 7n });
  assert.equal(message.temperature, 0);
  assert.equal(message.maxTokens, 4);
  assert.equal(samplingParams(message).seed, 7n);
  assert.equal(traceRequest(invoke("Hi", { topK: 5 }), message).invokes[0]?.samplingParams?.topK, 5);
});

test("the client's generate and trace refuse before they connect", async () => {
  const client = createNodeClient("127.0.0.1:9");
  try {
    await assert.rejects(client.generate("Hi", typo), refusedNaming("temprature", "temperature"));
    assert.throws(() => client.trace([invoke("Hi")], typo), refusedNaming("temprature", "temperature"));
  } finally {
    client.close();
  }
});
