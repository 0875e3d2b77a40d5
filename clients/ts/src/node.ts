/**
 * Node entry point (`@tracewire/client/node`): everything in the package plus
 * createNodeClient, kept apart so browser bundles never import node:http2.
 */

import { Http2SessionManager, createGrpcTransport, type GrpcTransportOptions } from "@connectrpc/connect-node";
import { withToken } from "./auth.js";
import { Code, TracewireError } from "./errors.js";
import { TracewireClient, type ClientOptions } from "./client.js";

export * from "./index.js";

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
}

/**
 * A client speaking gRPC over HTTP/2 to the server's gRPC port, e.g. "http://127.0.0.1:50051"
 * ("127.0.0.1:50051", the Python SDK's form, means plaintext http:// too; https:// with `tls`).
 * Connect-ES v2's gRPC transport is always HTTP/2, so there is no httpVersion to choose. Call
 * client.close() when done.
 */
export function createNodeClient(url: string, options: NodeClientOptions = {}): TracewireClient {
  const tls = options.tls === true ? {} : options.tls || undefined;
  const baseUrl = /^[a-z][a-z0-9+.-]*:\/\//i.test(url) ? url : `${tls ? "https" : "http"}://${url}`;
  if (tls && !baseUrl.startsWith("https://")) {
    throw new TracewireError(`tls needs an https:// URL, not ${baseUrl}`, Code.InvalidArgument);
  }
  const given = options.transport ?? {};
  const transportOptions = {
    ...given,
    interceptors: withToken(options.token, given.interceptors),
    ...(tls ? { nodeOptions: { ...given.nodeOptions, ...tls } } : {}),
  };
  // A session manager of our own (unless given one: then closing it is the caller's business),
  // so that client.close() can end the HTTP/2 connection.
  const own = transportOptions.sessionManager
    ? undefined
    : new Http2SessionManager(baseUrl, transportOptions, transportOptions.nodeOptions);
  const sessionManager = transportOptions.sessionManager ?? own;
  const transport = createGrpcTransport({ ...transportOptions, baseUrl, sessionManager });
  return new TracewireClient(transport, options, () => own?.abort());
}
