"""Spawn a fresh gloo/NCCL world per framework and time its training steps.

One world per framework keeps peak memory of one framework from leaking into the next. Each
rank builds the model from the same seed, feeds a fixed random token batch (seeded by rank, so
gradients differ across ranks and the all-reduce is not a no-op), runs ``warmup`` untimed steps
and ``steps`` timed ones, and writes a JSON record that the parent collects.

Timing: a barrier before every step (not timed), then forward + backward + optimizer step +
``loss.item()`` (plus ``cuda.synchronize`` on GPU) under ``perf_counter``. A framework's step
time is the slowest rank's median.

Memory: on CPU, peak RSS over the timed region minus the RSS right before the model is built
(after the framework's imports and a meta-device build of the model, which loads the modules
model construction imports lazily). The peak is read from ``VmHWM`` in ``/proc/self/status`` after
resetting it by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0) at the start of the
timed region; where that file is not writable a thread samples ``/proc/self/statm`` every 2 ms.
On CUDA, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the bytes
allocated before the model build. Optimizer state is the sum of tensor bytes in ``.state`` of
the innermost ``torch.optim.Optimizer`` (wrappers are unwrapped through ``.optimizer``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessException

__all__ = [
    "BenchConfig",
    "Framework",
    "FrameworkResult",
    "PeakMemory",
    "RankResult",
    "Switchable",
    "Trainer",
    "WorldOutcome",
    "optimizer_state_bytes",
    "run_framework",
    "run_interleaved",
    "spawn_world",
    "token_batch",
    "warm_imports",
]


@dataclass(frozen=True)
class BenchConfig:
    """What every framework is measured on: one world, one batch shape, one schedule."""

    world: int = 2
    """Number of ranks (processes)."""
    batch: int = 4
    """Micro-batch size per rank (sequences)."""
    seq: int = 256
    """Tokens per sequence."""
    steps: int = 10
    """Timed steps."""
    warmup: int = 3
    """Untimed steps before the timed ones."""
    vocab_size: int = 256
    """Token ids are drawn uniformly from [0, vocab_size)."""
    seed: int = 0
    """Seed of the model init (all ranks, all frameworks) and of the token batch (plus rank)."""
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (NCCL, one GPU per rank)."""
    bf16: bool = False
    """Train in bf16 (autocast for torch-native peers, ``bf16.enabled`` for engines)."""
    timeout_s: float = 900.0
    """Wall-clock limit for one framework's world, after which its ranks are killed."""
    bucket: int = 6_553_600
    """Gradient bucket in elements for every peer: DDP's ``bucket_cap_mb`` (25 MiB of fp32 by
    default), DeepSpeed's and slipstream's ``reduce_bucket_size``."""
    clock: str = "wall"
    """How a step is timed: "wall" (``perf_counter``) or "cpu" (the rank process's CPU time,
    all its threads: far less disturbed by other processes on a loaded machine)."""
    threads: int = 0
    """Torch threads per rank; 0 gives ``cores // world``."""

    def __post_init__(self) -> None:
        for name in ("world", "batch", "seq", "steps", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchConfig.{name}={getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"BenchConfig.warmup={self.warmup} must be >= 0")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"BenchConfig.device={self.device!r} must be 'cpu' or 'cuda'")
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"BenchConfig.clock={self.clock!r} must be 'wall' or 'cpu'")

    @property
    def rank_threads(self) -> int:
        """Torch threads of each rank."""
        return self.threads or max(1, _cpu_count() // self.world)

    @property
    def tokens_per_step(self) -> int:
        """Tokens processed by the whole world in one step."""
        return self.world * self.batch * self.seq


class Trainer(Protocol):
    """One framework's training step on an already-built model."""

    optimizer: Any
    """The optimizer (or wrapper) whose state is counted."""

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward, backward and optimizer step; returns the loss."""
        ...


class Switchable(Trainer, Protocol):
    """A trainer whose feature under test can be turned on and off between steps, so one
    process measures both (``run_interleaved``)."""

    def set_variant(self, on: bool) -> None:
        """Turn the feature on or off; turning it off first finishes the work it still owes
        (this call is timed and charged to the block it ends)."""
        ...


class Framework(Protocol):
    """A peer: how to import it (before the memory baseline) and wrap a model."""

    def prepare(self, cfg: BenchConfig) -> None:
        """Import the framework and set it up; runs before the memory baseline is taken."""
        ...

    def build(self, model: nn.Module, cfg: BenchConfig) -> Trainer:
        """Wrap ``model`` (already on the device) and create its AdamW optimizer."""
        ...


@dataclass
class RankResult:
    """Measurements of one rank."""

    rank: int
    step_ms: list[float]
    median_ms: float
    p10_ms: float
    p90_ms: float
    tokens_per_s: float
    """Tokens per second of the whole world, from this rank's median step time."""
    peak_mem_bytes: int
    mem_method: str
    baseline_mem_bytes: int
    optim_state_bytes: int
    losses: list[float]
    """Loss of every step, warmup included."""
    blocks: list[tuple[bool, float, float]] = field(default_factory=list)
    """Interleaved runs only: (feature on, wall ms, CPU ms) of every timed block in order. The
    wall time is the block's step times plus the switch that ends it; the CPU time is the
    process's (all its threads) over the same span, barriers included, which a busy machine
    disturbs far less than the wall time."""


@dataclass
class FrameworkResult:
    """One framework's world: per-rank results, or why it did not run."""

    name: str
    ranks: list[RankResult] = field(default_factory=list)
    error: str | None = None
    """First line of the failure; None on success."""
    detail: str | None = None
    """Traceback or log location of a failure."""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.ranks)

    @property
    def median_ms(self) -> float:
        """Slowest rank's median step time."""
        return max(r.median_ms for r in self.ranks)

    @property
    def p10_ms(self) -> float:
        return max(r.p10_ms for r in self.ranks)

    @property
    def p90_ms(self) -> float:
        return max(r.p90_ms for r in self.ranks)

    @property
    def tokens_per_s(self) -> float:
        return min(r.tokens_per_s for r in self.ranks)

    @property
    def peak_mem_bytes(self) -> int:
        """Largest per-rank peak."""
        return max(r.peak_mem_bytes for r in self.ranks)

    @property
    def optim_state_bytes(self) -> int:
        """Largest per-rank optimizer state."""
        return max(r.optim_state_bytes for r in self.ranks)

    @property
    def final_loss(self) -> float:
        """Last loss averaged over ranks (a parity check across frameworks)."""
        return statistics.fmean(r.losses[-1] for r in self.ranks)

    @property
    def on_off_ratios(self) -> list[float]:
        """Interleaved runs: per repeat, the on block's wall time over the off block's
        (slowest rank of each); empty otherwise."""
        return self._ratios(1)

    @property
    def on_off_cpu_ratios(self) -> list[float]:
        """As ``on_off_ratios`` for the CPU time (the rank that spent the most)."""
        return self._ratios(2)

    def _ratios(self, column: int) -> list[float]:
        per_rank = [[block[column] for block in r.blocks] for r in self.ranks]
        flags = [block[0] for block in self.ranks[0].blocks] if self.ranks else []
        slowest = [max(col) for col in zip(*per_rank, strict=True)]
        on = [ms for flag, ms in zip(flags, slowest, strict=True) if flag]
        off = [ms for flag, ms in zip(flags, slowest, strict=True) if not flag]
        return [a / b for a, b in zip(on, off, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "error": self.error, "detail": self.detail}
        out["ranks"] = [asdict(r) for r in self.ranks]
        if self.ok:
            out["on_off_ratios"] = self.on_off_ratios
            out["on_off_cpu_ratios"] = self.on_off_cpu_ratios
            for key in ("median_ms", "p10_ms", "p90_ms", "tokens_per_s", "peak_mem_bytes"):
                out[key] = getattr(self, key)
            out["optim_state_bytes"] = self.optim_state_bytes
            out["final_loss"] = self.final_loss
        return out


def run_framework(
    name: str,
    framework: Framework,
    cfg: BenchConfig,
    model_factory: Callable[[], nn.Module],
) -> FrameworkResult:
    """Run ``framework`` in a fresh world of ``cfg.world`` processes; never raises for a
    failure inside the world (it is returned in ``FrameworkResult.error``).

    ``framework`` and ``model_factory`` are pickled to the spawned ranks, so they must be
    module-level objects (or partials of them).
    """
    outcome = spawn_world(name, cfg, partial(_train_rank, framework, cfg, model_factory))
    if not outcome.ok:
        return FrameworkResult(name, error=outcome.error, detail=outcome.detail)
    return FrameworkResult(name, ranks=[RankResult(**record) for record in outcome.records])


def run_interleaved(
    name: str,
    framework: Framework,
    cfg: BenchConfig,
    model_factory: Callable[[], nn.Module],
    repeats: int,
) -> FrameworkResult:
    """Measure a feature's cost in one world: ``repeats`` pairs of blocks of ``cfg.steps``
    steps, feature off then on (on then off in every other pair, so a drift in machine load
    hits both alike), on the same model and trainer, whose ``build`` returns a ``Switchable``.

    The ranks' ``step_ms`` are the steps with the feature on; ``FrameworkResult.on_off_ratios``
    compares whole blocks, so work the feature does once in a while (a writer thread waking
    once a second) counts, which a median of step times would miss.
    """
    body = partial(_train_rank_interleaved, framework, cfg, model_factory, repeats)
    outcome = spawn_world(name, cfg, body)
    if not outcome.ok:
        return FrameworkResult(name, error=outcome.error, detail=outcome.detail)
    return FrameworkResult(name, ranks=[RankResult(**record) for record in outcome.records])


@dataclass
class WorldOutcome:
    """What the ranks of one spawned world returned, or why they did not."""

    records: list[dict[str, Any]] = field(default_factory=list)
    """Each rank's JSON-serializable record, in rank order (complete only on success)."""
    error: str | None = None
    """First line of the root-cause failure; None on success."""
    detail: str | None = None
    """Traceback and the rank logs' directory (kept on failure)."""

    @property
    def ok(self) -> bool:
        return self.error is None


def spawn_world(
    name: str, cfg: BenchConfig, body: Callable[[int, torch.device], dict[str, Any]]
) -> WorldOutcome:
    """Run ``body(rank, device)`` on each of ``cfg.world`` fresh spawned processes.

    Each rank gets the rendezvous environment variables, ``cores // world`` threads, its
    device and an initialized gloo (CPU) or NCCL (CUDA) default group before ``body`` runs;
    its stdout/stderr go to a log file. ``body`` must be picklable (a module-level function
    or a partial of one) and return a JSON-serializable dict. Never raises for a failure
    inside the world: the first-raised rank error (the root cause) is returned instead, and
    ranks still alive after ``cfg.timeout_s`` are killed.
    """
    out_dir = Path(tempfile.mkdtemp(prefix=f"slipstream-bench-{name}-"))
    args = (body, cfg, str(out_dir), _free_port())
    threads = cfg.rank_threads
    ctx = None
    try:
        with _env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)):
            ctx = mp.start_processes(
                _worker, args=args, nprocs=cfg.world, join=False, start_method="spawn"
            )
        failure = _join(ctx, cfg.timeout_s)
        records, errors = _collect(out_dir, cfg.world)
    except Exception as exc:  # spawning or collecting failed: a harness bug, not the peer's
        return WorldOutcome(error=_first_line(exc), detail=traceback.format_exc())
    finally:
        _kill(ctx)
    if failure is None and not errors and len(records) == cfg.world:
        shutil.rmtree(out_dir, ignore_errors=True)
        return WorldOutcome(records=records)
    error, detail = errors[0] if errors else (failure or "rank produced no result", None)
    return WorldOutcome(error=error, detail=f"{detail or ''}\nrank logs: {out_dir}")


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors held in the innermost optimizer's ``state`` (local shards only).

    Unwraps ``.optimizer`` attributes (DeepSpeed's ZeRO optimizer, engine wrappers) down to
    the object that owns the per-parameter state; DTensors count their local shard; a
    storage shared by several state tensors counts once.
    """
    inner = optimizer
    while getattr(inner, "optimizer", None) is not None and inner.optimizer is not inner:
        inner = inner.optimizer
    seen: set[int] = set()
    total = 0
    for state in getattr(inner, "state", {}).values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            local = value.to_local() if hasattr(value, "to_local") else value
            storage = local.untyped_storage()
            if storage.data_ptr() in seen and storage.data_ptr() != 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


# --------------------------------------------------------------------------- rank side


def _worker(
    rank: int,
    body: Callable[[int, torch.device], dict[str, Any]],
    cfg: BenchConfig,
    out_dir: str,
    port: int,
) -> None:
    out = Path(out_dir)
    _redirect_output(out / f"rank{rank}.log")
    try:
        device = _init_rank(rank, cfg, port)
        result = body(rank, device)
        (out / f"rank{rank}.json").write_text(json.dumps({"result": result}))
    except BaseException as exc:
        record = {
            "error": _first_line(exc),
            "traceback": traceback.format_exc(),
            "time": time.time(),
        }
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        raise  # a non-zero exit makes the parent terminate the other ranks
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_rank(rank: int, cfg: BenchConfig, port: int) -> torch.device:
    """Rendezvous variables, threads, device and the default process group of one rank."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(cfg.world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(cfg.world),
    )
    torch.set_num_threads(cfg.rank_threads)
    device = torch.device(cfg.device, rank) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=cfg.world)
    return device


