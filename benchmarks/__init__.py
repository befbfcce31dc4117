"""The benchmarks: one folder per benchmark over the helpers of ``common/``; see ``README.md``.

Run them from the repository root as modules, ``.venv/bin/python -m benchmarks.<name>``, or all of
them with ``.venv/bin/python -m benchmarks.run_all``.
"""
