/**
 * Building TraceRequests without ceremony.
 *
 *   const request = traceRequest(
 *     invoke("The capital of France is")
 *       .read("top", read.logits({ topK: 5 }))          // every step
 *       .write(write.force(794), { steps: 0 })          // force the first draw
 *       .stop({ step: 3 }),
 *     { temperature: 0, maxTokens: 16 },
 *   );
 *
 * Everything here is data: the builder only assembles the proto messages the
 * server compiles into its in-engine hooks. The server validates and answers
 * INVALID_ARGUMENT naming the field; the builder checks only what would make
 * results ambiguous locally (duplicate or missing read names).
 */

import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { Code, TracewireError } from "./errors.js";
import { sampledIn, textContains, type Condition } from "./conditions.js";
import { float32Tensor } from "./tensors.js";
import {
  InterventionSchema,
  LogitsStage,
  PositionsSchema,
  ReadRefSchema,
  Reduction,
  StepSelectorSchema,
  type Intervention,
  type Positions,
  type StepSelector,
} from "./gen/tracewire/v1/intervention_pb.js";
import { PromptSchema, type Prompt } from "./gen/tracewire/v1/prompt_pb.js";
import { SamplingParamsSchema, type SamplingParams } from "./gen/tracewire/v1/sampling_pb.js";
import { TraceRequestSchema, type TraceRequest } from "./gen/tracewire/v1/service_pb.js";
import { InvokeSchema, TraceOptionsSchema, type Invoke } from "./gen/tracewire/v1/trace_pb.js";

/** Text (tokenized by the server), token ids used verbatim, or a Prompt message. */
export type PromptInput = string | readonly number[] | Prompt;

/** vLLM's SamplingParams in camelCase (temperature, maxTokens, topK, logprobs, seed, ...). */
export type Sampling = MessageInitShape<typeof SamplingParamsSchema>;

/** Trace limits and switches (maxReadBytes, streamEveryStep). */
export type TraceOptionsInit = MessageInitShape<typeof TraceOptionsSchema>;

/**
 * Which steps: "all" (the default), one step, a list of steps, or the half-open
 * range [start, stop) (open-ended without stop). Step 0 draws the first generated token.
 */
export type Steps = "all" | number | readonly number[] | { readonly start: number; readonly stop?: number };

/**
 * Which token positions a module read / write / logit lens acts on: "new" (the token
 * processed at each step, the default), "prompt", "all", a range or a list of prompt
 * positions (negative counts from the end).
 */
export type PositionsInput = "new" | "prompt" | "all" | readonly number[] | { readonly start: number; readonly stop?: number };

/** Where an action applies: its steps and an optional server-side condition. */
export interface Where {
  readonly steps?: Steps;
  readonly when?: Condition;
}

type ActionInit = NonNullable<MessageInitShape<typeof InterventionSchema>["action"]>;
type ReadCase =
  | "readLogits"
  | "readSample"
  | "readLogprobs"
  | "readModule"
  | "readLogitLens"
  | "readAttentionPattern"
  | "readDictionary";
type WriteCase = "forceSample" | "writeLogits" | "writeModule" | "writeDictionary";

/** A read action, from the `read` helpers. */
export type ReadAction = Extract<ActionInit, { case: ReadCase }>;
/** A write action, from the `write` helpers. */
export type WriteAction = Extract<ActionInit, { case: WriteCase }>;

/** The stages of the logits row, in the order the sampler's row passes them. */
export type LogitsStageName = "raw" | "before_writes" | "processed";

const LOGITS_STAGES: Readonly<Record<LogitsStageName, LogitsStage>> = {
  raw: LogitsStage.RAW,
  before_writes: LogitsStage.BEFORE_WRITES,
  processed: LogitsStage.PROCESSED,
};

