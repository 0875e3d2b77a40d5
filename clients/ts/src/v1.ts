/** The generated tracewire.v1 code (src/gen, from proto/ by `make proto`), as one namespace. */

export * from "./gen/tracewire/v1/dictionary_pb.js";
export * from "./gen/tracewire/v1/intervention_pb.js";
export * from "./gen/tracewire/v1/output_pb.js";
export * from "./gen/tracewire/v1/prompt_pb.js";
export * from "./gen/tracewire/v1/sampling_pb.js";
export * from "./gen/tracewire/v1/service_pb.js";
export * from "./gen/tracewire/v1/tensor_pb.js";
export * from "./gen/tracewire/v1/trace_pb.js";
