"""Browser tests against a real JupyterLab (see conftest.py)."""
