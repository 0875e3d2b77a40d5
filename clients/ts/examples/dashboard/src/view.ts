/**
 * The DOM: one row per step (its token and top-k candidates as probability bars), the
 * continuation as text, a status line and an error banner. Everything the server sends
 * goes in through textContent / attributes, never as HTML.
 *
 * Stable hooks for tests and scripts: #status[data-state][data-run], #error[data-status][data-field],
 * .step[data-step][data-token-id][data-forced], .candidate[data-step][data-token-id][data-prob][data-chosen].
 */

import { Code, TracewireError } from "@tracewire/client";
import { showToken, type TokenLabels } from "./labels.js";
import type { StepView } from "./model.js";

export type RunState = "idle" | "running" | "done" | "error";

export interface Elements {
  readonly form: HTMLFormElement;
  readonly prompt: HTMLInputElement;
  readonly maxTokens: HTMLInputElement;
  readonly topK: HTMLInputElement;
  readonly temperature: HTMLInputElement;
  readonly ignoreEos: HTMLInputElement;
  readonly server: HTMLElement;
  readonly status: HTMLElement;
  readonly error: HTMLElement;
  readonly text: HTMLElement;
  readonly previous: HTMLElement;
  readonly steps: HTMLElement;
}

/** The page's elements by id; a missing one is a bug in index.html. */
export function findElements(doc: Document): Elements {
  const get = <T extends HTMLElement>(id: string, type: new () => T): T => {
    const el = doc.getElementById(id);
    if (!(el instanceof type)) {
      throw new Error(`index.html lacks #${id} (${type.name})`);
    }
    return el;
  };
  return {
    form: get("run-form", HTMLFormElement),
    prompt: get("prompt", HTMLInputElement),
    maxTokens: get("max-tokens", HTMLInputElement),
    topK: get("top-k", HTMLInputElement),
    temperature: get("temperature", HTMLInputElement),
    ignoreEos: get("ignore-eos", HTMLInputElement),
    server: get("server", HTMLElement),
    status: get("status", HTMLElement),
    error: get("error", HTMLElement),
    text: get("text", HTMLElement),
    previous: get("previous", HTMLElement),
    steps: get("steps", HTMLElement),
  };
}

export function setStatus(els: Elements, state: RunState, run: number, message: string): void {
  els.status.dataset.state = state;
  els.status.dataset.run = String(run);
  els.status.textContent = message;
}

/**
 * The red banner: the status name and the offending field, as the server said them.
 * `hint` follows errors that never reached the server (fetch refused: down, wrong port, CORS).
 */
export function showError(els: Elements, error: unknown, hint?: string): void {
  const tw = error instanceof TracewireError ? error : undefined;
  const status = tw?.status ?? "ERROR";
  els.error.dataset.status = status;
  els.error.dataset.field = tw?.field ?? "";
  els.error.replaceChildren(
    span("error-status", status),
    ...(tw?.field ? [span("error-field", tw.field)] : []),
    span("error-message", error instanceof Error ? error.message : String(error)),
    ...(hint && tw?.code === Code.Unknown ? [span("error-hint", hint)] : []),
  );
  els.error.hidden = false;
}

export function clearError(els: Elements): void {
  els.error.hidden = true;
  els.error.replaceChildren();
  delete els.error.dataset.status;
  delete els.error.dataset.field;
}

/** A new run: the prompt in the text line, no rows yet; the last run's text kept for comparison. */
export function startRun(els: Elements, prompt: string, previousText: string | undefined): void {
  els.text.replaceChildren(span("prompt", prompt));
  els.steps.replaceChildren();
  els.previous.hidden = previousText === undefined;
  els.previous.textContent = previousText === undefined ? "" : `before: ${prompt}${previousText}`;
}

/** Append one streamed step: its piece of text and its row of candidates. */
export function addStep(els: Elements, labels: TokenLabels, step: StepView): void {
  const piece = span(step.forced ? "piece forced" : "piece", step.text);
  piece.dataset.step = String(step.step);
  els.text.append(piece);

  const row = document.createElement("li");
  row.className = "step";
  row.dataset.step = String(step.step);
  row.dataset.tokenId = String(step.tokenId);
  row.dataset.forced = String(step.forced);
  const chosen = label(labels, step.tokenId, "chosen");
  const p = step.prob === undefined ? "?" : percent(step.prob);
  const prob = span("chosen-prob", step.forced ? `forced (was ${p})` : p);
  const candidates = document.createElement("div");
  candidates.className = "candidates";
  candidates.append(...step.candidates.map((c) => candidateButton(labels, step, c.tokenId, c.prob)));
  row.append(span("index", String(step.step)), chosen, prob, candidates);
  els.steps.append(row);
}

function candidateButton(labels: TokenLabels, step: StepView, tokenId: number, prob: number): HTMLButtonElement {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "candidate";
  button.dataset.step = String(step.step);
  button.dataset.tokenId = String(tokenId);
  button.dataset.prob = String(prob);
  button.dataset.chosen = String(tokenId === step.tokenId);
  button.title = `force token ${tokenId} at step ${step.step} and re-run`;
  const bar = span("bar", "");
  bar.style.width = percent(prob);
  button.append(bar, label(labels, tokenId, "label"), span("prob", percent(prob)));
  return button;
}

/** A token's label: its id at once, its text once Detokenize answers. */
function label(labels: TokenLabels, tokenId: number, className: string): HTMLSpanElement {
  const el = span(className, `#${tokenId}`);
  el.dataset.labelFor = String(tokenId);
  void labels.get(tokenId).then((text) => {
    el.textContent = showToken(text);
  });
  return el;
}

function span(className: string, text: string): HTMLSpanElement {
  const el = document.createElement("span");
  el.className = className;
  el.textContent = text;
  return el;
}

function percent(prob: number): string {
  return `${(prob * 100).toFixed(prob >= 0.1 ? 1 : 2)}%`;
}
