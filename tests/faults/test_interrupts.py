"""F5: Jupyter's stop button reaches every rank (the escalation for blocked ranks: test_desync.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.faults.conftest import interrupt_after

pytestmark = pytest.mark.timeout(120)


def test_interrupt_python_loop_on_all_ranks_keeps_state(kernel: Any) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute("%%distributed --nproc 2 --device cpu\nkept = 41").ok
    fired = interrupt_after(kernel, 1.0)
    run = kernel.execute("%%distributed\nimport time\nwhile True:\n    time.sleep(0.001)\n")
    fired.join()
    assert not run.ok
    assert run.elapsed < 1.0 + 2.0, f"cell took {run.elapsed:.1f} s after the interrupt"
    text = run.error_text()
    assert text.splitlines()[0] == "interrupted: KeyboardInterrupt on rank 0-1"
    assert "----> 4     time.sleep(0.001)" in text
    after = kernel.execute("%%distributed\nkept + 1")
    assert after.data("execute_result") == [{"text/plain": "42"}]
