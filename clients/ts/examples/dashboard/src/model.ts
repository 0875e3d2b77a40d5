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

/* ---------------------------------------------------------------------------------------
 * The feature strip: per step, the top features of a dictionary (an SAE the server holds,
 * ListDictionaries) with their labels. Read at the new token like the candidates: step s's
 * features are those of the forward pass that drew step s's token (at the position before
 * it), so a row's features and its candidates come from the same pass.
 */

import { DictionaryKind, v1 as wire, type Dictionary } from "@tracewire/client";

/** The feature read's name in every step's values. */
export const FEATURES = "features";

/** How many features a step's strip shows at most (only active ones: value > 0). */
export const FEATURE_TOP_K = 5;

/**
 * The dictionaries the strip can show: the SAEs the server lists, in its order. None when
 * the server cannot run module reads (not eager: dictionary reads need module hooks).
 */
export function stripChoices(dictionaries: readonly Dictionary[], engineMode: wire.EngineMode): Dictionary[] {
  if (engineMode !== wire.EngineMode.EAGER) return [];
  return dictionaries.filter((d) => d.spec?.kind === DictionaryKind.SAE);
}

/** The dictionary to read: `chosen` when it is one of the choices, else the first (none: no strip). */
export function stripDictionary(choices: readonly Dictionary[], chosen?: string): Dictionary | undefined {
  return choices.find((d) => d.name === chosen) ?? choices[0];
}

/** The run's trace with the strip's read added (unchanged without a dictionary). */
export function withFeatures(builder: InvokeBuilder, dictionary: Dictionary | undefined, k = FEATURE_TOP_K): InvokeBuilder {
  if (!dictionary) return builder;
  return builder.read(FEATURES, read.dictionary(dictionary.name, { topK: Math.min(k, dictionary.size) }));
}

/** One feature of a step's strip. */
export interface FeatureChip {
  readonly feature: number;
  readonly value: number;
  /** The dictionary's label for it, else "#id". */
  readonly label: string;
}

/**
 * A step's strip: its top features with their labels, largest first, active ones only
 * (an SAE's top-k can include features at 0). Undefined when the step has no feature read.
 */
export function featureStrip(step: Step, dictionary: Dictionary): FeatureChip[] | undefined {
  const top = step.values[FEATURES];
  if (!top?.tokenIds) return undefined;
  const values = Array.from(top.values.data, Number);
  const ids = Array.from(top.tokenIds.data, Number);
  const labels = dictionary.spec?.labels ?? [];
  return ids
    .map((feature, i) => ({ feature, value: values[i] ?? 0, label: labels[feature] || `#${feature}` }))
    .filter((chip) => chip.value > 0);
}
