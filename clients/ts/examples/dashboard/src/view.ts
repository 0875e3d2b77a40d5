/**
 * The DOM: one row per step (its token and top-k candidates as probability bars), the
 * continuation as text, a status line and an error banner. Everything the server sends
 * goes in through textContent / attributes, never as HTML.
 *
 * Stable hooks for tests and scripts: #status[data-state][data-run], #error[data-status][data-field][data-control],
 * .field-error[data-control] (next to the control a server error names), .step[data-step][data-token-id][data-forced],
 * .candidate[data-step][data-token-id][data-prob][data-chosen], labels' [data-label-for][data-special];
 * the logit lens: #lens-note[data-available], #lens th.lens-input[data-position][data-token-id],
 * #lens td.lens-cell[data-layer][data-position][data-token-id][data-prob]; steering: #steer-note[data-available],
 * #steer-status[data-state][data-run][data-norm], #steer-plain / #steer-steered (their text, [data-coefficient]).
 */

import { Code, TracewireError, UnreachableError, type Dictionary } from "@tracewire/client";
import { controlForField, controlMessage, formatProb, lensColors, unreachableMessage, type ControlId, type TokenLabel } from "./format.js";
import type { TokenLabels } from "./labels.js";
import type { Availability, FeatureChip, LensColumn, Side, StepView } from "./model.js";

/** "checking" / "offline": the load-time server check; the others: runs ("idle" is ready). */
export type RunState = "checking" | "offline" | "idle" | "running" | "done" | "error";

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
  /** What the steps' place says before the first run. */
  readonly stepsEmpty: HTMLElement;
  readonly lensNote: HTMLElement;
  readonly lens: HTMLTableElement;
  readonly steerNote: HTMLElement;
  readonly steerForm: HTMLFormElement;
  readonly steerLayer: HTMLSelectElement;
  readonly steerA: HTMLInputElement;
  readonly steerB: HTMLInputElement;
  readonly steerCoef: HTMLInputElement;
  readonly steerCoefValue: HTMLOutputElement;
  readonly steerRun: HTMLButtonElement;
  readonly steerStatus: HTMLElement;
  readonly steerPlain: HTMLElement;
  readonly steerSteered: HTMLElement;
  readonly steerSteeredTitle: HTMLElement;
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
    stepsEmpty: get("steps-empty", HTMLElement),
    lensNote: get("lens-note", HTMLElement),
    lens: get("lens", HTMLTableElement),
    steerNote: get("steer-note", HTMLElement),
    steerForm: get("steer-form", HTMLFormElement),
    steerLayer: get("steer-layer", HTMLSelectElement),
    steerA: get("steer-a", HTMLInputElement),
    steerB: get("steer-b", HTMLInputElement),
    steerCoef: get("steer-coef", HTMLInputElement),
    steerCoefValue: get("steer-coef-value", HTMLOutputElement),
    steerRun: get("steer-run", HTMLButtonElement),
    steerStatus: get("steer-status", HTMLElement),
    steerPlain: get("steer-plain", HTMLElement),
    steerSteered: get("steer-steered", HTMLElement),
    steerSteeredTitle: get("steer-steered-title", HTMLElement),
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
  // No server reached: the page's own line (its ?server=, not the client's createWebClient).
  const unreachable = error instanceof UnreachableError;
  const message = unreachable ? unreachableMessage(error.target, error.reason) : error instanceof Error ? error.message : String(error);
  const control = controlForField(tw?.field);
  els.error.dataset.status = status;
  els.error.dataset.field = tw?.field ?? "";
  els.error.dataset.control = control ?? "";
  els.error.replaceChildren(
    ...(control && tw?.field ? [span("error-control", controlMessage(control, tw.field, message))] : []),
    span("error-status", status),
    ...(tw?.field ? [span("error-field", tw.field)] : []),
    span("error-message", message),
    ...(hint && (unreachable || tw?.code === Code.Unknown) ? [span("error-hint", hint)] : []),
  );
  els.error.hidden = false;
  if (control && tw?.field) {
    markControl(els, control, controlMessage(control, tw.field, message));
  }
}

