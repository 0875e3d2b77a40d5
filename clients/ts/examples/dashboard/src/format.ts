/**
 * How the dashboard writes numbers, tokens and errors: pure functions, no DOM and no imports,
 * so the Node tests run them directly (test/dashboard-format.standalone.test.ts).
 */

/**
 * A probability as people read it: "42.1%", "0.53%", and below 0.1% scientific ("3.1e-4"),
 * where a fixed number of decimals would print "0.00%" for everything the model ruled out.
 */
export function formatProb(prob: number): string {
  if (!Number.isFinite(prob)) {
    return "?";
  }
  if (prob <= 0) {
    return "0";
  }
  if (prob >= 0.1) {
    return `${(prob * 100).toFixed(1)}%`;
  }
  if (prob >= 0.001) {
    return `${(prob * 100).toFixed(2)}%`;
  }
  return prob.toExponential(1); // "3.1e-4"
}

/** Token ids the model info names: they get a name instead of their (often empty) text. */
export interface SpecialTokens {
  readonly eos: readonly number[];
  readonly bos: number | undefined;
}

export const NO_SPECIAL_TOKENS: SpecialTokens = { eos: [], bos: undefined };

/** A token as the page shows it: `text` is what it reads, `special` marks a non-text token. */
export interface TokenLabel {
  readonly text: string;
  readonly special: boolean;
}

/**
 * A token made visible. Ordinary text is quoted with its escapes (`" Paris"`, `"\n"`), so
 * leading spaces and newlines show; EOS / BOS are named (`⟨EOS⟩`, with their text when the
 * tokenizer gives them one: `⟨EOS </s>⟩`); any other token that decodes to nothing shows
 * its id (`⟨#0⟩`) rather than an empty label.
 */
export function tokenLabel(text: string, tokenId: number, specials: SpecialTokens): TokenLabel {
  const name = specials.eos.includes(tokenId) ? "EOS" : specials.bos === tokenId ? "BOS" : undefined;
  if (name !== undefined) {
    return { text: text ? `⟨${name} ${text}⟩` : `⟨${name}⟩`, special: true };
  }
  if (text === "") {
    return { text: `⟨#${tokenId}⟩`, special: true };
  }
  return { text: JSON.stringify(text), special: false };
}

/** The form's controls that a server error can point at (their element ids in index.html). */
export type ControlId = "prompt" | "max-tokens" | "top-k" | "temperature" | "ignore-eos";

/** What the user sees for each control: the label next to it on the page. */
export const CONTROL_NAMES: Readonly<Record<ControlId, string>> = {
  prompt: "prompt",
  "max-tokens": "max tokens",
  "top-k": "top-k",
  temperature: "temperature",
  "ignore-eos": "ignore EOS",
};

/**
 * Status field paths (google.rpc.BadRequest) -> the control that sets them. The dashboard's
 * request has one read (`read.logprobs(k)`, from top-k) and the form's sampling; the paths are
 * the server's (frontend/compiler.py, sampling.py, prompts.py), request-level or per invoke.
 */
const FIELD_CONTROLS: readonly (readonly [RegExp, ControlId])[] = [
  [/(^|\.)read_logprobs\.top_k$/, "top-k"],
  [/(^|\.)sampling_params\.max_tokens$/, "max-tokens"],
  [/(^|\.)sampling_params\.temperature$/, "temperature"],
  [/(^|\.)sampling_params\.ignore_eos$/, "ignore-eos"],
  [/(^|\.)prompt(\.|$)/, "prompt"],
];

/** The control behind a status's field path; undefined for fields the form does not set. */
export function controlForField(field: string | undefined): ControlId | undefined {
  if (!field) {
    return undefined;
  }
  return FIELD_CONTROLS.find(([pattern]) => pattern.test(field))?.[1];
}

/**
 * The short line next to a control: "top-k: must be in [0, 32000] ..." — the server's message
 * without its field path (it says "PATH: why"), prefixed with the control's name.
 */
export function controlMessage(control: ControlId, field: string, message: string): string {
  const prefix = `${field}: `;
  const why = message.startsWith(prefix) ? message.slice(prefix.length) : message;
  return `${CONTROL_NAMES[control]}: ${why}`;
}

/**
 * A logit-lens cell's colours: probability as the blue's depth (white at 0, deep at 1), the
 * text white once the background is dark enough that black would not read.
 */
export function lensColors(prob: number): { readonly background: string; readonly text: string } {
  const p = Number.isFinite(prob) ? Math.min(Math.max(prob, 0), 1) : 0;
  const lightness = Math.round(97 - 62 * p); // 97% .. 35%
  return { background: `hsl(212 70% ${lightness}%)`, text: lightness < 60 ? "#ffffff" : "#1d232b" };
}

/**
 * The banner's line when no server answered at `target` (the client's UnreachableError: its
 * `reason`): how to start one, and how to point this page at another (?server=).
 */
export function unreachableMessage(target: string, reason: string): string {
  return `cannot reach a tracewire server at ${target} (${reason}): start one (make serve), or open this page with ?server=URL of its HTTP port (--http-port)`;
}
