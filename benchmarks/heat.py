"""HEAT vs a plain PyTorch SimpleX: epoch time and Recall/NDCG@20 on the same cores.

Usage::

    python benchmarks/heat.py [--epochs 15] [--threads 2] [--data auto|ml100k|synthetic]
        [--gate 0.4] [--heat-lr 0.03] [--tile N1:N2] [--timed-epochs 2] [--json out.json]

Data: MovieLens-100K from the ``recbole`` wheel when installed (``--data auto``), else a
synthetic set of the same size (943 users, 1,682 items, 100k interactions). Every runner
trains its own model from the same initialisation with the same model hyper-parameters
(``SimpleXConfig`` defaults); epochs are interleaved (baseline epoch, HEAT epoch, ...) so
machine load affects all of them alike, and the reported time is the median epoch.

Runners (``-Nt``: N threads): ``pytorch`` — the straightforward autograd SimpleX (gather,
concat, normalise, bmm; Adam lr 5e-3, batch 1024, as SimpleX is usually trained);
``heat-numba`` — HEAT's per-sample kernel (SGD, ``--heat-lr`` per sample); ``heat-torch`` —
the vectorized-PyTorch HEAT candidate. ``pytorch-1t`` and ``heat-numba`` at 1 and
``--threads`` train for ``--epochs`` and are evaluated; ``pytorch-{threads}t`` and
``heat-torch`` are timed for the first ``--timed-epochs`` only. Speed-ups are given against
the PyTorch row with the same thread count and against the fastest PyTorch row (on a
shared, oversubscribed CPU torch's 2-thread OpenMP can be several times slower than 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from slipstream.recsys import (
    HEATConfig,
    HEATTrainer,
    InteractionSplit,
    SimpleX,
    SimpleXConfig,
    evaluate_topk,
    load_movielens_100k,
    numba_available,
    popularity_scores,
    synthetic_interactions,
    train_reference_epoch,
    user_history,
)

__all__ = ["Row", "format_table", "load_data", "main", "parallelism_check", "run"]


@dataclass
class Row:
    """One runner's result."""

    name: str
    epoch_s: list[float] = field(default_factory=list)
    recall: float = float("nan")
    ndcg: float = float("nan")

    @property
    def median_s(self) -> float:
        return statistics.median(self.epoch_s) if self.epoch_s else float("nan")


def load_data(kind: str) -> tuple[InteractionSplit, str]:
    """``(split, description)`` for ``auto`` / ``ml100k`` / ``synthetic``."""
    if kind in ("auto", "ml100k"):
        try:
            return load_movielens_100k(), "MovieLens-100K (recbole wheel)"
        except FileNotFoundError:
            if kind == "ml100k":
                raise
    return synthetic_interactions(), "synthetic, MovieLens-100K size (recbole not installed)"


def _make_model(split: InteractionSplit, cfg: SimpleXConfig) -> SimpleX:
    history = user_history(split.train, split.num_users, cfg.max_history)
    return SimpleX(split.num_users, split.num_items, history, cfg, seed=0)


def _pytorch_runner(split: InteractionSplit, cfg: SimpleXConfig, threads: int):
    model = _make_model(split, cfg)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    gen = torch.Generator().manual_seed(0)

    def epoch() -> None:
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            train_reference_epoch(model, split.train, opt, 1024, gen)
        finally:
            torch.set_num_threads(prev)

    return epoch, model


def _heat_runner(
    split: InteractionSplit,
    cfg: SimpleXConfig,
    threads: int,
    backend: str,
    lr: float,
    tile: tuple[int, int] = (0, 1),
):
    model = _make_model(split, cfg)
    heat_cfg = HEATConfig(
        lr=lr, num_threads=threads, backend=backend, tile_size=tile[0], refresh_interval=tile[1]
    )
    trainer = HEATTrainer(model, split.train, heat_cfg)
    one = torch.zeros(1, dtype=torch.int64)
    trainer.gradients(one, one, torch.zeros(1, cfg.num_negatives, dtype=torch.int64))  # compile
    return trainer.train_epoch, model


def parallelism_check(threads: int, n: int = 30_000_000) -> float:
    """Speed-up of ``threads`` threads over 1 on an embarrassingly parallel numba loop:
    how many cores this (possibly shared) machine actually gives the benchmark now."""
    from concurrent.futures import ThreadPoolExecutor

    import numba

    @numba.njit(nogil=True)
    def spin(m: int) -> float:
        acc = 0.0
        for i in range(m):
            acc += (i % 7) ** 0.5
        return acc

    spin(10)
    times = []
    for k in (1, threads):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(k) as pool:
            list(pool.map(spin, [n] * k))
        times.append((time.perf_counter() - t0) / k)
    return times[0] / times[1]


