/**
 * Renders a rank-output bundle as tabs: "summary" (a line several ranks printed, once, with their
 * ranks), "all ranks" (every line labelled `[rank k]`), one tab per group of ranks with identical
 * output (failed ranks' tabs marked; past GROUP_TABS groups, one "by rank" tab choosing the group)
 * and, when ranks differ, a "diff" tab comparing two chosen ranks line by line (neither where the
 * kernel left lines out of the bundle). A cell opens on the summary or on every line as the reader last chose (kept in
 * localStorage), else as the kernel says (the summary from 9 ranks up).
 */
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Widget } from '@lumino/widgets';

import {
  ALL_TAB,
  DIFF_MARK,
  diffLines,
  firstView,
  groupRanks,
  IRankOutput,
  labelledText,
  linesByRank,
  RANK_OUTPUT_MIME,
  rankLabel,
  SUMMARY_TAB,
  summaryText,
  VIEW_KEY
} from './rankoutput';

function remembered(): string | null {
  try {
    return window.localStorage.getItem(VIEW_KEY);
  } catch {
    return null; // storage refused (a sandboxed page): the kernel's choice
  }
}

function remember(view: string): void {
  try {
    window.localStorage.setItem(VIEW_KEY, view);
  } catch {
    // not kept: the next cell opens on the kernel's choice
  }
}

/** Groups of ranks shown as tabs of their own; more are chosen in the "by rank" tab. */
export const GROUP_TABS = 8;
const BY_RANK = 'by rank';

interface ITab {
  label: string;
  failed: boolean;
  show: (body: HTMLPreElement) => void;
}

export class RankOutputRenderer extends Widget implements IRenderMime.IRenderer {
  constructor() {
    super();
    this.addClass('jp-ShardRankOutput');
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const output = model.data[RANK_OUTPUT_MIME] as unknown as IRankOutput;
    const groups = groupRanks(output);
    const text = (body: HTMLPreElement, value: string) => {
      body.textContent = value;
    };
    const tabs: ITab[] = [];
    if (output.summary !== undefined) {
      tabs.push({ label: SUMMARY_TAB, failed: false, show: body => text(body, summaryText(output)) });
    }
    tabs.push({ label: ALL_TAB, failed: false, show: body => text(body, labelledText(output)) });
    const controls = document.createElement('div');
    controls.className = 'jp-ShardRankOutput-diffControls';
    const groupText = (index: number) => groups[index].lines.map(([, line]) => `${line}\n`).join('');
    // Where the bundle left lines out, ranks cannot be grouped or compared by what it kept: the
    // summary (which counted every line) and every kept line, with the note, are what is shown.
    const whole = !output.omitted;
    if (whole && groups.length <= GROUP_TABS) {
      groups.forEach((group, index) => {
        tabs.push({ label: group.label, failed: group.failed, show: body => text(body, groupText(index)) });
      });
    } else if (whole) {
      const failed = groups.some(group => group.failed);
      tabs.push({ label: BY_RANK, failed, show: body => this._showGroup(groups, groupText, controls, body) });
    }
    if (whole && groups.length > 1) {
      tabs.push({ label: 'diff', failed: false, show: body => this._showDiff(output, groups[1].ranks[0], controls, body) });
    }
    const node = this.node;
    node.textContent = '';
    const bar = document.createElement('div');
    bar.className = 'jp-ShardRankOutput-tabs';
    const body = document.createElement('pre');
    body.className = 'jp-ShardRankOutput-body';
    const select = (index: number) => {
      this._selected = index;
      controls.textContent = '';
      tabs[index].show(body);
      controls.hidden = tabs[index].label !== 'diff' && tabs[index].label !== BY_RANK;
      bar.querySelectorAll('button').forEach((b, i) => b.classList.toggle('jp-mod-current', i === index));
    };
    tabs.forEach((tab, index) => {
      const button = document.createElement('button');
      button.className = 'jp-ShardRankOutput-tab';
      button.textContent = tab.label;
      button.classList.toggle('jp-mod-failed', tab.failed);
      button.onclick = () => {
        select(index);
        if (tab.label === SUMMARY_TAB || tab.label === ALL_TAB) {
          remember(tab.label);
        }
      };
      bar.appendChild(button);
    });
    node.appendChild(bar);
    node.appendChild(controls);
    node.appendChild(body);
    // An update in place (more lines) keeps the tab the reader chose; a new cell opens on its view.
    if (this._selected < 0 || this._selected >= tabs.length) {
      this._selected = Math.max(0, tabs.findIndex(tab => tab.label === firstView(output, remembered())));
    }
    select(this._selected);
  }

