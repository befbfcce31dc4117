/**
 * Renders a rank-output bundle as tabs: "all ranks" (every line labelled `[rank k]`, the default)
 * and one tab per group of ranks with identical output; failed ranks' tabs are marked.
 */
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Widget } from '@lumino/widgets';

import { groupRanks, IRankOutput, labelledText, RANK_OUTPUT_MIME } from './rankoutput';

export class RankOutputRenderer extends Widget implements IRenderMime.IRenderer {
  constructor() {
    super();
    this.addClass('jp-ShardRankOutput');
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const output = model.data[RANK_OUTPUT_MIME] as unknown as IRankOutput;
    const tabs: { label: string; text: string; failed: boolean; stderr: boolean }[] = [
      { label: 'all ranks', text: labelledText(output), failed: false, stderr: false }
    ];
    for (const group of groupRanks(output)) {
      const text = group.lines.map(([, line]) => `${line}\n`).join('');
      const stderr = group.lines.some(([name]) => name === 'stderr');
      tabs.push({ label: group.label, text, failed: group.failed, stderr });
    }
    const node = this.node;
    node.textContent = '';
    const bar = document.createElement('div');
    bar.className = 'jp-ShardRankOutput-tabs';
    const body = document.createElement('pre');
    body.className = 'jp-ShardRankOutput-body';
    const select = (index: number) => {
      this._selected = index;
      body.textContent = tabs[index].text;
      bar.querySelectorAll('button').forEach((b, i) => b.classList.toggle('jp-mod-current', i === index));
    };
    tabs.forEach((tab, index) => {
      const button = document.createElement('button');
      button.className = 'jp-ShardRankOutput-tab';
      button.textContent = tab.label;
      button.classList.toggle('jp-mod-failed', tab.failed);
      button.onclick = () => select(index);
      bar.appendChild(button);
    });
    node.appendChild(bar);
    node.appendChild(body);
    // An update in place (more lines) keeps the tab the reader chose.
    select(this._selected < tabs.length ? this._selected : 0);
  }

  private _selected = 0;
}

export const rankOutputRenderer: IRenderMime.IRendererFactory = {
  safe: true,
  mimeTypes: [RANK_OUTPUT_MIME],
  defaultRank: 50,
  createRenderer: () => new RankOutputRenderer()
};
