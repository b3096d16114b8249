"""Train and evaluate a token segmenter on adaptive or uniform patches with the slipstream engine.

Used by ``examples/apf_segmentation.py`` and ``benchmarks/apf.py`` to compare adaptive
(APF) and uniform patching at an equal token budget and patch size: images are tokenized
once (:func:`tokenize`), the same model class is trained for the same number of steps on
each token set (:func:`train_segmenter`, through ``slipstream.initialize``), and Dice is
measured at full resolution after painting the predictions back (:func:`evaluate_dice`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from slipstream.vision.losses import bce_dice_loss, dice_score
from slipstream.vision.patcher import AdaptivePatcher, PatchBatch
from slipstream.vision.quadtree import Leaves
from slipstream.vision.tokens import tokens_to_image

__all__ = [
    "TokenSet",
    "TrainResult",
    "evaluate_dice",
    "oracle_dice",
    "tokenize",
    "train_segmenter",
]


@dataclass
class TokenSet:
    """Tokenized images with their full-resolution masks (the evaluation ground truth)."""

    batch: PatchBatch
    """Tokens, leaves and mask targets of every image."""
    masks: Tensor
    """(N, R, R) bool full-resolution masks."""
    preprocess_s: float = 0.0
    """Seconds spent tokenizing (edges + tree + tokens), summed over chunks."""

    def __len__(self) -> int:
        return self.batch.tokens.shape[0]

    def minibatch(self, index: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(tokens, valid, geometry, targets) of the images ``index``."""
        b = self.batch
        assert b.targets is not None
        return b.tokens[index], b.valid[index], b.geometry[index], b.targets[index]


def tokenize(
    patcher: AdaptivePatcher,
    images: Tensor,
    masks: Tensor,
    *,
    uniform: bool = False,
    chunk: int = 8,
) -> TokenSet:
    """Tokenize ``images`` (N, C, R, R) and ``masks`` (N, R, R) in chunks of ``chunk`` images.

    ``uniform=True`` uses the patcher's uniform baseline (same token count L and patch size P
    as its adaptive trees; L must be a power of 4).
    """
    parts: list[PatchBatch] = []
    start = time.perf_counter()
    for i in range(0, images.shape[0], chunk):
        img, m = images[i : i + chunk], masks[i : i + chunk]
        parts.append(patcher.uniform(img, m) if uniform else patcher(img, m))
    elapsed = time.perf_counter() - start
    targets = [p.targets for p in parts]
    assert all(t is not None for t in targets)
    batch = PatchBatch(
        tokens=torch.cat([p.tokens for p in parts]),
        leaves=Leaves.cat([p.leaves for p in parts]),
        targets=torch.cat(targets),  # type: ignore[arg-type]
    )
    return TokenSet(batch=batch, masks=masks.bool(), preprocess_s=elapsed)


@dataclass
class TrainResult:
    """What :func:`train_segmenter` measured."""

    losses: list[float] = field(default_factory=list)
    """Loss per step."""
    step_s: list[float] = field(default_factory=list)
    """Wall time per step (forward + backward + optimizer step)."""

    @property
    def median_step_s(self) -> float:
        """Median step time in seconds (first step excluded when there are several)."""
        times = self.step_s[1:] if len(self.step_s) > 1 else self.step_s
        return statistics.median(times)


def train_segmenter(
    model: nn.Module,
    data: TokenSet,
    *,
    steps: int,
    batch_size: int,
    lr: float = 1e-3,
    seed: int = 0,
    config: dict[str, Any] | None = None,
) -> TrainResult:
    """Train ``model`` on random minibatches of ``data`` with ``slipstream.initialize``.

    Loss: 0.5 BCE + 0.5 soft-Dice on the token masks (padding excluded). ``config`` replaces
    the default engine config (AdamW at ``lr``, gradient clipping 1.0, global batch
    ``batch_size``); any DeepSpeed-style key works (ZeRO stages, bf16, ...).

    Data parallel: under ``slipstream run --nproc N`` every rank draws the same global batch
    of images (same ``seed``) and trains on its own slice of ``batch_size / N``, so N ranks
    follow the single-process run on the global batch. ``steps`` counts micro-steps.
    """
    from slipstream.distributed import comm
    from slipstream.runtime.initialize import initialize

    cfg = config or {
        "train_batch_size": batch_size,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
    }
    engine, *_ = initialize(model=model, config=cfg)
    micro = engine.train_micro_batch_size_per_gpu()
    rank, world = comm.get_rank(), comm.get_world_size()
    g = torch.Generator().manual_seed(seed)
    result = TrainResult()
    engine.train()
    for _ in range(steps):
        index = torch.randint(len(data), (micro * world,), generator=g)
        tokens, valid, geometry, targets = data.minibatch(index[rank * micro : (rank + 1) * micro])
        start = time.perf_counter()
        logits = engine(tokens, valid, geometry)
        loss = bce_dice_loss(logits, targets, valid)
        engine.backward(loss)
        engine.step()
        result.losses.append(float(loss.detach()))
        result.step_s.append(time.perf_counter() - start)
    return result


@torch.no_grad()
def evaluate_dice(model: nn.Module, data: TokenSet, batch_size: int = 8) -> float:
    """Mean full-resolution Dice of ``model``'s thresholded predictions over ``data``."""
    was_training = model.training
    model.eval()
    scores = []
    for i in range(0, len(data), batch_size):
        index = torch.arange(i, min(i + batch_size, len(data)))
        tokens, valid, geometry, _ = data.minibatch(index)
        probs = torch.sigmoid(model(tokens, valid, geometry))
        pred = tokens_to_image(probs, data.batch.leaves.select(index)) > 0.5
        scores.append(dice_score(pred, data.masks[index]))
    model.train(was_training)
    return float(torch.cat(scores).mean())


def oracle_dice(data: TokenSet) -> float:
    """Mean Dice of the token targets painted back: the best any per-token model can reach."""
    b = data.batch
    assert b.targets is not None
    pred = tokens_to_image(b.targets, b.leaves) > 0.5
    return float(dice_score(pred, data.masks).mean())
