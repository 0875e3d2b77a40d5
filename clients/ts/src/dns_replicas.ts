/**
 * A `dns:` target naming several replicas (README: Replicas), as gRPC's dns resolver takes it
 * (`dns:///tracewire.default.svc:50051`, `dns:host:port`; a Kubernetes headless Service's name
 * resolves to every ready pod): the name is resolved with the OS resolver (Node's
 * `dns.promises.lookup`, both families) before the first call, and again on a call once the
 * last resolution is 30 s old (gRPC's dns resolver re-resolves at most every 30 s) or after a
 * call that every replica refused. Each address keeps one transport (one HTTP/2 connection)
 * while it stays listed; calls go over them with replicas.ts's round-robin, retries and benching.
 */

import { lookup } from "node:dns/promises";
import type { DescMessage, DescMethodStreaming, DescMethodUnary, MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, type ContextValues, type StreamResponse, type Transport, type UnaryResponse } from "@connectrpc/connect";
import { TracewireError } from "./errors.js";
import { DEFAULT_RETRY, ReplicaTransport, isRefusal, type RetryPolicy } from "./replicas.js";

/** One address of a name, as `dns.promises.lookup(host, { all: true })` gives it. */
export interface DnsAddress {
  readonly address: string;
  readonly family: number;
}

/** Resolves a host name to its addresses (no ports): Node's lookup by default. */
export type DnsLookup = (host: string) => Promise<readonly DnsAddress[]>;

export interface DnsOptions {
  /** The resolver (default: the OS's, through `dns.promises.lookup(host, { all: true })`). */
  readonly lookup?: DnsLookup;
  /** How old a resolution may get before a call resolves the name again (default 30 000 ms, gRPC's). */
  readonly reresolveMs?: number;
}

export const DEFAULT_RERESOLVE_MS = 30_000;

const osLookup: DnsLookup = (host) => lookup(host, { all: true });

/** A `dns:` target's host and port. gRPC's default port (443) when it names none. */
export interface DnsTarget {
  readonly host: string;
  readonly port: number;
}

/** `dns:///host:port`, `dns:host:port` (and `[v6]:port`); undefined for a target that is not `dns:`. */
export function parseDnsTarget(target: string): DnsTarget | undefined {
  if (!target.startsWith("dns:")) return undefined;
  const rest = target.slice("dns:".length);
  const authority = /^\/\/([^/]*)\/(.*)$/.exec(rest);
  if (rest.startsWith("//") && !authority) {
    throw new TracewireError(`target: ${target} is not dns:///host:port`, Code.InvalidArgument);
  }
  if (authority && authority[1]) {
    // gRPC's dns://SERVER/name asks that DNS server; Node's lookup asks the OS's only.
    throw new TracewireError(`target: ${target}: a DNS server of its own (dns://${authority[1]}/) is not supported; use dns:///name:port`, Code.InvalidArgument);
  }
  const name = authority ? authority[2]! : rest;
  const match = /^(\[[0-9a-fA-F:.]+\]|[^:[\]/]+)(?::(\d+))?$/.exec(name);
  const port = match?.[2] === undefined ? 443 : Number(match[2]);
  if (!match || port < 1 || port > 65535) {
    throw new TracewireError(`target: ${target} is not dns:///host:port`, Code.InvalidArgument);
  }
  return { host: match[1]!.replace(/^\[(.*)\]$/, "$1"), port };
}

/** One replica's transport, and how to end its HTTP/2 connection (node.ts's connect). */
export interface Connection {
  readonly transport: Transport;
  readonly release: () => void;
}

/**
 * A Transport over the addresses `target` resolves to; `connect` makes one address's
 * (`host:port`, `[v6]:port`). `close()` ends every connection.
 */
export function dnsReplicaTransport(
  target: string,
  connect: (address: string) => Connection,
  options: DnsOptions = {},
  policy: RetryPolicy = DEFAULT_RETRY,
): DnsReplicaTransport {
  const parsed = parseDnsTarget(target);
  if (!parsed) throw new TracewireError(`target: ${target} is not a dns: name`, Code.InvalidArgument);
  const reresolveMs = options.reresolveMs ?? DEFAULT_RERESOLVE_MS;
  if (!(reresolveMs >= 0)) throw new TracewireError(`dns.reresolveMs: ${reresolveMs} is not a duration (ms >= 0)`, Code.InvalidArgument);
  return new DnsReplicaTransport(target, parsed, connect, options.lookup ?? osLookup, reresolveMs, policy);
}

/** Retired connections kept at most (each idle one closes itself; this bounds the bookkeeping). */
const RETIRED_MAX = 64;

