"""``save_checkpoint`` / ``load_checkpoint`` for the engine (DeepSpeed's semantics).

Every rank calls both. Before anything else the ranks meet at a monitored barrier: a rank that
does not arrive within ``checkpoint.barrier_timeout`` seconds is named in the error instead of
the job hanging. After that, every phase ends with the ranks agreeing on its outcome (one
``all_gather_object`` of an error report or None): a failure on any rank, such as rank 0
finding the disk full while it writes the manifest or rank 1 reading a corrupted shard, raises
a ``CheckpointError`` on *every* rank that names the failing ranks and their messages, within
the time of one small collective, instead of leaving the other ranks waiting in a barrier.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from slipstream._logging import log_rank0
from slipstream.accelerator import get_accelerator
from slipstream.checkpoint import _faults, commit
from slipstream.checkpoint._agreement import on_every_rank, on_rank0, raise_if_failed
from slipstream.checkpoint.commit import LATEST, SaveLock
from slipstream.checkpoint.deepspeed_pipe import open_deepspeed
from slipstream.checkpoint.export import HF_CONFIG
from slipstream.checkpoint.format import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    CheckpointReader,
    LogicalReader,
    file_digest,
    write_manifest,
    write_object,
    write_pieces,
)
from slipstream.checkpoint.from_deepspeed import DeepSpeedReader, check_optimizer, is_deepspeed_tag
from slipstream.checkpoint.in_flight import IN_FLIGHT
from slipstream.checkpoint.state import collect_state, restore_state, shared_parameter_names
from slipstream.config.schema import SlipstreamConfig
from slipstream.distributed import comm
from slipstream.version import __version__
from slipstream.zero.optimizer import ZeroOptimizer

__all__ = ["PendingSave", "TrainingState", "finish_save", "load_checkpoint", "save_checkpoint"]


class TrainingState(Protocol):
    """What a checkpoint saves and restores of an engine: the engine implements it, and this
    package sees an engine only through it (``checkpoint`` sits below ``runtime``)."""

    config: SlipstreamConfig
    module: torch.nn.Module
    optimizer: ZeroOptimizer | None
    lr_scheduler: Any
    training_dataloader: Any
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int

    @property
    def dp_world_size(self) -> int: ...

    def gradient_accumulation_steps(self) -> int: ...

    def zero_optimization_stage(self) -> int: ...


def _rendezvous(engine: TrainingState, what: str) -> None:
    """Every rank must call ``what``: name the ones that do not, within the timeout."""
    timeout = timedelta(seconds=engine.config.checkpoint.barrier_timeout)
    try:
        comm.monitored_barrier(timeout, what)
    except comm.PeerDiedError as e:
        done = "written" if what == "save_checkpoint" else "loaded"
        raise CheckpointError(f"{e}; nothing was {done}") from e
    except RuntimeError as e:
        raise CheckpointError(f"{e}, not only on rank 0") from e


def _agree(engine: TrainingState, value: str, what: str) -> str:
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
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        state[acc.device_name()] = acc.get_rng_state()  # "cuda" on NVIDIA GPUs
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    acc = get_accelerator()
    if acc.device_name() != "cpu" and acc.device_name() in state:
        acc.set_rng_state(state[acc.device_name()])


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


@dataclass
class PendingSave:
    """A save between its first and last step: the files being written (in the background
    with ``async_save``), and on rank 0 the lock that marks the save as live."""

    root: Path
    tag: str
    nonce: str
    save_latest: bool
    lock: SaveLock | None = None
    files: dict[str, tuple[int, int]] | None = None
    mine: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None
    thread: threading.Thread | None = None
    shard: tuple[str, Path, dict[str, torch.Tensor]] | None = None
    error: BaseException | None = None

    @property
    def tmp(self) -> Path:
        return self.root / f".{self.tag}.tmp-{self.nonce}"

    @property
    def where(self) -> str:
        return f"save_checkpoint({self.root / self.tag})"

    def write_shard(self) -> None:
        assert self.shard is not None and self.files is not None
        name, path, tensors = self.shard
        try:
            self.files[name] = write_pieces(path, tensors)
        except BaseException as e:  # re-raised by finish_save on the training thread
            self.error = e
        finally:
            self.shard = None  # drop the snapshot as soon as it is on disk

    def abort(self) -> None:
        """Rank 0, after a failure: remove the temporary directory, release the lock."""
        if self.lock is None:
            return
        try:
            if self.tmp.exists():
                commit.remove_tree(self.tmp, "abort")
        except OSError as e:  # the next save removes it (the lock is free by then)
            log_rank0(
                "could not remove %s after the failed save: %s", self.tmp, e, level=logging.WARNING
            )
        finally:
            self.lock.release()
            self.lock = None


def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or "\0" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not a valid directory name: it must be non-empty, "
            f"without '/', not start with '.', and not be {LATEST!r}"
        )


def _begin(root: Path, tag: str, save_latest: bool) -> PendingSave:
    """Rank 0 cleans up after crashed saves, takes this save's lock and creates its
    temporary directory; every rank learns the directory's name."""
    held: list[SaveLock] = []

    def prepare() -> str:
        root.mkdir(parents=True, exist_ok=True)
        try:
            for action in commit.clean_leftovers(root):
                log_rank0("save_checkpoint: %s (left by an interrupted save)", action)
        except OSError as e:  # not fatal: the next save tries again
            log_rank0("save_checkpoint: could not clean up %s: %s", root, e, level=logging.WARNING)
        nonce = commit.new_nonce()
        held.append(SaveLock.acquire(root, nonce))
        tmp = root / f".{tag}.tmp-{nonce}"
        try:
            _faults.point("save.locked")
            tmp.mkdir()
            _faults.point("save.tmp_created")
        except BaseException:
            if tmp.exists():
                tmp.rmdir()
            held.pop().release()
            raise
        return nonce

    nonce = on_rank0(f"save_checkpoint({root / tag}): creating the temporary directory", prepare)
    return PendingSave(root, tag, nonce, save_latest, held[0] if held else None)


