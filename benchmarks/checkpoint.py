"""Checkpoint benchmark: save and load time of slipstream vs DeepSpeed on the same GPT and world.

Usage::

    python benchmarks/checkpoint.py [--world 2] [--preset 25m] [--stages 2,3] [--repeats 3]
        [--frameworks deepspeed,slipstream] [--bf16] [--dir DIR] [--keep] [--json out.json]
    python benchmarks/checkpoint.py --quick     # tiny GPT, 1 repeat: a smoke run

For each ZeRO stage and framework, a fresh world of ``--world`` gloo processes (spawned by
``benchmarks/_harness.py``, engines built by ``benchmarks/_peers.py`` exactly as in
``train_step.py``) trains one step, so that optimizer states exist, then times
``save_checkpoint`` ``--repeats`` times (a fresh tag each time) and ``load_checkpoint`` of the
last tag ``--repeats`` times. Every rank calls both, as the API requires.

Measured, per (framework, stage):

- **Time.** A barrier (untimed), then the call under ``perf_counter``. One repeat's time is the
  slowest rank's (the checkpoint is done when the last rank returns); the table shows the
  median over repeats.
- **Bytes.** Sum of the file sizes in the last tag's directory.
- **Peak RSS.** Per rank, the peak resident set during the call above the RSS right before it
  (``benchmarks._harness.PeakMemory``: ``VmHWM`` after a ``clear_refs`` reset); the table shows
  the largest rank and repeat. Host memory even with ``--device cuda``.
- **Correctness.** The loss of a no-grad forward on each rank's batch right before the first
  save must equal the one right after the last load (after an extra training step in between
  moved the weights); and one training step after the load must land on the same loss as the
  step taken after the save did (optimizer states restored). ``exact`` means bit-equal on every
  rank.

The checkpoint files stay in the OS page cache (dropping it needs root), so loads read memory,
not the disk; saves include slipstream's ``fsync`` of every file (DeepSpeed's ``torch.save``
does not fsync).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._harness import BenchConfig, PeakMemory, spawn_world, token_batch, warm_imports
from benchmarks._peers import PEERS, Peer, reference_for
from benchmarks.train_step import build_gpt, gpt_config
from slipstream.models import GPT

__all__ = ["CheckpointResult", "RankCheckpoint", "format_table", "main", "run"]

FRAMEWORKS = ("deepspeed", "slipstream")
_MB = 2**20
PAGE_CACHE_NOTE = (
    "files stay in the OS page cache (dropping it needs root): loads read memory, not the disk; "
    "saves include slipstream's fsync of every file (DeepSpeed's torch.save does not fsync)"
)


@dataclass
class RankCheckpoint:
    """Measurements of one rank."""

    rank: int
    save_s: list[float]
    """Seconds of every ``save_checkpoint`` call, in order."""
    load_s: list[float]
    """Seconds of every ``load_checkpoint`` call, in order."""
    save_rss_bytes: list[int]
    """Peak RSS during each save above the RSS right before it."""
    load_rss_bytes: list[int]
    """Peak RSS during each load above the RSS right before it."""
    rss_before_save_bytes: int
    """RSS right before the first save (model, optimizer, framework)."""
    mem_method: str
    checkpoint_bytes: int
    """Bytes of the last tag's files (rank 0 only; 0 on the other ranks)."""
    checkpoint_files: int
    """Number of files in the last tag's directory (rank 0 only)."""
    loss_saved: float
    """No-grad forward loss right before the first save."""
    loss_moved: float
    """The same after a training step taken after the saves."""
    loss_loaded: float
    """The same after the last load: equals ``loss_saved`` when the weights came back."""
    loss_resumed: float
    """After one training step from the loaded state: equals ``loss_moved`` when the optimizer
    states came back too."""


@dataclass
class CheckpointResult:
    """One framework at one ZeRO stage: per-rank results, or why it did not run."""

    name: str
    ranks: list[RankCheckpoint] = field(default_factory=list)
    error: str | None = None
    """First line of the failure; None on success."""
    detail: str | None = None
    """Traceback or log location of a failure."""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.ranks)

    @property
    def save_s(self) -> float:
        """Median over repeats of the slowest rank's save time."""
        return statistics.median(map(max, zip(*(r.save_s for r in self.ranks))))

    @property
    def load_s(self) -> float:
        """Median over repeats of the slowest rank's load time."""
        return statistics.median(map(max, zip(*(r.load_s for r in self.ranks))))

    @property
    def checkpoint_bytes(self) -> int:
        return max(r.checkpoint_bytes for r in self.ranks)

    @property
    def checkpoint_files(self) -> int:
        return max(r.checkpoint_files for r in self.ranks)

    @property
    def save_rss_bytes(self) -> int:
        """Largest extra RSS of any rank during any save."""
        return max(max(r.save_rss_bytes) for r in self.ranks)

    @property
    def load_rss_bytes(self) -> int:
        """Largest extra RSS of any rank during any load."""
        return max(max(r.load_rss_bytes) for r in self.ranks)

    @property
    def loss_saved(self) -> float:
        """Loss before the save, mean over ranks."""
        return statistics.fmean(r.loss_saved for r in self.ranks)

    @property
    def loss_loaded(self) -> float:
        """Loss after the load, mean over ranks."""
        return statistics.fmean(r.loss_loaded for r in self.ranks)

    @property
    def max_loss_error(self) -> float:
        """Largest |difference| over ranks of loaded vs saved and resumed vs moved losses."""
        return max(
            max(abs(r.loss_loaded - r.loss_saved), abs(r.loss_resumed - r.loss_moved))
            for r in self.ranks
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "error": self.error, "detail": self.detail}
        out["ranks"] = [asdict(r) for r in self.ranks]
        if self.ok:
            for key in (
                "save_s",
                "load_s",
                "checkpoint_bytes",
                "checkpoint_files",
                "save_rss_bytes",
                "load_rss_bytes",
                "loss_saved",
                "loss_loaded",
                "max_loss_error",
            ):
                out[key] = getattr(self, key)
        return out


