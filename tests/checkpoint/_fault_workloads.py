"""Rank-side checkpoint fault scenarios (run under tests.distributed.harness.run_world).

Every scenario arms ``faulthandler`` first: a rank that hangs dumps its stack and exits, so
the test fails instead of hanging the suite.
"""

from __future__ import annotations

import errno
import faulthandler
import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slipstream.checkpoint import CheckpointError, _faults, commit
from tests.checkpoint._workloads import _engine, _train


class _Crash(BaseException):
    """Stops a save at a fault point like a kill would (nothing catches a BaseException)."""


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _which(engine: Any, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> str:
    got = _weights(engine)
    for label, ref in (("old", old), ("new", new)):
        if all(torch.equal(got[k], ref[k]) for k in ref):
            return label
    return "neither"


def _load(engine: Any, root: Path, **kw: Any) -> str:
    try:
        path, client = engine.load_checkpoint(root, **kw)
    except CheckpointError as e:
        return f"error: {e}"
    return f"loaded {Path(path).name} client={client}"


def _points(engine: Any, base: Path, scratch: Path, tag: str) -> list[str]:
    """The fault points a save of ``tag`` into a copy of ``base`` passes, in order."""
    shutil.copytree(base, scratch)
    seen: list[str] = []
    _faults.set_hook(seen.append)
    try:
        engine.save_checkpoint(scratch, tag=tag, client_state={"v": "new"})
    finally:
        _faults.set_hook(None)
    return seen


def _crash_at(engine: Any, work: Path, snap: Path, name: str, tag: str) -> None:
    """Save ``tag`` into ``work``; at point ``name`` copy ``work`` to ``snap`` (what a kill
    there leaves on disk: files as written, locks free) and stop the save."""

    def hook(point: str) -> None:
        if point == name:
            shutil.copytree(work, snap, symlinks=True)
            raise _Crash(point)

    _faults.set_hook(hook)
    try:
        engine.save_checkpoint(work, tag=tag, client_state={"v": "new"})
    except _Crash:
        pass
    finally:
        _faults.set_hook(None)


def tag_reuse_crashes(root: str) -> dict[str, Any]:
    """Reuse tag ``A`` (keep_last 1: the older tag ``first`` is deleted by the same save) and
    stop the save after every filesystem step, with RENAME_EXCHANGE and with two renames.
    After each crash: load (``latest``), then save ``B`` into the crashed directory (it
    cleans up), then load ``A`` again."""
    faulthandler.dump_traceback_later(240, exit=True)
    out: dict[str, Any] = {}
    engine, loader = _engine(1, dropout=0.0)
    reader, _ = _engine(1, dropout=0.0)
    for exchange in (True, False):
        commit.use_exchange = exchange
        base = Path(root, f"base-{exchange}")
        engine.config.checkpoint.keep_last = None
        _train(engine, loader, 1)
        engine.save_checkpoint(base, tag="first", client_state={"v": "first"})
        _train(engine, loader, 1)
        engine.save_checkpoint(base, tag="A", client_state={"v": "old"})
        old = _weights(engine)
        _train(engine, loader, 1)
        new = _weights(engine)
        engine.config.checkpoint.keep_last = 1
        points = _points(engine, base, Path(root, f"scratch-{exchange}"), "A")
        runs = []
        for i, name in enumerate(points):
            work, snap = Path(root, f"w{exchange:d}-{i}"), Path(root, f"s{exchange:d}-{i}")
            shutil.copytree(base, work)
            _crash_at(engine, work, snap, name, "A")
            first = _load(reader, snap)
            first_state = _which(reader, old, new)
            reader.save_checkpoint(snap, tag="B")
            # A free lock file stays until it is a minute old (its save may be starting).
            left = sorted(n for n in os.listdir(snap) if n.startswith(".") and ".lock" not in n)
            again = _load(reader, snap, tag="A")
            runs.append(
                {
                    "point": name,
                    "load": first,
                    "state": first_state,
                    "leftovers": left,
                    "reload": again,
                    "state_again": _which(reader, old, new),
                }
            )
            shutil.rmtree(work)
            shutil.rmtree(snap)
        out["exchange" if exchange else "two_renames"] = {"points": points, "runs": runs}
    commit.use_exchange = True
    engine.destroy()
    reader.destroy()
    return out


def damage(root_: str) -> dict[str, Any]:
    """Edited, damaged and pre-digest manifests; empty, wrong and missing ``latest``;
    leftovers of crashed saves next to a live save and a user's directory."""
    faulthandler.dump_traceback_later(180, exit=True)
    root = Path(root_)
    out: dict[str, Any] = {}
    engine, loader = _engine(1, dropout=0.0)
    _train(engine, loader, 1)
    engine.save_checkpoint(root, tag="a")
    _train(engine, loader, 1)
    engine.save_checkpoint(root, tag="b")
    manifest = root / "b" / "manifest.json"
    text = manifest.read_text()
    out["has_digest"] = "manifest_sha256" in json.loads(text)
    manifest.write_text(text.replace('"global_steps": 2', '"global_steps": 7', 1))
    out["edited"] = _load(engine, root, tag="b")
    manifest.write_bytes(b"\xff\xfe" + text.encode()[2:])
    out["damaged"] = _load(engine, root, tag="b")
    stripped = json.loads(text)
    del stripped["manifest_sha256"]
    manifest.write_text(json.dumps(stripped, indent=1))
    out["no_digest"] = _load(engine, root, tag="b")
    legacy = {**stripped, "format_version": 1}  # written before the digest was required
    manifest.write_text(json.dumps(legacy, indent=1))
    out["legacy"] = _load(engine, root, tag="b")
    latest = root / "latest"
    latest.write_text("")
    out["empty_latest"] = _load(engine, root)
    latest.write_text("gone\n")
    out["missing_tag"] = _load(engine, root)
    latest.unlink()
    out["no_latest"] = engine.load_checkpoint(root)

    # Leftovers: stale ones (no live lock) go on the next save, a live save's stay.
    (root / ".c.tmp-0123456789ab").mkdir()
    (root / ".c.tmp-0123456789ab" / "rank-00000.pt").write_bytes(b"x")
    (root / ".save-0123456789ab.lock").write_bytes(b"")
    os.utime(root / ".save-0123456789ab.lock", (time.time() - 120, time.time() - 120))
    (root / ".save-00000000000a.lock").write_bytes(b"")  # free but fresh: stays for now
    shutil.copytree(root / "a", root / ".a.old-4242")  # a pre-lock fallback leftover
    (root / ".x.del-0123456789ab").mkdir()
    (root / ".latest.tmp").write_text("a")
    (root / "c3").mkdir()  # half-deleted by an older keep_last: checkpoint files, no manifest
    (root / "c3" / "rank-00001.safetensors").write_bytes(b"x")
    (root / "notes").mkdir()  # a user's directory: never touched
    (root / "notes" / "todo.txt").write_text("keep me")
    live = root / ".save-fedcba987654.lock"
    fd = os.open(live, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    (root / ".d.tmp-fedcba987654").mkdir()
    engine.save_checkpoint(root, tag="c")
    out["after_clean"] = sorted(os.listdir(root))
    os.close(fd)
    engine.destroy()
    return out


def single_process(root: str) -> dict[str, Any]:
    """Both single-process scenarios in one process (one interpreter start-up)."""
    return {
        "crashes": tag_reuse_crashes(os.path.join(root, "crash")),
        "damage": damage(os.path.join(root, "damage")),
    }


def one_rank_failures(root: str) -> dict[str, Any]:
    """2 ranks at ZeRO-3; the script catches every checkpoint error and goes on to a barrier.

    (a) rank 0 only: ENOSPC while committing the manifest (``SLIPSTREAM_CHECKPOINT_FAULT``);
    (b) a corrupted file only rank 1 reads; (c) rank 1 only: an error while restoring, after
    the files were verified (the publish all-gathers of the persistent ZeRO-3 units must not
    hang); then a clean save and load."""
    faulthandler.dump_traceback_later(100, exit=True)
    rank = dist.get_rank()
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("slipstream").addHandler(handler)
    out: dict[str, Any] = {}
    # Persistent (always gathered) units: a load ends with all-gathers that publish them.
    zero = {"stage": 3, "stage3_param_persistence_threshold": 10**9}
    engine, loader = _engine(3, dropout=0.0, zero_optimization=zero)
    _train(engine, loader, 1)

    def attempt(key: str, call: Any) -> None:
        start = time.perf_counter()
        try:
            call()
            out[key] = "no error"
        except CheckpointError as e:
            out[key] = str(e)
        out[key + "_s"] = time.perf_counter() - start
        dist.barrier()  # the script goes on: every rank must get here

    os.environ[_faults.ENV] = "raise:manifest.written@0"
    attempt("save", lambda: engine.save_checkpoint(root, tag="t1"))
    del os.environ[_faults.ENV]
    out["after_failed_save"] = sorted(os.listdir(root))

    engine.save_checkpoint(root, tag="good")
    if rank == 0:
        shard = Path(root, "good", "rank-00001.pt")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    attempt("load", lambda: engine.load_checkpoint(root, tag="good"))

    engine.save_checkpoint(root, tag="good2")

    def unreadable(point: str) -> None:
        if point == "load.restored" and rank == 1:
            raise OSError(errno.EIO, "Input/output error (injected)")

    _faults.set_hook(unreadable)
    attempt("restore", lambda: engine.load_checkpoint(root, tag="good2"))
    _faults.set_hook(None)
    out["final"] = engine.load_checkpoint(root)[0]
    out["differs_logged"] = [m for m in messages if "differs between ranks" in m]
    engine.destroy()
    return out
