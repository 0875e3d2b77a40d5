/**
 * Declarative conditions (tracewire.v1.Condition), evaluated on the server per
 * step. Data only: a regex travels as a string and runs in the server's RE2 (linear time).
 *
 * The logits they look at: on a write, before the draw, the row before any of the step's
 * writes (read.logits({ stage: "before_writes" })); on a read or a stop, after the draw,
 * the row drawn from ("processed", the writes included).
 */

import { create } from "@bufbuild/protobuf";
import { Comparison, ConditionSchema, type Condition } from "./gen/tracewire/v1/intervention_pb.js";

export type { Condition };

/** ">", ">=", "<", "<=" as the proto's Comparison. */
export type Comparator = ">" | ">=" | "<" | "<=";

const COMPARISONS: Record<Comparator, Comparison> = {
  ">": Comparison.GREATER,
  ">=": Comparison.GREATER_EQUAL,
  "<": Comparison.LESS,
  "<=": Comparison.LESS_EQUAL,
};

/** The drawn token is one of these. */
export function sampledIn(tokenIds: number | readonly number[]): Condition {
  return create(ConditionSchema, { kind: { case: "sampledIn", value: { tokenIds: idList(tokenIds) } } });
}

/** The argmax of the logits is one of these (which stage: see above). */
export function argmaxIn(tokenIds: number | readonly number[]): Condition {
  return create(ConditionSchema, { kind: { case: "argmaxIn", value: { tokenIds: idList(tokenIds) } } });
}

/** The generated text so far (as streamed, whole) contains `text` (at most 1024 characters). */
export function textContains(text: string): Condition {
  return create(ConditionSchema, { kind: { case: "textContains", value: text } });
}

/**
 * The generated text so far (as streamed) matches this pattern: RE2 syntax (no backreferences
 * or lookaround), at most 1024 characters, searched in the last 4096 characters of the text.
 */
export function textMatches(pattern: string): Condition {
  return create(ConditionSchema, { kind: { case: "textMatches", value: pattern } });
}

/** A token's probability (the drawn token's when tokenId is omitted) compares to a threshold. */
export function tokenProbability(op: Comparator, value: number, tokenId?: number): Condition {
  const threshold = { comparison: COMPARISONS[op], value };
  return create(ConditionSchema, { kind: { case: "tokenProbability", value: { tokenId, threshold } } });
}

/** The entropy (nats) of the logits' distribution compares to a threshold (which stage: see above). */
export function entropy(op: Comparator, value: number): Condition {
  return create(ConditionSchema, { kind: { case: "entropy", value: { comparison: COMPARISONS[op], value } } });
}

export function allOf(...conditions: Condition[]): Condition {
  return create(ConditionSchema, { kind: { case: "allOf", value: { conditions } } });
}

export function anyOf(...conditions: Condition[]): Condition {
  return create(ConditionSchema, { kind: { case: "anyOf", value: { conditions } } });
}

export function not(condition: Condition): Condition {
  return create(ConditionSchema, { kind: { case: "not", value: condition } });
}

function idList(tokenIds: number | readonly number[]): number[] {
  return typeof tokenIds === "number" ? [tokenIds] : [...tokenIds];
}

/*
 * Dictionary values (linear probes, SAEs: read.dictionary), at the new token's position of
 * the dictionary's module: closed-loop control inside the engine. Which step's value a
 * condition sees: on reads and stops at step s, the value step s's forward pass computed
 * (what read.dictionary at the new token returns at step s); on writes, decided before
 * step s's forward pass, step s - 1's (one step late; at step 0 there is none and the
 * condition is false, its not() true).
 */

/** A probe output (after its activation) or an SAE feature activation compares to a threshold. */
export function dictionaryValue(dictionary: string, feature: number, op: Comparator, value: number): Condition {
  const threshold = { comparison: COMPARISONS[op], value };
  return create(ConditionSchema, { kind: { case: "dictionaryValue", value: { dictionary, feature, threshold } } });
}

/** Probe `dictionary`'s output `output` (default 0) is above the threshold. */
export function probeAbove(dictionary: string, threshold: number, output = 0): Condition {
  return dictionaryValue(dictionary, output, ">", threshold);
}

/** Probe `dictionary`'s output `output` (default 0) is below the threshold. */
export function probeBelow(dictionary: string, threshold: number, output = 0): Condition {
  return dictionaryValue(dictionary, output, "<", threshold);
}

/** SAE `dictionary`'s feature has an activation above the threshold (default 0: active). */
export function featureActive(dictionary: string, feature: number, threshold = 0): Condition {
  return dictionaryValue(dictionary, feature, ">", threshold);
}
