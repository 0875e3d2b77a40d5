/**
 * @tracewire/client: a typed client for the tracewire TraceService.
 * Universal (browser and Node); Node's gRPC transport lives in "@tracewire/client/node".
 */

export { TracewireClient, type CallOptions, type ClientOptions, type Tokenized } from "./client.js";
export { createWebClient, type WebClientOptions, type WebProtocol } from "./web.js";
export { bearerToken } from "./auth.js";
export {
  InvokeBuilder,
  invoke,
  read,
  samplingParams,
  toPrompt,
  traceRequest,
  write,
  type DictionaryReadOptions,
  type DictionaryWriteOptions,
  type LogitsStageName,
  type PositionsInput,
  type PromptInput,
  type ReadAction,
  type ReadRefInput,
  type Sampling,
  type Steps,
  type StopAt,
  type TraceOptionsInit,
  type Where,
  type WriteAction,
} from "./trace.js";
export { TraceRun, rowReads, toStep, type ReadResult, type RowReads, type Step, type TraceResult } from "./stream.js";
export {
  allOf,
  anyOf,
  argmaxIn,
  dictionaryValue,
  entropy,
  featureActive,
  not,
  probeAbove,
  probeBelow,
  sampledIn,
  textContains,
  textMatches,
  tokenProbability,
  type Comparator,
  type Condition,
} from "./conditions.js";
export { Dtype, decodeTensor, float32Tensor, type DecodedTensor, type DtypeArrays, type TensorArray } from "./tensors.js";
export { Code, TracewireError, UnreachableError, statusName, toTracewireError, type Endpoint } from "./errors.js";
export {
  DictionaryKind,
  ProbeActivation,
  SaeActivation,
  type Dictionary,
  type DictionarySpec,
} from "./gen/tracewire/v1/dictionary_pb.js";
/** The generated tracewire.v1 messages and service, for anything the typed layer does not cover. */
export * as v1 from "./v1.js";
