"""``save_checkpoint`` / ``load_checkpoint`` for the engine (DeepSpeed's semantics).

Every rank calls both. Before anything else the ranks meet at a monitored barrier: a rank that
does not arrive within ``checkpoint.barrier_timeout`` seconds is named in the error instead of
the job hanging.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from slipstream._logging import log_rank0
from slipstream.checkpoint.export import HF_CONFIG
from slipstream.checkpoint.format import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    CheckpointReader,
    atomic_write_text,
    commit_dir,
    file_digest,
    fsync_dir,
    write_object,
    write_pieces,
)
from slipstream.checkpoint.state import collect_state, restore_state
from slipstream.distributed import comm
from slipstream.version import __version__

if TYPE_CHECKING:
    from slipstream.runtime.engine import Engine

__all__ = ["PendingSave", "finish_save", "load_checkpoint", "save_checkpoint"]

LATEST = "latest"


def _rendezvous(engine: Engine, what: str) -> None:
    """Every rank must call ``what``: name the ones that do not, within the timeout."""
    timeout = timedelta(seconds=engine.config.checkpoint.barrier_timeout)
    try:
        comm.monitored_barrier(timeout, what)
    except RuntimeError as e:
        raise CheckpointError(f"{e}, not only on rank 0") from e


def _agree(engine: Engine, value: str, what: str) -> str:
    """Rank 0's ``value``; differing values follow ``checkpoint.tag_validation``."""
    values = comm.all_gather_object(value)
    if len(set(values)) > 1:
        detail = f"{what} differs between ranks: {dict(enumerate(values))}"
        mode = engine.config.checkpoint.tag_validation
        if mode == "Fail":
            raise CheckpointError(detail + " (checkpoint.tag_validation = Fail)")
        if mode == "Warn":
            log_rank0("%s; using rank 0's %r", detail, values[0])
    return str(values[0])


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # type: ignore[misc]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, np.asarray(keys).tolist(), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


@dataclass
class PendingSave:
    """A save whose shard file is being written in the background (``async_save``)."""

    root: Path
    tmp: Path
    tag: str
    save_latest: bool
    files: dict[str, tuple[int, int]]
    mine: dict[str, Any]
    meta: dict[str, Any]
    thread: threading.Thread | None = None
    shard: tuple[str, Path, dict[str, torch.Tensor]] | None = None
    error: BaseException | None = None

    def write_shard(self) -> None:
        assert self.shard is not None
        name, path, tensors = self.shard
        try:
            self.files[name] = write_pieces(path, tensors)
        except BaseException as e:  # re-raised by finish_save on the training thread
            self.error = e
        finally:
            self.shard = None  # drop the snapshot as soon as it is on disk


