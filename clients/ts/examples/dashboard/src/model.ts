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

import {
  DictionaryKind,
  invoke,
  read,
  v1,
  write,
  type Dictionary,
  type InvokeBuilder,
  type Sampling,
  type Step,
} from "@tracewire/client";

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
 * Module interventions: the logit lens and steering. An eager server reads and writes every
 * module; a compiled one reads the decoder layers it keeps read buffers on (--compiled-reads:
 * GetModelInfo readable_layers) and writes those it has steering tables on
 * (--compiled-steering: steerable_layers), and refuses the rest with FAILED_PRECONDITION. The
 * views offer only what the server serves; where that is nothing, the page says why instead.
 */

/** Whether a feature can run on this server; when not, the sentence the page shows instead. */
export type Availability = { readonly available: true } | { readonly available: false; readonly reason: string };

/** A feature on decoder layers: the layers it can use on this server, or why it cannot run. */
export type LayerFeature =
  | { readonly available: true; readonly layers: readonly number[] }
  | { readonly available: false; readonly reason: string };

/** What GetModelInfo says about module reads and writes (its response has these fields). */
export interface ModuleAccess {
  readonly engineMode: v1.EngineMode;
  readonly numLayers: number;
  /** Decoder layers a compiled engine reads (--compiled-reads); empty on an eager one. */
  readonly readableLayers: readonly number[];
  /** Decoder layers a compiled engine writes (--compiled-steering); empty on an eager one. */
  readonly steerableLayers: readonly number[];
  /** Each pipeline stage's first decoder layer ([0] without stages; empty from an older server). */
  readonly stageFirstLayers: readonly number[];
}

/** Every decoder layer, 0 .. numLayers - 1. */
export function allLayers(numLayers: number): number[] {
  return Array.from({ length: numLayers }, (_, i) => i);
}

function listLayers(layers: readonly number[]): string {
  return layers.length === 0 ? "no layers" : `layers ${layers.join(", ")}`;
}

/** The decoder layers this server reads: all on an eager server, else its readable layers, ascending. */
export function readableLayers(info: ModuleAccess): number[] {
  if (info.engineMode === v1.EngineMode.EAGER) return allLayers(info.numLayers);
  return [...new Set(info.readableLayers)].sort((a, b) => a - b);
}

/**
 * Where a feature reads decoder layers (the logit lens, the feature strip's SAEs) and, with
 * `writes`, also writes the layer it read (steering: its vector is read from the residual
 * stream it is added to). Eager: every layer. Compiled: the readable layers (and steerable,
 * with `writes`); none: the reason names the flag that would serve it.
 */
export function moduleFeature(feature: string, info: ModuleAccess, writes = false): LayerFeature {
  const readable = readableLayers(info);
  if (info.engineMode === v1.EngineMode.EAGER) return { available: true, layers: readable };
  const steerable = new Set(info.steerableLayers);
  const layers = writes ? readable.filter((layer) => steerable.has(layer)) : readable;
  if (layers.length > 0) return { available: true, layers };
  // UNSPECIFIED: a server older than engine_mode (and readable_layers), which cannot say.
  const mode = v1.EngineMode[info.engineMode] ?? String(info.engineMode);
  const eager = "--enforce-eager (make serve ENGINE_ARGS=--enforce-eager) for every module";
  const missing = [
    ...(readable.length === 0 ? ["--compiled-reads"] : []),
    ...(writes && steerable.size === 0 ? ["--compiled-steering"] : []),
  ];
  const has =
    `this server is ${mode}, reading ${listLayers(readable)} (GetModelInfo readable_layers)` +
    (writes ? ` and writing ${listLayers([...steerable].sort((x, y) => x - y))} (steerable_layers)` : "");
  const reason =
    missing.length > 0
      ? `${feature} needs module ${writes ? "reads and writes" : "reads"}; ${has}. Start it with ${missing.join(" ")} ` +
        `(make serve ENGINE_ARGS="${missing.join(" ")}") to keep compiled graphs, or ${eager}.`
      : `${feature} needs a read and a write of the same layer; ${has}: no layer both. Give --compiled-reads ` +
        `and --compiled-steering a common layer, or start it with ${eager}.`;
  return { available: false, reason };
}

