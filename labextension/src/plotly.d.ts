// plotly.js-dist-min ships no types; the renderer uses react, purge and Plots.resize.
declare module 'plotly.js-dist-min';
