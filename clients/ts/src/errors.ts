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

/** The TracewireError for anything a call threw (a ConnectError, an abort, a network error). */
export function toTracewireError(error: unknown): TracewireError {
  if (error instanceof TracewireError) {
    return error;
  }
  const connect = ConnectError.from(error);
  return new TracewireError(connect.rawMessage, connect.code, badRequestField(connect), { cause: error });
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
