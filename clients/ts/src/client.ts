/**
 * TracewireClient: the TraceService over any Connect transport (gRPC over HTTP/2 from
 * Node, gRPC-Web or Connect from the browser), with typed inputs, decoded trace steps
 * and TracewireErrors. `client.service` is the generated client for anything else.
 */

import { isMessage } from "@bufbuild/protobuf";
import { ConnectError, createClient, type CallOptions as ConnectCallOptions, type Client, type Transport } from "@connectrpc/connect";
import { Code, TracewireError, toTracewireError, type Endpoint } from "./errors.js";
import { TraceRun, rowReads } from "./stream.js";
import { InvokeBuilder, samplingParams, toPrompt, traceRequest, type PromptInput, type Sampling } from "./trace.js";
import type { Dictionary } from "./gen/tracewire/v1/dictionary_pb.js";
import type { RequestOutput } from "./gen/tracewire/v1/output_pb.js";
import {
  TraceRequestSchema,
  TraceService,
  type GenerateStreamResponse,
  type GetEngineStatsResponse,
  type GetModelInfoResponse,
  type TraceRequest,
} from "./gen/tracewire/v1/service_pb.js";

export interface ClientOptions {
  /** Default deadline of every call, in milliseconds (none when unset). */
  readonly timeoutMs?: number;
  /** Bearer token for a server started with --auth-tokens: sent as `authorization: Bearer TOKEN`. */
  readonly token?: string;
}

/** Per-call options: a deadline and / or a signal that cancels the call. */
export interface CallOptions {
  readonly timeoutMs?: number;
  readonly signal?: AbortSignal;
}

/** The served model's tokenizer output. */
export interface Tokenized {
  readonly tokenIds: number[];
  /** Each token decoded on its own. */
  readonly tokens: string[];
}

export class TracewireClient {
  /** The generated Connect client, for calls this layer does not wrap. */
  readonly service: Client<typeof TraceService>;

  /**
   * `close` releases what the transport holds open (connect-node's HTTP/2 session, which
   * otherwise keeps a Node process alive until it idles out); fetch transports need none.
   */
  /**
   * `endpoint`: where the transport sends its calls and how a user gives another address, for
   * the UnreachableError of a call that reaches no server (without it: the transport's error).
   */
  constructor(
    transport: Transport,
    private readonly options: ClientOptions = {},
    private readonly release: () => void = () => undefined,
    private readonly endpoint?: Endpoint,
  ) {
    this.service = createClient(TraceService, transport);
  }

  /** Close the connection; calls in flight fail with CANCELED. */
  close(): void {
    this.release();
  }

  /** Plain generation: one RequestOutput per prompt, in order. A number[] is one prompt of token ids. */
  async generate(
    prompts: PromptInput | readonly PromptInput[],
    sampling?: Sampling,
    call?: CallOptions,
  ): Promise<RequestOutput[]> {
    const request = { prompts: promptList(prompts).map(toPrompt), samplingParams: samplingParams(sampling) };
    const response = await this.unary(() => this.service.generate(request, this.callOptions(call)));
    return response.outputs;
  }

  /** Plain generation, streamed: per prompt, text and token id deltas as the engine makes them. */
  async *generateStream(
    prompts: PromptInput | readonly PromptInput[],
    sampling?: Sampling,
    call?: CallOptions,
  ): AsyncGenerator<GenerateStreamResponse> {
    const request = { prompts: promptList(prompts).map(toPrompt), samplingParams: samplingParams(sampling) };
    yield* this.stream((options) => this.service.generateStream(request, options), call);
  }

  /**
   * A traced generation: iterate it for decoded steps, then `await run.result()` for the
   * outputs, warnings and usage. Give a TraceRequest, or invokes plus their shared sampling.
   */
  trace(
    request: TraceRequest | InvokeBuilder | readonly InvokeBuilder[],
    sampling?: Sampling,
    call?: CallOptions,
  ): TraceRun {
    let message: TraceRequest;
    if (isMessage(request, TraceRequestSchema)) {
      if (sampling !== undefined) {
        throw new TracewireError("sampling goes into traceRequest(), not beside a TraceRequest", Code.InvalidArgument);
      }
      message = request;
    } else {
      message = traceRequest(request as InvokeBuilder | readonly InvokeBuilder[], sampling);
    }
    return new TraceRun(
      (signal) => this.stream((options) => this.service.trace(message, options), call, signal),
      rowReads(message),
    );
  }

