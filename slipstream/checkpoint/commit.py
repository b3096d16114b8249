"""How a save becomes visible atomically, and how an interrupted one is found and cleaned up.

Rank 0 runs every step here; the other ranks only write their files into the temporary
directory. The working names in ``<save_dir>`` are hidden and carry the save's nonce ``X``::

    .save-X.lock      held (``flock``) by rank 0 from before the first step of save X until
                      after its last; the kernel drops the lock when the process dies, so a
                      free (or missing) lock means save X is over and its leftovers are stale
    .<tag>.tmp-X      the checkpoint being written; after a tag-reuse exchange, the old one
    .<tag>.old-X      the old tag directory between two renames (no RENAME_EXCHANGE only)
    .<tag>.del-X      a ``keep_last`` victim being deleted (renamed first, so a half-deleted
                      directory never looks like a tag)
    .latest.tmp-X     the next ``latest``, renamed over it

Replacing a tag (a save reusing it) swaps the new and old directories with one
``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+; ext4, xfs, btrfs, tmpfs): a reader sees the old
or the new complete checkpoint, never none. Where the filesystem refuses it, two renames go
through ``.<tag>.old-X``; a crash between them leaves the tag missing, and the next save or
load renames the old checkpoint back (``recover_tag``). ``clean_leftovers`` removes what
crashed saves left, skipping every save whose lock is still held (a concurrent saver).
Locks use ``flock``, which Linux NFS clients map to NFS byte-range locks.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from slipstream.checkpoint import _faults
from slipstream.checkpoint.format import MANIFEST, CheckpointError, fsync_dir
from slipstream.checkpoint.from_deepspeed import is_deepspeed_tag

__all__ = [
    "LATEST",
    "SaveLock",
    "clean_leftovers",
    "find_checkpoint",
    "list_tags",
    "recover_tag",
    "remove_tree",
    "replace_dir",
    "retain",
    "write_latest",
]

logger = logging.getLogger(__name__)

LATEST = "latest"
_WORKING = re.compile(r"^\.(?P<tag>.+)\.(?P<kind>tmp|old|del)-(?P<nonce>[0-9a-f]{12}|\d+)$")
_LOCK = re.compile(r"^\.save-(?P<nonce>[0-9a-f]{12})\.lock$")
# Files a slipstream tag directory holds: a directory with only these and no manifest is a
# half-deleted tag from a version that deleted in place.
_OURS = re.compile(r"^(rank-\d{5}\.(safetensors|pt)|extra\.pt|hf_config\.json|manifest\.json)$")

_FRESH_LOCK_S = 60.0
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
use_exchange = True
"""Swap directories with ``renameat2(RENAME_EXCHANGE)`` when the filesystem allows it (tests
set it to False to exercise the two-rename path)."""


def new_nonce() -> str:
    return uuid.uuid4().hex[:12]


# --------------------------------------------------------------------------- locks


@dataclass
class SaveLock:
    """Rank 0's lock of one save: held from before its first step until after its last."""

    path: Path
    fd: int

    @classmethod
    def acquire(cls, root: Path, nonce: str) -> SaveLock:
        path = root / f".save-{nonce}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:  # a filesystem without locks: _is_live then says "live"
            logger.warning(
                "%s: file locks are not supported here (%s): leftovers of crashed saves in %s "
                "will not be removed automatically",
                path,
                e,
                root,
            )
        return cls(path, fd)

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in this order: see ``_is_live``)."""
        if self.fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = -1


def _is_live(root: Path, nonce: str) -> bool:
    """Whether save ``nonce`` still runs: its lock file exists and is held by someone.

    A save takes its lock before creating anything and removes the lock file before dropping
    the lock, so a missing file means the save is over (or was made by an older version).
    """
    if len(nonce) != 12:  # versions before the lock named directories by PID
        return False
    try:
        fd = os.open(root / f".save-{nonce}.lock", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (EWOULDBLOCK), or no locks on this filesystem: assume live
        return True
    finally:
        os.close(fd)  # also drops the lock if we got it
    return False


# --------------------------------------------------------------------------- removal


def remove_tree(path: Path, step: str) -> None:
    """Delete ``path`` (a file or a tree). The fault point ``<step>.half_removed`` follows
    the first deleted entry, so tests see a half-deleted directory."""
    if not path.is_dir() or path.is_symlink():
        path.unlink(missing_ok=True)
        return
    for i, entry in enumerate(sorted(path.iterdir())):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)
        if i == 0:
            _faults.point(f"{step}.half_removed")
    path.rmdir()


def _discard(path: Path, nonce: str) -> None:
    """Hide ``path`` under a ``.del`` name by one rename, then delete it."""
    hidden = path.with_name(f".{path.name}.del-{nonce}")
    os.rename(path, hidden)
    _faults.point("retain.hidden")
    remove_tree(hidden, "retain")


# --------------------------------------------------------------------------- commit


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the kernel, libc or filesystem cannot."""
    if not use_exchange:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:  # glibc < 2.28, musl
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def replace_dir(tmp: Path, final: Path, nonce: str) -> None:
    """Make the complete checkpoint in ``tmp`` visible as ``final``, replacing an older one.

    A reader of ``final`` sees the old or the new complete directory at every instant
    (with the exchange), or, between the two renames of the fallback, no directory but a
    ``.old`` one that ``recover_tag`` brings back.
    """
    fsync_dir(tmp)
    parent = final.parent
    if not final.exists():
        os.rename(tmp, final)
        _faults.point("commit.renamed")
    elif _exchange(tmp, final):
        _faults.point("commit.exchanged")
        fsync_dir(parent)
        _faults.point("commit.synced")
        remove_tree(tmp, "commit")  # now the old checkpoint
    else:
        old = parent / f".{final.name}.old-{nonce}"
        os.rename(final, old)
        _faults.point("commit.moved_old")
        os.rename(tmp, final)
        _faults.point("commit.renamed")
        fsync_dir(parent)
        _faults.point("commit.synced")
        remove_tree(old, "commit")
    fsync_dir(parent)
    _faults.point("commit.done")


