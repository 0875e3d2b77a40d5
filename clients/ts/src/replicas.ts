/**
 * Several tracewire servers behind one client (README: Replicas), as the Python SDK does it
 * with gRPC's `round_robin` policy and retry policy (tracewire/channel.py):
 *
 * - a target naming several replicas: gRPC's address list (`ipv4:10.0.0.1:50051,10.0.0.2:50051`,
 *   `ipv6:[::1]:50051,[::1]:50052`) or a list of URLs (a `dns:` name: dns_replicas.ts resolves
 *   it and keeps this transport over its addresses); a plain `host:port` / URL names one
 *   server (no policy: its own error at once, as before);
 * - calls spread round-robin over the replicas;
 * - a call refused with UNAVAILABLE before any response (a replica draining after SIGTERM
 *   refuses before it sends anything, or resets a stream that raced its GOAWAY with
 *   REFUSED_STREAM; one that is down refuses the connection; one that has just exited closed
 *   the connection under it: gRPC's UNAVAILABLE too) is retried on
 *   the next replica: up to 4 retries, 50 ms to 1 s apart with jitter (gRPC's backoff). A
 *   stream is retried only while its `transport.stream()` has not resolved, which happens once
 *   the response's headers arrive: a trace is never replayed after it began streaming. A unary
 *   response comes whole with its status, so an UNAVAILABLE unary call got nothing either.
 *
 * Like gRPC's round_robin, which picks only connected subchannels, a replica that refused is
 * left out of the rotation for a while (1 s, doubling while it keeps refusing, up to 30 s),
 * so a stopped replica does not cost every other call a refused attempt.
 */

import { createAsyncIterable } from "@connectrpc/connect/protocol";
import type { DescMessage, DescMethodStreaming, DescMethodUnary, MessageInitShape } from "@bufbuild/protobuf";
import {
  Code,
  ConnectError,
  type ContextValues,
  type StreamResponse,
  type Transport,
  type UnaryResponse,
} from "@connectrpc/connect";
import { TracewireError } from "./errors.js";

/** gRPC's retryPolicy fields, as tracewire.channel.SERVICE_CONFIG sets them. */
export interface RetryPolicy {
  /** Attempts in all, the first included. */
  readonly maxAttempts: number;
  readonly initialBackoffMs: number;
  readonly maxBackoffMs: number;
  readonly backoffMultiplier: number;
}

export const DEFAULT_RETRY: RetryPolicy = { maxAttempts: 5, initialBackoffMs: 50, maxBackoffMs: 1_000, backoffMultiplier: 2 };

// How long a replica that refused stays out of the rotation: doubles per refusal in a row.
const COOLDOWN_MS = 1_000;
const MAX_COOLDOWN_MS = 30_000;

/**
 * The servers a target names, each as `host:port` or a URL; a list of one means a single
 * server. `ipv4:` / `ipv6:` lists are gRPC's address-list syntax (what the Python SDK takes);
 * anything else is one server.
 */
export function replicaAddresses(target: string | readonly string[]): string[] {
  if (typeof target !== "string") {
    if (target.length === 0) {
      throw new TracewireError("target: an empty list of servers", Code.InvalidArgument);
    }
    return [...target];
  }
  const match = /^(ipv4|ipv6):(.*)$/.exec(target);
  if (!match) {
    if (target.startsWith("dns:")) {
      // A name's addresses change over time: createNodeClient resolves it per call (dns_replicas.ts).
      throw new TracewireError(
        `target: ${target}: a dns: name has no fixed list of addresses; createNodeClient resolves it (dnsReplicaTransport)`,
        Code.InvalidArgument,
      );
    }
    return [target];
  }
  const [, scheme, list = ""] = match;
  return list.split(",").map((address) => {
    const ok = scheme === "ipv4" ? /^[^:[\]]+:\d+$/.test(address) : /^\[[0-9a-fA-F:.]+\]:\d+$/.test(address);
    if (!ok) {
      const form = scheme === "ipv4" ? "a.b.c.d:port" : "[addr]:port";
      throw new TracewireError(`target: ${JSON.stringify(address)} in ${target} is not ${form}`, Code.InvalidArgument);
    }
    return address;
  });
}

