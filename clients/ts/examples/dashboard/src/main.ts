/**
 * tracewire dashboard: type a prompt, watch the tokens stream with each step's top-k
 * probabilities, click a candidate to force it at that step and re-run.
 *
 * The server's HTTP port is `?server=` (default http://127.0.0.1:8080, what `make serve`
 * opens); `?protocol=grpc-web` switches from the Connect protocol (binary either way).
 * A server started with --auth-tokens needs `#token=TOKEN` (see readToken).
 */

import {
  Code,
  createWebClient,
  TracewireError,
  type Dictionary,
  type Step,
  type TracewireClient,
  type WebProtocol,
} from "@tracewire/client";
import { NO_SPECIAL_TOKENS, type SpecialTokens } from "./format.js";
import { TokenLabels } from "./labels.js";
import {
  allLayers,
  buildInvoke,
  featureStrip,
  forceAt,
  inputTokenAt,
  lensColumns,
  lensFeature,
  moduleFeature,
  norm,
  sampling,
  sideOf,
  steeringInvokes,
  steeringVector,
  stripChoices,
  stripDictionary,
  stripUnavailable,
  toStepView,
  vectorInvokes,
  VECTOR_SAMPLING,
  withFeatures,
  withLens,
  type Forced,
  type LayerFeature,
  type RunSettings,
  type StepView,
} from "./model.js";
import {
  addFeatureStrip,
  addLensColumns,
  addSteeringText,
  addStep,
  clearError,
  findElements,
  findFeatureElements,
  setStatus,
  setSteerStatus,
  setUpSteering,
  showCoefficient,
  showDictionaries,
  showError,
  showLensAvailability,
  startLens,
  startRun,
  startSteering,
  type Elements,
} from "./view.js";
import "./style.css";

const DEFAULT_SERVER = "http://127.0.0.1:8080";
// Long enough for a cold engine on a small CPU; a stuck call still ends.
const TIMEOUT_MS = 300_000;
// The load-time check (GetModelInfo): a live server answers at once.
const CHECK_TIMEOUT_MS = 10_000;
// While the server is unreachable the page asks again this often, and turns ready when it answers.
const RECHECK_MS = 3_000;

interface Config {
  readonly server: string;
  readonly protocol: WebProtocol;
}

/** The page's query parameters; only an http(s) URL is taken as the server. */
function readConfig(search: string): Config {
  const params = new URLSearchParams(search);
  const server = params.get("server") ?? DEFAULT_SERVER;
  const url = new URL(server); // throws on garbage: shown in the banner
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    throw new Error(`?server= must be an http(s) URL, not ${JSON.stringify(server)}`);
  }
  const protocol = params.get("protocol") === "grpc-web" ? "grpc-web" : "connect";
  return { server: url.origin + url.pathname.replace(/\/+$/, ""), protocol };
}

const TOKEN_KEY = "tracewire.token";

/**
 * The bearer token, from the URL's fragment (`#token=...`) or this tab's sessionStorage. A
 * fragment, not `?token=`: browsers never send it to a server, so it stays out of access logs
 * and Referer headers. Once read it is moved to sessionStorage (this tab only, gone when the
 * tab closes) and wiped from the address bar and history. Any script of this page's origin
 * can still read it: serve the dashboard from an origin you trust, and give it a token of a
 * tenant with small quotas.
 */