# --------------------------------------------------------------------------- rank side


def _checkpoint_rank(
    peer: Peer,
    cfg: BenchConfig,
    model_factory: Callable[[], nn.Module],
    repeats: int,
    root: str,
    rank: int,
    device: torch.device,
) -> dict[str, Any]:
    """Build, train one step, save ``repeats`` times, move the weights, load ``repeats``
    times, check the losses; returns a ``RankCheckpoint`` as a dict."""
    peer.prepare(cfg)
    warm_imports(model_factory)
    torch.manual_seed(cfg.seed)
    trainer = peer.build(model_factory().to(device), cfg)
    engine = trainer.engine  # type: ignore[attr-defined]
    batch = token_batch(cfg, rank, device)
    trainer.step(*batch)
    loss_saved = _eval_loss(engine, *batch)
    before = PeakMemory(torch.device("cpu")).baseline
    tags = [f"bench{i}" for i in range(repeats)]
    saves = [_timed(partial(engine.save_checkpoint, root, tag=tag)) for tag in tags]
    trainer.step(*batch)
    loss_moved = _eval_loss(engine, *batch)
    loads = [_timed(partial(engine.load_checkpoint, root, tag=tags[-1])) for _ in tags]
    loss_loaded = _eval_loss(engine, *batch)
    trainer.step(*batch)
    size, files = _dir_size(Path(root) / tags[-1]) if rank == 0 else (0, 0)
    result = RankCheckpoint(
        rank=rank,
        save_s=[s for s, _, _ in saves],
        load_s=[s for s, _, _ in loads],
        save_rss_bytes=[m for _, m, _ in saves],
        load_rss_bytes=[m for _, m, _ in loads],
        rss_before_save_bytes=before,
        mem_method=saves[0][2],
        checkpoint_bytes=size,
        checkpoint_files=files,
        loss_saved=loss_saved,
        loss_moved=loss_moved,
        loss_loaded=loss_loaded,
        loss_resumed=_eval_loss(engine, *batch),
    )
    return asdict(result)


def _timed(call: Callable[[], object]) -> tuple[float, int, str]:
    """(seconds, peak RSS above the start, memory method) of ``call`` after a barrier."""
    dist.barrier()
    memory = PeakMemory(torch.device("cpu"))
    memory.reset_peak()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    return seconds, max(0, memory.peak_bytes() - memory.baseline), memory.method