/** The short message next to the control the error names, and the control marked invalid. */
function markControl(els: Elements, control: ControlId, message: string): void {
  const input = controlInput(els, control);
  const note = span("field-error", message);
  note.id = `${control}-error`;
  note.dataset.control = control;
  note.setAttribute("role", "alert");
  input.setAttribute("aria-invalid", "true");
  input.setAttribute("aria-describedby", note.id);
  // After the control's <label> (the prompt has none): the note sits beside what it is about.
  (input.closest("label") ?? input).after(note);
}

function controlInput(els: Elements, control: ControlId): HTMLInputElement {
  const inputs: Record<ControlId, HTMLInputElement> = {
    prompt: els.prompt,
    "max-tokens": els.maxTokens,
    "top-k": els.topK,
    temperature: els.temperature,
    "ignore-eos": els.ignoreEos,
  };
  return inputs[control];
}

export function clearError(els: Elements): void {
  els.error.hidden = true;
  els.error.replaceChildren();
  delete els.error.dataset.status;
  delete els.error.dataset.field;
  delete els.error.dataset.control;
  els.form.querySelectorAll(".field-error").forEach((note) => note.remove());
  els.form.querySelectorAll("[aria-invalid]").forEach((input) => {
    input.removeAttribute("aria-invalid");
    input.removeAttribute("aria-describedby");
  });
}

/** A new run: the prompt in the text line, no rows yet; the last run's text kept for comparison. */
export function startRun(els: Elements, prompt: string, previousText: string | undefined): void {
  els.text.replaceChildren(span("prompt", prompt));
  els.steps.replaceChildren();
  els.stepsEmpty.hidden = true;
  els.previous.hidden = previousText === undefined;
  els.previous.textContent = previousText === undefined ? "" : `before: ${prompt}${previousText}`;
}

/** Append one streamed step: its piece of text and its row of candidates. */
export function addStep(els: Elements, labels: TokenLabels, step: StepView): void {
  const piece = span(step.forced ? "piece forced" : "piece", step.text);
  piece.dataset.step = String(step.step);
  if (step.text === "") {
    // EOS and other tokens with no text: a visible marker (CSS ::after), the text itself stays "".
    void labels.get(step.tokenId).then((l) => {
      piece.dataset.special = l.text;
    });
  }
  els.text.append(piece);

  const row = document.createElement("li");
  row.className = "step";
  row.dataset.step = String(step.step);
  row.dataset.tokenId = String(step.tokenId);
  row.dataset.forced = String(step.forced);
  const chosen = label(labels, step.tokenId, "chosen");
  const p = step.prob === undefined ? "?" : formatProb(step.prob);
  const prob = span("chosen-prob", step.forced ? `forced (was ${p})` : p);
  const candidates = document.createElement("div");
  candidates.className = "candidates";
  candidates.append(...step.candidates.map((c) => candidateButton(labels, step, c.tokenId, c.prob)));
  if (step.candidates.length === 0) {
    candidates.append(span("no-candidates", "no candidates read (top-k 0): only the drawn token's probability"));
  }
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
  bar.style.width = `${Math.min(Math.max(prob, 0), 1) * 100}%`;
  button.append(bar, label(labels, tokenId, "label"), span("prob", formatProb(prob)));
  return button;
}

/**
 * A token's label: its id at once, its text once Detokenize answers. The whole token always
 * shows (the CSS wraps long ones); the tooltip repeats it with its id.
 */
function label(labels: TokenLabels, tokenId: number, className: string): HTMLSpanElement {
  const el = span(className, `#${tokenId}`);
  el.dataset.labelFor = String(tokenId);
  el.title = `token ${tokenId}`;
  void labels.get(tokenId).then((l: TokenLabel) => {
    el.textContent = l.text;
    el.title = `${l.text} (token ${tokenId})`;
    el.dataset.special = String(l.special);
  });
  return el;
}

function span(className: string, text: string): HTMLSpanElement {
  const el = document.createElement("span");
  el.className = className;
  el.textContent = text;
  return el;
}