function readToken(location: Location, storage: Storage): string | undefined {
  const fragment = new URLSearchParams(location.hash.slice(1));
  const token = fragment.get("token");
  if (token) {
    storage.setItem(TOKEN_KEY, token);
    fragment.delete("token");
    const rest = fragment.toString();
    history.replaceState(null, "", `${location.pathname}${location.search}${rest ? `#${rest}` : ""}`);
    return token;
  }
  return storage.getItem(TOKEN_KEY) ?? undefined;
}

/** The form's values as typed; the server validates them (and says which field is wrong). */
function readSettings(els: Elements): RunSettings {
  return {
    prompt: els.prompt.value,
    maxTokens: els.maxTokens.valueAsNumber,
    topK: els.topK.valueAsNumber,
    temperature: els.temperature.valueAsNumber,
    ignoreEos: els.ignoreEos.checked,
  };
}

/** What the server's model info allows: the lens's and steering's layers, or why they cannot run. */
interface ModuleViews {
  readonly lens: LayerFeature;
  readonly steering: LayerFeature;
}

class Dashboard {
  private readonly labels: TokenLabels;
  /** Bumped by every run; a superseded run stops drawing and is cancelled. */
  private runId = 0;
  private abort: AbortController | undefined;
  /** What is on screen: its settings and steps (a force re-runs exactly these settings). */
  private shown: { settings: RunSettings; steps: StepView[] } | undefined;

  /** Shown with errors from fetch itself, which say no more than "Failed to fetch". */
  private readonly unreachable: string;

  /** Settled by the server check: EOS / BOS ids for the labels (none if the check failed). */
  private readonly specials: Promise<SpecialTokens>;
  private resolveSpecials: (specials: SpecialTokens) => void = () => undefined;

  /** Set once the server check answers; until then runs go without the lens. */
  private moduleViews: ModuleViews | undefined;
  /** Bumped by every steering comparison; a superseded one stops drawing. */
  private steerRunId = 0;
  private steerAbort: AbortController | undefined;
  /** Steering vectors read so far, by layer and prompt pair. */
  private readonly vectors = new Map<string, Float32Array>();
  /** The feature strip's picker, and the SAEs it offers (none: no strip). */
  private readonly strip = findFeatureElements(document);
  private stripChoices: Dictionary[] = [];

  constructor(
    private readonly els: Elements,
    private readonly client: TracewireClient,
    private readonly server: string,
  ) {
    this.specials = new Promise((resolve) => (this.resolveSpecials = resolve));
    this.labels = new TokenLabels(client, this.specials);
    this.unreachable = `(is the server's HTTP port at ${server}? \`make serve\` opens 8080; ` +
      `pages from other origins than localhost need its --cors-origin)`;
  }

  /**
   * Asks the server for its model (GetModelInfo) before anything is run, so an unreachable or
   * refusing server shows at once, not on the first Run. Unreachable: asked again every few
   * seconds until it answers (a server still loading its engine comes up by itself).
   */
  async checkServer(): Promise<void> {
    setStatus(this.els, "checking", 0, `checking the server at ${this.server}…`);
    for (;;) {
      try {
        const info = await this.client.modelInfo({ timeoutMs: CHECK_TIMEOUT_MS });
        this.resolveSpecials({ eos: info.eosTokenIds, bos: info.bosTokenId });
        const steering = moduleFeature("Steering (its vector is read from the layer it steers)", info, true);
        this.moduleViews = { lens: lensFeature(info), steering };
        showLensAvailability(this.els, this.moduleViews.lens);
        // Unavailable: every layer listed, the controls disabled, the note saying why.
        setUpSteering(this.els, steering.available ? steering.layers : allLayers(info.numLayers), steering);
        void this.loadDictionaries(info);
        if (this.runId === 0) {
          clearError(this.els);
          setStatus(this.els, "idle", 0, `ready: ${info.model} (${info.architecture}, ${info.dtype}), vLLM ${info.vllmVersion}`);
        }
        return;
      } catch (error) {
        if (this.runId !== 0) {
          this.resolveSpecials(NO_SPECIAL_TOKENS); // a run took over the page and reports its own errors
          return;
        }
        showError(this.els, error, this.unreachable);
        if (!isUnreachable(error)) {
          // The server answered and refused (a token missing, ...): asking again changes nothing.
          this.resolveSpecials(NO_SPECIAL_TOKENS);
          setStatus(this.els, "error", 0, `the server at ${this.server} refused GetModelInfo`);
          return;
        }
        setStatus(this.els, "offline", 0, `no server at ${this.server}: start it with \`make serve\` (asking again every ${RECHECK_MS / 1000} s)`);
        await new Promise((wake) => setTimeout(wake, RECHECK_MS));
      }
    }
  }

  start(): void {
    this.els.form.addEventListener("submit", (event) => {
      event.preventDefault();
      void this.run(readSettings(this.els), []);
    });
    // One listener for every candidate button, present and future.
    this.els.steps.addEventListener("click", (event) => {
      const button = event.target instanceof Element ? event.target.closest<HTMLElement>("button.candidate") : null;
      if (button && this.shown) {
        const forced = forceAt(this.shown.steps, Number(button.dataset.step), Number(button.dataset.tokenId));
        void this.run(this.shown.settings, forced);
      }
    });
    this.els.steerForm.addEventListener("submit", (event) => {
      event.preventDefault();
      void this.steer();
    });
    this.els.steerCoef.addEventListener("input", () => showCoefficient(this.els));
    // Releasing the slider re-runs the comparison once a vector has been read (Steer reads it).
    this.els.steerCoef.addEventListener("change", () => {
      if (this.vectors.size > 0) void this.steer();
    });
  }

  /** One trace, drawn step by step as the stream delivers it. */
  private async run(settings: RunSettings, forced: Forced): Promise<void> {
    const id = ++this.runId;
    this.abort?.abort();
    const abort = new AbortController();
    this.abort = abort;
    // A forced run is compared with, and keeps the prefix's candidates of, the run on screen.
    const before = forced.length > 0 ? (this.shown?.steps ?? []) : [];
    const previousText = forced.length > 0 ? before.map((s) => s.text).join("") : undefined;
    const steps: StepView[] = [];
    this.shown = { settings, steps };
    clearError(this.els);
    startRun(this.els, settings.prompt, previousText);
    const what = forced.length > 0 ? `forcing token ${forced.at(-1)} at step ${forced.length - 1}` : "running";
    setStatus(this.els, "running", id, `${what}…`);
    const started = performance.now();
    const lens = this.moduleViews?.lens.available ? this.moduleViews.lens.layers : undefined;
    const dictionary = stripDictionary(this.stripChoices, this.strip.dictionary.value);
    try {
      // The lens's bottom row names the token each column reads: the prompt's, then the drawn ones.
      const promptIds = lens ? await this.promptTokenIds(settings.prompt) : [];
      if (lens) startLens(this.els, lens);
      const builder = withFeatures(buildInvoke(settings, forced), dictionary);
      const trace = this.client.trace(lens ? withLens(builder, lens) : builder, sampling(settings), {
        signal: abort.signal,
        timeoutMs: TIMEOUT_MS,
      });
      for await (const step of trace) {
        if (id !== this.runId) {
          return; // superseded: leaving the loop cancels the call
        }
        const view = toStepView(step, forced, before);
        steps.push(view);
        addStep(this.els, this.labels, view);
        if (lens) {
          const drawn = steps.map((s) => s.tokenId);
          addLensColumns(this.els, this.labels, lensColumns(step, lens), (p) => inputTokenAt(p, promptIds, drawn));
        }
        this.drawFeatures(step, dictionary);
        setStatus(this.els, "running", id, `${what}: step ${view.step}`);
      }
      const seconds = ((performance.now() - started) / 1000).toFixed(2);
      setStatus(this.els, "done", id, `done: ${steps.length} tokens in ${seconds} s`);
    } catch (error) {
      if (id === this.runId) {
        showError(this.els, error, this.unreachable);
        setStatus(this.els, "error", id, "failed");
      }
    }
  }

  /** The prompt's token ids (the lens's column labels); none when Tokenize fails (the run reports errors). */
  private async promptTokenIds(prompt: string): Promise<number[]> {
    try {
      return (await this.client.tokenize(prompt, {}, { timeoutMs: CHECK_TIMEOUT_MS })).tokenIds;
    } catch {
      return [];
    }
  }

  /**
   * The steering comparison: the vector for (layer, A, B) (read once, then kept), then one
   * trace with the prompt above as is and steered, both streamed side by side.
   */
  private async steer(): Promise<void> {
    if (!this.moduleViews?.steering.available) {
      return;
    }
    const id = ++this.steerRunId;
    this.steerAbort?.abort();
    const abort = new AbortController();
    this.steerAbort = abort;
    const settings = readSettings(this.els);
    const layer = Number(this.els.steerLayer.value);
    const coefficient = this.els.steerCoef.valueAsNumber;
    const call = { signal: abort.signal, timeoutMs: TIMEOUT_MS };
    clearError(this.els);
    try {
      const key = `${layer}\n${this.els.steerA.value}\n${this.els.steerB.value}`;
      let vector = this.vectors.get(key);
      if (!vector) {
        setSteerStatus(this.els, "running", id, `reading layers.${layer} for A and B…`);
        const read = await this.client.trace(vectorInvokes(layer, this.els.steerA.value, this.els.steerB.value), VECTOR_SAMPLING, call).collect();
        vector = steeringVector(read.steps);
        this.vectors.set(key, vector);
      }
      if (id !== this.steerRunId) return;
      startSteering(this.els, settings.prompt, coefficient, norm(vector));
      setSteerStatus(this.els, "running", id, `steering layers.${layer} with coefficient ${coefficient}…`);
      const trace = this.client.trace(steeringInvokes(settings.prompt, layer, vector, coefficient), sampling(settings), call);
      for await (const step of trace) {
        if (id !== this.steerRunId) return; // superseded: leaving the loop cancels the call
        addSteeringText(this.els, sideOf(step), step.text);
      }
      setSteerStatus(this.els, "done", id, `done: layers.${layer}, coefficient ${coefficient}`);
    } catch (error) {
      if (id === this.steerRunId) {
        showError(this.els, error, this.unreachable);
        setSteerStatus(this.els, "error", id, "steering failed");
      }
    }
  }

  /**
   * The feature strip's dictionaries (ListDictionaries): the SAEs it can read, the first chosen.
   * A server without such dictionaries (or without the RPC, or compiled without read buffers
   * on their layers) keeps the strip hidden.
   */
  private async loadDictionaries(info: Parameters<typeof stripChoices>[1]): Promise<void> {
    let unavailable: string | undefined;
    try {
      const listed = await this.client.listDictionaries({}, { timeoutMs: CHECK_TIMEOUT_MS });
      this.stripChoices = stripChoices(listed, info);
      unavailable = stripUnavailable(listed, info);
    } catch {
      this.stripChoices = [];
    }
    showDictionaries(this.strip, this.stripChoices, stripDictionary(this.stripChoices)?.name, unavailable);
  }

  private drawFeatures(step: Step, dictionary: Dictionary | undefined): void {
    const chips = dictionary ? featureStrip(step, dictionary) : undefined;
    if (dictionary && chips) addFeatureStrip(this.els, step.step, dictionary.name, chips);
  }
}

function main(): void {
  const els = findElements(document);
  let config: Config;
  try {
    config = readConfig(window.location.search);
  } catch (error) {
    showError(els, error);
    setStatus(els, "error", 0, "bad ?server= parameter");
    return;
  }
  els.server.textContent = `${config.server} (${config.protocol})`;
  const token = readToken(window.location, window.sessionStorage);
  const client = createWebClient(config.server, { protocol: config.protocol, ...(token ? { token } : {}) });
  const dashboard = new Dashboard(els, client, config.server);
  dashboard.start();
  void dashboard.checkServer();
}

/** Errors of fetch itself or of a server still starting: worth asking again. */
function isUnreachable(error: unknown): boolean {
  const code = error instanceof TracewireError ? error.code : Code.Unknown;
  return code === Code.Unknown || code === Code.Unavailable || code === Code.DeadlineExceeded;
}

main();
