"""Tests marked ``late`` run after all the others (tests/conftest.py), so ``make test``'s background
build of DeepSpeed's async_io has the suites' idle time before the test that needs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import late_last

ROOT = Path(__file__).resolve().parents[2]


class _Item:
    def __init__(self, name: str, late: bool) -> None:
        self.name, self.late = name, late

    def get_closest_marker(self, name: str) -> object:
        return pytest.mark.late.mark if name == "late" and self.late else None


def test_late_items_move_to_the_end_and_both_groups_keep_their_order() -> None:
    items = [_Item("a", False), _Item("nvme", True), _Item("b", False), _Item("z", True), _Item("c", False)]
    assert [item.name for item in late_last(items)] == ["a", "b", "c", "nvme", "z"]
    assert [item.name for item in late_last(items[:1])] == ["a"]


def test_the_nvme_offload_test_is_marked_late_and_the_marker_is_registered() -> None:
    pytest.importorskip("deepspeed")
    from tests.integration import test_deepspeed

    marks = getattr(test_deepspeed.test_nvme_offload_swaps_to_the_given_directory, "pytestmark", [])
    assert "late" in [mark.name for mark in marks], "the async_io test must run last"
    assert '"late: ' in (ROOT / "pyproject.toml").read_text()