/* The logit lens --------------------------------------------------------------------- */

/** Whether the lens runs on this server; when not, the note says why and no table is drawn. */
export function showLensAvailability(els: Elements, availability: Availability): void {
  els.lensNote.dataset.available = String(availability.available);
  if (!availability.available) {
    els.lensNote.textContent = `Not available: ${availability.reason}`;
    els.lens.hidden = true;
  }
}

/**
 * A new run's heatmap: one row per layer, the last layer on top (the model's own guess), and
 * a bottom row of the tokens each column reads; columns are added as the steps stream in.
 */
export function startLens(els: Elements, layers: readonly number[]): void {
  const body = document.createElement("tbody");
  for (const layer of [...layers].reverse()) {
    const row = document.createElement("tr");
    row.dataset.layer = String(layer);
    const head = document.createElement("th");
    head.scope = "row";
    head.textContent = `layer ${layer}`;
    row.append(head);
    body.append(row);
  }
  const inputs = document.createElement("tr");
  inputs.className = "lens-inputs";
  const corner = document.createElement("th");
  corner.textContent = "reads";
  inputs.append(corner);
  body.append(inputs);
  els.lens.replaceChildren(body);
  // Shown with its first column: a run that fails before its first step leaves no empty grid.
  els.lens.hidden = true;
}

/** A step's columns: a cell per layer (top token, probability as colour), the token read below. */
export function addLensColumns(
  els: Elements,
  labels: TokenLabels,
  columns: readonly LensColumn[],
  inputToken: (position: number) => number | undefined,
): void {
  for (const column of columns) {
    for (const cell of column.cells) {
      const row = els.lens.querySelector<HTMLTableRowElement>(`tr[data-layer='${cell.layer}']`);
      if (!row) continue;
      const td = document.createElement("td");
      td.className = "lens-cell";
      td.dataset.layer = String(cell.layer);
      td.dataset.position = String(cell.position);
      td.dataset.tokenId = String(cell.tokenId);
      td.dataset.prob = String(cell.prob);
      const colors = lensColors(cell.prob);
      td.style.background = colors.background;
      td.style.color = colors.text;
      const name = label(labels, cell.tokenId, "lens-token");
      td.append(name, span("lens-prob", formatProb(cell.prob)));
      row.append(td);
    }
    const inputs = els.lens.querySelector<HTMLTableRowElement>("tr.lens-inputs");
    const th = document.createElement("th");
    th.className = "lens-input";
    th.dataset.position = String(column.position);
    const tokenId = inputToken(column.position);
    if (tokenId !== undefined) {
      th.dataset.tokenId = String(tokenId);
      th.append(label(labels, tokenId, "lens-token"));
    }
    inputs?.append(th);
    els.lens.hidden = false;
  }
}

/* Steering ------------------------------------------------------------------------------ */

/** The layer choices, and the whole control off (with the reason) when the server cannot run it. */
export function setUpSteering(els: Elements, layers: readonly number[], availability: Availability): void {
  els.steerLayer.replaceChildren(
    ...layers.map((layer) => {
      const option = document.createElement("option");
      option.value = String(layer);
      option.textContent = `layers.${layer}`;
      return option;
    }),
  );
  // A middle layer: early enough to change what follows, late enough to carry the prompts' meaning.
  els.steerLayer.value = String(layers[Math.floor((layers.length - 1) / 2)] ?? 0);
  els.steerNote.dataset.available = String(availability.available);
  if (!availability.available) {
    els.steerNote.textContent = `Not available: ${availability.reason}`;
    for (const control of els.steerForm.elements) (control as HTMLInputElement).disabled = true;
    for (const side of [els.steerPlain, els.steerSteered]) side.replaceChildren(span("empty", "not on this server: see above"));
  }
}

export function showCoefficient(els: Elements): void {
  els.steerCoefValue.textContent = els.steerCoef.value;
}