/**
 * Where the logit lens reads: moduleFeature's layers, and under pipeline parallelism only the last
 * stage's (lm_head is there; the server refuses the others: GetModelInfo stage_first_layers).
 */
export function lensFeature(info: ModuleAccess): LayerFeature {
  const feature = moduleFeature("The logit lens", info);
  const lastStage = info.stageFirstLayers.at(-1) ?? 0;
  if (!feature.available || lastStage === 0) return feature;
  return { available: true, layers: feature.layers.filter((layer) => layer >= lastStage) };
}

/** The lens read's name in every step's values. */
export const LENS = "lens";

/**
 * The run's trace with the logit lens added: each layer's top-1 next-token guess at every
 * position ("all": the prompt's positions at step 0, the new token's at each later step).
 */
export function withLens(builder: InvokeBuilder, layers: readonly number[]): InvokeBuilder {
  return builder.read(LENS, read.logitLens(layers, { positions: "all", topK: 1 }));
}

/** One heatmap cell: layer `layer`'s top guess for the token after `position`. */
export interface LensCell {
  readonly layer: number;
  readonly position: number;
  readonly tokenId: number;
  /** Its probability under that layer's lens (exp of the logprob). */
  readonly prob: number;
}

/** One heatmap column: a position, its cells by layer (as the read lists the layers). */
export interface LensColumn {
  readonly position: number;
  readonly cells: readonly LensCell[];
}

/**
 * A step's lens read ([layers, positions, 1] logprobs and ids, `positions` the sequence
 * positions) as heatmap columns; none when the step has no lens read.
 */
export function lensColumns(step: Step, layers: readonly number[]): LensColumn[] {
  const lens = step.values[LENS];
  if (!lens) {
    return [];
  }
  if (!lens.tokenIds || !lens.positions) {
    throw new Error(`step ${step.step}: the "${LENS}" read came without token ids or positions`);
  }
  const [layerCount = 0, positionCount = 0, k = 1] = lens.values.shape;
  if (layerCount !== layers.length) {
    throw new Error(`step ${step.step}: the lens has ${layerCount} layers, ${layers.length} were asked for`);
  }
  const positions = Array.from(lens.positions.data, Number);
  return positions.slice(0, positionCount).map((position, p) => ({
    position,
    cells: layers.map((layer, l) => {
      const at = (l * positionCount + p) * k; // top-1: the first of the k
      return { layer, position, tokenId: Number(lens.tokenIds!.data[at]), prob: Math.exp(Number(lens.values.data[at])) };
    }),
  }));
}

/**
 * The token each heatmap column reads at its position: the prompt's tokens, then the token
 * drawn at step s for position promptLength + s (what the model reads to guess the next one).
 */
export function inputTokenAt(position: number, promptTokenIds: readonly number[], drawn: readonly number[]): number | undefined {
  return position < promptTokenIds.length ? promptTokenIds[position] : drawn[position - promptTokenIds.length];
}

/* Steering ----------------------------------------------------------------------------- */

/** The module a decoder layer's residual stream is read from and steered at. */
export function layerPath(layer: number): string {
  return `layers.${layer}`;
}

/** The read's name for a steering prompt's residual stream. */
export const RESIDUAL = "residual";

/**
 * Reads for the vector: each prompt of the pair as its own invoke, layer `layer`'s output
 * averaged over the prompt's positions (so prompts of different lengths compare), at step 0.
 */
export function vectorInvokes(layer: number, a: string, b: string): InvokeBuilder[] {
  const mean = read.module(layerPath(layer), { positions: "prompt", mean: true });
  return [invoke(a).read(RESIDUAL, mean, { steps: 0 }), invoke(b).read(RESIDUAL, mean, { steps: 0 })];
}

/** One generated token is enough: the vector is read at the prefill. */
export const VECTOR_SAMPLING: Sampling = { temperature: 0, maxTokens: 1 };

