/**
 * The client against a real server (started by run.ts; TRACEWIRE_TEST_URL), real engine,
 * the embedded tracewire-tiny model in float32.
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { promisify } from "node:util";
import {
  Code,
  Dtype,
  TracewireError,
  createNodeClient,
  invoke,
  read,
  textContains,
  traceRequest,
  v1,
  write,
  type Step,
  type TracewireClient,
} from "../src/node.js";
import { PYTHON, REPO } from "./server.js";

const URL = process.env.TRACEWIRE_TEST_URL;
const FRANCE = "The capital of France is";
const PARIS = 806; // " Paris" in tracewire-tiny's tokenizer

let client: TracewireClient;
let berlin: number;

before(async () => {
  assert.ok(URL, "TRACEWIRE_TEST_URL is unset: run the tests with `node dist/test/run.js` (make test-ts)");
  client = createNodeClient(URL, { timeoutMs: 300_000 });
  [berlin] = (await client.tokenize(" Berlin", { addSpecialTokens: false })).tokenIds as [number];
});

after(() => client?.close());

test("model info describes the served model", async () => {
  const info = await client.modelInfo();
  assert.equal(info.vocabSize, 2048);
  assert.equal(info.dtype, "float32");
  assert.equal(info.numLayers, 4);
  assert.equal(info.hiddenSize, 256);
  assert.ok(info.modules.some((m) => m.path === "layers.3" && m.kind === "decoder_layer"));
  // run.ts starts it eager: every module intervention
  assert.equal(info.engineMode, v1.EngineMode.EAGER);
  assert.deepEqual(info.steerableLayers, []);
});

test("greedy generation: the capital of France is Paris", async () => {
  const [out] = await client.generate(FRANCE, { temperature: 0, maxTokens: 8 });
  const seq = out?.outputs[0];
  assert.ok(seq);
  assert.equal(seq.tokenIds[0], PARIS);
  assert.match(seq.text, /^ Paris/);
  assert.equal(out?.prompt, FRANCE);
  assert.ok((out?.promptTokenIds.length ?? 0) > 0);
});

test("several prompts, text and token ids, in order", async () => {
  const { tokenIds } = await client.tokenize(FRANCE);
  const outputs = await client.generate([FRANCE, tokenIds], { temperature: 0, maxTokens: 4 });
  assert.equal(outputs.length, 2);
  assert.deepEqual(outputs[1]?.promptTokenIds, tokenIds);
  assert.deepEqual(outputs[1]?.outputs[0]?.tokenIds, outputs[0]?.outputs[0]?.tokenIds);
});

test("streamed generation adds up to the unary result", async () => {
  const sampling = { temperature: 0, maxTokens: 8, ignoreEos: true };
  const [unary] = await client.generate(FRANCE, sampling);
  let text = "";
  const ids: number[] = [];
  let finished = false;
  for await (const update of client.generateStream(FRANCE, sampling)) {
    assert.equal(update.promptIndex, 0);
    text += update.output?.outputs[0]?.text ?? "";
    ids.push(...(update.output?.outputs[0]?.tokenIds ?? []));
    finished ||= update.output?.finished ?? false;
  }
  assert.ok(finished);
  assert.equal(text, unary?.outputs[0]?.text);
  assert.deepEqual(ids, unary?.outputs[0]?.tokenIds);
});

test("tokenize / detokenize round trip", async () => {
  const text = "Once upon a time, the capital of France was Paris.";
  const { tokenIds, tokens } = await client.tokenize(text, { addSpecialTokens: false });
  assert.equal(tokens.length, tokenIds.length);
  assert.equal(tokens.join(""), text);
  assert.equal(await client.detokenize(tokenIds), text);
  assert.deepEqual((await client.tokenize(" Paris", { addSpecialTokens: false })).tokenIds, [PARIS]);
});

test("a trace's top-k and full logits match the Python SDK's", async () => {
  const steps = 4;
  const k = 5;
  const python = await pythonReference(FRANCE, steps, k);
  const run = client.trace(
    invoke(FRANCE).read("top", read.logits({ topK: k })).read("raw", read.logits({ stage: "raw" })),
    { temperature: 0, maxTokens: steps, ignoreEos: true },
  );
  const seen: Step[] = [];
  for await (const step of run) {
    seen.push(step);
  }
  const { outputs, warnings, usage } = await run.result();
  assert.deepEqual(warnings, []);
  assert.equal(Number(usage?.generatedTokens), steps);
  assert.deepEqual(outputs[0]?.outputs[0]?.tokenIds, python.token_ids);
  assert.deepEqual(seen.map((s) => s.step), [0, 1, 2, 3]);
  for (const [i, step] of seen.entries()) {
    const top = step.values.top;
    const raw = step.values.raw;
    assert.ok(top?.tokenIds && raw, `step ${i} has both reads`);
    assert.ok(top.values.data instanceof Float32Array && raw.values.data instanceof Float32Array);
    assert.deepEqual(top.values.shape, [k]);
    assert.deepEqual(raw.values.shape, [2048]);
    assert.deepEqual(numbers(top.tokenIds.data), python.top_ids[i]);
    assertClose(top.values.data, python.top_values[i] ?? [], `top-k values at step ${i}`);
    assertClose(raw.values.data, python.raw[i] ?? [], `raw logits at step ${i}`);
    // Greedy: the drawn token is the argmax, which leads the top-k.
    assert.equal(step.tokenId, python.token_ids[i]);
    assert.equal(numbers(top.tokenIds.data)[0], step.tokenId);
  }
});

test("sample and logprobs reads: the drawn token, its logprob first", async () => {
  const { steps } = await client
    .trace(invoke(FRANCE).read("drawn", read.sample()).read("lp", read.logprobs(3), { steps: [0, 1] }), {
      temperature: 0,
      maxTokens: 3,
    })
    .collect();
  assert.equal(steps.length, 3);
  for (const step of steps) {
    const drawn = step.values.drawn;
    assert.ok(drawn);
    assert.deepEqual(drawn.values.shape, []);
    assert.equal(Number(drawn.values.data[0]), step.tokenId);
  }
  assert.equal(steps[2]?.values.lp, undefined, "logprobs only at steps 0 and 1");
  const lp = steps[0]?.values.lp;
  assert.ok(lp?.tokenIds);
  assert.deepEqual(lp.values.shape, [4]);
  assert.equal(numbers(lp.tokenIds.data)[0], PARIS);
  assert.equal(numbers(lp.tokenIds.data)[1], PARIS, "greedy: the drawn token is also the most likely");
  const values = [...(lp.values.data as Float32Array)];
  assert.ok(values.every((v) => v <= 0));
  assert.ok((values[1] ?? 0) >= (values[2] ?? 0) && (values[2] ?? 0) >= (values[3] ?? 0));
});

test("a forced token changes the continuation", async () => {
  const sampling = { temperature: 0, maxTokens: 6, ignoreEos: true };
  const [plain] = await client.generate(FRANCE, sampling);
  const { steps, outputs } = await client.trace(invoke(FRANCE).write(write.force(berlin), { steps: 0 }), sampling).collect();
  const forced = outputs[0]?.outputs[0];
  assert.equal(steps[0]?.tokenId, berlin);
  assert.equal(forced?.tokenIds[0], berlin);
  assert.match(forced?.text ?? "", /^ Berlin/);
  assert.notDeepEqual(forced?.tokenIds, plain?.outputs[0]?.tokenIds);
  // The engine continued from " Berlin": the same as generating after it.
  const { tokenIds } = await client.tokenize(FRANCE);
  const [after] = await client.generate([...tokenIds, berlin], { ...sampling, maxTokens: 5 });
  assert.deepEqual(forced?.tokenIds.slice(1), after?.outputs[0]?.tokenIds);
});

test("a forced token: the before_writes stage still shows the model's row", async () => {
  const ids = [PARIS, berlin];
  const { steps } = await client
    .trace(
      invoke(FRANCE)
        .read("before", read.logits({ tokenIds: ids, stage: "before_writes" }), { steps: 0 })
        .read("raw", read.logits({ tokenIds: ids, stage: "raw" }), { steps: 0 })
        .read("processed", read.logits({ tokenIds: ids }), { steps: 0 })
        .write(write.force(berlin), { steps: 0 }),
      { temperature: 0, maxTokens: 1 },
    )
    .collect();
  const values = (name: string): number[] => [...(steps[0]?.values[name]?.values.data as Float32Array)];
  assert.deepEqual(values("processed"), [Number.NEGATIVE_INFINITY, 0]);
  assert.deepEqual(values("before"), values("raw")); // no vLLM processing asked for: the raw row
  const [paris, berlinLogit] = values("before") as [number, number];
  assert.ok(paris > berlinLogit, "greedy would draw Paris without the force");
  assert.throws(() => read.logits({ stage: "cooked" as "raw" }), TracewireError);
});

test("a bias write makes a token the greedy choice", async () => {
  const { outputs } = await client
    .trace(invoke(FRANCE).write(write.bias({ [berlin]: 100 }), { steps: 0 }), { temperature: 0, maxTokens: 2 })
    .collect();
  assert.equal(outputs[0]?.outputs[0]?.tokenIds[0], berlin);
});

test("a stop at step 2 returns exactly 3 tokens", async () => {
  const { steps, outputs } = await client
    .trace(invoke(FRANCE).stop({ step: 2 }), { temperature: 0, maxTokens: 16, ignoreEos: true })
    .collect();
  const seq = outputs[0]?.outputs[0];
  assert.equal(seq?.tokenIds.length, 3);
  assert.equal(seq?.finishReason, v1.FinishReason.STOP);
  assert.deepEqual(steps.map((s) => [s.step, s.stopped]), [[0, false], [1, false], [2, true]]);
});

test("a stop on text and on a token", async () => {
  const sampling = { temperature: 0, maxTokens: 16, ignoreEos: true };
  const onText = await client.trace(invoke(FRANCE).stop({ text: "." }), sampling).result();
  assert.match(onText.outputs[0]?.outputs[0]?.text ?? "", /^ Paris\.$/);
  const onToken = await client.trace(invoke(FRANCE).stop({ token: PARIS }), sampling).result();
  assert.deepEqual(onToken.outputs[0]?.outputs[0]?.tokenIds, [PARIS]);
  const onCondition = await client
    .trace(invoke(FRANCE).stop({ when: textContains("Paris"), steps: { start: 0, stop: 4 } }), sampling)
    .result();
  assert.deepEqual(onCondition.outputs[0]?.outputs[0]?.tokenIds, [PARIS]);
});

test("several invokes with their own sampling and a warning for an unreached step", async () => {
  const request = traceRequest(
    [
      invoke(FRANCE).read("drawn", read.sample(), { steps: [0, 7] }),
      invoke("The capital of Japan is", { maxTokens: 2 }).read("drawn", read.sample()),
    ],
    { temperature: 0, maxTokens: 3, ignoreEos: true },
  );
  const { outputs, warnings, steps } = await client.trace(request).collect();
  assert.equal(outputs.length, 2);
  assert.equal(outputs[0]?.outputs[0]?.tokenIds.length, 3);
  assert.equal(outputs[1]?.outputs[0]?.tokenIds.length, 2);
  assert.equal(steps.filter((s) => s.invokeIndex === 1).length, 2);
  assert.ok(warnings.some((w) => w.invokeIndex === 0 && w.intervention === "drawn"), JSON.stringify(warnings));
});

test("bad input is INVALID_ARGUMENT naming the field", async () => {
  const run = client.trace(invoke(FRANCE).read("top", read.logits({ topK: 0 })), { maxTokens: 2 });
  const error = await run.result().then(
    () => assert.fail("a top-k of 0 must be refused"),
    (e: unknown) => e,
  );
  assert.ok(error instanceof TracewireError);
  assert.equal(error.code, Code.InvalidArgument);
  assert.equal(error.status, "INVALID_ARGUMENT");
  assert.match(error.field ?? "", /^invokes\[0\]\.interventions\[0\]/);

  const unary = await client.generate(FRANCE, { temperature: -1 }).then(
    () => assert.fail("a negative temperature must be refused"),
    (e: unknown) => e,
  );
  assert.ok(unary instanceof TracewireError);
  assert.equal(unary.code, Code.InvalidArgument);
  assert.match(unary.field ?? "", /temperature/);
});

test("leaving a trace early cancels it on the server", async () => {
  const run = client.trace(invoke(FRANCE).read("drawn", read.sample()), { maxTokens: 400, ignoreEos: true });
  let seen = 0;
  for await (const step of run) {
    seen = step.step + 1;
    if (seen === 2) break;
  }
  assert.equal(seen, 2);
  await assert.rejects(run.result(), (e: unknown) => e instanceof TracewireError && e.code === Code.Canceled);
  // The engine request is aborted rather than generating 400 tokens for nobody.
  const deadline = Date.now() + 30_000;
  while ((await client.engineStats()).numUnfinishedRequests > 0) {
    assert.ok(Date.now() < deadline, "the cancelled trace is still in the engine");
    await new Promise((r) => setTimeout(r, 100));
  }
});

test("a trace past its deadline is DEADLINE_EXCEEDED", async () => {
  const run = client.trace(invoke(FRANCE), { maxTokens: 400, ignoreEos: true }, { timeoutMs: 50 });
  await assert.rejects(run.collect(), (e: unknown) => e instanceof TracewireError && e.code === Code.DeadlineExceeded);
});

test("a decoded sample read is an int64 scalar", async () => {
  const { steps } = await client.trace(invoke(FRANCE).read("drawn", read.sample()), { temperature: 0, maxTokens: 1 }).collect();
  const drawn = steps[0]?.values.drawn?.values;
  assert.ok(drawn);
  assert.ok([Dtype.INT64, Dtype.INT32].includes(drawn.dtype));
  assert.equal(Number(drawn.data[0]), PARIS);
});

interface PythonTrace {
  token_ids: number[];
  text: string;
  top_values: number[][];
  top_ids: number[][];
  raw: number[][];
}

/** The same trace through the Python SDK, in a subprocess. */
async function pythonReference(prompt: string, maxTokens: number, k: number): Promise<PythonTrace> {
  const script = join(REPO, "clients/ts/test/fixtures/python_reference.py");
  const target = new globalThis.URL(URL ?? "").host;
  const { stdout } = await promisify(execFile)(PYTHON, [script, target, prompt, String(maxTokens), String(k)], {
    maxBuffer: 64 << 20,
  });
  return JSON.parse(stdout) as PythonTrace;
}

function numbers(data: ArrayLike<number | bigint>): number[] {
  return Array.from(data, Number);
}

function assertClose(actual: Float32Array, expected: readonly number[], what: string): void {
  assert.equal(actual.length, expected.length, `${what}: length`);
  for (let i = 0; i < actual.length; i++) {
    const e = expected[i] as number;
    const a = actual[i] as number;
    assert.ok(Math.abs(a - e) <= 1e-4 + 1e-4 * Math.abs(e), `${what}[${i}]: ${a} vs ${e}`);
  }
}
