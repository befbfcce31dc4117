/**
 * The rank-output bundle (`application/vnd.jupyter-shard.rank-output+json`) that the kernel shows
 * instead of plain `[rank k] …` streams once this extension opened the `jupyter_shard` comm, and its
 * grouping: ranks whose output is identical share one tab ("ranks 0–3"). The kernel also sends the
 * cell's summary (a line several ranks printed, once, with their ranks) and which view to open first;
 * a view the reader picks is remembered for later cells. Pure: the Jest tests run it.
 */

export const RANK_OUTPUT_MIME = 'application/vnd.jupyter-shard.rank-output+json';

/** `[rank, stream name, line]`, in the order the kernel received them. */
export type RankLine = [number, string, string];

/**
 * `[ranks, stream name, text]`: one line of the summary; the ranks as the kernel writes them
 * ("0-1023"; a list of numbers in bundles saved before), none for a note such as lines left out.
 */
export type SummaryRow = [string | number[], string, string];

export interface IRankOutput {
  version: number;
  lines: RankLine[];
  failed?: number[];
  summary?: SummaryRow[];
  view?: 'summary' | 'all';
  /** `[index, count]`: `count` lines left out of `lines` before `index` (every rank's log has them). */
  omitted?: [number, number];
}

/** The note that stands where lines were left out of the bundle, as the kernel's fallback words it. */
export function omittedNote(count: number): string {
  return `… ${count.toLocaleString('en-US')} lines left out here; each rank's log has every line (%dist_status lists the logs)`;
}

export const SUMMARY_TAB = 'summary';
export const ALL_TAB = 'all ranks';
/** Where the reader's choice between the summary and every line is kept (localStorage). */
export const VIEW_KEY = 'jupyter_shard.rankOutputView';

/** The runs of consecutive ranks, each written `lo${dash}hi` (or `k` alone), in order. */
function rankRuns(ranks: number[], dash: string): string[] {
  const sorted = [...ranks].sort((a, b) => a - b);
  const parts: string[] = [];
  let start = 0;
  for (let i = 1; i <= sorted.length; i++) {
    if (i === sorted.length || sorted[i] !== sorted[i - 1] + 1) {
      const [lo, hi] = [sorted[start], sorted[i - 1]];
      parts.push(lo === hi ? `${lo}` : `${lo}${dash}${hi}`);
      start = i;
    }
  }
  return parts;
}

/** "0-3,5": ranks as the kernel writes them (`jupyter_shard.spec.format_ranks`). */
export function formatRanks(ranks: number[]): string {
  return rankRuns(ranks, '-').join(',');
}

/** The summary view's text: `[rank 0-63] epoch 1 done`, as the kernel's plain-text fallback. */
export function summaryText(output: IRankOutput): string {
  return (output.summary ?? [])
    .map(([ranks, , text]) => {
      const written = typeof ranks === 'string' ? ranks : formatRanks(ranks);
      return written ? `[rank ${written}] ${text}\n` : `${text}\n`;
    })
    .join('');
}

/** The view a cell opens on: the one the reader last picked, else the kernel's choice. */
export function firstView(output: IRankOutput, remembered: string | null): string {
  if (output.summary === undefined) {
    return ALL_TAB;
  }
  if (remembered === SUMMARY_TAB || remembered === ALL_TAB) {
    return remembered;
  }
  return output.view === 'summary' ? SUMMARY_TAB : ALL_TAB;
}

export interface IRankGroup {
  ranks: number[];
  label: string;
  lines: [string, string][];
  failed: boolean;
}

/** "rank 2", "ranks 0–3", "ranks 0–1, 3". */
export function rankLabel(ranks: number[]): string {
  return `${ranks.length === 1 ? 'rank' : 'ranks'} ${rankRuns(ranks, '–').join(', ')}`;
}