def write_latest(root: Path, tag: str, nonce: str) -> None:
    """Point ``latest`` at ``tag`` by rename (a reader sees the old or the new name)."""
    tmp = root / f".{LATEST}.tmp-{nonce}"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    _faults.point("latest.written")
    os.replace(tmp, root / LATEST)
    _faults.point("latest.replaced")
    fsync_dir(root)


def list_tags(root: Path) -> list[str]:
    """Complete tags in ``root`` (directories with a manifest), oldest first."""
    if not root.is_dir():
        return []
    tags = [
        d
        for d in root.iterdir()
        if not d.name.startswith(".") and d.is_dir() and (d / MANIFEST).is_file()
    ]
    tags.sort(key=lambda d: ((d / MANIFEST).stat().st_mtime, d.name))
    return [d.name for d in tags]


def retain(root: Path, keep_last: int, keep: set[str], nonce: str) -> None:
    """Delete all but the newest ``keep_last`` tags, never one named in ``keep``."""
    tags = list_tags(root)
    for name in tags[: max(0, len(tags) - keep_last)]:
        if name not in keep:
            _discard(root / name, nonce)
    fsync_dir(root)
    _faults.point("retain.done")


# --------------------------------------------------------------------------- recovery


def _old_copies(root: Path, tag: str) -> list[tuple[Path, str]]:
    """``.<tag>.old-X`` directories holding a complete checkpoint, with their nonces."""
    out = []
    for entry in root.iterdir() if root.is_dir() else []:
        m = _WORKING.match(entry.name)
        if m and m["kind"] == "old" and m["tag"] == tag and (entry / MANIFEST).is_file():
            out.append((entry, m["nonce"]))
    return out


def recover_tag(root: Path, tag: str) -> Path | None:
    """Bring back ``root/tag`` from the ``.old`` copy a crashed tag-reuse save left.

    Returns the directory to read: ``root/tag`` once renamed back, the ``.old`` copy itself
    where the rename is not possible (a read-only mount), or None when there is nothing to
    recover. Raises ``CheckpointError`` while a live save is between its two renames.
    """
    for old, nonce in _old_copies(root, tag):
        if _is_live(root, nonce):
            raise CheckpointError(
                f"{root / tag} is being replaced by a save in progress (lock "
                f"{root}/.save-{nonce}.lock is held): load it again once that save is done"
            )
        try:
            os.rename(old, root / tag)
            fsync_dir(root)
        except OSError as e:
            logger.warning("could not rename %s back to %s (%s): reading it in place", old, tag, e)
            return old
        logger.warning(
            "%s was missing (a save reusing tag %r was interrupted between its two renames); "
            "recovered the previous checkpoint from %s",
            root / tag,
            tag,
            old.name,
        )
        return root / tag
    return None


