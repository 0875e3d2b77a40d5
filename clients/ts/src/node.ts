/**
 * Node entry point (`@tracewire/client/node`): everything in the package plus
 * createNodeClient, kept apart so browser bundles never import node:http2.
 */

import { Http2SessionManager, createGrpcTransport, type GrpcTransportOptions } from "@connectrpc/connect-node";
import { withToken } from "./auth.js";
import { Code, TracewireError } from "./errors.js";
import { TracewireClient, type ClientOptions } from "./client.js";
import { replicaAddresses, replicaTransport } from "./replicas.js";
import { dnsReplicaTransport, parseDnsTarget, type Connection, type DnsOptions } from "./dns_replicas.js";

export * from "./index.js";
export { DEFAULT_RETRY, ReplicaTransport, replicaAddresses, replicaTransport, type RetryPolicy } from "./replicas.js";
export { DEFAULT_RERESOLVE_MS, dnsReplicaTransport, parseDnsTarget, type DnsAddress, type DnsLookup, type DnsOptions } from "./dns_replicas.js";

/** TLS for the gRPC port (the server's --tls-cert; --tls-client-ca: present cert and key). PEM. */
export interface NodeTlsOptions {
  /** CA certificates to trust instead of Node's bundled ones (a self-signed or private CA). */
  readonly ca?: string | Buffer;
  /** The client certificate and its private key, for mutual TLS. */
  readonly cert?: string | Buffer;
  readonly key?: string | Buffer;
}

export interface NodeClientOptions extends ClientOptions {
  /**
   * TLS: `true` trusts Node's bundled CAs, an object sets them and / or a client certificate.
   * A URL without a scheme is then https://. (Or set transport.nodeOptions yourself.)
   */
  readonly tls?: boolean | NodeTlsOptions;
  /** Extra options for connect-node's gRPC transport (TLS nodeOptions, interceptors, limits...). */
  readonly transport?: Omit<GrpcTransportOptions, "baseUrl">;
  /** A `dns:` target's resolver and re-resolution interval (defaults: the OS's, 30 s). */
  readonly dns?: DnsOptions;
}

/**
 * A client speaking gRPC over HTTP/2 to the server's gRPC port, e.g. "http://127.0.0.1:50051"
 * ("127.0.0.1:50051", the Python SDK's form, means plaintext http:// too; https:// with `tls`).
 * Connect-ES v2's gRPC transport is always HTTP/2, so there is no httpVersion to choose. Call
 * client.close() when done.
 *
 * Several replicas (README: Replicas): gRPC's address list, "ipv4:10.0.0.1:50051,10.0.0.2:50051"
 * (as the Python SDK takes it), or a list of URLs. Calls then go round-robin over them, and a
 * call refused with UNAVAILABLE before any response is retried on the next one (replicas.ts).
 * A DNS name, "dns:///tracewire.default.svc:50051", names the replicas it resolves to, resolved
 * with the OS resolver before the first call and again at most every 30 s (dns_replicas.ts).
 */
export function createNodeClient(target: string | readonly string[], options: NodeClientOptions = {}): TracewireClient {
  const endpoint = { target: typeof target === "string" ? target : target.join(", "), howToSet: NODE_HOW_TO_SET };
  const name = typeof target === "string" ? parseDnsTarget(target) : undefined;
  if (name) {
    if (options.transport?.sessionManager) {
      throw new TracewireError("transport.sessionManager: one session serves one server, not a DNS name's replicas", Code.InvalidArgument);
    }
    // With TLS, the certificate names the host, not each address it resolves to (as gRPC checks it).
    const connectTo = (address: string): Connection => connect(address, options, name.host);
    const transport = dnsReplicaTransport(target as string, connectTo, options.dns);
    return new TracewireClient(transport, options, () => transport.close(), endpoint);
  }
  const addresses = replicaAddresses(target);
  if (addresses.length > 1 && options.transport?.sessionManager) {
    throw new TracewireError("transport.sessionManager: one session serves one server, not a list of replicas", Code.InvalidArgument);
  }
  const connections = addresses.map((address) => connect(address, options));
  const transport =
    connections.length === 1 ? connections[0]!.transport : replicaTransport(connections.map((c) => c.transport));
  return new TracewireClient(transport, options, () => connections.forEach((c) => c.release()), endpoint);
}

/** How an UnreachableError says to give another server. */
const NODE_HOW_TO_SET = 'createNodeClient("http://HOST:PORT"), the server\'s gRPC port (--port)';

/** One server's gRPC transport, and how to end its HTTP/2 connection. */
function connect(url: string, options: NodeClientOptions, servername?: string): Connection {
  const tls = options.tls === true ? {} : options.tls || undefined;
  const baseUrl = /^[a-z][a-z0-9+.-]*:\/\//i.test(url) ? url : `${tls ? "https" : "http"}://${url}`;
  if (tls && !baseUrl.startsWith("https://")) {
    throw new TracewireError(`tls needs an https:// URL, not ${baseUrl}`, Code.InvalidArgument);
  }
  const given = options.transport ?? {};
  const transportOptions = {
    ...given,
    interceptors: withToken(options.token, given.interceptors),
    ...(tls ? { nodeOptions: { ...(servername ? { servername } : {}), ...given.nodeOptions, ...tls } } : {}),
  };
  // A session manager of our own (unless given one: then closing it is the caller's business),
  // so that client.close() can end the HTTP/2 connection.
  const own = transportOptions.sessionManager
    ? undefined
    : new Http2SessionManager(baseUrl, transportOptions, transportOptions.nodeOptions);
  const sessionManager = transportOptions.sessionManager ?? own;
  const transport = createGrpcTransport({ ...transportOptions, baseUrl, sessionManager });
  return { transport, release: () => own?.abort() };
}
