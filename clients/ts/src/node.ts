/**
 * Node entry point (`@tracewire/client/node`): everything in the package plus
 * createNodeClient, kept apart so browser bundles never import node:http2.
 */

import { Http2SessionManager, createGrpcTransport, type GrpcTransportOptions } from "@connectrpc/connect-node";
import { TracewireClient, type ClientOptions } from "./client.js";

export * from "./index.js";

export interface NodeClientOptions extends ClientOptions {
  /** Extra options for connect-node's gRPC transport (TLS nodeOptions, interceptors, limits...). */
  readonly transport?: Omit<GrpcTransportOptions, "baseUrl">;
}

/**
 * A client speaking gRPC over HTTP/2 to the server's gRPC port, e.g. "http://127.0.0.1:50051"
 * ("127.0.0.1:50051", the Python SDK's form, means plaintext http:// too). Connect-ES v2's gRPC
 * transport is always HTTP/2, so there is no httpVersion to choose. Call client.close() when done.
 */
export function createNodeClient(url: string, options: NodeClientOptions = {}): TracewireClient {
  const baseUrl = /^[a-z][a-z0-9+.-]*:\/\//i.test(url) ? url : `http://${url}`;
  const transportOptions = options.transport ?? {};
  // A session manager of our own (unless given one: then closing it is the caller's business),
  // so that client.close() can end the HTTP/2 connection.
  const own = transportOptions.sessionManager
    ? undefined
    : new Http2SessionManager(baseUrl, transportOptions, transportOptions.nodeOptions);
  const sessionManager = transportOptions.sessionManager ?? own;
  const transport = createGrpcTransport({ ...transportOptions, baseUrl, sessionManager });
  return new TracewireClient(transport, options, () => own?.abort());
}