def clean_leftovers(root: Path) -> list[str]:
    """Recover or delete what interrupted saves left in ``root``; returns what was done.

    Skips everything of a save whose lock is held (a concurrent saver). A ``.old`` copy is
    renamed back when its tag is missing and deleted otherwise (the save that made it
    committed); ``.tmp`` and ``.del`` directories, ``.latest.tmp`` files and free lock files
    older than a minute are deleted, and so are tag directories that only hold checkpoint files but no manifest
    (half-deleted by an older version).
    """
    if not root.is_dir():
        return []
    done: list[str] = []
    for entry in sorted(root.iterdir(), key=lambda e: (".old-" not in e.name, e.name)):
        m = _WORKING.match(entry.name)  # .old copies first: recover before deleting
        if m is None or _is_live(root, m["nonce"]) or not entry.exists():
            continue
        if m["kind"] == "old" and not (root / m["tag"]).exists():
            try:
                if recover_tag(root, m["tag"]) is not None:
                    done.append(f"recovered {m['tag']} from {entry.name}")
            except CheckpointError:  # another copy's save is live: it finishes the job
                pass
            continue
        remove_tree(entry, "clean")
        done.append(f"removed {entry.name}")
    for entry in root.iterdir():
        lock = _LOCK.match(entry.name)
        stale_lock = lock is not None and not _is_live(root, lock["nonce"]) and _aged(entry)
        if stale_lock or entry.name == f".{LATEST}.tmp":  # the name before nonces
            entry.unlink(missing_ok=True)
            done.append(f"removed {entry.name}")
        elif _half_deleted(entry):
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed {entry.name} (a half-deleted tag: no {MANIFEST})")
    if done:
        fsync_dir(root)
    return done


def _aged(lock: Path) -> bool:
    """A free lock file is removed only once it is a minute old: a save that has just
    created its lock file may not have taken the lock yet."""
    try:
        return time.time() - lock.stat().st_mtime > _FRESH_LOCK_S
    except FileNotFoundError:
        return False


def _half_deleted(entry: Path) -> bool:
    if entry.name.startswith(".") or not entry.is_dir() or (entry / MANIFEST).exists():
        return False
    names = [e.name for e in entry.iterdir()]
    return bool(names) and all(_OURS.match(n) for n in names)


# --------------------------------------------------------------------------- reading


def _tags_note(root: Path) -> str:
    tags = list_tags(root)
    if not tags:
        return f"{root} holds no complete checkpoint"
    shown = tags[-8:]
    more = f" and {len(tags) - len(shown)} older" if len(tags) > len(shown) else ""
    return f"tags present (oldest first): {shown}{more}"


def read_latest(root: Path) -> str | None:
    """The tag ``root/latest`` names; None if there is no ``latest``; an error naming the
    problem (and the tags present) if it is empty or damaged."""
    path = root / LATEST
    if not path.exists():
        return None
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file: {_tags_note(root)}")
    try:
        tag = path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path} is damaged (not UTF-8 text: {e}); {_tags_note(root)}. Pass tag= to load "
            f"one, or write the tag name into {path}"
        ) from e
    if not tag or "/" in tag or tag.startswith(".") or "\n" in tag:
        what = "empty" if not tag else f"not a tag name ({tag[:80]!r})"
        raise CheckpointError(
            f"{path} is {what}; {_tags_note(root)}. Pass tag= to load one, or write the tag "
            f"name into {path}"
        )
    return tag


def find_checkpoint(root: Path, tag: str | None, recover: bool = True) -> Path | None:
    """The tag directory to load: ``root/tag`` (default: the tag in ``latest``), written by
    slipstream or by DeepSpeed (``from_deepspeed``).

    None when ``tag`` is None and there is no ``latest`` (DeepSpeed's "nothing to load").
    Recovers a tag a crashed tag-reuse save left missing (``recover=False``: read the
    ``.old`` copy in place, changing nothing). Raises ``CheckpointError`` naming what is
    wrong and the tags present otherwise.
    """
    source = "the tag passed"
    if tag is None:
        tag = read_latest(root)
        source = f"{root / LATEST}"
        universal = root / "latest_universal"  # DeepSpeed's ds_to_universal names its tag so
        if tag is None and universal.is_file():
            tag, source = universal.read_text().strip(), str(universal)
        if tag is None:
            return None
    directory = root / tag
    if (directory / MANIFEST).is_file() or is_deepspeed_tag(directory):
        return directory
    if not directory.exists():
        olds = _old_copies(root, tag)
        found = recover_tag(root, tag) if recover else (olds[0][0] if olds else None)
        if found is not None:
            return found
        raise CheckpointError(
            f"checkpoint {directory} (named by {source}) does not exist; {_tags_note(root)}"
        )
    raise CheckpointError(
        f"{directory} is not a complete slipstream checkpoint: it has no {MANIFEST} (damaged, "
        f"or not written by save_checkpoint); {_tags_note(root)}"
    )
