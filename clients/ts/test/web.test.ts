/**
 * createWebClient (connect-web, fetch) against the real server's HTTP port, in both of its
 * protocols: what a browser does, run from Node (whose fetch is HTTP/1.1, like a page's).
 */

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import {
  Code,
  TracewireError,
  createNodeClient,
  createWebClient,
  invoke,
  read,
  type TracewireClient,
  type WebProtocol,
} from "../src/node.js";

const GRPC_URL = process.env.TRACEWIRE_TEST_URL;
const HTTP_URL = process.env.TRACEWIRE_TEST_HTTP_URL;
const FRANCE = "The capital of France is";
const PARIS = 806;

let grpc: TracewireClient;

before(() => {
  assert.ok(GRPC_URL && HTTP_URL, "run the tests with `node dist/test/run.js` (make test-ts)");
  grpc = createNodeClient(GRPC_URL, { timeoutMs: 300_000 });
});

after(() => grpc?.close());

const variants: [string, WebProtocol, boolean][] = [
  ["gRPC-Web", "grpc-web", false],
  ["Connect, binary", "connect", false],
  ["Connect, JSON", "connect", true],
];

for (const [label, protocol, useJson] of variants) {
  describe(`createWebClient over ${label}`, () => {
    const web = (): TracewireClient => createWebClient(HTTP_URL ?? "", { protocol, useJson, timeoutMs: 300_000 });

    test("greedy generation and tokenization", async () => {
      const client = web();
      const [out] = await client.generate(FRANCE, { temperature: 0, maxTokens: 8 });
      assert.equal(out?.outputs[0]?.tokenIds[0], PARIS);
      assert.match(out?.outputs[0]?.text ?? "", /^ Paris/);
      assert.deepEqual((await client.tokenize(" Paris", { addSpecialTokens: false })).tokenIds, [PARIS]);
    });

    test("a streamed trace gives the gRPC port's steps and values", async () => {
      const request = invoke(FRANCE).read("top", read.logits({ topK: 4 })).stop({ step: 2 });
      const sampling = { temperature: 0, maxTokens: 8 };
      const overHttp = await web().trace(request, sampling).collect();
      const overGrpc = await grpc.trace(request, sampling).collect();
      assert.equal(overHttp.steps.length, 3);
      assert.deepEqual(overHttp.outputs[0]?.outputs[0]?.tokenIds, overGrpc.outputs[0]?.outputs[0]?.tokenIds);
      for (const [i, step] of overHttp.steps.entries()) {
        const other = overGrpc.steps[i];
        assert.equal(step.tokenId, other?.tokenId);
        assert.deepEqual([...(step.values.top?.tokenIds?.data ?? [])], [...(other?.values.top?.tokenIds?.data ?? [])]);
        const a = step.values.top?.values.data as Float32Array;
        const b = other?.values.top?.values.data as Float32Array;
        assert.ok(a.every((v, j) => Math.abs(v - (b[j] ?? NaN)) <= 1e-4 * (1 + Math.abs(v))), `step ${i}: ${a} vs ${b}`);
      }
      assert.equal(overHttp.steps.at(-1)?.stopped, true);
    });

    test("bad input is INVALID_ARGUMENT naming the field", async () => {
      const error = await web()
        .generate([], { maxTokens: 2 })
        .then(
          () => assert.fail("no prompts must be refused"),
          (e: unknown) => e,
        );
      assert.ok(error instanceof TracewireError);
      assert.equal(error.code, Code.InvalidArgument);
      assert.equal(error.field, "prompts");
      const traced = await web()
        .trace(invoke(FRANCE).read("top", read.logits({ topK: 0 })), { maxTokens: 2 })
        .result()
        .then(
          () => assert.fail("a top-k of 0 must be refused"),
          (e: unknown) => e,
        );
      assert.ok(traced instanceof TracewireError);
      assert.equal(traced.code, Code.InvalidArgument);
      assert.match(traced.field ?? "", /^invokes\[0\]\.interventions\[0\]/);
    });
  });
}
