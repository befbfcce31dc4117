/**
 * The rank-output bundle (`application/vnd.jupyter-shard.rank-output+json`) that the kernel shows
 * instead of plain `[rank k] …` streams once this extension opened the `jupyter_shard` comm, and its
 * grouping: ranks whose output is identical share one tab ("ranks 0–3"). Pure: the Jest tests run it.
 */

export const RANK_OUTPUT_MIME = 'application/vnd.jupyter-shard.rank-output+json';

/** `[rank, stream name, line]`, in the order the kernel received them. */
export type RankLine = [number, string, string];

export interface IRankOutput {
  version: number;
  lines: RankLine[];
  failed?: number[];
}

export interface IRankGroup {
  ranks: number[];
  label: string;
  lines: [string, string][];
  failed: boolean;
}

/** "rank 2", "ranks 0–3", "ranks 0–1, 3". */
export function rankLabel(ranks: number[]): string {
  const sorted = [...ranks].sort((a, b) => a - b);
  const parts: string[] = [];
  let start = 0;
  for (let i = 1; i <= sorted.length; i++) {
    if (i === sorted.length || sorted[i] !== sorted[i - 1] + 1) {
      const [lo, hi] = [sorted[start], sorted[i - 1]];
      parts.push(lo === hi ? `${lo}` : `${lo}–${hi}`);
      start = i;
    }
  }
  return `${sorted.length === 1 ? 'rank' : 'ranks'} ${parts.join(', ')}`;
}

/** One group per distinct output, ranks with identical lines (and outcome) together, by first rank. */
export function groupRanks(output: IRankOutput): IRankGroup[] {
  const failed = new Set(output.failed ?? []);
  const byRank = new Map<number, [string, string][]>();
  for (const [rank, name, text] of output.lines) {
    if (!byRank.has(rank)) {
      byRank.set(rank, []);
    }
    byRank.get(rank)!.push([name, text]);
  }
  for (const rank of failed) {
    if (!byRank.has(rank)) {
      byRank.set(rank, []);
    }
  }
  const groups = new Map<string, IRankGroup>();
  for (const rank of [...byRank.keys()].sort((a, b) => a - b)) {
    const lines = byRank.get(rank)!;
    const key = JSON.stringify([failed.has(rank), lines]);
    const group = groups.get(key);
    if (group) {
      group.ranks.push(rank);
    } else {
      groups.set(key, { ranks: [rank], label: '', lines, failed: failed.has(rank) });
    }
  }
  const out = [...groups.values()];
  for (const group of out) {
    group.label = rankLabel(group.ranks) + (group.failed ? ' (failed)' : '');
  }
  return out;
}

/** The "all ranks" view: every line labelled, as the plain-text fallback shows it. */
export function labelledText(output: IRankOutput): string {
  return output.lines.map(([rank, , text]) => `[rank ${rank}] ${text}\n`).join('');
}