def save_checkpoint(
    engine: TrainingState,
    save_dir: str | os.PathLike[str],
    tag: Any = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
) -> PendingSave | None:
    """Write a sharded, reshardable checkpoint of ``engine`` to ``save_dir/tag`` atomically.

    With ``checkpoint.async_save`` the state is snapshotted (copied) now and the shard files
    are written by a background thread while training goes on: the returned ``PendingSave`` is
    committed (manifest, rename, ``latest``) by ``finish_save``, which the engine calls before
    its next save or load and in ``destroy``. Returns None when the save is committed.

    Raises:
        CheckpointError: on every rank when any rank fails (full disk, no permission, ...),
            naming the failing ranks; the previous checkpoint and ``latest`` stay as they were.
    """
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
    _check_tag(tag)
    pending = _begin(Path(save_dir), tag, save_latest)
    try:
        on_every_rank(
            f"{pending.where}: writing the files",
            lambda: _write_files(engine, pending, client_state, cfg.async_save),
        )
    except BaseException:
        pending.abort()
        raise
    if cfg.async_save:
        pending.thread = threading.Thread(
            target=pending.write_shard, name="slipstream-checkpoint", daemon=True
        )
        pending.thread.start()
        IN_FLIGHT.add(pending)
        return pending
    pending.write_shard()
    _commit(engine, pending)
    return None


def _write_files(
    engine: TrainingState, pending: PendingSave, client_state: dict[str, Any] | None, snapshot: bool
) -> None:
    """This rank's small files now; its shard's tensors are staged in ``pending.shard``
    (copies when ``snapshot``: training may change them in place before they are written)."""
    rank, world = comm.get_rank(), comm.get_world_size()
    opt = engine.optimizer
    if opt is not None and engine.micro_steps % engine.gradient_accumulation_steps():
        log_rank0(
            "save_checkpoint at micro-step %d, inside a gradient accumulation window: the "
            "partially accumulated gradients are not saved",
            engine.micro_steps,
        )
    collected = collect_state(engine.module, opt, rank)
    tmp = pending.tmp
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
                "shared_params": shared_parameter_names(engine.module),
                "lr_scheduler": engine.lr_scheduler.state_dict()
                if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "state_dict")
                else None,
            },
        )
    hf_config = getattr(getattr(engine.module, "config", None), "to_json_string", None)
    if rank == 0 and callable(hf_config):  # a Hugging Face model: convert writes config.json
        (tmp / HF_CONFIG).write_text(hf_config())
        files[HF_CONFIG] = file_digest(tmp / HF_CONFIG)
    pending.files = files
    pending.mine = {
        "pieces": [[t, s, e, shard_name, key] for key, (t, s, e, _) in collected.pieces.items()],
        "tensors": collected.tensors,
        "scalars": collected.optim_scalars,
        "tp_layout": collected.tp_layout,
    }
    pending.meta = _engine_meta(engine, world)
    tensors = {k: v[3] for k, v in collected.pieces.items()}
    if snapshot:
        tensors = {k: t.clone() for k, t in tensors.items()}
    pending.shard = (shard_name, tmp / shard_name, tensors)


