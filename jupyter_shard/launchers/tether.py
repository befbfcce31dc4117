"""Runs a node agent (torchrun, ssh or srun) tied to the kernel's lifeline.

``python -m jupyter_shard.launchers.tether --lifeline FD [--cancel JSON] -- command...`` starts the
command in its own session and waits for it. When the kernel that started it dies (the lifeline pipe
closes) or the tether is sent SIGTERM/SIGINT, it runs the cancel command if one was given (e.g.
``scancel`` for a SLURM job), sends the command's process group SIGTERM, and SIGKILL after
``GRACE`` seconds. It exits with the command's status (128 + N for a signal, as a shell does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from types import FrameType

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_shard.launchers.tether")
    parser.add_argument("--lifeline", type=int, required=True)
    parser.add_argument("--cancel", default="[]", help="JSON list: a command run before stopping")
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
    lifeline = args.lifeline
    while True:
        code = proc.poll()
        if code is not None:
            return _status(code)
        if asked:
            _stop(proc, cancel)
            return _status(proc.wait())
        with contextlib.suppress(InterruptedError):
            readable, _, _ = select.select([lifeline], [], [], 0.25)
            if readable and os.read(lifeline, 1) == b"":
                print("jupyter_shard: the kernel is gone; stopping the node agent", file=sys.stderr)
                _stop(proc, cancel)
                time.sleep(0.1)
                return _status(proc.poll() or 0)


if __name__ == "__main__":
    sys.exit(main())