def save_checkpoint(
    engine: Engine,
    save_dir: str | os.PathLike[str],
    tag: Any = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
) -> bool:
    """Write a sharded, reshardable checkpoint of ``engine`` to ``save_dir/tag`` atomically.

    With ``checkpoint.async_save`` the state is snapshotted (copied) now and the shard files
    are written by a background thread while training goes on; the checkpoint is committed
    (manifest, rename, ``latest``) by ``engine.wait_for_checkpoint()``, which the next save,
    load and ``destroy`` call first.
    """
    finish_save(engine)
    cfg = engine.config.checkpoint
    if cfg.use_node_local_storage:
        raise CheckpointError(
            "checkpoint.use_node_local_storage = true is not supported: save to a directory "
            "every rank can reach (a shared filesystem), or set it to false"
        )
    _rendezvous(engine, "save_checkpoint")
    tag = _agree(
        engine, str(tag if tag is not None else f"global_step{engine.global_steps}"), "tag"
    )
    if not tag or "/" in tag or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} is not a valid directory name")
    root = Path(save_dir)
    rank, world = comm.get_rank(), comm.get_world_size()
    nonce = _agree(engine, uuid.uuid4().hex[:12], "temporary directory name")
    tmp = root / f".{tag}.tmp-{nonce}"
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    comm.barrier()

    opt = engine.optimizer
    if opt is not None and engine.micro_steps % engine.gradient_accumulation_steps():
        log_rank0(
            "save_checkpoint at micro-step %d, inside a gradient accumulation window: the "
            "partially accumulated gradients are not saved",
            engine.micro_steps,
        )
    collected = collect_state(engine.module, opt, rank)
    shard_name = f"rank-{rank:05d}.safetensors"
    files: dict[str, tuple[int, int]] = {}
    extra_name = f"rank-{rank:05d}.pt"
    loader = engine.training_dataloader
    files[extra_name] = write_object(
        tmp / extra_name,
        {
            "rng": _rng_state(),
            "dataloader": loader.state_dict() if loader is not None else None,
        },
    )
    if rank == 0:
        files["extra.pt"] = write_object(
            tmp / "extra.pt",
            {
                "client_state": client_state or {},
                "lr_scheduler": engine.lr_scheduler.state_dict()
                if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "state_dict")
                else None,
            },
        )
    hf_config = getattr(getattr(engine.module, "config", None), "to_json_string", None)
    if rank == 0 and callable(hf_config):  # a Hugging Face model: convert writes config.json
        (tmp / HF_CONFIG).write_text(hf_config())
        files[HF_CONFIG] = file_digest(tmp / HF_CONFIG)
    mine = {
        "pieces": [[t, s, e, shard_name, key] for key, (t, s, e, _) in collected.pieces.items()],
        "tensors": collected.tensors,
        "scalars": collected.optim_scalars,
    }
    pending = PendingSave(root, tmp, tag, save_latest, files, mine, _engine_meta(engine, world))
    tensors = {k: v[3] for k, v in collected.pieces.items()}
    if cfg.async_save:
        # Snapshot: training may change parameters and states in place from here on.
        pending.shard = (shard_name, tmp / shard_name, {k: t.clone() for k, t in tensors.items()})
        pending.thread = threading.Thread(
            target=pending.write_shard, name="slipstream-checkpoint", daemon=True
        )
        pending.thread.start()
        engine._pending_save = pending
        return True
    pending.shard = (shard_name, tmp / shard_name, tensors)
    pending.write_shard()
    _commit(engine, pending)
    return True


def finish_save(engine: Engine) -> None:
    """Commit an asynchronous save still in flight (every rank must call it); no-op if none."""
    pending = engine._pending_save
    if pending is None:
        return
    engine._pending_save = None
    if pending.thread is not None:
        pending.thread.join()
    _commit(engine, pending)


def _commit(engine: Engine, pending: PendingSave) -> None:
    """Gather every rank's files and pieces; rank 0 writes the manifest and renames."""
    errors = comm.all_gather_object(None if pending.error is None else repr(pending.error))
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        if pending.error is not None:
            raise pending.error
        raise CheckpointError(
            f"checkpoint {pending.root / pending.tag} was not saved: ranks {sorted(failed)} "
            f"failed to write their shards ({failed})"
        )
    every = comm.all_gather_object(dict(pending.mine, files=pending.files))
    if comm.get_rank() == 0:
        manifest = _manifest(pending.meta, every)
        (pending.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        with open(pending.tmp / MANIFEST, "rb+") as f:
            os.fsync(f.fileno())
        commit_dir(pending.tmp, pending.root / pending.tag)
        if pending.save_latest:
            atomic_write_text(pending.root / LATEST, pending.tag)
        keep_last = engine.config.checkpoint.keep_last
        if keep_last is not None:
            _retain(pending.root, keep_last, keep=pending.tag)
    comm.barrier()
    log_rank0("saved checkpoint %s", pending.root / pending.tag)


def _engine_meta(engine: Engine, world: int) -> dict[str, Any]:
    opt = engine.optimizer
    return {
        "format_version": FORMAT_VERSION,
        "slipstream_version": __version__,
        "world_size": world,
        "dp_world_size": engine.dp_world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": opt.loss_scaler.state_dict() if opt is not None else None,
        "param_groups": [
            {k: _jsonable(v) for k, v in g.items() if k != "params"} for g in opt.param_groups
        ]
        if opt is not None
        else [],
    }


def _manifest(meta: dict[str, Any], every: list[dict[str, Any]]) -> dict[str, Any]:
    files: dict[str, Any] = {}
    pieces: list[Any] = []
    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for part in every:
        files.update({k: list(v) for k, v in part["files"].items()})
        pieces.extend(part["pieces"])
        for name, (shape, dtype) in part["tensors"].items():
            tensors[name] = {"shape": list(shape), "dtype": dtype}
        for group, entries in part["scalars"].items():
            scalars.setdefault(str(group), {}).update(entries)
    keys = sorted({t.split("/")[1] for t in tensors if t.startswith("optim/")})
    return dict(
        meta,
        optim_keys=keys,
        optim_scalars=scalars,
        tensors=tensors,
        pieces=pieces,
        files=files,
    )


def _retain(root: Path, keep_last: int, keep: str) -> None:
    tags = [
        d
        for d in root.iterdir()
        if d.is_dir() and not d.name.startswith(".") and (d / MANIFEST).is_file()
    ]
    tags.sort(key=lambda d: (d / MANIFEST).stat().st_mtime)
    for old in tags[:-keep_last]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)
    fsync_dir(root)


