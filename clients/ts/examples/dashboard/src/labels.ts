/**
 * Token ids -> their labels, one Detokenize call per id ever seen (cached): the trace
 * gives the top-k as ids only. Labels fill in asynchronously, so the stream never waits.
 */

import type { TracewireClient } from "@tracewire/client";
import { tokenLabel, type SpecialTokens, type TokenLabel } from "./format.js";

export class TokenLabels {
  private readonly cache = new Map<number, Promise<TokenLabel>>();

  /** `specials` resolves with the model info's EOS / BOS ids (empty when it could not be read). */
  constructor(
    private readonly client: TracewireClient,
    private readonly specials: Promise<SpecialTokens>,
  ) {}

  /** The token's label; a failed lookup shows as "#id" (the run itself reports real errors). */
  get(tokenId: number): Promise<TokenLabel> {
    let label = this.cache.get(tokenId);
    if (!label) {
      label = Promise.all([this.client.detokenize([tokenId], { skipSpecialTokens: false }), this.specials])
        .then(([text, specials]) => tokenLabel(text, tokenId, specials))
        .catch(() => ({ text: `#${tokenId}`, special: false }));
      this.cache.set(tokenId, label);
    }
    return label;
  }
}
