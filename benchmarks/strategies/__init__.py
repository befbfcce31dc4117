"""Training throughput against torchrun, per strategy; run it as ``python -m benchmarks.strategies``."""
