import { FIGURE_MIME, figureOf, keepUserChoices, PLOTLY_MIME } from '../src/figurestate';

const figure = { data: [{ type: 'scatter', x: [1, 2], y: [3, 4] }], layout: { uirevision: 'jupyter_shard' } };

describe('figureOf', () => {
  it('reads an inline figure while the cell runs', () => {
    expect(figureOf({ [FIGURE_MIME]: { figure } })).toBe(figure);
  });

  it("reads the saved form from the bundle's Plotly entry", () => {
    expect(figureOf({ [FIGURE_MIME]: { figure: PLOTLY_MIME }, [PLOTLY_MIME]: figure })).toBe(figure);
  });

  it('gives null for a bundle without a figure', () => {
    expect(figureOf({ [FIGURE_MIME]: { figure: PLOTLY_MIME } })).toBeNull();
    expect(figureOf({ 'text/plain': 'x' })).toBeNull();
  });
});

describe('keepUserChoices', () => {
  const menu = (name: string, active: number) => ({ name, active, buttons: [] });
  const next = {
    yaxis: { domain: [0.5, 1] },
    yaxis2: { domain: [0, 0.4] },
    xaxis: { domain: [0, 1] },
    updatemenus: [menu('y1 scale', 0), menu('y2 scale', 0)]
  };

  it('draws the first figure as sent', () => {
    expect(keepUserChoices(undefined, next)).toBe(next);
  });

  it("keeps a y axis switched to log and its switch's lit button", () => {
    const drawn = {
      yaxis: { type: 'linear' },
      yaxis2: { type: 'log' },
      xaxis: { type: 'log' },
      updatemenus: [menu('y2 scale', 1), menu('y1 scale', 0)]
    };
    const out = keepUserChoices(drawn, next);
    expect(out.yaxis2).toEqual({ domain: [0, 0.4], type: 'log' });
    expect(out.yaxis).toEqual({ domain: [0.5, 1], type: 'linear' });
    expect(out.xaxis).toEqual({ domain: [0, 1] }); // only y axes have the switch
    expect(out.updatemenus.map((m: { active: number }) => m.active)).toEqual([0, 1]);
    expect(next.yaxis2).toEqual({ domain: [0, 0.4] }); // the new layout is not changed in place
  });

  it('leaves a chart that was not drawn before as sent', () => {
    const out = keepUserChoices({ yaxis: { type: 'log' } }, { ...next, yaxis3: { domain: [0, 0.1] } });
    expect(out.yaxis3).toEqual({ domain: [0, 0.1] });
  });
});