/** What to read; each read's values come back per step under the name given to `.read()`. */
export const read = {
  /**
   * A logits row: the full [vocab] row, the top k (values and token ids, largest first),
   * or the values of chosen token ids. `stage`: "processed" (the default: the row the
   * sampler draws from, after vLLM's processing and the trace's writes; read and stop
   * conditions see it), "before_writes" (after vLLM's processing, before the trace's
   * writes: exactly what write conditions see) or "raw" (lm_head's output).
   */
  logits(options: { topK?: number; tokenIds?: readonly number[]; stage?: LogitsStageName } = {}): ReadAction {
    const stage = LOGITS_STAGES[options.stage ?? "processed"];
    if (stage === undefined) {
      throw new TracewireError(`read.logits: unknown stage "${String(options.stage)}"`, Code.InvalidArgument);
    }
    if (options.topK !== undefined && options.tokenIds !== undefined) {
      throw new TracewireError("read.logits: give topK or tokenIds, not both", Code.InvalidArgument);
    }
    if (options.topK !== undefined) {
      return { case: "readLogits", value: { stage, selection: { case: "topK", value: { k: options.topK } } } };
    }
    if (options.tokenIds !== undefined) {
      const tokenIds = [...options.tokenIds];
      return { case: "readLogits", value: { stage, selection: { case: "tokenIds", value: { tokenIds } } } };
    }
    return { case: "readLogits", value: { stage, selection: { case: "full", value: {} } } };
  },

  /** The token id drawn (or forced): a scalar per step. */
  sample(): ReadAction {
    return { case: "readSample", value: {} };
  },

  /** The drawn token's logprob first, then the topK largest logprobs; token ids alike. */
  logprobs(topK = 0): ReadAction {
    return { case: "readLogprobs", value: { topK } };
  },

  /**
   * A module's output (decoder layers "layers.i": the residual stream). An eager server reads
   * every module; a compiled one those its graph keeps (GetModelInfo readableLayers,
   * unitReadableLayers, readableModules; the rest it refuses, FAILED_PRECONDITION naming the
   * field and the flag).
   * `units` / `topK`: attention heads of "layers.i.self_attn.heads" ([heads, headDim] per
   * position) or neurons of "layers.i.mlp.act" ([neurons]): these ids, in this order, or the
   * topK largest neurons (values, their ids in tokenIds).
   */
  module(
    path: string,
    options: { positions?: PositionsInput; mean?: boolean; units?: readonly number[]; topK?: number } = {},
  ): ReadAction {
    const reduction = options.mean ? Reduction.MEAN : Reduction.UNSPECIFIED;
    if (options.units !== undefined && options.topK !== undefined) {
      throw new TracewireError("read.module: give units or topK, not both", Code.InvalidArgument);
    }
    const units =
      options.units !== undefined
        ? { kind: { case: "ids" as const, value: { ids: [...options.units] } } }
        : options.topK !== undefined
          ? { kind: { case: "topK" as const, value: { k: options.topK } } }
          : undefined;
    return { case: "readModule", value: { module: path, positions: positions(options.positions), reduction, units } };
  },

  /**
   * Final norm + lm_head on these layers: [layers, positions, k] top-k logprobs (topK 0: full
   * rows). An eager server reads every layer; a compiled one (--compiled-reads) its readableLayers.
   */
  logitLens(layers: number | readonly number[], options: { positions?: PositionsInput; topK?: number } = {}): ReadAction {
    const layerList = typeof layers === "number" ? [layers] : [...layers];
    return {
      case: "readLogitLens",
      value: { layers: layerList, positions: positions(options.positions), topK: options.topK ?? 5 },
    };
  },

  /**
   * Attention patterns: the attention weights of query `positions` over the keys at these
   * decoder layers and query heads (all by default), computed on the server from the
   * model's own post-rotary q / k. Values [layers, positions, heads, topK], largest first,
   * with tokenIds the key positions (-1 past the keys a query sees) and positions the query
   * positions; topK 0 gives full rows [layers, positions, heads, last query position + 1]
   * (keys a query does not see weigh 0). An eager server computes every layer's; a compiled
   * one those whose queries and keys its graph keeps (--compiled-pattern-reads:
   * patternReadableLayers).
   */
  attention(
    layers: number | readonly number[],
    options: { heads?: readonly number[]; positions?: PositionsInput; topK?: number } = {},
  ): ReadAction {
    const layerList = typeof layers === "number" ? [layers] : [...layers];
    return {
      case: "readAttentionPattern",
      value: {
        layers: layerList,
        heads: [...(options.heads ?? [])],
        positions: positions(options.positions),
        topK: options.topK ?? 5,
      },
    };
  },

  /**
   * A dictionary (a linear probe or an SAE the server holds: listDictionaries) on the output
   * of the module it reads, per position: every value ([k] probe outputs after the probe's
   * activation, [d] SAE features), the `topK` largest with their ids in tokenIds (largest
   * first), the values of chosen `features` (probe outputs or feature ids, in order), or
   * (SAEs) `reconstructionError`, the norm ||x - reconstruction|| ([1]). Per step [values]
   * at the new token, [positions, values] at any other positions. `module`: optional, the
   * module you mean (the server checks it is the dictionary's). Served wherever the server
   * reads the dictionary's module (see `module`).
   */
  dictionary(name: string, options: DictionaryReadOptions = {}): ReadAction {
    return {
      case: "readDictionary",
      value: {
        dictionary: name,
        module: options.module ?? "",
        positions: positions(options.positions),
        selection: dictionarySelection(name, options),
      },
    };
  },
} as const;

