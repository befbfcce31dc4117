"""``make gpu-check`` passes only on a check that tested something: every stage asked for ran, every
collected test ran, and every skip was for a device count the machine lacks; no GPU visible fails
unless the CPU rehearsal was asked for by name."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_verdict import problems

ALL = ["bench", "install", "tests"]
OK = {"install": "ok", "bench": "ok", "tests": "ok"}
IDS = ["tests/gpu/test_a.py::test_one", "tests/gpu/test_a.py::test_two[x]"]


def _row(test: str, outcome: str = "passed", message: str = "") -> dict[str, Any]:
    return {"test": test, "outcome": outcome, "message": message}


def test_a_full_run_on_a_gpu_passes() -> None:
    assert problems(OK, ALL, [_row(IDS[0]), _row(IDS[1])], IDS, visible=1, rehearsal=False) == []


def test_a_skip_for_more_gpus_than_the_machine_has_passes_and_any_other_skip_fails() -> None:
    wanted = _row(IDS[1], "skipped", "needs 2 CUDA devices, 1 visible")
    assert problems(OK, ALL, [_row(IDS[0]), wanted], IDS, visible=1, rehearsal=False) == []
    missing = _row(IDS[1], "skipped", "could not import 'deepspeed': No module named 'deepspeed'")
    found = problems(OK, ALL, [_row(IDS[0]), missing], IDS, visible=1, rehearsal=False)
    assert len(found) == 1 and "test_two[x] skipped, not for a device count" in found[0]


def test_every_test_skipped_because_no_gpu_is_visible_fails() -> None:
    skipped = [
        _row(i, "skipped", "needs 1 CUDA device, 0 visible; the GPU tests run on a GPU machine") for i in IDS
    ]
    found = problems(OK, ALL, skipped, IDS, visible=0, rehearsal=False)
    assert found[0].startswith("no GPU is visible to the check's Python")
    assert sum("not for a device count" in line for line in found) == 2


def test_the_cpu_rehearsal_passes_with_its_skips() -> None:
    skipped = [_row(i, "skipped", "needs 1 CUDA device, 0 visible") for i in IDS]
    assert problems(OK, ALL, skipped, IDS, visible=0, rehearsal=True) == []


def test_a_stage_that_did_not_run_or_timed_out_fails_naming_the_tests_it_never_reached() -> None:
    statuses = {**OK, "tests": "timed out after 300 s"}
    found = problems(statuses, ALL, [_row(IDS[0])], IDS, visible=1, rehearsal=False)
    assert "the tests stage did not succeed: timed out after 300 s" in found
    assert any(
        line.startswith("1 test(s) cut for time, never run: tests/gpu/test_a.py::test_two[x]")
        for line in found
    )
    found = problems({**OK, "tests": "skipped: no time left"}, ALL, [], IDS, visible=1, rehearsal=False)
    assert "the test stage reported no test" in found


def test_failures_are_named_and_an_install_skipped_on_purpose_is_fine() -> None:
    statuses = {**OK, "install": "skipped: ran in /usr/bin/python3"}
    rows = [_row(IDS[0], "failed", "AssertionError: 3 != 4\nmore"), _row(IDS[1])]
    assert problems(statuses, ALL, rows, IDS, visible=2, rehearsal=False) == [
        "tests/gpu/test_a.py::test_one failed: AssertionError: 3 != 4"
    ]


def test_the_report_names_the_bundles_commit_and_whether_the_tree_runs_its_code(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """The GPU machine's copy of the tree carried another repository state (a report said f0ae112 for
    a bundle made at d635cae), and ranks and tests run the tree, not the bundled wheel: the report
    names the bundle's commit and says whether the tree's code is the one the bundle was made from."""
    import json

    from benchmarks import gpu_bundle, gpu_check

    monkeypatch.setattr(gpu_check, "_git_revision", lambda: "revision f0ae112 with uncommitted changes")
    assert (
        gpu_check._revisions(tmp_path)
        == "revision f0ae112 with uncommitted changes (the bundle names no revision)"
    )
    (tmp_path / "REVISION").write_text("")  # empty or not JSON: as good as none
    assert gpu_check._revisions(tmp_path).endswith("(the bundle names no revision)")
    stamp = gpu_bundle.revision()
    assert len(str(stamp["commit"])) == 40 and stamp["tree"] == gpu_check.tree_digest()
    (tmp_path / "REVISION").write_text(json.dumps({**stamp, "commit": "d635cae" + "0" * 33, "dirty": False}))
    assert gpu_check._revisions(tmp_path) == (
        "bundle made at d635cae00000; the tree's code is the bundle's "
        "(this tree's git: revision f0ae112 with uncommitted changes)"
    )
    (tmp_path / "REVISION").write_text(json.dumps({**stamp, "tree": "0" * 64, "dirty": True}))
    assert "with uncommitted changes; the tree's code differs from it" in gpu_check._revisions(tmp_path)
