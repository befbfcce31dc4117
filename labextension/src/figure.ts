/**
 * Draws the jupyter_shard dashboard's Plotly figure and redraws it in place on every update of its
 * output (`update_display_data`), with `Plotly.react`: the user's zoom, hidden ranks and log
 * switches stay across redraws. Plotly's own JupyterLab renderer draws a figure once and ignores
 * later updates, hence this one. plotly.js ships inside the extension and loads on first use.
 */
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { FIGURE_MIME, figureOf, IFigure, keepUserChoices } from './figurestate';

/* eslint-disable @typescript-eslint/no-explicit-any */
let plotly: Promise<any> | null = null;

function loadPlotly(): Promise<any> {
  if (!plotly) {
    plotly = import('plotly.js-dist-min').then(module => module.default ?? module);
  }
  return plotly;
}

export class FigureRenderer extends Widget implements IRenderMime.IRenderer {
  constructor() {
    super();
    this.addClass('jp-ShardFigure');
  }

  renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const figure = figureOf(model.data as Record<string, any>);
    if (!figure) {
      this.node.textContent = 'jupyter_shard: this output holds no figure';
      return Promise.resolve();
    }
    const queued = this._next !== null;
    this._next = figure; // updates faster than drawing: only the latest is drawn
    if (!queued) {
      this._drawing = this._drawing.then(() => this._draw()).catch(error => console.error(error));
    }
    return this._drawing;
  }

  protected onResize(msg: Widget.ResizeMessage): void {
    this._resize();
  }

  protected onAfterShow(msg: Message): void {
    this._resize();
  }

  dispose(): void {
    if (this._drawn && plotly) {
      void plotly.then(Plotly => Plotly.purge(this.node));
    }
    super.dispose();
  }

  private async _draw(): Promise<void> {
    const figure = this._next;
    this._next = null;
    if (!figure || this.isDisposed) {
      return;
    }
    const Plotly = await loadPlotly();
    const node = this.node as any;
    const layout = keepUserChoices(this._drawn ? node.layout : undefined, figure.layout);
    const config = { responsive: true, displaylogo: false, ...(figure.config ?? {}) };
    await Plotly.react(node, figure.data, layout, config);
    this._drawn = true;
    this.node.dataset.draws = String(++this._draws); // how many figures it has drawn (tests wait on it)
  }

  private _resize(): void {
    if (this._drawn && plotly && this.node.offsetWidth > 0) {
      void plotly.then(Plotly => Plotly.Plots.resize(this.node));
    }
  }

  private _next: IFigure | null = null;
  private _drawing: Promise<void> = Promise.resolve();
  private _drawn = false;
  private _draws = 0;
}

export const figureRenderer: IRenderMime.IRendererFactory = {
  safe: true,
  mimeTypes: [FIGURE_MIME],
  defaultRank: 0,
  createRenderer: () => new FigureRenderer()
};