def _build_rank(
    framework: Framework,
    cfg: BenchConfig,
    model_factory: Callable[[], nn.Module],
    device: torch.device,
) -> tuple[PeakMemory, Trainer]:
    """Import the framework and the model's lazy modules, start the memory baseline, then
    build the seeded model and wrap it: what every rank does before its first step."""
    framework.prepare(cfg)
    warm_imports(model_factory)
    memory = PeakMemory(device)
    torch.manual_seed(cfg.seed)
    model = model_factory().to(device)
    return memory, framework.build(model, cfg)


def _train_rank(
    framework: Framework,
    cfg: BenchConfig,
    model_factory: Callable[[], nn.Module],
    rank: int,
    device: torch.device,
) -> dict[str, Any]:
    memory, trainer = _build_rank(framework, cfg, model_factory, device)
    input_ids, labels = token_batch(cfg, rank, device)
    losses = [_step(trainer, input_ids, labels, device)[0] for _ in range(cfg.warmup)]
    memory.reset_peak()
    times = []
    for _ in range(cfg.steps):
        dist.barrier()
        loss, seconds = _step(trainer, input_ids, labels, device, cfg.clock)
        losses.append(loss)
        times.append(seconds * 1e3)
    peak = memory.peak_bytes()
    return asdict(_summarize(rank, cfg, times, losses, peak, memory, trainer.optimizer))


