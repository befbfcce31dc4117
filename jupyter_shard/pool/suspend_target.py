"""Where a suspend is written: never over what the user owns, never under another kernel's suspend.

Why it exists: a suspend is written into a temporary sibling of its directory and swapped into place,
and the swap removes what was there. That is right for an earlier suspend and wrong for anything else:
``%dist_suspend .`` from a project folder would remove the project. So the target is checked before
any rank writes (:func:`claim`): it must be new, empty, or hold a complete earlier suspend and nothing
else, and must not hold the kernel's working directory. The temporary directory doubles as a lock: the
kernel writing it holds an exclusive ``flock`` on it until the swap is done, so a second kernel
suspending to the same directory is refused instead of deleting the first one's work, and a
temporary left by a kernel killed mid-suspend (no holder) is emptied and reused, and the user told
how much it held. Before the swap every file and directory in it is synced (:func:`sync_tree`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_shard.errors import PoolError

MANIFEST = "manifest.json"
#: the names a suspend writes at its top level (pool/suspend.py and rank/suspend.py)
OURS = re.compile(
    r"manifest\.json|manifest\.sig|spec\.json|spec\.pkl|model\.pkl|namespace-\d+\.pkl|state|\.[^/]+\.tmp"
)


@dataclass
class Claim:
    """A target being written: the temporary directory, held locked, and what was found on the way."""

    final: Path
    tmp: Path
    fd: int
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        os.close(self.fd)  # the flock goes with the descriptor


def claim(final: Path) -> Claim:
    """Check ``final`` and take its temporary sibling, locked; one :class:`PoolError` line saying
    what to do where the suspend cannot go there."""
    _check(final)
    tmp = final.with_name(f".{final.name}.suspending")
    notes: list[str] = []
    _recover_interrupted_swap(final, notes)
    try:
        tmp.mkdir(mode=0o700)
    except FileExistsError:
        if tmp.is_symlink() or not tmp.is_dir():
            raise PoolError(f"{tmp} is in the way of the suspend and is not ours; move it away") from None
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise PoolError(f"{tmp} cannot be used for the suspend ({exc.strerror}); move it away") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:  # planted by someone else: not ours
            raise PoolError(f"{tmp} is in the way of the suspend and is not this user's alone; move it away")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise PoolError(
                    f"another kernel is suspending to {final} right now; wait for it to finish, or suspend "
                    "to another directory"
                ) from None
            raise
        now = os.lstat(tmp) if tmp.exists() or tmp.is_symlink() else None
        if now is None or (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            raise PoolError(  # another kernel finished and swapped it away between open and lock
                f"another kernel just suspended to {final}; run the suspend again"
            )
    except BaseException:
        os.close(fd)
        raise
    left = _size(tmp)
    if any(tmp.iterdir()):
        for entry in tmp.iterdir():  # a kernel killed mid-suspend left these: no one holds them
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        notes.append(
            f"jupyter_shard: removed a half-written suspend ({left / 2**20:.1f} MiB in {tmp.name}) left by a "
            "kernel that stopped while suspending"
        )
    return Claim(final, tmp, fd, notes)


def sync_tree(root: Path) -> None:
    """fsync every file under ``root`` (made 0600), then every directory bottom-up (0700), ``root``
    included: what the swap makes visible is on the disk and this user's alone, whatever the umask
    the ranks wrote with (DCP makes its files with the umask's modes, and a resume refuses a tree
    others could write)."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, 0o600)
                os.fsync(fd)
            finally:
                os.close(fd)
        os.chmod(directory, 0o700)
        fsync_directory(Path(directory))


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_suspend(path: Path) -> bool:
    """A complete suspend of ours and nothing else: a manifest with its format, the names a suspend
    writes, no other."""
    try:
        names = os.listdir(path)
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "format" in manifest and all(OURS.fullmatch(n) for n in names)


def check_again(final: Path) -> None:
    """Just before the swap: ``final`` is still new, empty or a suspend (the user may have saved
    files into it while the ranks wrote), so the swap removes nothing of theirs."""
    if final.exists() and not final.is_symlink() and final.is_dir():
        names = sorted(os.listdir(final))
        if names and not is_suspend(final):
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise PoolError(
                f"{final} now holds files that are not a suspend ({shown}), added while the ranks wrote; "
                "nothing was replaced: suspend to a new or empty directory"
            )


def _check(final: Path) -> None:
    if final.is_symlink():
        raise PoolError(f"{final} is a symbolic link; suspend to a directory path of its own")
    if not final.exists():
        return
    if not final.is_dir():
        raise PoolError(f"{final} is a file, not a directory; suspend to a new or empty directory")
    cwd = Path.cwd().resolve()
    here = final.resolve()
    if here == cwd or here in cwd.parents:
        raise PoolError(
            f"{final} holds this kernel's working directory; suspend to a new directory, such as "
            f"{final / 'jupyter_shard-suspended'}"
        )
    names = sorted(os.listdir(final))
    if names and not is_suspend(final):
        shown = ", ".join(n + ("/" if (final / n).is_dir() else "") for n in names[:3])
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise PoolError(
            f"{final} already holds files that are not a suspend ({shown}{more}); nothing was written: "
            "suspend to a new or empty directory"
        )


def _recover_interrupted_swap(final: Path, notes: list[str]) -> None:
    """A swap interrupted between its renames left the last good suspend as ``.final.old``: put it
    back before anything else, so that this suspend failing cannot lose it."""
    old = final.with_name(f".{final.name}.old")
    if old.is_dir() and not old.is_symlink() and not final.exists() and is_suspend(old):
        old.rename(final)
        notes.append(f"jupyter_shard: put back {final}, the last suspend, from an interrupted swap")


def _size(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
