"""A suspend's seal: each file's SHA-256 in the manifest, the manifest signed with the user's key.

Why it exists: a suspend holds pickles (each rank's namespace, the model's recipe, DCP's metadata), and
loading a pickle runs whatever it names. A directory that someone else could write, or a copy from
elsewhere, would run their code in the ranks on ``%dist_resume``. So a suspend records the SHA-256 of
every file it wrote (each rank hashes its own, in parallel) in its manifest, and the manifest is
signed with HMAC-SHA256 under a key only this user can read (:func:`user_key`, made on first use).
:func:`open_manifest` refuses an unsigned or altered manifest and a tree that another user could
write, before anything is loaded; each rank then checks the bytes it is about to load against the
manifest (:func:`check_digest`) and loads those same bytes, so a file changed after the kernel's check
is refused too.

The key lives in ``$JUPYTER_SHARD_KEY_DIR``, else ``~/.local/share/jupyter_shard`` (0700, the key
0600): a suspend outlives a reboot, and the runtime directory (``$XDG_RUNTIME_DIR``) does not.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from jupyter_shard.errors import PoolError

KEY_DIR_VAR = "JUPYTER_SHARD_KEY_DIR"
KEY_FILE = "suspend.key"
SEAL = "manifest.sig"


def key_dir() -> Path:
    return Path(os.environ.get(KEY_DIR_VAR) or Path.home() / ".local" / "share" / "jupyter_shard")


def user_key() -> bytes:
    """This user's signing key, made (32 random bytes, 0600) the first time; refused in one line if
    another user owns it or could read it."""
    folder = key_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(32))
            fh.flush()
            os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PoolError(
                f"{path} (the key that signs suspends) is not this user's alone; remove it, and a new one "
                "is made (earlier suspends then no longer resume)"
            )
        key = fh.read()
    if len(key) < 32:
        raise PoolError(f"{path} (the key that signs suspends) is cut short; remove it to make a new one")
    return key


def seal(root: Path, manifest_bytes: bytes) -> bytes:
    """The signature to write beside ``manifest_bytes`` (as :data:`SEAL`)."""
    return hmac.new(user_key(), manifest_bytes, hashlib.sha256).hexdigest().encode()


def open_manifest(root: Path) -> dict[str, Any]:
    """The manifest of the suspend in ``root``, once its signature and the tree's owner and modes are
    checked; one :class:`PoolError` line otherwise, before anything in it is read further."""
    _check_tree(root)
    try:
        data = (root / "manifest.json").read_bytes()
        signature = (root / SEAL).read_bytes().strip()
    except FileNotFoundError as exc:
        raise PoolError(
            f"{root} has no signature ({Path(exc.filename).name} is missing): it was not written by this "
            "version of jupyter_shard for this user, and its pickles would run code; nothing was loaded"
        ) from None
    expected = hmac.new(user_key(), data, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(signature, expected):
        raise PoolError(
            f"{root} is not signed by this user's key (altered since, or written by another user or "
            "machine); its pickles would run code, so nothing was loaded"
        )
    manifest: dict[str, Any] = json.loads(data)
    return manifest


def _check_tree(root: Path) -> None:
    """Every directory and file of the suspend owned by this user and writable by no one else."""
    uid = os.getuid()
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            raise PoolError(f"{path} is a symbolic link inside a suspend; nothing was loaded")
        if info.st_uid != uid or info.st_mode & 0o022:
            raise PoolError(
                f"{path} can be written by another user, so the suspend could have been altered; nothing "
                f"was loaded (chmod go-w -R {root} if it is yours)"
            )
