/**
 * Node entry point (`@tracewire/client/node`): everything in the package plus
 * createNodeClient, kept apart so browser bundles never import node:http2.
 */

import { createGrpcTransport, type GrpcTransportOptions } from "@connectrpc/connect-node";
import { TracewireClient, type ClientOptions } from "./client.js";

export * from "./index.js";

export interface NodeClientOptions extends ClientOptions {
  /** Extra options for connect-node's gRPC transport (TLS nodeOptions, interceptors, limits...). */
  readonly transport?: Omit<GrpcTransportOptions, "baseUrl">;
}

/**
 * A client speaking gRPC over HTTP/2 to the server's gRPC port, e.g. "http://127.0.0.1:50051"
 * ("127.0.0.1:50051", the Python SDK's form, means plaintext http:// too). Connect-ES v2's gRPC
 * transport is always HTTP/2, so there is no httpVersion to choose.
 */
export function createNodeClient(url: string, options: NodeClientOptions = {}): TracewireClient {
  const baseUrl = /^[a-z][a-z0-9+.-]*:\/\//i.test(url) ? url : `http://${url}`;
  const transport = createGrpcTransport({ ...options.transport, baseUrl });
  return new TracewireClient(transport, options);
}