export function setSteerStatus(els: Elements, state: RunState, run: number, message: string): void {
  els.steerStatus.dataset.state = state;
  els.steerStatus.dataset.run = String(run);
  els.steerStatus.textContent = message;
}

/** A new comparison: both texts start from the prompt; the steered side names its coefficient. */
export function startSteering(els: Elements, prompt: string, coefficient: number, vectorNorm: number): void {
  els.steerStatus.dataset.norm = String(vectorNorm);
  els.steerSteeredTitle.textContent = `steered (coefficient ${coefficient}, |vector| ${vectorNorm.toFixed(2)})`;
  for (const side of [els.steerPlain, els.steerSteered]) {
    side.replaceChildren(span("prompt", prompt));
    side.dataset.coefficient = String(coefficient);
  }
}

export function addSteeringText(els: Elements, side: Side, text: string): void {
  (side === "plain" ? els.steerPlain : els.steerSteered).append(span("piece", text));
}

/* ---------------------------------------------------------------------------------------
 * The feature strip (model.ts: stripChoices, featureStrip): under each step's row, the top
 * features of the chosen dictionary with their labels. The panel with the dictionary picker
 * stays hidden while the server lists no SAE (or cannot read modules).
 * Hooks: #features-panel[hidden], #dictionary (a select of names),
 * .features[data-step][data-dictionary], .feature[data-feature][data-value].
 */

export interface FeatureElements {
  readonly panel: HTMLElement;
  readonly dictionary: HTMLSelectElement;
  /** Why there is no strip, when the server lists SAEs it cannot read. */
  readonly note: HTMLElement;
}

export function findFeatureElements(doc: Document): FeatureElements {
  const panel = doc.getElementById("features-panel");
  const dictionary = doc.getElementById("dictionary");
  const note = doc.getElementById("features-note");
  if (!(panel instanceof HTMLElement) || !(dictionary instanceof HTMLSelectElement) || !(note instanceof HTMLElement)) {
    throw new Error("index.html lacks #features-panel / #dictionary (select) / #features-note");
  }
  return { panel, dictionary, note };
}

/**
 * The picker's options (name, size, module, description as the tooltip); hidden when there are
 * none, and then `unavailable` (why the server's SAEs cannot be read here), if any, in its place.
 */
export function showDictionaries(els: FeatureElements, choices: readonly Dictionary[], selected?: string, unavailable?: string): void {
  els.note.hidden = unavailable === undefined || choices.length > 0;
  els.note.textContent = els.note.hidden ? "" : `Not available: ${unavailable}`;
  els.dictionary.replaceChildren(
    ...choices.map((d) => {
      const option = document.createElement("option");
      option.value = d.name;
      option.textContent = `${d.name} (${d.size} features, ${d.spec?.module ?? "?"})`;
      option.title = d.spec?.description ?? "";
      option.selected = d.name === selected;
      return option;
    }),
  );
  els.panel.hidden = choices.length === 0;
}

/** A step's features under its row (the row addStep drew for it). */
export function addFeatureStrip(els: Elements, step: number, dictionary: string, chips: readonly FeatureChip[]): void {
  const row = els.steps.querySelector<HTMLElement>(`.step[data-step="${step}"]`);
  if (!row) return;
  const strip = document.createElement("div");
  strip.className = "features";
  strip.dataset.step = String(step);
  strip.dataset.dictionary = dictionary;
  strip.title = `${dictionary}: the top features of the pass that drew this token`;
  const top = chips[0]?.value ?? 0;
  strip.append(
    ...chips.map((chip) => {
      const el = span("feature", "");
      el.dataset.feature = String(chip.feature);
      el.dataset.value = String(chip.value);
      el.title = `feature ${chip.feature}: ${chip.value.toFixed(3)}`;
      // the chip's shade: its activation against the step's largest
      el.style.setProperty("--strength", String(top > 0 ? Math.min(chip.value / top, 1) : 0));
      el.append(span("feature-label", chip.label), span("feature-value", chip.value.toFixed(2)));
      return el;
    }),
  );
  if (chips.length === 0) strip.append(span("feature-none", "no active features"));
  row.append(strip);
}