export class DnsReplicaTransport implements Transport {
  /** Per address (`host:port`), its connection: kept while the name still lists it. */
  private connections = new Map<string, Connection>();
  /**
   * Connections of addresses the name stopped listing: out of the rotation but not cut, so
   * the calls on them finish (a pod leaving a headless Service drains its traces, then its
   * server closes the connection; else the session manager's idle timeout ends it). Reused
   * if the address comes back; the oldest are released past RETIRED_MAX.
   */
  private retired = new Map<string, Connection>();
  private replicas: ReplicaTransport | undefined;
  private resolvedAt = 0;
  /** Every replica refused a call since the last resolution: the next call resolves again. */
  private stale = false;
  /** The resolution under way, shared by the calls that wait for it. */
  private resolving: Promise<ReplicaTransport> | undefined;

  constructor(
    private readonly target: string,
    private readonly name: DnsTarget,
    private readonly connect: (address: string) => Connection,
    private readonly lookup: DnsLookup,
    private readonly reresolveMs: number,
    private readonly policy: RetryPolicy,
  ) {}

  async unary<I extends DescMessage, O extends DescMessage>(
    method: DescMethodUnary<I, O>,
    signal: AbortSignal | undefined,
    timeoutMs: number | undefined,
    header: HeadersInit | undefined,
    input: MessageInitShape<I>,
    contextValues?: ContextValues,
  ): Promise<UnaryResponse<I, O>> {
    const started = Date.now();
    const replicas = await this.current();
    return this.watch(replicas.unary(method, signal, remaining(timeoutMs, started), header, input, contextValues));
  }

  async stream<I extends DescMessage, O extends DescMessage>(
    method: DescMethodStreaming<I, O>,
    signal: AbortSignal | undefined,
    timeoutMs: number | undefined,
    header: HeadersInit | undefined,
    input: AsyncIterable<MessageInitShape<I>>,
    contextValues?: ContextValues,
  ): Promise<StreamResponse<I, O>> {
    const started = Date.now();
    const replicas = await this.current();
    return this.watch(replicas.stream(method, signal, remaining(timeoutMs, started), header, input, contextValues));
  }

  /** Ends every replica's connection. */
  close(): void {
    for (const connection of [...this.connections.values(), ...this.retired.values()]) connection.release();
    this.connections.clear();
    this.retired.clear();
  }

  /** A call refused by every replica it tried (retries spent) asks for a fresh resolution. */
  private async watch<T>(call: Promise<T>): Promise<T> {
    try {
      return await call;
    } catch (error) {
      if (isRefusal(error)) this.stale = true;
      throw error;
    }
  }

  /** The replicas, resolved again when the last resolution is old or they all refused. */
  private current(): Promise<ReplicaTransport> {
    const fresh = this.replicas && !this.stale && Date.now() - this.resolvedAt < this.reresolveMs;
    if (fresh) return Promise.resolve(this.replicas!);
    this.resolving ??= this.resolve().finally(() => (this.resolving = undefined));
    return this.resolving;
  }

  private async resolve(): Promise<ReplicaTransport> {
    let addresses: string[];
    try {
      addresses = await this.addresses();
    } catch (error) {
      // Like gRPC, a failed re-resolution keeps the addresses known so far (until the next try).
      if (!this.replicas) throw error;
      this.resolvedAt = Date.now();
      this.stale = false;
      return this.replicas;
    }
    const previous = this.connections;
    this.connections = new Map(addresses.map((address) => [
      address, previous.get(address) ?? this.retired.get(address) ?? this.connect(address),
    ]));
    for (const address of addresses) this.retired.delete(address);
    // Addresses the name no longer lists (a pod leaving the Service): out of the rotation.
    for (const [address, connection] of previous) if (!this.connections.has(address)) this.retired.set(address, connection);
    for (const [address, connection] of this.retired) {
      if (this.retired.size <= RETIRED_MAX) break;
      this.retired.delete(address); // (Map order: the oldest first)
      connection.release();
    }
    const transports = [...this.connections.values()].map((c) => c.transport);
    if (this.replicas) this.replicas.setReplicas(transports);
    else this.replicas = new ReplicaTransport(transports, this.policy);
    this.resolvedAt = Date.now();
    this.stale = false;
    return this.replicas;
  }

  /** The name's addresses as `host:port`; UNAVAILABLE naming the target when there are none (gRPC's answer). */
  private async addresses(): Promise<string[]> {
    const { host, port } = this.name;
    let found: readonly DnsAddress[];
    try {
      found = await this.lookup(host);
    } catch (error) {
      const reason = error instanceof Error ? error.message : String(error);
      throw new ConnectError(`${this.target}: DNS resolution of ${host} failed: ${reason}`, Code.Unavailable, undefined, undefined, error);
    }
    const addresses = [...new Set(found.map(({ address, family }) => (family === 6 ? `[${address}]:${port}` : `${address}:${port}`)))];
    if (addresses.length === 0) {
      throw new ConnectError(`${this.target}: DNS resolution of ${host} returned no addresses`, Code.Unavailable);
    }
    return addresses;
  }
}

/** What is left of the call's deadline after resolving (Connect reads <= 0 as "none": keep it positive). */
function remaining(timeoutMs: number | undefined, started: number): number | undefined {
  if (timeoutMs === undefined || timeoutMs <= 0) return timeoutMs;
  return Math.max(1, timeoutMs - (Date.now() - started));
}
