/**
 * read.attention against the shared test server (run.ts starts it with --enforce-eager:
 * module hooks need it), checked against transformers'
 * output_attentions=True with eager attention on the same weights (a Python subprocess):
 * top-k at the new token every step and full rows at the prompt, GQA heads included.
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { after, before, test } from "node:test";
import { promisify } from "node:util";
import { Code, TracewireError, createNodeClient, invoke, read, type TracewireClient } from "../src/node.js";
import { PYTHON, REPO } from "./server.js";

const FRANCE = "The capital of France is";
const ATOL = 1e-5;
// transformers' weights of `layer` over the sequence argv[2] (JSON ids): [heads][T][T]
const HF_ATTENTIONS = `
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("models/tracewire-tiny", dtype=torch.float32, attn_implementation="eager")
with torch.no_grad():
    out = model(torch.tensor([json.loads(sys.argv[2])]), output_attentions=True)
print(json.dumps(out.attentions[int(sys.argv[1])][0].tolist()))
`;

let client: TracewireClient;

before(() => {
  const url = process.env.TRACEWIRE_TEST_URL;
  assert.ok(url, "run the tests with `node dist/test/run.js` (make test-ts)");
  client = createNodeClient(url, { timeoutMs: 300_000 });
});

after(() => client?.close());

async function hfAttentions(layer: number, ids: readonly number[]): Promise<number[][][]> {
  const { stdout } = await promisify(execFile)(PYTHON, ["-c", HF_ATTENTIONS, String(layer), JSON.stringify(ids)], {
    cwd: REPO,
    maxBuffer: 64 << 20,
  });
  return JSON.parse(stdout) as number[][][];
}

function close(got: number, want: number, what: string): void {
  assert.ok(Math.abs(got - want) <= ATOL, `${what}: ${got} vs ${want}`);
}

test("read.attention: top-k of GQA heads at every new token, full rows at the prompt, as transformers", async () => {
  const request = invoke(FRANCE)
    .read("top", read.attention(1, { heads: [2, 1], topK: 3 }))
    .read("rows", read.attention([1], { positions: "prompt", topK: 0 }), { steps: 0 });
  const { steps, outputs } = await client.trace(request, { temperature: 0, maxTokens: 3, ignoreEos: true }).collect();
  const prompt = [...(outputs[0]?.promptTokenIds ?? [])];
  const drawn = [...(outputs[0]?.outputs[0]?.tokenIds ?? [])];
  const n = prompt.length;
  const ref = await hfAttentions(1, [...prompt, ...drawn.slice(0, -1)]);

  const rows = steps[0]?.values.rows;
  assert.ok(rows && rows.positions && !rows.tokenIds);
  assert.deepEqual(rows.values.shape, [1, n, 4, n]);
  assert.deepEqual([...rows.positions.data].map(Number), [...Array(n).keys()]);
  const full = rows.values.data as Float32Array;
  for (let p = 0; p < n; p++) {
    for (let h = 0; h < 4; h++) {
      for (let key = 0; key < n; key++) {
        close(full[(p * 4 + h) * n + key] ?? NaN, key <= p ? (ref[h]?.[p]?.[key] ?? NaN) : 0, `rows p${p} h${h} k${key}`);
      }
    }
  }

  assert.equal(steps.length, 3);
  steps.forEach((step, s) => {
    const top = step.values.top;
    const q = n - 1 + s;
    assert.ok(top && top.tokenIds && top.positions);
    assert.deepEqual(top.values.shape, [1, 1, 2, 3]);
    assert.deepEqual([...top.positions.data].map(Number), [q]);
    [2, 1].forEach((head, j) => {
      const row = (ref[head]?.[q] ?? []).slice(0, q + 1);
      const want = [...row.keys()].sort((a, b) => (row[b] ?? 0) - (row[a] ?? 0)).slice(0, 3);
      const keys = [...(top.tokenIds?.data ?? [])].slice(j * 3, j * 3 + 3).map(Number);
      const values = [...(top.values.data as Float32Array)].slice(j * 3, j * 3 + 3);
      assert.deepEqual(keys, want, `step ${s} head ${head}`);
      values.forEach((v, i) => close(v, row[want[i] ?? 0] ?? NaN, `step ${s} head ${head} #${i}`));
    });
  });
});

test("read.attention: a head the model lacks is INVALID_ARGUMENT naming the field", async () => {
  try {
    await client.trace(invoke(FRANCE).read("p", read.attention(0, { heads: [4] })), { maxTokens: 1 }).collect();
    assert.fail("accepted");
  } catch (error) {
    assert.ok(error instanceof TracewireError, String(error));
    assert.equal(error.code, Code.InvalidArgument);
    assert.match(error.message, /read_attention_pattern\.heads\[0\]/);
  }
});
