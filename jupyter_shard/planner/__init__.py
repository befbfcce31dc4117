"""Choosing a strategy without starting one: per-rank memory estimates, free memory, the choice logic
the picker widget shows. Pure computation; no process is started and torch is not imported."""