type DictionarySelection = Extract<ReadAction, { case: "readDictionary" }>["value"]["selection"];

function dictionarySelection(name: string, options: DictionaryReadOptions): DictionarySelection {
  const chosen = [options.topK !== undefined, options.features !== undefined, options.reconstructionError === true];
  if (chosen.filter(Boolean).length > 1) {
    throw new TracewireError(
      `read.dictionary("${name}"): give one of topK, features, reconstructionError`,
      Code.InvalidArgument,
    );
  }
  if (options.topK !== undefined) return { case: "topK", value: { k: options.topK } };
  if (options.features !== undefined) return { case: "features", value: { ids: featureList(name, options.features) } };
  if (options.reconstructionError === true) return { case: "reconstructionError", value: {} };
  return undefined;
}

/** What `read.dictionary` returns per position (at most one of topK, features, reconstructionError). */
export interface DictionaryReadOptions {
  /** The module you mean, e.g. "layers.2" (optional; it must be the dictionary's own). */
  readonly module?: string;
  readonly positions?: PositionsInput;
  /** The k largest values and their ids, largest first. */
  readonly topK?: number;
  /** These probe outputs / SAE features, in this order. */
  readonly features?: number | readonly number[];
  /** SAEs: ||x - reconstruction||_2, [1] per position. */
  readonly reconstructionError?: boolean;
}

