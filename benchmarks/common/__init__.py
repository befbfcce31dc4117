"""What every benchmark shares, written once: the machine and its load, the results section with its
target lines, percentiles and the plotting backend.

A benchmark's section must describe the machine and the load before and after, end with one
``<!-- target: … | … | met -->`` line per target (``run_all`` reads them) and link its plots
relatively; these helpers do each of those the same way for every benchmark.
"""

from benchmarks.common.machine import RESULTS, ROOT, LoadWatch, cpu, format_loads, git_revision, load_average
from benchmarks.common.plot import pyplot
from benchmarks.common.report import TARGET_LINE, met, target_line, target_table, write_section
from benchmarks.common.running import other_runs
from benchmarks.common.stats import percentile

__all__ = [
    "RESULTS",
    "ROOT",
    "TARGET_LINE",
    "LoadWatch",
    "cpu",
    "format_loads",
    "git_revision",
    "load_average",
    "met",
    "other_runs",
    "percentile",
    "pyplot",
    "target_line",
    "target_table",
    "write_section",
]
