"""Adaptive (APF) vs uniform patching at an equal token budget and patch size.

Trains the same ViT segmenter twice through ``slipstream.initialize`` -- once on uniform
patches, once on adaptive quadtree patches, both L tokens of P x P pixels -- on synthetic
high-resolution images with exact masks, and prints tokens, time per step and full-resolution
Dice on held-out images ("oracle": Dice of the token targets painted back, the ceiling any
per-token prediction can reach with that patching). About a minute on a 2-core CPU with the defaults::

    python examples/apf_segmentation.py [--image-size 1024] [--length 256] [--patch 8]
        [--steps 150] [--model tiny] [--position slot] [--threads N]
"""

from __future__ import annotations

import argparse

import torch

from slipstream.models.vit import ViTSegConfig, ViTSegmenter
from slipstream.vision import (
    AdaptivePatcher,
    APFConfig,
    evaluate_dice,
    oracle_dice,
    synthetic_blobs,
    tokenize,
    train_segmenter,
)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--image-size", type=int, default=1024, help="R (power of two)")
    ap.add_argument("--length", type=int, default=256, help="tokens per image L (a power of 4)")
    ap.add_argument("--patch", type=int, default=8, help="token side P")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--train-images", type=int, default=24)
    ap.add_argument("--test-images", type=int, default=8)
    ap.add_argument("--model", default="tiny", choices=["tiny", "small", "base"])
    ap.add_argument("--position", default="slot", choices=["slot", "geometry", "slot+geometry"])
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    n = args.train_images + args.test_images
    images, masks = synthetic_blobs(n, args.image_size, seed=0)
    patcher = AdaptivePatcher(APFConfig(patch_size=args.patch, length=args.length))
    r, split = args.image_size, args.train_images
    print(f"{n} images of {r}x{r}; L = {args.length} tokens of {args.patch}x{args.patch} pixels; "
          f"uniform {args.patch}x{args.patch} patching would need {(r // args.patch) ** 2:,} tokens")  # fmt: skip
    print(
        f"{'patching':<9} {'tokens':>6} {'leaf sides':>11} {'prep/img':>9} {'step':>9} {'Dice':>7} {'oracle':>7}"
    )
    # numba (the CPU kernels) compiles or loads its kernels on first use: not part of the timings
    patcher(images[:1], masks[:1]), patcher.uniform(images[:1], masks[:1])
    for name, uniform in (("uniform", True), ("adaptive", False)):
        train = tokenize(patcher, images[:split], masks[:split], uniform=uniform)
        test = tokenize(patcher, images[split:], masks[split:], uniform=uniform)
        sizes = train.batch.leaves.size[train.batch.valid]
        torch.manual_seed(0)
        cfg = ViTSegConfig.preset(
            args.model, patch_size=args.patch, max_tokens=args.length, position=args.position
        )
        model = ViTSegmenter(cfg)
        result = train_segmenter(model, train, steps=args.steps, batch_size=args.batch, lr=args.lr)
        dice = evaluate_dice(model, test)
        print(f"{name:<9} {args.length:>6} {int(sizes.min()):>4}-{int(sizes.max()):<6} "
              f"{1e3 * train.preprocess_s / split:>7.1f}ms {1e3 * result.median_step_s:>7.1f}ms {dice:>7.4f} {oracle_dice(test):>7.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
