"""Suspend a pool to a directory and resume it, at the same or another world size.

:func:`suspend` asks every rank to write its part (:mod:`jupyter_shard.rank.suspend`: the prepared
model and optimizer through ``torch.distributed.checkpoint``, the namespace through cloudpickle)
into a temporary sibling of the directory, adds the manifest (the pool's options, what each rank
kept and could not keep, the dashboard's history), and only then swaps it into place: a suspend that
fails midway (a rank killed, the disk full) leaves the last good one where it was and the ranks
running with their state. Then the ranks end, and their devices are free.

:func:`resume` starts a pool with the suspended options (or changed ones: another world size),
restores the history, and asks every rank to load its part; DCP reshards the model and optimizer
for the new world size.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from jupyter_shard._util.atomic import write_private
from jupyter_shard._util.digests import check_digest, check_file, digest_bytes
from jupyter_shard.errors import PoolError
from jupyter_shard.launchers import merge_spec
from jupyter_shard.launchers.spec_record import from_record, to_record
from jupyter_shard.pool.disk_progress import DiskProgress, bytes_read, bytes_written
from jupyter_shard.pool.keep import let_go
from jupyter_shard.pool.pool import Pool
from jupyter_shard.pool.results import DistributedError
from jupyter_shard.pool.suspend_seal import SEAL, open_manifest, seal
from jupyter_shard.pool.suspend_target import (
    MANIFEST,
    check_again,
    claim,
    fsync_directory,
    is_suspend,
    sync_tree,
)
from jupyter_shard.spec import format_ranks

__all__ = ["DEFAULT_DIRECTORY", "Resumed", "Suspended", "resume", "suspend"]

DEFAULT_DIRECTORY = "jupyter_shard-suspended"
SPEC_FILE = "spec.json"
FORMAT = 2  # 2: the spec as JSON, each file's digest, the manifest signed (pool/suspend_seal.py)


@dataclass
class Suspended:
    """What a suspend wrote: where, how much, in how long, and which names it kept or could not."""

    directory: Path
    world_size: int
    strategy: str
    seconds: float
    bytes: int
    kept: list[str]
    lost: dict[str, str]  # name -> why (the first rank that could not keep it)
    prepared: bool

    def summary(self) -> str:
        model = "the prepared model and optimizer, " if self.prepared else ""
        kept = ", ".join(self.kept[:12]) + (" …" if len(self.kept) > 12 else "")
        lines = [
            f"jupyter_shard: suspended {self.world_size} ranks ({self.strategy}) to {self.directory} in "
            f"{self.seconds:.1f} s, {self.bytes / 2**20:.1f} MiB: {model}{len(self.kept)} names"
            + (f" ({kept})" if kept else "")
            + "; the ranks ended and their devices are free. Resume with %dist_resume"
        ]
        for name, why in sorted(self.lost.items()):
            lines.append(f"jupyter_shard: not kept: {name} ({why})")
        return "\n".join(lines)


@dataclass
class Resumed:
    """What a resume restored, on which world size, and what it could not."""

    directory: Path
    world_size: int
    saved_world_size: int
    seconds: float
    restored: list[str]
    lost: dict[str, str] = field(default_factory=dict)
    prepared: bool = False
    reopened: dict[str, str] = field(default_factory=dict)  # open files reopened, by name (rank 0's)
    rebuilt: list[str] = field(default_factory=list)  # prepared loaders split again (another world size)
    differed: list[str] = field(default_factory=list)  # names each suspended rank held its own value of
    load_seconds: float = 0.0  # of ``seconds``, the ranks' loading (after their pool started)

    def summary(self) -> str:
        model = "the prepared model and optimizer and " if self.prepared else ""
        lines = [
            f"jupyter_shard: resumed {self.directory} on {self.world_size} ranks in {self.seconds:.1f} s: "
            f"{model}{len(self.restored)} names"
        ]
        if self.world_size != self.saved_world_size:
            lines.append(
                f"jupyter_shard: suspended at {self.saved_world_size} ranks: the model and optimizer were "
                "resharded; every rank has rank 0's other names and freshly seeded generators"
            )
            if self.rebuilt:
                lines.append(
                    f"jupyter_shard: {', '.join(self.rebuilt)}: split again over {self.world_size} ranks; "
                    "the rest of each epoch reads every sample no rank had read, once"
                )
            if self.differed:
                lines.append(
                    f"jupyter_shard: {', '.join(self.differed)}: each suspended rank held its own value; "
                    "every rank now holds rank 0's (rebuild them if they were per-rank)"
                )
        for name, where in sorted(self.reopened.items()):
            lines.append(f"jupyter_shard: reopened {name}: {where}")
        for name, why in sorted(self.lost.items()):
            lines.append(f"jupyter_shard: not restored: {name} ({why})")
        return "\n".join(lines)


def suspend(
    pool: Pool,
    directory: str | os.PathLike[str] = DEFAULT_DIRECTORY,
    say: Callable[[str], None] = lambda line: None,
) -> Suspended:
    """Write the pool's state into ``directory`` (atomically), then stop its ranks. ``directory``
    must be new, empty or an earlier suspend (:func:`~jupyter_shard.pool.suspend_target.claim`);
    ``say`` is told what was found on the way (a half-written suspend cleaned up)."""
    pool.refuse_while_background("suspend the pool")
    if not pool.started:
        raise PoolError("no pool is running; there is nothing to suspend")
    final = Path(directory).expanduser().absolute()
    began = time.monotonic()
    final.parent.mkdir(parents=True, exist_ok=True)
    target = claim(final)  # refused here, before any rank writes, where the suspend cannot go
    for note in target.notes:
        say(note)
    tmp = target.tmp
    try:
        with DiskProgress("suspending", "written", partial(bytes_written, tmp)):
            pool.run_own(f"__import__('jupyter_shard.rank.suspend', fromlist=['save']).save({str(tmp)!r})")
        reports = pool.last_values()
        missing = sorted(set(range(pool.world_size)) - set(reports))
        if missing:
            raise PoolError(f"rank {format_ranks(missing)} did not report what it wrote")
        manifest = {
            "format": FORMAT,
            "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "world_size": pool.world_size,
            "strategy": pool.spec.strategy,
            "options": pool.spec.describe(),
            "dcp_format": reports[0]["dcp_format"],
            "ranks": {str(rank): reports[rank] for rank in sorted(reports)},
            "history": pool.history.records(),
        }
        spec = json.dumps(to_record(pool.spec), indent=1).encode()
        write_private(tmp / SPEC_FILE, spec)
        digests = {SPEC_FILE: digest_bytes(spec)}
        for rank in sorted(reports):
            digests |= reports[rank].pop("digests", {})
        manifest["digests"] = digests
        sync_tree(tmp)  # every rank's files and directories on the disk before the manifest says done
        data = json.dumps(manifest, indent=1, default=str).encode()
        write_private(tmp / MANIFEST, data)
        write_private(tmp / SEAL, seal(tmp, data))
        fsync_directory(tmp)
        _swap(tmp, final)
    except BaseException as exc:
        _empty(tmp)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise PoolError(_failed("suspend", exc, pool, final)) from exc
    finally:
        try:
            if tmp.is_dir() and not any(tmp.iterdir()):
                tmp.rmdir()  # while still locked: no other kernel has it yet
        except OSError:
            pass  # left for the next suspend, which empties and reuses it
        finally:
            target.release()
    lost: dict[str, str] = {}
    for rank in sorted(reports, reverse=True):
        lost.update(reports[rank]["lost"])
    pool.shutdown()
    return Suspended(
        directory=final,
        world_size=pool.world_size,
        strategy=pool.spec.strategy,
        seconds=time.monotonic() - began,
        bytes=sum(_sizes(final)),
        kept=sorted(set(reports[0]["kept"])),
        lost=lost,
        prepared=bool(reports[0]["prepared"]),
    )


def resume(
    directory: str | os.PathLike[str] = DEFAULT_DIRECTORY,
    changes: Mapping[str, object] | None = None,
    pool: Pool | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> tuple[Pool, Resumed]:
    """Start a pool (``pool``, or a new one) from a suspend, with ``changes`` to its options
    (``{"nproc": 4}``), and load every rank's state into it. A running ``pool`` is let go first
    (a kept one released, any other stopped; ``say`` is told which)."""
    root = _readable(Path(directory).expanduser().resolve())  # a link the user names is followed
    try:
        manifest = open_manifest(root)  # signed by this user, and no one else could write the tree
    except (OSError, ValueError) as exc:
        raise PoolError(f"{root} is not a readable suspend ({exc}); suspend with %dist_suspend") from None
    if manifest.get("format") != FORMAT:
        raise PoolError(
            f"{root} was written by another version of jupyter_shard (format {manifest.get('format')})"
        )
    digests: dict[str, str] = manifest.get("digests", {})
    try:
        data = (root / SPEC_FILE).read_bytes()
        check_digest(data, SPEC_FILE, digests)
        saved = from_record(json.loads(data))
    except (OSError, ValueError, RuntimeError) as exc:
        raise PoolError(f"{root} is not a readable suspend ({exc}); suspend with %dist_suspend") from None
    spec = merge_spec(saved, dict(changes or {}))
    # before the running pool is let go: a suspend that cannot load leaves it be
    _check_parts(root, manifest, digests)
    saved_world = int(manifest["world_size"])
    if spec.world_size != saved_world and any(r.get("between_steps") for r in manifest["ranks"].values()):
        raise PoolError(
            f"{root} was suspended between micro-steps of a gradient accumulation, whose gradients were "
            f"summed over {saved_world} ranks' data; resume it at {saved_world} ranks (then suspend after "
            "a step to change the world size); nothing was changed"
        )
    positions = _positions(manifest, saved_world) if spec.world_size != saved_world else None
    began = time.monotonic()
    if pool is None:
        pool = Pool(spec=spec)
    elif pool.started:
        let_go(pool, say)
    pool.spec = spec
    _restore_history(pool, manifest.get("history", []))
    try:
        pool.start()
        load = f"__import__('jupyter_shard.rank.suspend', fromlist=['load']).load({str(root)!r}, "
        total = _expected_reads(root, manifest)
        loading = time.monotonic()
        with DiskProgress("resuming", "read", bytes_read(_local_pids(pool)), total):
            pool.run_own(load + f"{saved_world}, {digests!r}, {positions!r})")
        reports = pool.last_values()
        load_seconds = time.monotonic() - loading
    except BaseException as exc:
        pool.shutdown()
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise PoolError(
            f"the resume failed: {_cause(exc)}; the pool was stopped and {root} is unchanged"
        ) from exc
    lost: dict[str, str] = {}
    for rank in sorted(reports, reverse=True):
        lost.update(reports[rank]["lost"])
    first = reports.get(0, {})
    return pool, Resumed(
        directory=root,
        world_size=pool.world_size,
        saved_world_size=saved_world,
        seconds=time.monotonic() - began,
        restored=list(first.get("restored", [])),
        lost=lost,
        prepared=bool(manifest["ranks"]["0"].get("prepared")),
        reopened=dict(first.get("reopened", {})),
        **_per_rank_names(manifest),
        load_seconds=load_seconds,
    )


def _expected_reads(root: Path, manifest: Mapping[str, Any]) -> int:
    """Bytes a resume's ranks read: DCP's files twice (the digest checked, then loaded), the rest once."""
    total = sum(int(part.get("bytes", 0)) for part in manifest["ranks"].values())
    try:
        state = sum(p.stat().st_size for p in (root / "state").iterdir() if p.is_file())
    except OSError:
        state = 0
    return total + state


def _local_pids(pool: Pool) -> dict[int, int]:
    """Rank -> pid of the ranks on this host (their reads can be counted)."""
    here = socket.gethostname()
    return {r.rank: r.handle.pid for r in pool.ranks if r.handle.pid and r.handle.host == here}


def _positions(manifest: Mapping[str, Any], world: int) -> dict[str, list[int]]:
    """Each prepared-loader iterator's samples read on every suspended rank (those all ranks had)."""
    ranks = [manifest["ranks"].get(str(r), {}).get("loaders", {}) for r in range(world)]
    keys = set(ranks[0]).intersection(*ranks[1:]) if ranks else set()
    return {key: [int(r[key]) for r in ranks] for key in sorted(keys)}


