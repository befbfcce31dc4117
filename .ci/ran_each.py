"""Each test folder ran at least one test: a folder whose tests were all skipped or deselected (a
missing browser, SLURM, package or device, a marker typo) fails the run instead of passing quietly.

    python .ci/ran_each.py JUNIT.xml [JUNIT.xml ...] -- FOLDER [FOLDER ...]

A test counts as run when pytest's JUnit report has it passed or failed (not skipped); its folder is
the one its path starts with (for nbval, the notebook's).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def ran_per_folder(reports: list[Path], folders: list[str]) -> dict[str, int]:
    counts = dict.fromkeys(folders, 0)
    for report in reports:
        try:
            root = ElementTree.parse(report).getroot()
        except (OSError, ElementTree.ParseError) as exc:
            raise SystemExit(f"error: cannot read {report}: {exc}") from None
        for case in root.iter("testcase"):
            if any(child.tag == "skipped" for child in case):
                continue
            where = (case.get("file") or case.get("classname", "").replace(".", "/")).lstrip("./")
            for folder in folders:
                if where.startswith(folder.rstrip("/") + "/") or where == folder:
                    counts[folder] += 1
    return counts


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    reports, folders = [Path(a) for a in argv[:split]], argv[split + 1 :]
    counts = ran_per_folder(reports, folders)
    empty = [folder for folder, n in counts.items() if n == 0]
    for folder, n in counts.items():
        print(f"  {folder}: {n} test(s) ran")
    if empty:
        print(f"error: no test ran in {', '.join(empty)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