@torch.no_grad()
def _eval_loss(engine: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Loss of a forward in eval mode (no dropout); the engine is left in train mode."""
    engine.eval()
    try:
        return float(engine(input_ids, labels).item())
    finally:
        engine.train()


def _dir_size(path: Path) -> tuple[int, int]:
    """(bytes, number of files) under ``path``."""
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


# --------------------------------------------------------------------------- parent side


def run(
    names: Sequence[str],
    cfg: BenchConfig,
    preset: str,
    repeats: int,
    base_dir: str | None = None,
    keep: bool = False,
    log: bool = True,
) -> list[CheckpointResult]:
    """Run each peer (``deepspeed-z2``, ...) in its own world, in order, checkpointing into a
    fresh directory under ``base_dir`` (removed afterwards unless ``keep``); failures are
    returned, not raised."""
    factory = partial(build_gpt, preset, cfg.seq)
    results = []
    for name in names:
        peer = PEERS[name]
        reason = peer.unavailable()
        if log:
            print(f"[bench] {name}: {'skipped' if reason else 'running'}", file=sys.stderr)
        if reason:
            results.append(CheckpointResult(name, error=f"unavailable ({reason})"))
            continue
        root = tempfile.mkdtemp(prefix=f"ckpt-{name}-", dir=base_dir)
        try:
            body = partial(_checkpoint_rank, peer, cfg, factory, repeats, root)
            outcome = spawn_world(name, cfg, body)
        finally:
            if not keep:
                shutil.rmtree(root, ignore_errors=True)
        if outcome.ok:
            ranks = [RankCheckpoint(**record) for record in outcome.records]
            results.append(CheckpointResult(name, ranks=ranks))
        else:
            results.append(CheckpointResult(name, error=outcome.error, detail=outcome.detail))
    return results


def format_table(results: Sequence[CheckpointResult]) -> str:
    """A text table with slipstream/DeepSpeed ratios of save and load time per stage."""
    by_name = {r.name: r for r in results if r.ok}
    header = (
        f"{'framework':<15} {'save s':>7} {'load s':>7} {'ckpt MB':>8} {'files':>5} "
        f"{'save +RSS MB':>12} {'load +RSS MB':>12} {'loss saved':>10} {'loss loaded':>11} "
        f"{'check':>7} {'save/ds':>7} {'load/ds':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        if not r.ok:
            error = r.error or "failed"
            lines.append(f"{r.name:<15} {error[:160]}{'...' if len(error) > 160 else ''}")
            continue
        ref_name = reference_for(r.name)
        ref = by_name.get(ref_name) if ref_name else None
        diff = r.max_loss_error
        check = "exact" if diff == 0 else f"{diff:.0e}"
        lines.append(
            f"{r.name:<15} {r.save_s:>7.2f} {r.load_s:>7.2f} {r.checkpoint_bytes / _MB:>8.1f} "
            f"{r.checkpoint_files:>5} {r.save_rss_bytes / _MB:>12.0f} "
            f"{r.load_rss_bytes / _MB:>12.0f} {r.loss_saved:>10.6f} {r.loss_loaded:>11.6f} "
            f"{check:>7} {_ratio(r.save_s, ref.save_s if ref else None):>7} "
            f"{_ratio(r.load_s, ref.load_s if ref else None):>7}"
        )
    return "\n".join(lines)


def _ratio(value: float, reference: float | None) -> str:
    return f"{value / reference:.2f}" if reference else "-"


def _environment(cfg: BenchConfig, preset: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = GPT(gpt_config(preset, cfg.seq))
    try:
        ds_version: str | None = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds_version = None
    return {
        "preset": preset,
        "params": model.num_params(),
        "torch": torch.__version__,
        "deepspeed": ds_version,
        "threads_per_rank": max(1, len(os.sched_getaffinity(0)) // cfg.world),
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks per world")
    parser.add_argument("--preset", default="25m", help="GPTConfig preset (tiny, small, 25m)")
    parser.add_argument("--stages", default="2,3", help="ZeRO stages, comma-separated (0-3)")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed saves, then timed loads")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16.enabled for both engines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="parent of the checkpoint dirs (temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--quick", action="store_true", help="tiny GPT, batch 2x64, 1 repeat")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per world")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.batch, args.seq, args.repeats = "tiny", 2, 64, 1
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1")
    try:
        stages = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--stages {args.stages!r} must be comma-separated integers, e.g. 2,3")
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    args.names = [f"{f}-z{s}" for s in stages for f in frameworks]
    unknown = [n for n in args.names if n not in PEERS]
    if unknown or not args.names:
        parser.error(
            f"unknown framework/stage {unknown or args.names}: frameworks are {FRAMEWORKS}, "
            "stages 0-3"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    cfg = BenchConfig(
        world=args.world,
        batch=args.batch,
        seq=args.seq,
        steps=1,
        warmup=0,
        vocab_size=gpt_config(args.preset, args.seq).vocab_size,
        seed=args.seed,
        device=args.device,
        bf16=args.bf16,
        timeout_s=args.timeout,
    )
    env = _environment(cfg, args.preset)
    results = run(args.names, cfg, args.preset, args.repeats, args.dir, args.keep)
    print(
        f"GPT {args.preset} ({env['params'] / 1e6:.1f}M params), world {cfg.world} "
        f"({cfg.device}, {env['threads_per_rank']} threads/rank), "
        f"{'bf16' if cfg.bf16 else 'fp32'}, AdamW, 1 training step, then {args.repeats} "
        f"saves and {args.repeats} loads; checkpoints under {args.dir or tempfile.gettempdir()}; "
        f"torch {env['torch']}, deepspeed {env['deepspeed']}"
    )
    print(format_table(results))
    print(
        "save s, load s: median over repeats of the slowest rank; +RSS: largest per-rank peak "
        "RSS above the RSS before the call; check: loss after load vs before save, and after "
        "one more step vs the same step before the load ('exact': bit-equal on every rank); "
        "save/ds, load/ds: slipstream time / DeepSpeed time at the same ZeRO stage"
    )
    print(f"note: {PAGE_CACHE_NOTE}")
    if args.json:
        payload = {
            "config": asdict(cfg),
            "repeats": args.repeats,
            "env": env,
            "results": [r.to_dict() for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    failed = [r for r in results if not r.ok and not (r.error or "").startswith("unavailable")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