def _per_rank_names(manifest: Mapping[str, Any]) -> dict[str, list[str]]:
    """The prepared loaders (split again) and the names whose pickles differed between the suspended
    ranks (every rank of another world size gets rank 0's)."""
    ranks = manifest["ranks"]
    first = ranks["0"]
    rebuilt = list(first.get("rebuilt", []))
    digests = [r.get("name_digests", {}) for r in ranks.values()]
    differed = sorted(
        name
        for name, value in first.get("name_digests", {}).items()
        if name not in rebuilt and any(d.get(name) != value for d in digests)
    )
    return {"rebuilt": rebuilt, "differed": differed}


def _check_parts(root: Path, manifest: Mapping[str, Any], digests: Mapping[str, str]) -> None:
    """Every rank's part is there at the size the suspend wrote (its namespace and, with a prepared
    model, its DCP files and the recipe), and every file but DCP's tensor files (which the ranks check
    as they load) is the one the signed manifest names; one line naming the first that is not."""
    for name in sorted(digests):
        if name.startswith("state/__"):
            continue
        if not (root / name).is_file():
            raise PoolError(f"{root} lacks {name}, so it cannot be resumed; nothing was changed")
        try:
            check_file(root / name, name, dict(digests))
        except (OSError, RuntimeError) as exc:
            why = " ".join(str(exc).split())
            raise PoolError(f"{root}: {why}; the running pool, if any, keeps going") from None
    try:
        ranks = {int(r): int(part["bytes"]) for r, part in manifest["ranks"].items()}
        prepared = bool(manifest["ranks"]["0"].get("prepared"))
    except (KeyError, TypeError, ValueError) as exc:
        raise PoolError(
            f"{root} is not a readable suspend (its manifest lacks {exc}); nothing was changed"
        ) from None
    needed = [root / "model.pkl", root / "state" / ".metadata"] if prepared else []
    for path in needed:
        if not path.is_file():
            raise PoolError(f"{root} lacks {path.name}, so it cannot be resumed; nothing was changed")
    for rank, size in sorted(ranks.items()):
        parts = [root / f"namespace-{rank}.pkl", *(root / "state").glob(f"__{rank}_*")]
        have = sum(p.stat().st_size for p in parts if p.is_file())
        if not parts[0].is_file() or have != size:
            what = "lacks" if not parts[0].is_file() else f"holds {have} of the {size} bytes of"
            raise PoolError(
                f"{root} {what} rank {rank}'s part, so it cannot be resumed; nothing was changed (the "
                "running pool, if any, keeps going)"
            )


