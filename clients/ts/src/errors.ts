/**
 * Every failed call surfaces as a TracewireError: the gRPC status code and, for
 * INVALID_ARGUMENT, the path of the offending request field.
 *
 * The server names the field in a google.rpc.BadRequest detail of the status
 * (grpc-status-details-bin), exactly what the Python SDK's errors.py reads.
 */

import { Code, ConnectError } from "@connectrpc/connect";
import { BinaryReader, WireType } from "@bufbuild/protobuf/wire";

export { Code };

const BAD_REQUEST = "google.rpc.BadRequest";

export class TracewireError extends Error {
  override readonly name = "TracewireError";
  /** The status code (numerically gRPC's: Code.InvalidArgument === 3). */
  readonly code: Code;
  /** Path of the offending request field, when the error names one (e.g. "invokes[0].interventions[1].steps"). */
  readonly field: string | undefined;

  constructor(message: string, code: Code = Code.Unknown, field?: string, options?: { cause?: unknown }) {
    super(message, options);
    this.code = code;
    this.field = field;
  }

  /** The code as gRPC spells it: "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", ... */
  get status(): string {
    return statusName(this.code);
  }
}

/**
 * Where a client sends its calls, for the message of a call that reached no server: `target`
 * as given, and `howToSet` how to give another ("createNodeClient(\"http://HOST:PORT\")").
 */
export interface Endpoint {
  readonly target: string;
  readonly howToSet: string;
}

/**
 * No server answered at the client's target: nothing listens there (connection refused), a
 * name that does not resolve, a host that cannot be reached, or, in a browser, a request the
 * browser refused to make (fetch says no more: a closed port and a CORS refusal look alike).
 * UNAVAILABLE, as gRPC calls it; the message is one line naming the target and how to give
 * another; `target` and `reason` say the same for code that reports it its own way. It
 * carries no `cause` (Node would print the whole chain of socket errors under it): `reason`
 * is what that chain said.
 */
export class UnreachableError extends TracewireError {
  readonly target: string;
  readonly reason: string;

  constructor(endpoint: Endpoint, reason: string) {
    super(`cannot reach a tracewire server at ${endpoint.target} (${reason}): start one (make serve), or pass its address: ${endpoint.howToSet}`, Code.Unavailable);
    this.target = endpoint.target;
    this.reason = reason;
  }
}

/**
 * The TracewireError for anything a call threw (a ConnectError, an abort, a network error);
 * with the client's `endpoint`, an UnreachableError for a call that reached no server.
 */
export function toTracewireError(error: unknown, endpoint?: Endpoint): TracewireError {
  if (error instanceof TracewireError) {
    return error;
  }
  const connect = ConnectError.from(error);
  const reason = endpoint ? unreachableReason(connect) : undefined;
  if (endpoint && reason !== undefined) {
    return new UnreachableError(endpoint, reason);
  }
  return new TracewireError(connect.rawMessage, connect.code, badRequestField(connect), { cause: error });
}

// Node's errors for a connection that was never made (net.connect, dns.lookup).
const NO_CONNECTION: Readonly<Record<string, string>> = {
  ECONNREFUSED: "connection refused: nothing listens there",
  ENOTFOUND: "the name does not resolve",
  EAI_AGAIN: "the name does not resolve (for now)",
  EHOSTUNREACH: "the host is unreachable",
  ENETUNREACH: "the network is unreachable",
  ETIMEDOUT: "the connection timed out",
};
// fetch's own failure, as browsers and Node word it (Chromium, Firefox, Safari, undici).
const FETCH_FAILED = /^(Failed to fetch|NetworkError when attempting to fetch resource\.?|Load failed|fetch failed)$/;

/**
 * Why a call reached no server, in a few words; undefined for anything else (an error a
 * server answered with, an abort). Node's socket error is somewhere in the cause chain
 * (Connect's error, fetch's TypeError, the system error); a browser's fetch says only that it failed.
 */
export function unreachableReason(error: ConnectError): string | undefined {
  if (error.code !== Code.Unavailable && error.code !== Code.Unknown) return undefined;
  let fetchFailed = false;
  let cause: unknown = error;
  for (let depth = 0; depth < 6 && cause instanceof Error; depth++) {
    const code = (cause as { code?: unknown }).code;
    if (typeof code === "string" && NO_CONNECTION[code]) return NO_CONNECTION[code];
    fetchFailed ||= cause instanceof TypeError && FETCH_FAILED.test(cause.message);
    cause = cause.cause;
  }
  return fetchFailed ? "the request failed: nothing listens there, or its CORS does not allow this page's origin" : undefined;
}

/** "INVALID_ARGUMENT" for Code.InvalidArgument (Code's own names are CamelCase). */
export function statusName(code: Code): string {
  if (code === Code.Canceled) {
    return "CANCELLED"; // gRPC's spelling; Connect's enum says "Canceled"
  }
  return (Code[code] ?? "Unknown").replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase();
}

/** The first field violation of a google.rpc.BadRequest detail, if the error carries one. */
function badRequestField(error: ConnectError): string | undefined {
  for (const detail of error.details) {
    // Details parsed from the wire are {type, value}; outgoing ones (built locally) are not.
    if ("type" in detail && detail.type === BAD_REQUEST) {
      const field = firstViolationField(detail.value);
      if (field !== undefined) {
        return field;
      }
    }
  }
  return undefined;
}

/**
 * Decodes just enough of google.rpc.BadRequest by hand:
 *   BadRequest { repeated FieldViolation field_violations = 1; }
 *   FieldViolation { string field = 1; string description = 2; ... }
 * Generating googleapis' error_details.proto would add a vendored proto tree for two fields.
 */
function firstViolationField(bytes: Uint8Array): string | undefined {
  const reader = new BinaryReader(bytes);
  while (reader.pos < reader.len) {
    const [fieldNo, wireType] = reader.tag();
    if (fieldNo === 1 && wireType === WireType.LengthDelimited) {
      const violation = new BinaryReader(reader.bytes());
      while (violation.pos < violation.len) {
        const [vField, vType] = violation.tag();
        if (vField === 1 && vType === WireType.LengthDelimited) {
          return violation.string();
        }
        violation.skip(vType, vField);
      }
    } else {
      reader.skip(wireType, fieldNo);
    }
  }
  return undefined;
}