/** What to change; the sampler then draws from the result. */
export const write = {
  /** Make the sampler draw this token. */
  force(tokenId: number): WriteAction {
    return { case: "forceSample", value: { tokenId } };
  },

  /** Add a value to these token ids' logits. */
  bias(biases: Readonly<Record<number, number>> | ReadonlyMap<number, number>): WriteAction {
    const bias = biases instanceof Map ? Object.fromEntries(biases) : { ...biases };
    return { case: "writeLogits", value: { op: { case: "bias", value: { bias } } } };
  },

  /** Set these token ids' logits to -inf so they cannot be drawn. */
  mask(tokenIds: number | readonly number[]): WriteAction {
    const ids = typeof tokenIds === "number" ? [tokenIds] : [...tokenIds];
    return { case: "writeLogits", value: { op: { case: "mask", value: { tokenIds: ids } } } };
  },

  /** Add a [vocab] vector to the logits row. */
  addLogits(values: ArrayLike<number>): WriteAction {
    return { case: "writeLogits", value: { op: { case: "add", value: float32Tensor(values) } } };
  },

  /** Replace the logits row with a [vocab] vector. */
  replaceLogits(values: ArrayLike<number>): WriteAction {
    return { case: "writeLogits", value: { op: { case: "replace", value: float32Tensor(values) } } };
  },

  /**
   * Add scale * vector ([hidden]) to a module's output: a steering vector. An eager server
   * writes every module; a compiled one those its graph has tables for (GetModelInfo
   * steerableLayers, unitSteerableLayers, steerableModules; the rest it refuses,
   * FAILED_PRECONDITION naming the field and the flag), as for every write below.
   * With `units` (heads / neurons, see unitWrite): a [headDim] or [units, headDim] vector
   * (`shape`) for heads, a value per neuron.
   */
  steer(
    path: string,
    vector: ArrayLike<number>,
    options: { scale?: number; positions?: PositionsInput } & UnitOptions = {},
  ): WriteAction {
    return unitWrite(path, { case: "add", value: float32Tensor(vector, options.shape) }, options, options.scale);
  },

  /**
   * Zero a module's output at the positions (with `units`: those heads / neurons only).
   */
  zero(path: string, options: { positions?: PositionsInput } & UnitOptions = {}): WriteAction {
    return unitWrite(path, { case: "zero", value: {} }, options);
  },

  /**
   * Set each selected position to the mean over the selected positions (per head / neuron with
   * `units`); a compiled server with compiledMeanAblation (a small model's default hooks have it).
   */
  meanAblate(path: string, options: { positions?: PositionsInput } & UnitOptions = {}): WriteAction {
    return unitWrite(path, { case: "mean", value: {} }, options);
  },

  /**
   * Replace a module's output at the positions: [hidden]; heads a [headDim] vector for every
   * chosen head or [units, headDim] (`shape`); neurons a value per chosen neuron (their `set`).
   */
  replace(path: string, values: ArrayLike<number>, options: { positions?: PositionsInput } & UnitOptions = {}): WriteAction {
    return unitWrite(path, { case: "replace", value: float32Tensor(values, options.shape) }, options);
  },

  /**
   * Activation patching: replace a module's output at the positions with another invoke's
   * module read of the same trace (`from`: its invoke index and read name), on the server,
   * at the same step: prompt positions take the source's step-0 rows (`from.positions`:
   * which of its prompt positions, in order; unset: all it read), the new token its row of
   * the same step. The invoke starts once the source has that step. Served where the server
   * reads the source's module and writes this one.
   */
  patch(path: string, from: ReadRefInput, options: { positions?: PositionsInput } = {}): WriteAction {
    return {
      case: "writeModule",
      value: { module: path, positions: positions(options.positions), op: { case: "patch", value: readRef(from) } },
    };
  },

  /** Add scale * another invoke's module read (taken as `patch` takes it); served where `patch` is. */
  addRead(path: string, from: ReadRefInput, options: { scale?: number; positions?: PositionsInput } = {}): WriteAction {
    return {
      case: "writeModule",
      value: {
        module: path,
        positions: positions(options.positions),
        op: { case: "addRead", value: readRef(from) },
        scale: options.scale,
      },
    };
  },

  /**
   * Change the dictionary's module output along its directions at the positions: `steer`
   * adds steer * direction for each feature (SAE: W_dec[f]; probe: W[f], unnormalised);
   * `clamp` (SAEs) sets each feature's activation to that value, keeping the reconstruction
   * error (x + sum_f (clamp - a_f(x)) * W_dec[f]); `ablate` (SAEs) clamps them to 0. Exactly
   * one of the three. A compiled server steers where it writes the module, and clamps ReLU /
   * JumpReLU SAEs' features (at most 8 a write) on its clampLayers.
   */
  dictionary(name: string, features: number | readonly number[], options: DictionaryWriteOptions): WriteAction {
    const ops = [options.steer !== undefined, options.clamp !== undefined, options.ablate === true];
    if (ops.filter(Boolean).length !== 1) {
      throw new TracewireError(
        `write.dictionary("${name}"): give exactly one of steer, clamp, ablate`,
        Code.InvalidArgument,
      );
    }
    const op =
      options.steer !== undefined
        ? { case: "steer" as const, value: finite(name, "steer", options.steer) }
        : options.clamp !== undefined
          ? { case: "clamp" as const, value: finite(name, "clamp", options.clamp) }
          : { case: "ablate" as const, value: {} };
    return {
      case: "writeDictionary",
      value: {
        dictionary: name,
        module: options.module ?? "",
        positions: positions(options.positions),
        features: featureList(name, features),
        op,
      },
    };
  },
} as const;

/** How `write.dictionary` acts: exactly one of steer, clamp, ablate. */
export interface DictionaryWriteOptions {
  /** Add steer * direction of each feature. */
  readonly steer?: number;
  /** SAEs: set each feature's activation to this value. */
  readonly clamp?: number;
  /** SAEs: set each feature's activation to 0. */
  readonly ablate?: boolean;
  /** The module you mean (optional; it must be the dictionary's own). */
  readonly module?: string;
  readonly positions?: PositionsInput;
}

/** Feature ids as the wire takes them: integers, not empty, no duplicates (the range is the server's to check). */
function featureList(name: string, features: number | readonly number[]): number[] {
  const list = typeof features === "number" ? [features] : [...features];
  if (list.length === 0 || list.some((f) => !Number.isInteger(f)) || new Set(list).size !== list.length) {
    throw new TracewireError(
      `dictionary "${name}": features must be integer ids, not empty, without duplicates; got [${list.join(", ")}]`,
      Code.InvalidArgument,
    );
  }
  return list;
}

function finite(name: string, field: string, value: number): number {
  if (!Number.isFinite(value)) {
    throw new TracewireError(`write.dictionary("${name}"): ${field} must be finite, got ${value}`, Code.InvalidArgument);
  }
  return value;
}