def _train_rank_interleaved(
    framework: Framework,
    cfg: BenchConfig,
    model_factory: Callable[[], nn.Module],
    repeats: int,
    rank: int,
    device: torch.device,
) -> dict[str, Any]:
    memory, trainer = _build_rank(framework, cfg, model_factory, device)
    if not hasattr(trainer, "set_variant"):
        raise TypeError(f"{type(trainer).__name__} has no set_variant: it cannot be interleaved")
    input_ids, labels = token_batch(cfg, rank, device)
    losses = []
    for on in (True, False):  # warm both paths (the feature's threads and files too)
        trainer.set_variant(on)
        losses += [_step(trainer, input_ids, labels, device)[0] for _ in range(cfg.warmup)]
    memory.reset_peak()
    on_times: list[float] = []
    blocks: list[tuple[bool, float, float]] = []
    order = [(False, True) if r % 2 == 0 else (True, False) for r in range(repeats)]
    variants = [on for pair in order for on in pair]
    trainer.set_variant(variants[0])
    for i, on in enumerate(variants):
        times = []
        cpu_start = time.process_time()
        for _ in range(cfg.steps):
            dist.barrier()
            loss, seconds = _step(trainer, input_ids, labels, device)
            losses.append(loss)
            times.append(seconds * 1e3)
        start = time.perf_counter()
        trainer.set_variant(variants[i + 1] if i + 1 < len(variants) else False)
        wall_ms = sum(times) + (time.perf_counter() - start) * 1e3
        blocks.append((on, wall_ms, (time.process_time() - cpu_start) * 1e3))
        if on:
            on_times += times
    peak = memory.peak_bytes()
    result = _summarize(rank, cfg, on_times, losses, peak, memory, trainer.optimizer)
    result.blocks = blocks
    return asdict(result)