def finish_save(engine: TrainingState, pending: PendingSave) -> None:
    """Commit an asynchronous save still in flight (every rank must call it)."""
    if pending.thread is not None:
        pending.thread.join()
    IN_FLIGHT.discard(pending)
    _commit(engine, pending)


def _commit(engine: TrainingState, pending: PendingSave) -> None:
    """Agree that every shard is on disk; rank 0 writes the manifest, renames the directory
    into place, updates ``latest`` and applies ``keep_last``; agree that it did."""
    try:
        raise_if_failed(f"{pending.where}: writing the shard file", pending.error)
        every = comm.all_gather_object(dict(pending.mine or {}, files=pending.files))
        on_rank0(
            f"{pending.where}: committing (manifest, rename, '{LATEST}')",
            lambda: _publish(engine, pending, every),
        )
    except BaseException:
        pending.abort()
        raise
    if pending.lock is not None:
        pending.lock.release()
    log_rank0("saved checkpoint %s", pending.root / pending.tag)


def _publish(engine: TrainingState, pending: PendingSave, every: list[dict[str, Any]]) -> None:
    """Rank 0: the steps that make the checkpoint visible, each atomic (``commit``)."""
    assert pending.meta is not None
    root, tag = pending.root, pending.tag
    write_manifest(pending.tmp / MANIFEST, _manifest(pending.meta, every))
    commit.replace_dir(pending.tmp, root / tag, pending.nonce)
    if pending.save_latest:
        commit.write_latest(root, tag, pending.nonce)
    keep_last = engine.config.checkpoint.keep_last
    if keep_last is not None:
        keep = {tag}
        try:
            named = commit.read_latest(root)
        except CheckpointError:
            named = None
        if named is not None:
            keep.add(named)  # never delete what ``latest`` names (save_latest=False saves)
        try:
            commit.retain(root, keep_last, keep, pending.nonce)
        except OSError as e:  # the checkpoint is committed; the next save retries
            log_rank0(
                "save_checkpoint: keep_last could not delete old tags: %s", e, level=logging.WARNING
            )


def _engine_meta(engine: TrainingState, world: int) -> dict[str, Any]:
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
        "param_order": _param_order(engine),
        "moe_ep_sizes": sorted(
            {b.expert.ep_size for b in getattr(opt, "buckets", ()) if b.expert is not None}
        ),
        "param_groups": [
            {k: _jsonable(v) for k, v in g.items() if k != "params"} for g in opt.param_groups
        ]
        if opt is not None
        else [],
    }


def _param_order(engine: TrainingState) -> list[list[str]]:
    """The trained parameters of each optimizer param group in module order (what a flat
    layout such as DeepSpeed's needs to export to; the pieces alone do not say it)."""
    opt = engine.optimizer
    if opt is None:
        return []
    rank = {n: i for i, (n, _) in enumerate(engine.module.named_parameters())}
    groups: list[list[str]] = [[] for _ in opt.param_groups]
    for bucket in opt.buckets:
        groups[bucket.group_index].extend(bucket.names)
    return [sorted(g, key=lambda n: rank.get(n, len(rank))) for g in groups]


def _manifest(meta: dict[str, Any], every: list[dict[str, Any]]) -> dict[str, Any]:
    files: dict[str, Any] = {}
    pieces: list[Any] = []
    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    tp_layout: dict[str, list[int]] = {}
    for part in every:
        tp_layout.update(part.get("tp_layout", {}))
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
        tp_layout=tp_layout,
        tensors=tensors,
        pieces=pieces,
        files=files,
    )


