/**
 * The "Distributed" side panel: the current notebook's pool, one row per rank, and the controls.
 * It polls the kernel every 2 s while visible; the rendering is plain DOM from `format.ts`.
 */
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { ShardClient } from './client';
import { RANK_COLUMNS, rankCells, rankLevel, rankTitle, Request } from './format';

export const POLL_MS = 2000;
const CONTROLS: Request[] = ['interrupt', 'restart', 'shutdown', 'stacks'];
const CONFIRM: Partial<Record<Request, string>> = {
  restart: 'Restart every rank? Rank state (models, variables) is lost.',
  shutdown: 'Stop every rank? Rank state (models, variables) is lost.'
};

export class DistributedPanel extends Widget {
  constructor() {
    super();
    this.id = 'jupyter-shard-panel';
    this.addClass('jp-ShardPanel');
    this.title.caption = 'Distributed';
    this.title.label = 'Distributed';
    const node = this.node;
    this._header = append(node, 'div', 'jp-ShardPanel-header');
    this._state = append(node, 'div', 'jp-ShardPanel-state');
    const buttons = append(node, 'div', 'jp-ShardPanel-buttons');
    for (const request of CONTROLS) {
      const button = append(buttons, 'button', 'jp-ShardPanel-button jp-mod-styled') as HTMLButtonElement;
      button.textContent = request;
      button.dataset.request = request;
      button.onclick = () => this._control(request);
    }
    this._table = append(node, 'table', 'jp-ShardPanel-ranks') as HTMLTableElement;
    this._message = append(node, 'div', 'jp-ShardPanel-message');
    this._stacks = append(node, 'pre', 'jp-ShardPanel-stacks');
    this.render();
  }

  /** Follow another notebook's client (or none). */
  set client(client: ShardClient | null) {
    if (this._client === client) {
      return;
    }
    this._client?.changed.disconnect(this.render, this);
    this._client = client;
    client?.changed.connect(this.render, this);
    if (client && this.isVisible) {
      client.request('status');
    }
    this.render();
  }

  get client(): ShardClient | null {
    return this._client;
  }

  render(): void {
    const client = this._client;
    const status = client?.status ?? null;
    this._header.textContent = status?.pool ?? 'no pool';
    let state: string;
    if (!client) {
      state = 'no notebook';
    } else if (client.connection === 'no kernel') {
      state = 'no kernel';
    } else if (client.connection === 'not loaded') {
      state = 'jupyter_shard is not loaded in this kernel (%load_ext jupyter_shard)';
    } else {
      state = status?.state ?? 'waiting for the kernel';
    }
    if (client?.kernelBusy) {
      state += ' · kernel busy (showing the last status)';
    }
    this._state.textContent = state;
    this._state.dataset.state = status?.state ?? '';
    this._renderRanks();
    this._message.textContent = client?.error || client?.message || '';
    this._message.classList.toggle('jp-mod-error', !!client?.error);
    this._stacks.textContent = client?.stacks ?? '';
  }

  protected onAfterShow(msg: Message): void {
    this._client?.request('status');
    this._timer = window.setInterval(() => this._client?.request('status'), POLL_MS);
  }

  protected onAfterHide(msg: Message): void {
    window.clearInterval(this._timer);
  }

  dispose(): void {
    window.clearInterval(this._timer);
    super.dispose();
  }

  private _renderRanks(): void {
    const table = this._table;
    table.textContent = '';
    const rows = this._client?.status?.ranks ?? [];
    if (!rows.length) {
      return;
    }
    const head = table.createTHead().insertRow();
    for (const name of RANK_COLUMNS) {
      const th = document.createElement('th');
      th.textContent = name;
      head.appendChild(th);
    }
    const body = table.createTBody();
    for (const row of rows) {
      const tr = body.insertRow();
      tr.dataset.rank = String(row.rank);
      tr.dataset.count = String(row.count ?? 1);
      tr.dataset.state = row.state;
      tr.classList.add(`jp-ShardPanel-${rankLevel(row)}`);
      tr.title = rankTitle(row);
      for (const text of rankCells(row)) {
        tr.insertCell().textContent = text;
      }
    }
  }

  private _control(request: Request): void {
    const question = CONFIRM[request];
    if (question && !window.confirm(question)) {
      return;
    }
    this._client?.request(request);
  }

  private _client: ShardClient | null = null;
  private _timer = 0;
  private _header: HTMLElement;
  private _state: HTMLElement;
  private _table: HTMLTableElement;
  private _message: HTMLElement;
  private _stacks: HTMLElement;
}

function append(parent: HTMLElement, tag: string, className: string): HTMLElement {
  const child = document.createElement(tag);
  child.className = className;
  parent.appendChild(child);
  return child;
}