/** One group per distinct output, ranks with identical lines (and outcome) together, by first rank. */
export function groupRanks(output: IRankOutput): IRankGroup[] {
  const failed = new Set(output.failed ?? []);
  const byRank = linesByRank(output);
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
  const lines = output.lines.map(([rank, , text]) => `[rank ${rank}] ${text}\n`);
  if (output.omitted) {
    const [index, count] = output.omitted;
    lines.splice(index, 0, `${omittedNote(count)}\n`);
  }
  return lines.join('');
}

/** One line of a diff between two ranks: in both (`same`), only the first (`del`), only the second (`add`). */
export interface IDiffLine {
  kind: 'same' | 'del' | 'add';
  name: string;
  text: string;
}

/** Beyond this many cells of the comparison table, the differing middle is shown as removed then added. */
export const DIFF_LIMIT = 4_000_000;

/** Each rank's `[stream name, line]` list, in arrival order. */
export function linesByRank(output: IRankOutput): Map<number, [string, string][]> {
  const byRank = new Map<number, [string, string][]>();
  for (const [rank, name, text] of output.lines) {
    if (!byRank.has(rank)) {
      byRank.set(rank, []);
    }
    byRank.get(rank)!.push([name, text]);
  }
  for (const rank of output.failed ?? []) {
    if (!byRank.has(rank)) {
      byRank.set(rank, []);
    }
  }
  return byRank;
}

/**
 * A line diff of two ranks' output (a longest common subsequence; a line on another stream is a
 * different line). The common head and tail are matched first, so outputs that differ in a few
 * lines compare quickly however long they are.
 */
export function diffLines(a: [string, string][], b: [string, string][]): IDiffLine[] {
  const key = ([name, text]: [string, string]) => `${name}\u0000${text}`;
  const ka = a.map(key);
  const kb = b.map(key);
  let head = 0;
  while (head < ka.length && head < kb.length && ka[head] === kb[head]) {
    head++;
  }
  let tail = 0;
  while (tail < ka.length - head && tail < kb.length - head && ka[ka.length - 1 - tail] === kb[kb.length - 1 - tail]) {
    tail++;
  }
  const line = (kind: IDiffLine['kind'], [name, text]: [string, string]): IDiffLine => ({ kind, name, text });
  const out: IDiffLine[] = a.slice(0, head).map(l => line('same', l));
  const n = ka.length - head - tail;
  const m = kb.length - head - tail;
  if (n * m > DIFF_LIMIT) {
    out.push(...a.slice(head, head + n).map(l => line('del', l)));
    out.push(...b.slice(head, head + m).map(l => line('add', l)));
  } else {
    // lcs[i][j]: the longest common subsequence of the middles' suffixes from i and j
    const lcs = Array.from({ length: n + 1 }, () => new Uint32Array(m + 1));
    for (let i = n - 1; i >= 0; i--) {
      for (let j = m - 1; j >= 0; j--) {
        lcs[i][j] =
          ka[head + i] === kb[head + j] ? lcs[i + 1][j + 1] + 1 : Math.max(lcs[i + 1][j], lcs[i][j + 1]);
      }
    }
    let i = 0;
    let j = 0;
    while (i < n || j < m) {
      if (i < n && j < m && ka[head + i] === kb[head + j]) {
        out.push(line('same', a[head + i++]));
        j++;
      } else if (i < n && (j === m || lcs[i + 1][j] >= lcs[i][j + 1])) {
        out.push(line('del', a[head + i++])); // removals before additions, as unified diffs show them
      } else {
        out.push(line('add', b[head + j++]));
      }
    }
  }
  out.push(...a.slice(a.length - tail).map(l => line('same', l)));
  return out;
}

export const DIFF_MARK: Record<IDiffLine['kind'], string> = { same: '  ', del: '- ', add: '+ ' };

/** The unified-diff text of a diff: `- ` only in the first rank, `+ ` only in the second. */
export function diffText(diff: IDiffLine[]): string {
  return diff.map(d => `${DIFF_MARK[d.kind]}${d.text}\n`).join('');
}
