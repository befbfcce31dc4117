"""Runs a node agent (torchrun, ssh or srun) tied to the kernel's lifeline.

``python -m jupyter_shard.launchers.tether --lifeline FD [--cancel JSON] -- command...`` starts the
command in its own session and waits for it. When the kernel that started it dies (the lifeline pipe
closes) or the tether is sent SIGTERM/SIGINT, it runs the cancel command if one was given (e.g.
``scancel`` for a SLURM job), sends the command's process group SIGTERM, and SIGKILL after
``GRACE`` seconds. It exits with the command's status (128 + N for a signal, as a shell does).

With ``--kept RECORD`` (a pool's ``kept.json``): if the record is there when the kernel dies, the pool
is kept (``--keep``), so the agent is left running, and its ranks wait out their lease for a kernel to
attach. The tether notes in the record when the kernel went (for ``%dist_pools``' time left), goes on
waiting for the agent (and for SIGTERM from a kernel that attached and stops the pool), and when the
agent has ended with no kernel attached, removes the pool's directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import psutil

from jupyter_shard._util.atomic import write_private

GRACE = 5.0


def _stop(proc: subprocess.Popen[bytes], cancel: list[str]) -> None:
    if cancel:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(cancel, stdin=subprocess.DEVNULL, timeout=30, check=False)
    for sig, wait in ((signal.SIGTERM, GRACE), (signal.SIGKILL, 1.0)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _kept(record: Path | None) -> bool:
    """Whether the pool is kept: its record is there with a lease. Notes that the kernel went."""
    if record is None:
        return False
    try:
        data = json.loads(record.read_text())
        if float(data.get("keep", 0)) <= 0:
            return False
        if data.get("owner"):  # every tether of the pool notes it; the first one's time stands
            data["owner"], data["orphaned_at"] = None, time.time()
            write_private(record, json.dumps(data))
        return True
    except (OSError, ValueError, TypeError):
        return False


def _unattached(record: Path) -> bool:
    """The kept pool's record is there and names no live kernel (the lease ran out unattached)."""
    try:
        owner = json.loads(record.read_text()).get("owner")
        if not owner:
            return True
        return bool(psutil.Process(int(owner[0])).create_time() != owner[1])
    except psutil.Error:
        return True
    except (OSError, ValueError, TypeError, IndexError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_shard.launchers.tether")
    parser.add_argument("--lifeline", type=int, required=True)
    parser.add_argument("--cancel", default="[]", help="JSON list: a command run before stopping")
    parser.add_argument("--kept", type=Path, default=None, help="a kept pool's record (kept.json)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    cancel = [str(part) for part in json.loads(args.cancel)]
    asked: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        asked.append(signum)

    # Handlers first: a SIGTERM that came between starting the command and installing them would
    # end the tether and leave the command running.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    proc = subprocess.Popen(command, start_new_session=True)
    lifeline: int | None = args.lifeline
    while True:
        code = proc.poll()
        if code is not None:
            if lifeline is None and args.kept is not None and _unattached(args.kept):
                shutil.rmtree(args.kept.parent, ignore_errors=True)  # the lease ran out: nothing left
            return _status(code)
        if asked:
            _stop(proc, cancel)
            return _status(proc.wait())
        if lifeline is None:
            time.sleep(0.25)
            continue
        with contextlib.suppress(InterruptedError):
            readable, _, _ = select.select([lifeline], [], [], 0.25)
            if readable and os.read(lifeline, 1) == b"":
                if _kept(args.kept):
                    print(
                        "jupyter_shard: the kernel is gone; the node agent stays for the kept pool",
                        file=sys.stderr,
                    )
                    os.close(lifeline)
                    lifeline = None
                    continue
                print("jupyter_shard: the kernel is gone; stopping the node agent", file=sys.stderr)
                _stop(proc, cancel)
                time.sleep(0.1)
                return _status(proc.poll() or 0)


if __name__ == "__main__":
    sys.exit(main())
