/**
 * A running trace: the server's TraceResponse stream as typed, decoded steps.
 *
 *   const run = client.trace(request);
 *   for await (const step of run) console.log(step.step, step.text, step.values.top?.values.data);
 *   const { outputs, warnings, usage } = await run.result();
 *
 * The call starts when iteration (or result() / collect()) starts, once. Leaving the
 * loop early cancels the call, and the server aborts the trace's engine requests.
 */

import { timestampDate } from "@bufbuild/protobuf/wkt";
import { Code, TracewireError, toTracewireError } from "./errors.js";
import { decodeTensor, type DecodedTensor } from "./tensors.js";
import { Reduction } from "./gen/tracewire/v1/intervention_pb.js";
import type { RequestOutput } from "./gen/tracewire/v1/output_pb.js";
import type { TraceRequest, TraceResponse } from "./gen/tracewire/v1/service_pb.js";
import type { ReadValue, StepResult, TraceWarning, Usage } from "./gen/tracewire/v1/trace_pb.js";

/**
 * One read's values at one step, decoded. Shapes, one rule per read: logits [vocab] or
 * [k]; a module read at the new token (or with mean) [hidden]; a module read over any
 * other positions [positions, hidden] at every step ("all": the prompt at step 0, then
 * [1, hidden]); the logit lens [layers, positions, k] (k = vocab for topK 0, then without
 * tokenIds: the index is the token id); attention patterns [layers, positions, heads, k]
 * (tokenIds: key positions; k = last query position + 1 for topK 0, without tokenIds,
 * positions: the query positions); a sample [].
 */
export interface ReadResult {
  /** Logits, logprobs, hidden states; a scalar (shape []) for a sample. */
  readonly values: DecodedTensor;
  /** The token ids the values belong to (top-k, chosen ids, logprobs, logit lens top-k). */
  readonly tokenIds?: DecodedTensor;
  /** The prompt positions the rows belong to, for reads over prompt positions. */
  readonly positions?: DecodedTensor;
}

/** One step of one sequence. */
export interface Step {
  readonly invokeIndex: number;
  readonly sequenceIndex: number;
  /** 0 for the first generated token. */
  readonly step: number;
  /** The token drawn (or forced) at this step. */
  readonly tokenId: number;
  /** Text this token added to the sequence's output. */
  readonly text: string;
  /** Whether a stop intervention ended the sequence at this step. */
  readonly stopped: boolean;
  /** Values read at this step, by read name. */
  readonly values: Readonly<Record<string, ReadResult>>;
  /** When the server got this step's token from the engine (server clock): streaming latency. */
  readonly engineTime: Date | undefined;
}

/** What a trace ends with: each invoke's final output, the warnings and the totals. */
export interface TraceResult {
  /** One RequestOutput per invoke, in request order. */
  readonly outputs: readonly RequestOutput[];
  /** E.g. a step selector naming steps the generation never reached. */
  readonly warnings: readonly TraceWarning[];
  readonly usage: Usage | undefined;
}

/** Opens the underlying call; the signal cancels it. */
export type OpenTrace = (signal: AbortSignal) => AsyncIterable<TraceResponse>;

/** Per invoke, the names of its module reads over positions: [positions, hidden] at every step. */
export type RowReads = ReadonlyMap<number, ReadonlySet<string>>;

/** The request's module (and dictionary) reads over positions other than the new token, without mean. */
export function rowReads(request: TraceRequest): RowReads {
  const found = new Map<number, Set<string>>();
  request.invokes.forEach((inv, index) => {
    for (const iv of inv.interventions) {
      const action = iv.action;
      if (action.case === "readDictionary") {
        // per position like a module read (a dictionary read has no mean)
        const kind = action.value.positions?.kind.case;
        if (kind !== undefined && kind !== "newToken") found.set(index, (found.get(index) ?? new Set<string>()).add(iv.name));
        continue;
      }
      if (action.case !== "readModule" || action.value.reduction === Reduction.MEAN) continue;
      const kind = action.value.positions?.kind.case;
      if (kind === undefined || kind === "newToken") continue;
      const names = found.get(index) ?? new Set<string>();
      found.set(index, names.add(iv.name));
    }
  });
  return found;
}

export class TraceRun implements AsyncIterable<Step> {
  private readonly outputs: RequestOutput[] = [];
  private readonly warnings: TraceWarning[] = [];
  private usage: Usage | undefined;
  private started = false;
  private readonly done: Promise<TraceResult>;
  private settle!: { resolve: (r: TraceResult) => void; reject: (e: unknown) => void };