  /** A picker of the groups of ranks (when there are too many for tabs) and the chosen group's lines. */
  private _showGroup(
    groups: { label: string }[],
    groupText: (index: number) => string,
    controls: HTMLDivElement,
    body: HTMLPreElement
  ): void {
    const picker = document.createElement('select');
    picker.className = 'jp-ShardRankOutput-group';
    picker.setAttribute('aria-label', 'ranks');
    groups.forEach((group, index) => {
      const option = document.createElement('option');
      option.value = `${index}`;
      option.textContent = group.label;
      option.selected = index === Math.min(this._group, groups.length - 1);
      picker.appendChild(option);
    });
    const draw = () => {
      this._group = Number(picker.value);
      body.textContent = groupText(this._group);
    };
    picker.onchange = draw;
    controls.append(picker, ` · ${groups.length} groups of ranks with different output`);
    draw();
  }

  /** Two rank pickers (by default the first rank against the first one that differs) and their diff. */
  private _showDiff(output: IRankOutput, firstOther: number, controls: HTMLDivElement, body: HTMLPreElement): void {
    const byRank = linesByRank(output);
    const ranks = [...byRank.keys()].sort((a, b) => a - b);
    if (!ranks.includes(this._diffRanks[0]) || !ranks.includes(this._diffRanks[1])) {
      this._diffRanks = [ranks[0], firstOther];
    }
    const pickers = this._diffRanks.map((chosen, side) => {
      const picker = document.createElement('select');
      picker.className = 'jp-ShardRankOutput-diffRank';
      picker.setAttribute('aria-label', side === 0 ? 'first rank' : 'second rank');
      for (const rank of ranks) {
        const option = document.createElement('option');
        option.value = `${rank}`;
        option.textContent = rankLabel([rank]);
        option.selected = rank === chosen;
        picker.appendChild(option);
      }
      picker.onchange = () => {
        this._diffRanks[side] = Number(picker.value);
        draw();
      };
      return picker;
    });
    const summary = document.createElement('span');
    summary.className = 'jp-ShardRankOutput-diffSummary';
    controls.append(pickers[0], ' against ', pickers[1], summary);
    const draw = () => {
      const [a, b] = this._diffRanks;
      const diff = diffLines(byRank.get(a) ?? [], byRank.get(b) ?? []);
      const removed = diff.filter(d => d.kind === 'del').length;
      const added = diff.filter(d => d.kind === 'add').length;
      summary.textContent =
        removed + added === 0 ? ' · identical' : ` · ${removed} only on rank ${a}, ${added} only on rank ${b}`;
      body.textContent = '';
      for (const line of diff) {
        const span = document.createElement('span');
        span.className = `jp-ShardRankOutput-${line.kind}`;
        span.classList.toggle('jp-mod-stderr', line.name === 'stderr');
        span.textContent = `${DIFF_MARK[line.kind]}${line.text}\n`;
        body.appendChild(span);
      }
    };
    draw();
  }

  private _selected = -1;
  private _group = 0;
  private _diffRanks: [number, number] = [-1, -1];
}

export const rankOutputRenderer: IRenderMime.IRendererFactory = {
  safe: true,
  mimeTypes: [RANK_OUTPUT_MIME],
  defaultRank: 50,
  createRenderer: () => new RankOutputRenderer()
};