def _restore_history(pool: Pool, records: list[dict[str, Any]]) -> None:
    """The dashboard's history carries on from where the suspended pool left it (in place of what
    a reused pool object held: the suspend's history already has it)."""
    pool.history.clear()
    for record in records:
        values = {k: v for k, v in record.items() if k not in ("rank", "step", "time")}
        pool.history.extend(
            int(record["rank"]), [{"step": record["step"], "ts": record["time"], "values": values}]
        )


def _failed(what: str, exc: BaseException, pool: Pool, final: Path) -> str:
    """One line: why, what became of the ranks, and which suspend is on disk."""
    dead = [r.rank for r in pool.ranks if r.dead]
    ranks = (
        f"rank {format_ranks(dead)} died, so the pool needs %dist_restart (the other ranks' state is lost)"
        if dead
        else "the ranks keep running with their state"
    )
    kept = (
        f"{final} still holds the last good suspend" if final.exists() else f"nothing was written to {final}"
    )
    return f"the {what} failed: {_cause(exc)}; {ranks}; {kept}"


def _cause(exc: BaseException) -> str:
    if isinstance(exc, DistributedError) and exc.failures:
        failure = exc.failures[0]
        if all(f.ename == "KeyboardInterrupt" for f in exc.failures):
            return "stopped by Ctrl-C"
        text = f"{failure.ename}: {failure.evalue}" if failure.status != "dead" else failure.evalue
        return f"rank {failure.rank}: {text.strip().splitlines()[0] if text.strip() else failure.ename}"
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _readable(final: Path) -> Path:
    """The suspend directory, or the one a swap interrupted between its two renames left."""
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and old.exists():
        return old
    if not (final / MANIFEST).is_file():
        raise PoolError(f"no suspend in {final} (no {MANIFEST}); suspend a pool there with %dist_suspend")
    return final


def _swap(tmp: Path, final: Path) -> None:
    """``tmp`` becomes ``final`` (checked by :func:`claim` to be new, empty or an earlier suspend); a
    crash between the renames leaves ``.final.old``, which resume reads and the next suspend puts back."""
    old = final.with_name(f".{final.name}.old")
    if old.exists() or old.is_symlink():
        if not is_suspend(old) or old.is_symlink():
            raise PoolError(f"{old} is in the way of the swap and is not a suspend; move it away")
        shutil.rmtree(old)
    check_again(final)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    fsync_directory(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _empty(tmp: Path) -> None:
    """What a failed suspend wrote into its temporary directory (still locked by this kernel)."""
    if tmp.is_dir() and not tmp.is_symlink():
        for entry in tmp.iterdir():
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


def _sizes(root: Path) -> list[int]:
    return [p.stat().st_size for p in root.rglob("*") if p.is_file()]
