/**
 * What the dashboard asks for and what it keeps: pure functions, no DOM.
 *
 * A run reads, at every step, the drawn token's logprob and the top-k logprobs
 * (`read.logprobs(k)`: [1 + k] values, the drawn token first). Forcing token t at
 * step k re-runs the same prompt and sampling with the tokens of steps 0..k-1 forced
 * to what they were (so they stay identical even when sampling is not greedy) and
 * t forced at step k.
 *
 * The logprobs are read after the writes, so at a forced step they say only "forced:
 * probability 1". What the model thought there is the previous run's reading of that
 * step (same prefix, same distribution), so those steps keep the previous candidates.
 */

import { invoke, read, write, type InvokeBuilder, type Sampling, type Step } from "@tracewire/client";

/** The read's name in every step's values. */
export const TOP = "top";

export interface RunSettings {
  readonly prompt: string;
  readonly maxTokens: number;
  readonly topK: number;
  readonly temperature: number;
  /** Keep generating past the end-of-sequence token (up to maxTokens). */
  readonly ignoreEos: boolean;
}

/** Token ids forced at steps 0, 1, ... (empty: a plain run). */
export type Forced = readonly number[];

/** One token candidate at a step, with its probability (exp of the logprob). */
export interface Candidate {
  readonly tokenId: number;
  readonly prob: number;
}

/** A step as the view draws it. */
export interface StepView {
  readonly step: number;
  readonly tokenId: number;
  readonly text: string;
  /** The drawn (or forced) token's probability under the model, before any forcing (undefined: unknown). */
  readonly prob: number | undefined;
  /** The top-k candidates, most likely first. */
  readonly candidates: readonly Candidate[];
  /** The step the user forced (the last of the forced prefix). */
  readonly forced: boolean;
}

/** The trace for these settings, with `forced[i]` forced at step i. */
export function buildInvoke(settings: RunSettings, forced: Forced): InvokeBuilder {
  const builder = invoke(settings.prompt).read(TOP, read.logprobs(settings.topK));
  forced.forEach((tokenId, step) => builder.write(write.force(tokenId), { steps: step }));
  return builder;
}

export function sampling(settings: RunSettings): Sampling {
  return { temperature: settings.temperature, maxTokens: settings.maxTokens, ignoreEos: settings.ignoreEos };
}

/** The forces for "token t at step k", keeping the steps before k as they were. */
export function forceAt(previous: readonly StepView[], step: number, tokenId: number): Forced {
  const prefix = previous.filter((s) => s.step < step).sort((a, b) => a.step - b.step);
  return [...prefix.map((s) => s.tokenId), tokenId];
}

/**
 * A decoded step as the view draws it; `before` is the previous run's steps, whose
 * candidates the forced prefix keeps. Throws when the read is missing (a server bug).
 */
export function toStepView(step: Step, forced: Forced, before: readonly StepView[]): StepView {
  const isForced = step.step === forced.length - 1;
  const prior = step.step < forced.length ? before.find((s) => s.step === step.step) : undefined;
  if (prior) {
    const prob = prior.tokenId === step.tokenId ? prior.prob : prior.candidates.find((c) => c.tokenId === step.tokenId)?.prob;
    return { step: step.step, tokenId: step.tokenId, text: step.text, prob, candidates: prior.candidates, forced: isForced };
  }
  const top = step.values[TOP];
  if (!top?.tokenIds) {
    throw new Error(`step ${step.step} came without its "${TOP}" read`);
  }
  const logprobs = Array.from(top.values.data, Number);
  const ids = Array.from(top.tokenIds.data, Number);
  const candidates = ids.slice(1).map((tokenId, i) => ({ tokenId, prob: Math.exp(logprobs[i + 1] ?? -Infinity) }));
  return {
    step: step.step,
    tokenId: step.tokenId,
    text: step.text,
    prob: Math.exp(logprobs[0] ?? -Infinity),
    candidates,
    forced: isForced,
  };
}