/** A Transport over several replicas' transports: round-robin, with retries on UNAVAILABLE before a response. */
export function replicaTransport(replicas: readonly Transport[], policy: RetryPolicy = DEFAULT_RETRY): ReplicaTransport {
  return new ReplicaTransport(replicas, policy);
}

/** When a replica last refused and when it rejoins the rotation (ms, Date.now()), its refusals in a row. */
interface Bench {
  readonly since: number;
  readonly until: number;
  readonly refusals: number;
}

const IN_ROTATION: Bench = { since: 0, until: 0, refusals: 0 };

export class ReplicaTransport implements Transport {
  private next = 0;
  private replicas: readonly Transport[];
  /** Per replica (by transport, so that a new list keeps the state of the replicas it keeps). */
  private benched = new Map<Transport, Bench>();

  constructor(
    replicas: readonly Transport[],
    private readonly policy: RetryPolicy,
  ) {
    this.replicas = this.checked(replicas);
  }

  /**
   * A new list of replicas (a DNS name re-resolved: dns_replicas.ts): replicas still listed
   * keep their place out of the rotation; calls already retrying finish over the list they began on.
   */
  setReplicas(replicas: readonly Transport[]): void {
    this.replicas = this.checked(replicas);
    const kept = new Set(replicas);
    for (const replica of this.benched.keys()) if (!kept.has(replica)) this.benched.delete(replica);
  }

  private checked(replicas: readonly Transport[]): readonly Transport[] {
    if (replicas.length === 0) throw new TracewireError("replicas: an empty list of transports", Code.InvalidArgument);
    return [...replicas];
  }

  unary<I extends DescMessage, O extends DescMessage>(
    method: DescMethodUnary<I, O>,
    signal: AbortSignal | undefined,
    timeoutMs: number | undefined,
    header: HeadersInit | undefined,
    input: MessageInitShape<I>,
    contextValues?: ContextValues,
  ): Promise<UnaryResponse<I, O>> {
    return this.attempt(signal, timeoutMs, (replica, remaining) =>
      replica.unary(method, signal, remaining, header, input, contextValues),
    );
  }

  async stream<I extends DescMessage, O extends DescMessage>(
    method: DescMethodStreaming<I, O>,
    signal: AbortSignal | undefined,
    timeoutMs: number | undefined,
    header: HeadersInit | undefined,
    input: AsyncIterable<MessageInitShape<I>>,
    contextValues?: ContextValues,
  ): Promise<StreamResponse<I, O>> {
    if (method.methodKind !== "server_streaming") {
      // A client stream cannot be replayed once sent: one replica, no retry.
      return this.pick(this.replicas).stream(method, signal, timeoutMs, header, input, contextValues);
    }
    // The one request message, kept so that each attempt sends it again.
    const messages: MessageInitShape<I>[] = [];
    for await (const message of input) messages.push(message);
    return this.attempt(signal, timeoutMs, (replica, remaining) =>
      replica.stream(method, signal, remaining, header, createAsyncIterable(messages), contextValues),
    );
  }

  /**
   * `call` on the next replica, again while it is refused with UNAVAILABLE: each retry on a
   * replica this call has not tried yet, when one is in the rotation.
   */
  private async attempt<T>(
    signal: AbortSignal | undefined,
    timeoutMs: number | undefined,
    call: (replica: Transport, remainingMs: number | undefined) => Promise<T>,
  ): Promise<T> {
    const started = Date.now();
    const replicas = this.replicas; // this call's list, even if a re-resolution replaces it meanwhile
    const tried = new Set<Transport>();
    for (let attempt = 1; ; attempt++) {
      // The call's deadline covers all its attempts (as gRPC's does); Connect reads <= 0 as "none".
      const remaining = timeoutMs === undefined || timeoutMs <= 0 ? undefined : timeoutMs - (Date.now() - started);
      if (remaining !== undefined && remaining <= 0) {
        throw new ConnectError("deadline exceeded (retrying on other replicas)", Code.DeadlineExceeded);
      }
      const replica = this.pick(replicas, tried);
      tried.add(replica);
      const sent = Date.now();
      try {
        const response = await call(replica, remaining);
        // Back in the rotation, unless it refused another call since this one was sent (a
        // replica that began draining after taking this call).
        if (this.bench(replica).since < sent) this.benched.delete(replica);
        return response;
      } catch (error) {
        if (!isRefusal(error) || signal?.aborted || attempt >= this.policy.maxAttempts) throw error;
        this.refused(replica);
        await sleep(this.backoff(attempt), signal);
      }
    }
  }

