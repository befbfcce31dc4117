"""``make gpu-bundle``: the wheels a GPU machine without network lacks, in one folder under 64 MiB.

That machine has CPython 3.12 on x86-64 Linux with torch (a CUDA build) and Lightning, and nothing of
Jupyter. The bundle holds this package built as a wheel, DeepSpeed built here as a pure-Python wheel
(it publishes only an sdist; ``DS_BUILD_OPS=0``, built without torch, so nothing is compiled), pytest
and pytest-timeout, and every dependency of those for CPython 3.12 manylinux x86-64, downloaded with
``pip download --only-binary=:all:``. Never torch, triton, the nvidia-* CUDA libraries or Lightning:
the machine has its own, and ``make gpu-check`` holds them at the installed versions.

Run it with a Python 3.12 where there is one: pip evaluates dependencies' environment markers for the
interpreter it runs in. The bundle is then checked: no forbidden wheel, the size, and that the
requirements resolve from the bundle alone (``pip install --dry-run --no-index``) with a stand-in torch.
Usage: ``python benchmarks/gpu_bundle.py [--out gpu-bundle] [--deepspeed deepspeed==0.19.8]``.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What `make gpu-check` installs from the bundle (with this package's wheel).
TOP = ("deepspeed", "pytest", "pytest-timeout")
TARGET = [
    "--only-binary=:all:",
    "--implementation=cp",
    "--python-version=3.12",
    "--abi=cp312",
    "--platform=manylinux2014_x86_64",
    "--platform=manylinux_2_17_x86_64",
    "--platform=manylinux_2_28_x86_64",  # what torch's own CUDA 12/13 wheels need
]
# The GPU machine's own: never in the bundle, never replaced by it.
HOST_OWNED = re.compile(
    r"^(torch|triton|lightning|pytorch[-_]lightning|lightning[-_]fabric|nvidia[-_].*)$", re.I
)
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    return canonical(path.name.split("-")[0])


def requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements (no extras), less those the GPU machine owns."""
    with zipfile.ZipFile(wheel) as zf:
        metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(zf.read(metadata).decode())
    kept = []
    for line in message.get_all("Requires-Dist") or []:
        marker = line.partition(";")[2]
        match = _NAME.match(line)
        if match is None or re.search(r"\bextra\b", marker) or HOST_OWNED.match(canonical(match[1])):
            continue
        kept.append(line.strip())
    return kept


def pip(python: str, *args: str, env: dict[str, str] | None = None) -> None:
    command = [python, "-m", "pip", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def stub_wheel(folder: Path, name: str, version: str) -> Path:
    """An empty wheel that stands for a package the GPU machine has, for the resolution check."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{dist}/RECORD"])
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
    return path


def resolve_offline(python: str, bundle: Path, torch_version: str) -> list[str]:
    """What ``pip install --no-index --find-links bundle`` would install for CPython 3.12, torch
    standing in as an empty wheel; pip's configuration and PIP_* variables are left out, so that
    nothing but the bundle is seen. Raises if it does not resolve or needs anything else."""
    with tempfile.TemporaryDirectory() as tmp:
        stub = stub_wheel(Path(tmp), "torch", torch_version)
        report = Path(tmp) / "report.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        pip(
            python,
            "install",
            "--dry-run",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            f"--find-links={bundle}",
            f"--find-links={tmp}",
            *TARGET,
            f"--target={Path(tmp) / 'site'}",
            f"--report={report}",
            "jupyter_shard",
            *TOP,
            env=env,
        )
        installs = json.loads(report.read_text())["install"]
        names = sorted(canonical(item["metadata"]["name"]) for item in installs)
        outside = [
            item["download_info"]["url"]
            for item in installs
            if Path(item["download_info"]["url"].removeprefix("file://")).parent not in (bundle, stub.parent)
        ]
    if outside:
        raise SystemExit(f"error: the resolution took files from outside the bundle: {outside}")
    return [n for n in names if n != "torch"]


def build(python: str, out: Path, deepspeed: str) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    pip(python, "wheel", "--no-deps", f"--wheel-dir={out}", str(ROOT))
    # torch is not in DeepSpeed's build requirements, so its isolated build never sees one: no ops
    # are compiled (DS_BUILD_OPS=0 says so explicitly) and the wheel is py3-none-any.
    pip(
        python,
        "wheel",
        "--no-deps",
        "--no-binary=deepspeed",
        f"--wheel-dir={out}",
        deepspeed,
        env={**os.environ, "DS_BUILD_OPS": "0"},
    )
    needs = sorted(
        {r for wheel in out.glob("*.whl") for r in requirements(wheel)} | {"pytest", "pytest-timeout"}
    )
    (out / "requirements.txt").write_text("".join(f"{r}\n" for r in needs))
    pip(python, "download", *TARGET, f"--dest={out}", f"--requirement={out / 'requirements.txt'}")
    (out / "REVISION").write_text(json.dumps(revision()) + "\n")


def revision() -> dict[str, object]:
    """This checkout's commit, whether tracked files differ from it, and the digest of the code the
    check runs (``gpu_check.tree_digest``): the report says whether the GPU machine's tree is the same."""
    try:
        from gpu_check import git_state, tree_digest  # beside this file, run by path
    except ImportError:
        from benchmarks.gpu_check import git_state, tree_digest

    commit, dirty = git_state(ROOT) or ("not a git checkout", False)
    return {"commit": commit, "dirty": dirty, "tree": tree_digest(ROOT)}


def verify(python: str, out: Path, max_mib: float, torch_version: str) -> None:
    wheels = sorted(out.glob("*.whl"))
    owned = [w.name for w in wheels if HOST_OWNED.match(wheel_name(w))]
    if owned:
        raise SystemExit(f"error: the bundle holds what the GPU machine owns: {owned}")
    compiled = [
        w.name for w in wheels if wheel_name(w) == "deepspeed" and not w.name.endswith("py3-none-any.whl")
    ]
    if compiled:
        raise SystemExit(f"error: DeepSpeed was built with compiled ops: {compiled}")
    installed = resolve_offline(python, out, torch_version)
    unused = sorted({wheel_name(w) for w in wheels} - set(installed))
    mib = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(
        f"resolves from the bundle alone for CPython 3.12 ({len(installed)} packages): {' '.join(installed)}"
    )
    if unused:
        print(f"not needed on CPython 3.12 (left in): {' '.join(unused)}")
    print(f"{out}: {len(wheels)} wheels, {mib:.1f} MiB (limit {max_mib:g} MiB)")
    if mib > max_mib:
        raise SystemExit(
            f"error: {out} is {mib:.1f} MiB, over the {max_mib:g} MiB that can travel with a run"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-bundle")
    parser.add_argument("--deepspeed", default="deepspeed==0.19.8", help="the DeepSpeed requirement to build")
    parser.add_argument("--max-mib", type=float, default=64.0)
    parser.add_argument("--torch", default="2.11.0", help="the torch version the resolution check assumes")
    parser.add_argument("--verify-only", action="store_true", help="check an existing bundle")
    args = parser.parse_args(argv)
    if sys.version_info[:2] != (3, 12):
        print(f"warning: Python {sys.version.split()[0]}: dependencies' markers are read for it, not 3.12")
    started = time.monotonic()
    out = args.out.resolve()
    if not args.verify_only:
        build(sys.executable, out, args.deepspeed)
    verify(sys.executable, out, args.max_mib, args.torch)
    print(f"gpu-bundle done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
