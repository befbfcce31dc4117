"""Dispatch latency, cold start and warm restart against ipyparallel and jupyter-distributed; run it
as ``python -m benchmarks.dispatch`` (``__main__.py`` says what it measures)."""