  /** Tokenize with the served model's tokenizer (special tokens added unless told otherwise). */
  async tokenize(text: string, options: { addSpecialTokens?: boolean } = {}, call?: CallOptions): Promise<Tokenized> {
    const response = await this.unary(() =>
      this.service.tokenize({ text, addSpecialTokens: options.addSpecialTokens }, this.callOptions(call)),
    );
    return { tokenIds: response.tokenIds, tokens: response.tokens };
  }

  /** Token ids back to text (special tokens skipped unless told otherwise). */
  async detokenize(
    tokenIds: readonly number[],
    options: { skipSpecialTokens?: boolean } = {},
    call?: CallOptions,
  ): Promise<string> {
    const request = { tokenIds: [...tokenIds], skipSpecialTokens: options.skipSpecialTokens };
    const response = await this.unary(() => this.service.detokenize(request, this.callOptions(call)));
    return response.text;
  }

  /** The served model: vocab size, EOS ids, max length, dtype, layers, modules, and the engine mode (which module interventions it serves). */
  async modelInfo(call?: CallOptions): Promise<GetModelInfoResponse> {
    return this.unary(() => this.service.getModelInfo({}, this.callOptions(call)));
  }

  /**
   * The dictionaries (linear probes, SAEs) the server holds, by name: the operator's
   * (--dictionaries) and uploaded ones, each with its spec (kind, module, labels unless
   * `omitLabels`), size and device bytes. read.dictionary / write.dictionary name them.
   */
  async listDictionaries(options: { omitLabels?: boolean } = {}, call?: CallOptions): Promise<Dictionary[]> {
    const request = { omitLabels: options.omitLabels ?? false };
    const response = await this.unary(() => this.service.listDictionaries(request, this.callOptions(call)));
    return response.dictionaries;
  }

  /** Requests in the engine right now. */
  async engineStats(call?: CallOptions): Promise<GetEngineStatsResponse> {
    return this.unary(() => this.service.getEngineStats({}, this.callOptions(call)));
  }

  private async unary<T>(send: () => Promise<T>): Promise<T> {
    try {
      return await send();
    } catch (error) {
      throw toTracewireError(error, this.endpoint);
    }
  }

  /**
   * A server stream with the call's deadline kept here rather than in Connect's timeoutMs:
   * connect 2.1 leaves its deadline timer running when the consumer stops reading early
   * (a `break` out of a trace), which holds a Node process open until the deadline passes.
   * The price: no grpc-timeout header; the server still sees the cancellation when the timer fires.
   */
  private async *stream<T>(
    open: (options: ConnectCallOptions) => AsyncIterable<T>,
    call: CallOptions = {},
    internal?: AbortSignal,
  ): AsyncGenerator<T> {
    const timeoutMs = call.timeoutMs ?? this.options.timeoutMs;
    const deadline = new AbortController();
    const timer =
      timeoutMs === undefined
        ? undefined
        : setTimeout(() => deadline.abort(new ConnectError("deadline exceeded", Code.DeadlineExceeded)), timeoutMs);
    // The timer alone is not enough: a stream that keeps delivering can hold the event
    // loop in promise callbacks past the timer's due time, so each message is checked too.
    const due = timeoutMs === undefined ? Number.POSITIVE_INFINITY : Date.now() + timeoutMs;
    try {
      for await (const item of open({ signal: anySignal(call.signal, internal, deadline.signal) })) {
        if (Date.now() > due) throw new ConnectError("deadline exceeded", Code.DeadlineExceeded);
        yield item;
      }
      if (deadline.signal.aborted) throw deadline.signal.reason;
    } catch (error) {
      throw toTracewireError(error, this.endpoint);
    } finally {
      clearTimeout(timer);
    }
  }

  /** Connect's call options for a unary call: the call's deadline or the client's, and its signal. */
  private callOptions(call: CallOptions = {}): ConnectCallOptions {
    return { timeoutMs: call.timeoutMs ?? this.options.timeoutMs, signal: call.signal };
  }
}

function anySignal(...signals: (AbortSignal | undefined)[]): AbortSignal | undefined {
  const present = signals.filter((s): s is AbortSignal => s !== undefined);
  return present.length > 1 ? AbortSignal.any(present) : present[0];
}

/** One prompt or a list of them; a list of numbers is one prompt of token ids (as in the Python SDK). */
function promptList(prompts: PromptInput | readonly PromptInput[]): readonly PromptInput[] {
  if (!Array.isArray(prompts)) {
    return [prompts as PromptInput];
  }
  const list = prompts as readonly unknown[];
  if (list.length > 0 && list.every((p) => typeof p === "number")) {
    return [list as readonly number[]];
  }
  return list as readonly PromptInput[];
}