def run(
    split: InteractionSplit,
    model_cfg: SimpleXConfig,
    epochs: int,
    threads: int,
    heat_lr: float = 0.03,
    tile: tuple[int, int] | None = None,
    timed_epochs: int = 2,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Train ``pytorch-1t``, ``heat-numba-1t``, ``heat-numba-{threads}t`` (and a tiled
    ``heat-numba`` row when ``tile = (N1, N2)``) for ``epochs`` interleaved epochs and
    evaluate them; time ``pytorch-{threads}t`` and ``heat-torch-{1,threads}t`` for the
    first ``timed_epochs`` (no metrics). One :class:`Row` each, plus ``popularity``."""
    full = {"pytorch-1t": _pytorch_runner(split, model_cfg, 1)}
    timed = {}
    if threads != 1:
        timed[f"pytorch-{threads}t"] = _pytorch_runner(split, model_cfg, threads)
    if numba_available():
        for n in sorted({1, threads}):
            full[f"heat-numba-{n}t"] = _heat_runner(split, model_cfg, n, "numba", heat_lr)
        if tile is not None:
            name = f"heat-numba-tile{tile[0]}/{tile[1]}-1t"
            full[name] = _heat_runner(split, model_cfg, 1, "numba", heat_lr, tile)
    else:
        log("numba is not installed: HEAT numba rows skipped (pip install numba)")
    for n in sorted({1, threads}):
        timed[f"heat-torch-{n}t"] = _heat_runner(split, model_cfg, n, "torch", heat_lr)
    rows = {name: Row(name) for name in (*full, *timed)}
    for epoch in range(epochs):
        for name, (step, _) in {**full, **(timed if epoch < timed_epochs else {})}.items():
            t0 = time.perf_counter()
            step()
            rows[name].epoch_s.append(time.perf_counter() - t0)
        log(f"epoch {epoch + 1}/{epochs}: " + ", ".join(
            f"{n} {r.epoch_s[-1]:.2f}s" for n, r in rows.items() if len(r.epoch_s) > epoch))  # fmt: skip
    for name, (_, model) in full.items():
        metrics = evaluate_topk(model.score_all, split, k=20)
        rows[name].recall, rows[name].ndcg = metrics["recall"], metrics["ndcg"]
    pop = evaluate_topk(popularity_scores(split), split, k=20)
    rows["popularity"] = Row("popularity", [], pop["recall"], pop["ndcg"])
    return list(rows.values())


def format_table(rows: list[Row]) -> str:
    """Markdown table: median epoch time, speed-up over the PyTorch baseline on the same
    thread count and over the fastest PyTorch row, Recall/NDCG@20 (— where not measured)."""
    base = {
        r.name.split("-")[-1]: r.median_s
        for r in rows
        if r.name.startswith("pytorch") and r.epoch_s
    }
    best = min(base.values(), default=float("nan"))
    lines = [
        "| runner | epochs timed | median epoch (s) | vs pytorch, same threads | vs fastest pytorch "
        "| Recall@20 | NDCG@20 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.epoch_s and r.recall != r.recall:
            continue  # a timed-only row that was not timed (--timed-epochs 0)
        same = base.get(r.name.split("-")[-1])
        cells = [r.name, str(len(r.epoch_s)) if r.epoch_s else "—"]
        if r.epoch_s:
            cells += [f"{r.median_s:.3f}", f"{same / r.median_s:.1f}x" if same else "—",
                      f"{best / r.median_s:.1f}x"]  # fmt: skip
        else:
            cells += ["—", "—", "—"]
        cells += ["—" if r.recall != r.recall else f"{v:.4f}" for v in (r.recall, r.ndcg)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", choices=("auto", "ml100k", "synthetic"), default="auto")
    ap.add_argument("--gate", type=float, default=0.4, help="1.0 benchmarks MF-CCL")
    ap.add_argument("--heat-lr", type=float, default=0.03)
    ap.add_argument(
        "--tile", type=str, default=None, help="N1:N2 adds a 1-thread random-tiling row"
    )
    ap.add_argument("--timed-epochs", type=int, default=2, help="epochs of the timed-only rows")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    split, desc = load_data(args.data)
    model_cfg = SimpleXConfig(gate=args.gate)
    print(f"data: {desc}; {split.num_users} users, {split.num_items} items, "
          f"{len(split.train)} train / {len(split.test)} test pairs")  # fmt: skip
    print(f"model: {model_cfg}")
    tile = tuple(int(x) for x in args.tile.split(":")) if args.tile else None
    if args.threads > 1 and numba_available():
        print(f"parallelism available now: {parallelism_check(args.threads):.2f}x on "
              f"{args.threads} threads for a trivially parallel loop (ideal {args.threads}x)")  # fmt: skip
    rows = run(split, model_cfg, args.epochs, args.threads, args.heat_lr, tile, args.timed_epochs)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