/**
 * Unit writes: `units` chooses attention heads of "layers.i.self_attn.heads" or neurons of
 * "layers.i.mlp.act" (unset: every unit); `shape` is the operand's shape when it is not a
 * vector (heads: [units, headDim]).
 */
export interface UnitOptions {
  readonly units?: readonly number[];
  readonly shape?: readonly number[];
}

type WriteModuleOp = Extract<WriteAction, { case: "writeModule" }>["value"]["op"];

function unitWrite(
  path: string,
  op: WriteModuleOp,
  options: { positions?: PositionsInput } & UnitOptions,
  scale?: number,
): WriteAction {
  return {
    case: "writeModule",
    value: {
      module: path,
      positions: positions(options.positions),
      op,
      scale,
      units: options.units !== undefined ? { ids: [...options.units] } : undefined,
    },
  };
}

/** Another invoke's module read, as a patch's operand: its invoke index, read name and (prompt reads) positions. */
export interface ReadRefInput {
  readonly invoke: number;
  readonly name: string;
  readonly positions?: readonly number[];
}

function readRef(from: ReadRefInput): MessageInitShape<typeof ReadRefSchema> {
  return { invoke: from.invoke, name: from.name, positions: [...(from.positions ?? [])] };
}

/** When to end the sequence (the token drawn at that step is kept). */
export type StopAt =
  | { readonly step: number }
  | { readonly token: number | readonly number[] }
  | { readonly text: string }
  | { readonly when: Condition; readonly steps?: Steps };

/** One prompt of a trace and its interventions; chainable. */
export class InvokeBuilder {
  readonly prompt: Prompt;
  /** Overrides of the trace's sampling parameters for this prompt. */
  readonly sampling: Sampling | undefined;
  private readonly interventions: Intervention[] = [];
  private readonly readNames = new Set<string>();

  constructor(prompt: PromptInput, sampling?: Sampling) {
    this.prompt = toPrompt(prompt);
    this.sampling = checkSampling(sampling);
  }

  /** Read at the selected steps (every step by default); values come back under `name`. */
  read(name: string, action: ReadAction, where: Where = {}): this {
    if (!name) {
      throw new TracewireError("a read needs a name: its values come back under it", Code.InvalidArgument);
    }
    if (this.readNames.has(name)) {
      throw new TracewireError(`duplicate read name "${name}"`, Code.InvalidArgument);
    }
    this.readNames.add(name);
    return this.add(name, action, where);
  }

  /** Write at the selected steps (every step by default). */
  write(action: WriteAction, where: Where = {}): this {
    return this.add("", action, where);
  }

  /** End the sequence at a step, at the first drawn token in a set, or once the text contains a string. */
  stop(at: StopAt): this {
    if ("step" in at) {
      return this.add("", { case: "stop", value: {} }, { steps: at.step });
    }
    if ("token" in at) {
      return this.add("", { case: "stop", value: {} }, { when: sampledIn(at.token) });
    }
    if ("text" in at) {
      return this.add("", { case: "stop", value: {} }, { when: textContains(at.text) });
    }
    return this.add("", { case: "stop", value: {} }, { steps: at.steps, when: at.when });
  }

  /** The Invoke message. */
  message(): Invoke {
    return create(InvokeSchema, {
      prompt: this.prompt,
      samplingParams: this.sampling,
      interventions: [...this.interventions],
    });
  }

  private add(name: string, action: ActionInit, where: Where): this {
    this.interventions.push(
      create(InterventionSchema, { name, steps: stepSelector(where.steps), condition: where.when, action }),
    );
    return this;
  }
}

/** One prompt of a trace: `invoke(prompt).read(...).write(...).stop(...)`. */
export function invoke(prompt: PromptInput, sampling?: Sampling): InvokeBuilder {
  return new InvokeBuilder(prompt, sampling);
}

/** The TraceRequest for one or more invokes sharing `sampling` (each invoke may override fields). */
export function traceRequest(
  invokes: InvokeBuilder | readonly InvokeBuilder[],
  sampling?: Sampling,
  options?: TraceOptionsInit,
): TraceRequest {
  const list = invokes instanceof InvokeBuilder ? [invokes] : invokes;
  if (list.length === 0) {
    throw new TracewireError("a trace needs at least one invoke", Code.InvalidArgument);
  }
  return create(TraceRequestSchema, {
    samplingParams: checkSampling(sampling),
    invokes: list.map((inv) => inv.message()),
    options,
  });
}

