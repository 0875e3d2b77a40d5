/**
 * The dashboard's pure formatting (examples/dashboard/src/format.ts): probabilities, token
 * labels, and server field paths mapped to the form's controls. No server: the paths are the
 * ones the server writes (dashboard.test.ts checks one end to end).
 */

import assert from "node:assert/strict";
import { test } from "node:test";
import {
  controlForField,
  controlMessage,
  formatProb,
  tokenLabel,
  type SpecialTokens,
} from "../examples/dashboard/src/format.js";

test("formatProb: percent down to 0.1%, scientific below (never 0.00%)", () => {
  assert.equal(formatProb(0.4213), "42.1%");
  assert.equal(formatProb(1), "100.0%");
  assert.equal(formatProb(0.0532), "5.32%");
  assert.equal(formatProb(0.001), "0.10%");
  assert.equal(formatProb(3.1e-4), "3.1e-4");
  assert.equal(formatProb(0.0000123), "1.2e-5");
  assert.equal(formatProb(0), "0");
  assert.equal(formatProb(Number.NaN), "?");
  for (const p of [1e-3, 4.9e-5, 2e-9]) {
    assert.notEqual(formatProb(p), "0.00%");
  }
});

const SPECIALS: SpecialTokens = { eos: [2], bos: 1 };

test("tokenLabel: quoted text, named EOS / BOS, empty tokens by id", () => {
  assert.deepEqual(tokenLabel(" Paris", 806, SPECIALS), { text: '" Paris"', special: false });
  assert.deepEqual(tokenLabel("\n", 13, SPECIALS), { text: '"\\n"', special: false });
  assert.deepEqual(tokenLabel("", 2, SPECIALS), { text: "⟨EOS⟩", special: true });
  assert.deepEqual(tokenLabel("</s>", 2, SPECIALS), { text: "⟨EOS </s>⟩", special: true });
  assert.deepEqual(tokenLabel("<s>", 1, SPECIALS), { text: "⟨BOS <s>⟩", special: true });
  assert.deepEqual(tokenLabel("", 0, SPECIALS), { text: "⟨#0⟩", special: true });
  // A long token is kept whole: cutting it is the CSS's business, and the CSS wraps.
  assert.equal(tokenLabel(" Brussels-Capital", 9, SPECIALS).text, '" Brussels-Capital"');
});

test("controlForField: the server's field paths -> the form's controls", () => {
  assert.equal(controlForField("invokes[0].interventions[0].read_logprobs.top_k"), "top-k");
  assert.equal(controlForField("sampling_params.max_tokens"), "max-tokens");
  assert.equal(controlForField("invokes[0].sampling_params.max_tokens"), "max-tokens");
  assert.equal(controlForField("sampling_params.temperature"), "temperature");
  assert.equal(controlForField("sampling_params.ignore_eos"), "ignore-eos");
  assert.equal(controlForField("invokes[0].prompt.text"), "prompt");
  assert.equal(controlForField("invokes[0].prompt"), "prompt");
  // Fields the form does not set: the banner alone.
  assert.equal(controlForField("invokes[0].interventions[1].write_force.token_id"), undefined);
  assert.equal(controlForField("sampling_params.top_k"), undefined);
  assert.equal(controlForField(undefined), undefined);
  assert.equal(controlForField(""), undefined);
});

test("controlMessage: the control's name and the server's reason, without the path", () => {
  const field = "invokes[0].interventions[0].read_logprobs.top_k";
  assert.equal(
    controlMessage("top-k", field, `${field}: must be in [0, 32000] (the vocabulary), got 100000`),
    "top-k: must be in [0, 32000] (the vocabulary), got 100000",
  );
  assert.equal(controlMessage("max-tokens", "sampling_params.max_tokens", "must be >= 1, got 0"), "max tokens: must be >= 1, got 0");
});
