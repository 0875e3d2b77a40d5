/**
 * Browser transport: the server's HTTP port (not its gRPC port, which is HTTP/2-only and
 * unreachable from fetch) speaking gRPC-Web or the Connect protocol.
 */

import { createConnectTransport, createGrpcWebTransport } from "@connectrpc/connect-web";
import type { Interceptor } from "@connectrpc/connect";
import { withToken } from "./auth.js";
import { Code, TracewireError } from "./errors.js";
import { TracewireClient, type ClientOptions } from "./client.js";

/** The wire protocol of the server's HTTP port. */
export type WebProtocol = "grpc-web" | "connect";

export interface WebClientOptions extends ClientOptions {
  /** "grpc-web" (the default) or "connect"; whichever the server's HTTP port speaks. */
  readonly protocol?: WebProtocol;
  /** JSON instead of binary protobuf on the wire (binary by default: smaller tensors). */
  readonly useJson?: boolean;
  readonly interceptors?: Interceptor[];
  /** A fetch of your own (defaults to globalThis.fetch). */
  readonly fetch?: typeof globalThis.fetch;
}

/** How an UnreachableError says to give another server. */
const WEB_HOW_TO_SET = 'createWebClient("http://HOST:PORT"), the server\'s HTTP port (--http-port)';

/** A client for the browser (or any fetch runtime), e.g. createWebClient("http://127.0.0.1:8080"). */
export function createWebClient(baseUrl: string, options: WebClientOptions = {}): TracewireClient {
  const common = {
    baseUrl,
    useBinaryFormat: !options.useJson,
    interceptors: withToken(options.token, options.interceptors),
    ...(options.fetch ? { fetch: options.fetch } : {}),
  };
  const protocol = options.protocol ?? "grpc-web";
  const endpoint = { target: baseUrl, howToSet: WEB_HOW_TO_SET };
  switch (protocol) {
    case "grpc-web":
      return new TracewireClient(createGrpcWebTransport(common), options, undefined, endpoint);
    case "connect":
      return new TracewireClient(createConnectTransport(common), options, undefined, endpoint);
    default:
      // Reached only from untyped JavaScript.
      throw new TracewireError(`unknown web protocol "${String(protocol)}": "grpc-web" or "connect"`, Code.InvalidArgument);
  }
}