  private bench(replica: Transport): Bench {
    return this.benched.get(replica) ?? IN_ROTATION;
  }

  /**
   * The next replica in the rotation that is not benched, preferring one `tried` lacks; when
   * every one is benched, the one back soonest.
   */
  private pick(replicas: readonly Transport[], tried: ReadonlySet<Transport> = new Set()): Transport {
    const now = Date.now();
    const count = replicas.length;
    const order = Array.from({ length: count }, (_, i) => (this.next + i) % count);
    const ready = (i: number): boolean => this.bench(replicas[i]!).until <= now;
    const choice =
      order.find((i) => ready(i) && !tried.has(replicas[i]!)) ??
      order.find(ready) ??
      order.reduce((best, i) => (this.bench(replicas[i]!).until < this.bench(replicas[best]!).until ? i : best));
    this.next = (choice + 1) % count;
    return replicas[choice]!;
  }

  private refused(replica: Transport): void {
    const refusals = this.bench(replica).refusals + 1;
    const cooldown = Math.min(COOLDOWN_MS * 2 ** (refusals - 1), MAX_COOLDOWN_MS);
    const now = Date.now();
    this.benched.set(replica, { since: now, until: now + cooldown, refusals });
  }

  /** gRPC's: uniform in [0, min(initial * multiplier^(n-1), max)). */
  private backoff(attempt: number): number {
    const { initialBackoffMs, backoffMultiplier, maxBackoffMs } = this.policy;
    return Math.random() * Math.min(initialBackoffMs * backoffMultiplier ** (attempt - 1), maxBackoffMs);
  }
}

/**
 * Node's errors for a connection lost under a call: the replica closed its HTTP/2 session
 * (a server exiting at the end of its drain sends GOAWAY; Node then reports "Session closed
 * with error code 2") or reset the connection. Connect-node maps these to INTERNAL / ABORTED;
 * gRPC reports a call that got no response on a lost connection as UNAVAILABLE, and retries it.
 */
const CONNECTION_LOST = new Set(["ERR_HTTP2_SESSION_ERROR", "ERR_HTTP2_GOAWAY_SESSION", "ECONNRESET"]);

/**
 * A stream reset with REFUSED_STREAM: the server did not process it (RFC 9113 8.7). A draining
 * gRPC server answers this to a call that raced its GOAWAY; gRPC retries it transparently.
 * Node reports it as ERR_HTTP2_STREAM_ERROR naming the code; Connect-node as INTERNAL.
 */
function isRefusedStream(cause: Error): boolean {
  return (cause as { code?: unknown }).code === "ERR_HTTP2_STREAM_ERROR" && cause.message.includes("NGHTTP2_REFUSED_STREAM");
}

/**
 * UNAVAILABLE, the stream refused, or the connection lost, before any response: the replica
 * did not take the call (the caller only asks about errors that came before the response).
 */
export function isRefusal(error: unknown): boolean {
  if (!(error instanceof ConnectError)) {
    return false;
  }
  if (error.code === Code.Unavailable) {
    return true;
  }
  for (let cause: unknown = error.cause, depth = 0; cause instanceof Error && depth < 8; cause = cause.cause, depth++) {
    const code = (cause as { code?: unknown }).code;
    if ((typeof code === "string" && CONNECTION_LOST.has(code)) || isRefusedStream(cause)) return true;
  }
  return false;
}

function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((done) => {
    const timer = setTimeout(done, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      done(); // the next attempt sees the aborted signal and fails as Connect fails an aborted call
    }, { once: true });
  });
}
