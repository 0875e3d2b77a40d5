/**
 * The bearer token of a server started with --auth-tokens: an interceptor that sends
 * `authorization: Bearer TOKEN` with every call, on either transport.
 */

import type { Interceptor } from "@connectrpc/connect";
import { Code, TracewireError } from "./errors.js";

export function bearerToken(token: string): Interceptor {
  const trimmed = token.trim();
  if (!trimmed) {
    throw new TracewireError("the token is empty", Code.InvalidArgument);
  }
  const value = `Bearer ${trimmed}`;
  return (next) => async (request) => {
    request.header.set("authorization", value);
    return next(request);
  };
}

/** The interceptors a client's options ask for: its token's first, then the caller's own. */
export function withToken(token: string | undefined, interceptors: readonly Interceptor[] = []): Interceptor[] {
  return token === undefined ? [...interceptors] : [bearerToken(token), ...interceptors];
}