def load_checkpoint(
    engine: Engine,
    load_dir: str | os.PathLike[str],
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load ``load_dir/tag`` (default: the tag in ``latest``) into ``engine``, resharding."""
    finish_save(engine)
    if not load_module_strict:
        raise ValueError("load_module_strict=False is not supported yet: pass True")
    _rendezvous(engine, "load_checkpoint")
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            log_rank0("load_checkpoint: %s has no '%s' file; nothing loaded", root, LATEST)
            return None, None
        tag = latest.read_text().strip()
    tag = _agree(engine, str(tag), "tag")
    reader = CheckpointReader(root / tag)
    m = reader.manifest
    opt = engine.optimizer
    full = not load_module_only
    restore_state(reader, engine.module, opt, load_optimizer_states and full and opt is not None)
    extra = reader.load_object("extra.pt")
    if full and opt is not None and load_optimizer_states:
        if m.get("loss_scaler") is not None:
            opt.loss_scaler.load_state_dict(m["loss_scaler"])
        for group, saved in zip(opt.param_groups, m["param_groups"]):
            for k, v in saved.items():
                if k in group:
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v
    scheduler_state = extra["lr_scheduler"]
    if full and load_lr_scheduler_states and engine.lr_scheduler is not None and scheduler_state:
        engine.lr_scheduler.load_state_dict(scheduler_state)
    if full:
        engine.global_steps = m["global_steps"]
        engine.global_samples = m["global_samples"]
        engine.micro_steps = m["micro_steps"]
        engine.skipped_steps = m["skipped_steps"]
        _restore_rank_state(engine, reader, m)
    reader.close()
    comm.barrier()
    log_rank0(
        "loaded checkpoint %s (saved at world %d, stage %d)",
        root / tag,
        m["world_size"],
        m["zero_stage"],
    )
    return str(root / tag), extra["client_state"]


def _restore_rank_state(engine: Engine, reader: CheckpointReader, m: dict[str, Any]) -> None:
    """RNG and data position: exact on the same world size; otherwise the position only."""
    rank, world = comm.get_rank(), comm.get_world_size()
    loader = engine.training_dataloader
    if world == m["world_size"]:
        own = reader.load_object(f"rank-{rank:05d}.pt")
        _set_rng_state(own["rng"])
        if own["dataloader"] is not None and loader is not None:
            loader.load_state_dict(own["dataloader"])
        return
    log_rank0(
        "checkpoint saved at world %d, loading at world %d: RNG states are not restored; the "
        "data loader resumes after the same number of samples of the same epoch",
        m["world_size"],
        world,
    )
    first = reader.load_object("rank-00000.pt")["dataloader"]
    if first is not None and loader is not None:
        loader.load_state_dict(first)