def load_checkpoint(
    engine: TrainingState,
    load_dir: str | os.PathLike[str],
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load ``load_dir/tag`` (default: the tag in ``latest``) into ``engine``, resharding.

    Returns ``(None, None)`` when ``tag`` is None and there is no ``latest``. Every file is
    checked against the manifest (each rank checks a share) before anything is restored.

    Raises:
        CheckpointError: on every rank when any rank fails, naming the failing ranks and
            what is wrong (a missing tag with the tags present, a damaged or edited
            manifest, a corrupted file).

    The caller commits its own asynchronous save first (``finish_save``).
    """
    if not load_module_strict:
        raise ValueError("load_module_strict=False is not supported yet: pass True")
    _rendezvous(engine, "load_checkpoint")
    root = Path(load_dir)
    if tag is not None:
        tag = _agree(engine, str(tag), "tag")
    directory = on_rank0(f"load_checkpoint({root})", lambda: commit.find_checkpoint(root, tag))
    if directory is None:
        tags = commit.list_tags(root)
        log_rank0(
            "load_checkpoint: %s has no '%s' file; nothing loaded%s",
            root,
            LATEST,
            f" (tags present: {tags}: pass tag= to load one)" if tags else "",
        )
        return None, None
    where = f"load_checkpoint({directory})"
    rank, world = comm.get_rank(), comm.get_world_size()

    def open_and_verify() -> LogicalReader:
        reader: LogicalReader
        if is_deepspeed_tag(directory):  # migrating from DeepSpeed: its own layout
            reader = open_deepspeed(directory)
        else:
            reader = CheckpointReader(directory)
        reader.verify_share(rank, world)
        return reader

    reader = on_every_rank(f"{where}: verifying the files", open_and_verify)
    reader.trust_all()
    try:
        client_state = on_every_rank(
            f"{where}: restoring the state",
            lambda: _restore(
                engine, reader, load_optimizer_states, load_lr_scheduler_states, load_module_only
            ),
        )
    finally:
        reader.close()
    m = reader.manifest
    log_rank0(
        "loaded checkpoint %s (saved at world %d, stage %d)",
        directory,
        m["world_size"],
        m["zero_stage"],
    )
    return str(directory), client_state


def _restore(
    engine: TrainingState,
    reader: LogicalReader,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> dict[str, Any]:
    """Put the checkpoint into ``engine``; returns its ``client_state``."""
    m = reader.manifest
    opt = engine.optimizer
    full = not load_module_only
    if isinstance(reader, DeepSpeedReader) and opt is not None and load_optimizer_states and full:
        check_optimizer(reader, opt)
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
    client_state: dict[str, Any] = extra["client_state"]
    return client_state


def _restore_rank_state(engine: TrainingState, reader: LogicalReader, m: dict[str, Any]) -> None:
    """RNG and data position: exact on the same world size; otherwise the position only."""
    rank, world = comm.get_rank(), comm.get_world_size()
    loader = engine.training_dataloader
    if not m.get("rank_state", True):
        log_rank0(
            "checkpoint %s was written by DeepSpeed, which saves no RNG state or data-loader "
            "position: both continue from where this process is",
            reader.dir,
        )
        return
    # Another data-parallel size at the same world size (TP or SP degree changed): each
    # rank's loader position and RNG belong to another data shard.
    same_dp = m.get("dp_world_size", engine.dp_world_size) == engine.dp_world_size
    if world == m["world_size"] and same_dp:
        own = reader.load_object(f"rank-{rank:05d}.pt")
        if engine.config.checkpoint.load_rng_state:
            _set_rng_state(own["rng"])
        if own["dataloader"] is not None and loader is not None:
            loader.load_state_dict(own["dataloader"])
        return
    log_rank0(
        "checkpoint saved at world %d (data-parallel %d), loading at world %d (data-parallel "
        "%d): RNG states are not restored; the data loader resumes after the same number of "
        "samples of the same epoch",
        m["world_size"],
        m.get("dp_world_size", engine.dp_world_size),
        world,
        engine.dp_world_size,
    )
    first = reader.load_object("rank-00000.pt")["dataloader"]
    if first is not None and loader is not None:
        loader.load_state_dict(first)