/** A Prompt message from text, token ids or a Prompt. */
export function toPrompt(prompt: PromptInput): Prompt {
  if (typeof prompt === "string") {
    return create(PromptSchema, { kind: { case: "text", value: prompt } });
  }
  if (isTokenIds(prompt)) {
    return create(PromptSchema, { kind: { case: "tokenIds", value: { ids: [...prompt] } } });
  }
  return prompt;
}

/** The SamplingParams message (unset fields stay unset: the server's / vLLM's defaults). */
export function samplingParams(sampling: Sampling = {}): SamplingParams {
  return create(SamplingParamsSchema, checkSampling(sampling));
}

/** Every key SamplingParams carries, as this client spells it (camelCase). */
const SAMPLING_KEYS: readonly string[] = SamplingParamsSchema.fields.map((f) => f.localName);

/**
 * `sampling` as given, or INVALID_ARGUMENT naming the first key SamplingParams does not carry:
 * protobuf-es's create() drops unknown keys, so plain JavaScript's `{ temprature: 0 }` would
 * otherwise sample at the default temperature (the Python SDK, the CLI and the server refuse it).
 */
export function checkSampling<T extends Sampling | undefined>(sampling: T): T {
  if (sampling === undefined || sampling === null) {
    return sampling;
  }
  if (typeof sampling !== "object" || Array.isArray(sampling)) {
    throw new TracewireError("sampling parameters are an object of SamplingParams fields", Code.InvalidArgument,
      "sampling_params");
  }
  if ("$typeName" in sampling) {
    return sampling; // a SamplingParams message: its fields are the schema's
  }
  for (const key of Object.keys(sampling)) {
    if (!SAMPLING_KEYS.includes(key)) {
      const close = closestKey(key, SAMPLING_KEYS);
      throw new TracewireError(
        `unknown sampling parameter "${key}".${close ? ` Did you mean "${close}"?` : ""} ` +
          `Valid ones: ${SAMPLING_KEYS.join(", ")}`,
        Code.InvalidArgument,
        key,
      );
    }
  }
  return sampling;
}

/** The key within two edits of `key` (a typo), or undefined. */
function closestKey(key: string, keys: readonly string[]): string | undefined {
  let best: string | undefined;
  let bestDistance = 3;
  for (const candidate of keys) {
    const d = editDistance(key.toLowerCase(), candidate.toLowerCase());
    if (d < bestDistance) {
      best = candidate;
      bestDistance = d;
    }
  }
  return best;
}

function editDistance(a: string, b: string): number {
  let row = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const next = [i];
    for (let j = 1; j <= b.length; j++) {
      next.push(Math.min(row[j]! + 1, next[j - 1]! + 1, row[j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1)));
    }
    row = next;
  }
  return row[b.length]!;
}

function isTokenIds(prompt: readonly number[] | Prompt): prompt is readonly number[] {
  return Array.isArray(prompt);
}

function stepSelector(steps: Steps = "all"): StepSelector {
  if (steps === "all") {
    return create(StepSelectorSchema, { kind: { case: "all", value: {} } });
  }
  if (typeof steps === "number") {
    return create(StepSelectorSchema, { kind: { case: "list", value: { steps: [steps] } } });
  }
  if (isList(steps)) {
    return create(StepSelectorSchema, { kind: { case: "list", value: { steps: [...steps] } } });
  }
  return create(StepSelectorSchema, { kind: { case: "range", value: { start: steps.start, stop: steps.stop } } });
}

function positions(input: PositionsInput = "new"): Positions {
  switch (input) {
    case "new":
      return create(PositionsSchema, { kind: { case: "newToken", value: {} } });
    case "prompt":
      return create(PositionsSchema, { kind: { case: "allPrompt", value: {} } });
    case "all":
      return create(PositionsSchema, { kind: { case: "all", value: {} } });
  }
  if (isList(input)) {
    return create(PositionsSchema, { kind: { case: "promptList", value: { positions: [...input] } } });
  }
  return create(PositionsSchema, { kind: { case: "promptRange", value: { start: input.start, stop: input.stop } } });
}

// Array.isArray does not narrow readonly arrays out of a union; this does.
function isList<T>(value: readonly T[] | object): value is readonly T[] {
  return Array.isArray(value);
}