  /** `rows`: the trace's module reads over positions (rowReads), decoded as [positions, hidden]. */
  constructor(
    private readonly open: OpenTrace,
    private readonly rows: RowReads = new Map(),
  ) {
    this.done = new Promise<TraceResult>((resolve, reject) => {
      this.settle = { resolve, reject };
    });
    // Nobody has to ask for the result: a failure is thrown to the iterating code anyway,
    // so an unobserved rejection here must not crash the process.
    this.done.catch(() => undefined);
  }

  [Symbol.asyncIterator](): AsyncIterator<Step> {
    return this.steps();
  }

  /** The outputs, warnings and usage once the trace ends; runs it (discarding steps) if nobody iterates. */
  async result(): Promise<TraceResult> {
    if (!this.started) {
      for await (const _ of this) {
        // draining: the steps are the caller's to keep via iteration or collect()
      }
    }
    return this.done;
  }

  /** Run the whole trace and keep every step. */
  async collect(): Promise<TraceResult & { readonly steps: readonly Step[] }> {
    const steps: Step[] = [];
    for await (const step of this) {
      steps.push(step);
    }
    return { ...(await this.done), steps };
  }

  private async *steps(): AsyncGenerator<Step> {
    if (this.started) {
      throw new TracewireError("a trace runs once: iterate it or call result() / collect() once", Code.FailedPrecondition);
    }
    this.started = true;
    const abort = new AbortController();
    let ended = false;
    try {
      for await (const response of this.open(abort.signal)) {
        const event = response.event;
        if (event.case === "steps") {
          // Several when the server coalesced them (stream_interval_ms, a slow reader);
          // in order within each sequence.
          for (const result of event.value.results) {
            yield toStep(result, this.rows.get(result.invokeIndex));
          }
        } else if (event.case === "invokeResult" && event.value.output) {
          this.outputs[event.value.invokeIndex] = event.value.output;
        } else if (event.case === "end") {
          this.warnings.push(...event.value.warnings);
          this.usage = event.value.usage;
          ended = true;
        }
      }
      if (!ended) {
        throw new TracewireError("the trace stream closed without its TraceEnd", Code.DataLoss);
      }
      this.settle.resolve({ outputs: this.outputs, warnings: this.warnings, usage: this.usage });
    } catch (error) {
      const mapped = toTracewireError(error);
      this.settle.reject(mapped);
      throw mapped;
    } finally {
      if (!ended) {
        // The consumer left the loop early (or the call failed): cancel it so the server
        // aborts the engine requests instead of generating for nobody.
        abort.abort();
        this.settle.reject(new TracewireError("the trace was not read to its end", Code.Canceled));
      }
    }
  }
}

/** A StepResult decoded; `rows` names its module reads over positions ([positions, hidden]). */
export function toStep(result: StepResult, rows?: ReadonlySet<string>): Step {
  const values: Record<string, ReadResult> = {};
  for (const [name, value] of Object.entries(result.values)) {
    const read = toReadResult(value);
    values[name] = rows?.has(name) ? asRows(read, result.step) : read;
  }
  return {
    invokeIndex: result.invokeIndex,
    sequenceIndex: result.sequenceIndex,
    step: result.step,
    tokenId: result.tokenId,
    text: result.textDelta,
    stopped: result.stopped,
    values,
    engineTime: result.engineTime ? timestampDate(result.engineTime) : undefined,
  };
}

function toReadResult(value: ReadValue): ReadResult {
  if (!value.values) {
    throw new TracewireError("a read value came without values", Code.DataLoss);
  }
  return {
    values: decodeTensor(value.values),
    ...(value.tokenIds ? { tokenIds: decodeTensor(value.tokenIds) } : {}),
    ...(value.positions ? { positions: decodeTensor(value.positions) } : {}),
  };
}

/** A module read over positions as [positions, ...]: after step 0 (the prompt's) a read
 * of "all" positions comes as the new token's row alone ([hidden]; heads [heads, headDim];
 * top-k neurons [k] with their ids); reads of prompt positions only end at step 0. */
function asRows(read: ReadResult, step: number): ReadResult {
  if (step === 0) return read;
  // values that name their prompt positions are rows already
  if (read.positions) return read;
  const tokenIds = read.tokenIds ? { tokenIds: { ...read.tokenIds, shape: [1, ...read.tokenIds.shape] } } : {};
  return { ...read, values: { ...read.values, shape: [1, ...read.values.shape] }, ...tokenIds };
}
