/**
 * Token ids -> their text, one Detokenize call per id ever seen (cached): the trace
 * gives the top-k as ids only. Labels fill in asynchronously, so the stream never waits.
 */

import type { TracewireClient } from "@tracewire/client";

export class TokenLabels {
  private readonly cache = new Map<number, Promise<string>>();

  constructor(private readonly client: TracewireClient) {}

  /** The token's text; a failed lookup shows as "#id" (the run itself reports real errors). */
  get(tokenId: number): Promise<string> {
    let label = this.cache.get(tokenId);
    if (!label) {
      label = this.client.detokenize([tokenId], { skipSpecialTokens: false }).catch(() => `#${tokenId}`);
      this.cache.set(tokenId, label);
    }
    return label;
  }
}

/** A token's text made visible: quotes, and escapes for newlines and tabs. */
export function showToken(text: string): string {
  return JSON.stringify(text);
}
