"""Code that runs in the notebook kernel (or any Python process driving a pool): no UI imports.

The :class:`~jupyter_shard.pool.pool.Pool` facade and the parts it is composed of: the connection to
the ranks, the rank table, one cell's gathering, escalation and the lifecycle. Frontends (the
notebook layer, scripts, tests) plug in through :class:`~jupyter_shard.pool.output.RankSink` and
:class:`~jupyter_shard.pool.pool.Observer`.
"""
