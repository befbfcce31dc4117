"""The IPython- and Jupyter-facing layer: magics, rank-output display, dashboard, charts, comm panel,
picker. It sits on top of :mod:`jupyter_shard.pool`; nothing below imports it."""
