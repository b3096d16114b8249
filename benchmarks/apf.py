"""Adaptive patching (APF) vs uniform patching at 1K-8K pixels a side.

Usage::

    python benchmarks/apf.py [--sizes 1024,4096,8192] [--length 1024] [--patch 8]
        [--sections tokens,time,prep,dice,positions] [--thresholds 50,24,12,6,3]
        [--prep-batch 1,4,16] [--prep-dtypes float32,uint8] [--backend auto|torch|numba]
        [--dice-steps 150] [--device cpu|cuda] [--json out.json]

Sections (all in one process, candidate and baseline in the same run):

* ``tokens``: per image (synthetic blobs with exact masks; the bundled IHC slide rescaled
  bicubically, Canny thresholds 100/200 transferred from its native 512^2 as fractions of
  the peak gradient)
  the APF token count of both quadtree variants vs uniform patches at the same minimum patch
  size (the smallest leaf APF produced), and the ratio; the threshold variant for every tau
  of ``--thresholds``, with the mask round-trip Dice of the tree (synthetic images: the
  exact mask through the leaves and back, what the tree can resolve at best).
* ``time``: forward+backward of the same ViT on L adaptive tokens vs the (R/P)**2 uniform
  P x P patches. Uniform lengths above ``--max-measured`` tokens are extrapolated from a fit
  t(N) = a N + b N**2 over measured lengths (marked "fit").
* ``prep``: APF preprocessing (the full ``AdaptivePatcher(images, masks)`` call: edges, tree,
  image and mask tokens; split into its parts for one image) as a fraction of one training
  step (forward + BCE/Dice + backward + AdamW) on its tokens, per model size and per batch
  size of ``--prep-batch`` (one call on B images vs one step on their B x L tokens); the two
  are timed alternately and the median per-repetition ratio is reported. Once per input
  dtype of ``--prep-dtypes``: float32 in [0, 1], and uint8 0-255 (a decoded image file as
  it comes, a quarter of the bytes; the tokens are float32 either way). ``--backend`` picks
  the CPU kernels (``APFConfig.backend``; "torch" shows the pure-PyTorch pipeline).
* ``dice``: adaptive vs uniform tokens at equal budget L and patch size P, same model, same
  steps (slipstream engine), Dice at full resolution on held-out images.
* ``positions``: slot vs slot+geometry vs geometry embeddings on adaptive tokens (first size).

Timings use ``--threads`` intra-op threads (default 1: stable on a shared machine), medians
of ``--reps`` repetitions after a warm-up (``prep`` and ``time``). ``--device cuda`` runs preprocessing and training
on the GPU (images generated there; CUDA synchronised around every timing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from slipstream.models.vit import ViTSegConfig, ViTSegmenter
from slipstream.vision import (
    AdaptivePatcher,
    APFConfig,
    PatchBatch,
    TokenSet,
    bundled_image,
    evaluate_dice,
    oracle_dice,
    resize_square,
    synthetic_blobs,
    train_segmenter,
)
from slipstream.vision.canny import _sobel, gaussian_blur, to_grey
from slipstream.vision.quadtree import Leaves
from slipstream.vision.tokens import extract_tokens, tokens_to_image

__all__ = ["main"]


_DEVICE = torch.device("cpu")


def _sync() -> None:
    if _DEVICE.type == "cuda":
        torch.cuda.synchronize(_DEVICE)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - start, out


def _median_timed(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """Median seconds of ``reps`` calls after one warm-up call, and the last result."""
    _, out = _timed(fn)
    times = []
    for _ in range(reps):
        t, out = _timed(fn)
        times.append(t)
    return statistics.median(times), out


def _ihc_relative_thresholds() -> tuple[float, float]:
    """Canny 100/200 at the slide's native 512^2, as fractions of its peak gradient.

    Upsampling divides every gradient by the scale factor, so fixed thresholds find no edge
    in the slide at 8K; fractions of the peak transfer the native-resolution edge map.
    """
    grey = gaussian_blur(to_grey(bundled_image("immunohistochemistry")).round(), kernel_size=3)
    gi, gj = _sobel(grey)
    peak = float((gi.abs() + gj.abs()).max())
    return 100.0 / peak, 200.0 / peak


def _image(kind: str, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    if kind == "synthetic":
        return synthetic_blobs(1, size, seed=seed)
    return resize_square(bundled_image("immunohistochemistry"), size, "bicubic"), None


def _patcher(
    kind: str, variant: str, args: argparse.Namespace, size: int, threshold: int = 50
) -> AdaptivePatcher:
    extra: dict[str, Any] = {}
    if kind == "ihc":
        lo, hi = _ihc_relative_thresholds()
        extra = dict(canny_relative=True, canny_low=lo, canny_high=hi)
    depth = (size // 2).bit_length() - 1
    extra["backend"] = args.backend
    if variant == "threshold":
        return AdaptivePatcher(
            APFConfig(patch_size=args.patch, variant="threshold", length=None, max_depth=depth,
                      threshold=threshold, **extra)
        )  # fmt: skip
    return AdaptivePatcher(APFConfig(patch_size=args.patch, length=args.length, **extra))


def _round_trip_dice(mask: torch.Tensor, leaves: Leaves, patch: int) -> float:
    """Dice of the exact mask after area tokens through ``leaves`` and back (the tree's best)."""
    targets = extract_tokens(mask.unsqueeze(1), leaves, patch, "area")[:, :, 0]
    back = tokens_to_image(targets, leaves) > 0.5
    inter = int((back & mask).sum())
    return 2 * inter / max(int(back.sum()) + int(mask.sum()), 1)


def section_tokens(args: argparse.Namespace) -> list[dict[str, Any]]:
    """APF token counts vs uniform patches at the same minimum patch size."""
    rows = []
    for size in args.sizes:
        for kind in ("synthetic", "ihc"):
            img, mask = _image(kind, size)
            base = _patcher(kind, "fixed_length", args, size)
            t_edges, points = _timed(lambda p=base, i=img: p.edge_points(i))
            runs = [("threshold", t) for t in args.thresholds] + [("fixed_length", None)]
            for variant, tau in runs:
                patcher = _patcher(kind, variant, args, size, tau or 50)
                t_tree, leaves = _timed(
                    lambda p=patcher, e=points, r=size: p.tree_of_points(e, 1, r)
                )
                sizes = leaves.size[leaves.valid]
                smin = int(sizes.min())
                n = int(leaves.num_leaves[0])
                uni = (size // smin) ** 2
                dice = None if mask is None else _round_trip_dice(mask, leaves, args.patch)
                rows.append(dict(size=size, image=kind, variant=variant, threshold=tau,
                                 edge_px=int(points.numel()), tokens=n, min_leaf=smin,
                                 max_leaf=int(sizes.max()), uniform_at_min=uni, ratio=uni / n,
                                 uniform_p2=(size // 2) ** 2, round_trip_dice=dice,
                                 edges_s=t_edges, tree_s=t_tree))  # fmt: skip
                name = variant if tau is None else f"{variant} tau={tau}"
                print(f"  tokens  {size:>5} {kind:<9} {name:<16} tokens {n:>7,}  min leaf {smin:>3}  "
                      f"uniform@min {uni:>10,}  ratio {uni / n:8.1f}x"
                      + ("" if dice is None else f"  round-trip Dice {dice:.5f}"), flush=True)  # fmt: skip
            del img, mask, points
    return rows


def _fwd_bwd_s(model: ViTSegmenter, n: int, reps: int) -> float:
    p, c = model.config.patch_size, model.config.in_channels
    tokens = torch.rand(1, n, c, p, p, device=_DEVICE)
    times = []
    for i in range(reps + 1):
        model.zero_grad(set_to_none=True)
        t, _ = _timed(lambda: model(tokens).float().mean().backward())
        if i:
            times.append(t)
    return statistics.median(times)


def _fit_linear_quadratic(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Least squares t = a N + b N**2 with a, b >= 0 (two-variable NNLS by cases)."""
    coef = torch.linalg.lstsq(torch.stack([xs, xs * xs], 1), ys.unsqueeze(1)).solution.squeeze(1)
    if coef[0] < 0:
        coef = torch.stack([xs.new_zeros(()), (ys * xs**2).sum() / (xs**4).sum()])
    if coef[1] < 0:
        coef = torch.stack([(ys * xs).sum() / (xs**2).sum(), xs.new_zeros(())])
    return coef


def section_time(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Forward+backward time of one ViT on L adaptive tokens vs (R/P)^2 uniform patches."""
    cfg = ViTSegConfig.preset(
        args.time_model, patch_size=args.patch, max_tokens=max(args.max_measured, args.length)
    )
    torch.manual_seed(0)
    model = ViTSegmenter(cfg).to(_DEVICE)
    measured: dict[int, float] = {}
    lengths = {args.length, args.max_measured, args.max_measured // 4, args.max_measured // 16}
    lengths |= {
        (s // args.patch) ** 2 for s in args.sizes if (s // args.patch) ** 2 <= args.max_measured
    }
    for n in sorted(x for x in lengths if x >= 1):
        measured[n] = _fwd_bwd_s(model, n, args.reps if n <= args.max_measured // 4 else 1)
        print(
            f"  time    fwd+bwd {args.time_model} N={n:>7,}: {measured[n] * 1e3:9.1f} ms",
            flush=True,
        )
    xs = torch.tensor(sorted(measured), dtype=torch.float64)
    ys = torch.tensor([measured[int(n)] for n in xs], dtype=torch.float64)
    coef = _fit_linear_quadratic(xs, ys)
    rows = []
    for size in args.sizes:
        n_uni = (size // args.patch) ** 2
        fit = n_uni not in measured
        t_uni = float(coef[0] * n_uni + coef[1] * n_uni**2) if fit else measured[n_uni]
        t_apf = measured[args.length]
        rows.append(dict(size=size, apf_tokens=args.length, uniform_tokens=n_uni, apf_s=t_apf,
                         uniform_s=t_uni, uniform_is_fit=fit, speedup=t_uni / t_apf))  # fmt: skip
        print(f"  time    {size:>5}: uniform {n_uni:>9,} tok {t_uni:10.2f} s{' (fit)' if fit else ''}"
              f"  apf {args.length} tok {t_apf:7.3f} s  ratio {t_uni / t_apf:12,.0f}x", flush=True)  # fmt: skip
    return rows


def _train_step_fn(cfg: ViTSegConfig, batch: PatchBatch) -> Callable[[], None]:
    """One training step (forward, BCE + soft-Dice, backward, AdamW) of a fresh model."""
    torch.manual_seed(0)
    model = ViTSegmenter(cfg).to(_DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    assert batch.targets is not None
    from slipstream.vision import bce_dice_loss

    def step() -> None:
        loss = bce_dice_loss(
            model(batch.tokens, batch.valid, batch.geometry), batch.targets, batch.valid
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def section_prep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """APF preprocessing (the whole patcher call) as a fraction of a training step on its tokens.

    For every batch size B of ``--prep-batch``: one ``patcher(images, masks)`` call on B images
    vs one training step on their B x L tokens. Preprocessing and step alternate, ``--reps``
    times after a warm-up, and the fraction is the median of the per-repetition ratios (robust
    to a shared machine whose speed drifts between the two measurements).
    """
    rows = []
    for size in args.sizes:
        for dtype in args.prep_dtypes:
            rows += _prep_rows(size, dtype, args)
    return rows


def _as_dtype(images: torch.Tensor, dtype: str) -> torch.Tensor:
    """``images`` in [0, 1] as float32, or as 8-bit 0-255 (what a decoded file holds)."""
    if dtype == "uint8":
        return images.mul(255).round_().to(torch.uint8)
    if dtype != "float32":
        raise SystemExit(f"--prep-dtypes takes float32 and/or uint8, got {dtype!r}")
    return images


def _prep_rows(size: int, dtype: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    patcher = _patcher("synthetic", "fixed_length", args, size)
    img, mask = synthetic_blobs(1, size, seed=0, device=_DEVICE)
    img = _as_dtype(img, dtype)
    parts = {}
    # edges include the means the CPU edge pass pools for the tokens (numba backend)
    parts["edges"], (points, means) = _median_timed(
        lambda: patcher.edge_points_and_means(img), args.reps
    )
    parts["tree"], leaves = _median_timed(
        lambda: patcher.tree_of_points(points, 1, size), args.reps
    )
    parts["tokens"], _ = _median_timed(lambda: patcher.tokens(img, leaves, mask, means), args.reps)
    for nb in args.prep_batch:
        images, masks = synthetic_blobs(nb, size, seed=0, device=_DEVICE)
        images = _as_dtype(images, dtype)
        batch = patcher(images, masks)
        for name in args.prep_models:
            cfg = ViTSegConfig.preset(name, patch_size=args.patch, max_tokens=args.length)
            step = _train_step_fn(cfg, batch)
            prep_fn = lambda x=images, m=masks: patcher(x, m)  # noqa: E731
            _timed(prep_fn), _timed(step)  # warm-up
            preps, steps = [], []
            for _ in range(args.reps):
                preps.append(_timed(prep_fn)[0])
                steps.append(_timed(step)[0])
            ratios = [p / t for p, t in zip(preps, steps)]
            row = dict(size=size, dtype=dtype, model=name, batch=nb, prep_s=statistics.median(preps),
                       step_s=statistics.median(steps), fraction=statistics.median(ratios),
                       fraction_range=(min(ratios), max(ratios)),
                       **{f"{k}_s": v for k, v in parts.items()})  # fmt: skip
            rows.append(row)
            lo, hi = row["fraction_range"]
            print(f"  prep    {size:>5} {dtype:<7} {name:<5} batch {nb:>2}: preprocessing {row['prep_s'] * 1e3:8.1f} ms "
                  f"(one image: edges {parts['edges'] * 1e3:.1f}, tree {parts['tree'] * 1e3:.1f}, tokens {parts['tokens'] * 1e3:.1f})"
                  f"  step {row['step_s'] * 1e3:8.1f} ms -> {100 * row['fraction']:6.1f}% "
                  f"({100 * lo:.1f}-{100 * hi:.1f})", flush=True)  # fmt: skip
        del images, masks, batch
    return rows


def _token_sets(
    size: int, args: argparse.Namespace, n_train: int, n_test: int
) -> tuple[TokenSet, ...]:
    """Adaptive and uniform token sets (train, test), one image at a time to bound memory."""
    patcher = _patcher("synthetic", "fixed_length", args, size)
    out: dict[str, list[PatchBatch]] = {"apf": [], "uniform": []}
    masks, prep = [], 0.0
    warm = synthetic_blobs(1, size, seed=999)  # numba kernels compile / load on first use
    patcher(*warm), patcher.uniform(*warm)
    for i in range(n_train + n_test):
        img, mask = synthetic_blobs(1, size, seed=1000 + i)
        t, batch = _timed(lambda im=img, m=mask: patcher(im, m))
        prep += t
        out["apf"].append(batch)
        out["uniform"].append(patcher.uniform(img, mask))
        masks.append(mask if i >= n_train else torch.zeros(1, 1, 1, dtype=torch.bool))
        del img
    sets = []
    for key in ("apf", "uniform"):
        for lo, hi in ((0, n_train), (n_train, n_train + n_test)):
            parts = out[key][lo:hi]
            batch = PatchBatch(
                tokens=torch.cat([p.tokens for p in parts]),
                leaves=Leaves.cat([p.leaves for p in parts]),
                targets=torch.cat([p.targets for p in parts if p.targets is not None]),
            )
            test_masks = (
                torch.cat(masks[lo:hi]) if lo else torch.zeros(hi - lo, 1, 1, dtype=torch.bool)
            )
            sets.append(TokenSet(batch=batch, masks=test_masks, preprocess_s=prep))
    return tuple(sets)


def _train_eval(
    train: TokenSet, test: TokenSet, args: argparse.Namespace, position: str
) -> dict[str, float]:
    torch.manual_seed(0)
    cfg = ViTSegConfig.preset(
        args.dice_model, patch_size=args.patch, max_tokens=args.length, position=position
    )  # type: ignore[arg-type]
    model = ViTSegmenter(cfg)
    result = train_segmenter(
        model, train, steps=args.dice_steps, batch_size=args.dice_batch, lr=args.lr
    )
    return dict(
        dice=evaluate_dice(model, test),
        oracle_dice=oracle_dice(test),
        step_s=result.median_step_s,
        final_loss=result.losses[-1],
    )


def section_dice(args: argparse.Namespace, positions: bool) -> list[dict[str, Any]]:
    """Adaptive vs uniform at equal budget, or (positions=True) positional-embedding variants."""
    rows = []
    sizes = args.sizes[:1] if positions else args.sizes
    for size in sizes:
        n_train, n_test = args.dice_images
        apf_tr, apf_te, uni_tr, uni_te = _token_sets(size, args, n_train, n_test)
        arms = [(f"apf/{p}", apf_tr, apf_te, p) for p in ("slot", "slot+geometry", "geometry")] if positions else [
            ("uniform", uni_tr, uni_te, "slot"), ("apf", apf_tr, apf_te, "slot")]  # fmt: skip
        for name, tr, te, pos in arms:
            res = _train_eval(tr, te, args, pos)
            smin = int(tr.batch.leaves.size[tr.batch.valid].min())
            rows.append(dict(size=size, arm=name, tokens=args.length, patch=args.patch, min_leaf=smin,
                             steps=args.dice_steps, **res))  # fmt: skip
            print(f"  {'pos ' if positions else 'dice'}    {size:>5} {name:<18} L={args.length} P={args.patch} "
                  f"min leaf {smin:>4}  step {res['step_s'] * 1e3:7.1f} ms  Dice {res['dice']:.4f}  oracle {res['oracle_dice']:.4f}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the selected sections, print tables, optionally write JSON; returns the results."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--sizes", default="1024,4096,8192", type=lambda s: [int(x) for x in s.split(",")]
    )
    ap.add_argument("--length", type=int, default=1024, help="APF tokens L (fixed-length variant)")
    ap.add_argument("--patch", type=int, default=8, help="token side P")
    ap.add_argument("--sections", default="tokens,time,prep,dice,positions")
    ap.add_argument("--time-model", default="tiny")
    ap.add_argument(
        "--max-measured", type=int, default=16384, help="longest uniform sequence timed"
    )
    ap.add_argument("--prep-models", default="tiny,small,base", type=lambda s: s.split(","))
    ap.add_argument(
        "--prep-batch",
        default="1",
        type=lambda s: [int(x) for x in s.split(",")],
        help="images per patcher call and training step (comma list)",
    )
    ap.add_argument(
        "--prep-dtypes",
        default="float32,uint8",
        type=lambda s: s.split(","),
        help="input image dtypes of the prep section (float32 in [0, 1], uint8 0-255)",
    )
    ap.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "torch", "numba"),
        help="APFConfig.backend: CPU kernels (numba fused edges / integer pooling, or torch)",
    )
    ap.add_argument(
        "--thresholds",
        default="50,24,12,6,3",
        type=lambda s: [int(x) for x in s.split(",")],
        help="tau values of the threshold variant in the tokens section",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (prep and time sections)")
    ap.add_argument("--dice-model", default="tiny")
    ap.add_argument("--dice-steps", type=int, default=150)
    ap.add_argument("--dice-batch", type=int, default=4)
    ap.add_argument(
        "--dice-images", default="12,4", type=lambda s: tuple(int(x) for x in s.split(","))
    )
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    global _DEVICE
    _DEVICE = torch.device(args.device)
    sections = args.sections.split(",")
    out: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}}
    where = torch.cuda.get_device_name(_DEVICE) if _DEVICE.type == "cuda" else "cpu"
    print(
        f"APF benchmark: sizes {args.sizes}, L={args.length}, P={args.patch}, "
        f"threads {args.threads}, device {where}"
    )
    if "tokens" in sections:
        out["tokens"] = section_tokens(args)
    if "time" in sections:
        out["time"] = section_time(args)
    if "prep" in sections:
        out["prep"] = section_prep(args)
    if "dice" in sections:
        out["dice"] = section_dice(args, positions=False)
    if "positions" in sections:
        out["positions"] = section_dice(args, positions=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
