"""The dry run against a real pool of CPU ranks: ``python -m benchmarks.dry_run``."""
