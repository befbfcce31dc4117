"""``%dist_export``: a notebook's cells and pushes as a torchrun script (and an sbatch job)."""