def warm_imports(model_factory: Callable[[], nn.Module]) -> None:
    """Build the model once on the meta device, so the modules that construction imports
    lazily (``torch.device`` as a context manager pulls in ``torch._dynamo``, ~80 MB RSS)
    are loaded before the memory baseline instead of being charged to the framework."""
    with contextlib.suppress(Exception), torch.device("meta"):
        model_factory()
    gc.collect()


def _step(
    trainer: Trainer,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    device: torch.device,
    clock: str = "wall",
) -> tuple[float, float]:
    now = time.process_time if clock == "cpu" else time.perf_counter
    start = now()
    loss = trainer.step(input_ids, labels).item()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return loss, now() - start


def token_batch(
    cfg: BenchConfig, rank: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed random (input_ids, labels) batch, the same for every framework."""
    gen = torch.Generator().manual_seed(cfg.seed + 1000 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _summarize(
    rank: int,
    cfg: BenchConfig,
    times: list[float],
    losses: list[float],
    peak: int,
    memory: PeakMemory,
    optimizer: Any,
) -> RankResult:
    median = statistics.median(times)
    return RankResult(
        rank=rank,
        step_ms=times,
        median_ms=median,
        p10_ms=_percentile(times, 0.1),
        p90_ms=_percentile(times, 0.9),
        tokens_per_s=cfg.tokens_per_step / (median / 1e3),
        peak_mem_bytes=max(0, peak - memory.baseline),
        mem_method=memory.method,
        baseline_mem_bytes=memory.baseline,
        optim_state_bytes=optimizer_state_bytes(optimizer),
        losses=losses,
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class PeakMemory:
    """Peak memory of this process since ``reset_peak``, see the module docstring.

    ``baseline`` is the memory when the object is created; ``method`` says how the peak is read.
    """

    _PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sampled_peak = 0
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        if device.type == "cuda":
            self.method = "cuda.max_memory_allocated"
            self.baseline = torch.cuda.memory_allocated(device)
        else:
            self.method = "VmHWM (clear_refs reset)" if _can_reset_hwm() else "statm sampler 2ms"
            self.baseline = self._rss()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.method.startswith("VmHWM"):
            Path("/proc/self/clear_refs").write_text("5")
        else:
            self._sampled_peak = self._rss()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.method.startswith("VmHWM"):
            status = Path("/proc/self/status").read_text()
            match = re.search(r"VmHWM:\s+(\d+) kB", status)
            return int(match.group(1)) * 1024 if match else 0
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
        return max(self._sampled_peak, self._rss())

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._sampled_peak = max(self._sampled_peak, self._rss())

    @classmethod
    def _rss(cls) -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * cls._PAGE


def _can_reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _redirect_output(path: Path) -> None:
    """Send this rank's stdout/stderr (Python and C level) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


# --------------------------------------------------------------------------- parent side


def _join(ctx: mp.ProcessContext, timeout_s: float) -> str | None:
    """Wait for all ranks; return None on success, else a one-line reason."""
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                return f"timed out after {timeout_s:.0f} s (killed)"
    except ProcessException as exc:  # a rank failed; join() has terminated the others
        return _first_line(exc)
    return None


def _kill(ctx: mp.ProcessContext | None) -> None:
    """Kill the ranks of ``ctx`` that are still alive (after a timeout or a harness error)."""
    if ctx is None:
        return
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
    for proc in ctx.processes:
        proc.join()


def _collect(out_dir: Path, world: int) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Read the rank records; errors come first-raised first (the root cause, not the
    peers' broken-connection errors that follow it)."""
    records: list[dict[str, Any]] = []
    errors: list[tuple[float, str, str]] = []
    for rank in range(world):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        if "error" in record:
            errors.append((record["time"], record["error"], record["traceback"]))
        else:
            records.append(record["result"])
    return records, [(error, tb) for _, error, tb in sorted(errors)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables for the spawned children, restoring them afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__
