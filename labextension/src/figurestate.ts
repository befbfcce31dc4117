/**
 * The live dashboard figure's bundle (`application/vnd.jupyter-shard.figure+json`) and the user's
 * choices a redraw must keep. Plotly's `uirevision` keeps zoom and hidden traces across
 * `Plotly.react`, but not an axis type set by the linear/log switch, nor which button of the switch
 * is lit: those are carried over here from the drawn layout to the new one.
 */

export const FIGURE_MIME = 'application/vnd.jupyter-shard.figure+json';
export const PLOTLY_MIME = 'application/vnd.plotly.v1+json';

// Plotly's JSON: open records, read only where named below.
/* eslint-disable @typescript-eslint/no-explicit-any */
export type ILayout = Record<string, any>;

export interface IFigure {
  data: Record<string, any>[];
  layout: ILayout;
  config?: Record<string, any>;
}

/**
 * The figure a bundle carries: inline (`{"figure": {...}}`, while the cell runs) or, in the saved
 * form, the name of the bundle's Plotly entry (`{"figure": "application/vnd.plotly.v1+json"}`).
 */
export function figureOf(data: Record<string, any>): IFigure | null {
  const entry = data[FIGURE_MIME];
  if (!entry || typeof entry !== 'object') {
    return null;
  }
  const figure = typeof entry.figure === 'string' ? data[entry.figure] : entry.figure;
  return figure && Array.isArray(figure.data) ? (figure as IFigure) : null;
}

/** `next` with each y axis's type and each switch's lit button as the user left them in `drawn`. */
export function keepUserChoices(drawn: ILayout | undefined, next: ILayout): ILayout {
  if (!drawn) {
    return next;
  }
  const out: ILayout = { ...next };
  for (const key of Object.keys(next)) {
    const type = /^yaxis\d*$/.test(key) ? drawn[key]?.type : undefined;
    if (type !== undefined) {
      out[key] = { ...next[key], type };
    }
  }
  if (Array.isArray(next.updatemenus) && Array.isArray(drawn.updatemenus)) {
    out.updatemenus = next.updatemenus.map((menu: ILayout) => {
      const before = drawn.updatemenus.find((m: ILayout) => m && m.name === menu.name);
      return before && before.active !== undefined ? { ...menu, active: before.active } : menu;
    });
  }
  return out;
}