/** mean(A) - mean(B) from the two invokes' step-0 reads (invoke 0: A, invoke 1: B). */
export function steeringVector(steps: readonly Step[]): Float32Array {
  const residual = (invokeIndex: number): ArrayLike<number> => {
    const found = steps.find((s) => s.invokeIndex === invokeIndex && s.values[RESIDUAL])?.values[RESIDUAL];
    if (!found) {
      throw new Error(`the steering prompt ${invokeIndex === 0 ? "A" : "B"} came without its "${RESIDUAL}" read`);
    }
    return found.values.data as ArrayLike<number>;
  };
  const a = residual(0);
  const b = residual(1);
  if (a.length !== b.length) {
    throw new Error(`the two residual reads differ in width: ${a.length} vs ${b.length}`);
  }
  return Float32Array.from(a, (x, i) => x - Number(b[i]));
}

/** The Euclidean norm, shown with the vector so its scale is visible next to the coefficient. */
export function norm(vector: ArrayLike<number>): number {
  let sum = 0;
  for (let i = 0; i < vector.length; i++) sum += Number(vector[i]) ** 2;
  return Math.sqrt(sum);
}

/** Which side of the comparison an invoke is: 0 runs the prompt as is, 1 steered. */
export type Side = "plain" | "steered";
export const SIDES: readonly Side[] = ["plain", "steered"];

/**
 * The comparison: the prompt as is (invoke 0) and steered (invoke 1, coefficient x vector
 * added to the layer's output at the new token of every step: the last prompt position at
 * step 0, then each drawn token), in one trace with the same sampling.
 */
export function steeringInvokes(prompt: string, layer: number, vector: ArrayLike<number>, coefficient: number): InvokeBuilder[] {
  return [invoke(prompt), invoke(prompt).write(write.steer(layerPath(layer), vector, { scale: coefficient }))];
}

export function sideOf(step: Step): Side {
  const side = SIDES[step.invokeIndex];
  if (!side) {
    throw new Error(`a steering step came from invoke ${step.invokeIndex}; the comparison has 2`);
  }
  return side;
}

/* ---------------------------------------------------------------------------------------
 * The feature strip: per step, the top features of a dictionary (an SAE the server holds,
 * ListDictionaries) with their labels. Read at the new token like the candidates: step s's
 * features are those of the forward pass that drew step s's token (at the position before
 * it), so a row's features and its candidates come from the same pass.
 */

/** The feature read's name in every step's values. */
export const FEATURES = "features";

/** How many features a step's strip shows at most (only active ones: value > 0). */
export const FEATURE_TOP_K = 5;

/**
 * The dictionaries the strip can show: the SAEs the server lists, in its order, that it can
 * read: any on an eager server; on a compiled one those on its --compiled-reads layers (none
 * without read buffers).
 */
export function stripChoices(dictionaries: readonly Dictionary[], info: ModuleAccess): Dictionary[] {
  const saes = dictionaries.filter((d) => d.spec?.kind === DictionaryKind.SAE);
  if (info.engineMode === v1.EngineMode.EAGER) return saes; // any module, layers.N or not
  const readable = new Set(readableLayers(info).map(layerPath));
  return saes.filter((d) => readable.has(d.spec?.module ?? ""));
}

/**
 * Why the strip is not there though the server lists SAEs: none is on a module this server
 * reads (a compiled server without read buffers on their layers). Undefined when the strip
 * can show one, or when the server lists no SAE (then there is nothing to miss).
 */
export function stripUnavailable(dictionaries: readonly Dictionary[], info: ModuleAccess): string | undefined {
  const saes = dictionaries.filter((d) => d.spec?.kind === DictionaryKind.SAE);
  if (saes.length === 0 || stripChoices(dictionaries, info).length > 0) return undefined;
  const modules = [...new Set(saes.map((d) => d.spec?.module ?? "?"))];
  const mode = v1.EngineMode[info.engineMode] ?? String(info.engineMode);
  const names = saes.map((d) => d.name).join(", ");
  return (
    `The feature strip needs a read of ${modules.join(", ")} (where the SAE${saes.length > 1 ? "s" : ""} ${names} ` +
    `read${saes.length > 1 ? "" : "s"}); this server is ${mode}, reading ${listLayers(readableLayers(info))} ` +
    `(GetModelInfo readable_layers). Start it with --compiled-reads (make serve ENGINE_ARGS="--compiled-reads") ` +
    `to keep compiled graphs, or --enforce-eager (make serve ENGINE_ARGS=--enforce-eager) for every module.`
  );
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
