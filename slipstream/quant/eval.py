"""Evaluation helpers: causal-LM perplexity and embedding cosine similarity, and tables of
them over named quantization configs (used by ``slipstream quant eval``)."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.quant.api import quantize_
from slipstream.quant.config import W4A8FP4, W8A8FP8, HeroModes, QuantConfig, W4A8Int4, W8A8Int

__all__ = [
    "EVAL_CONFIGS",
    "cosine_rows",
    "eval_configs",
    "format_table",
    "mean_cosine",
    "perplexity",
    "perplexity_rows",
]


@torch.no_grad()
def perplexity(
    model: nn.Module,
    ids: torch.Tensor,
    seq_len: int,
    logits_fn: Callable[..., torch.Tensor] | None = None,
) -> float:
    """Perplexity of ``model`` on a 1-D token stream ``ids``, over non-overlapping windows.

    ``logits_fn(model, window [1, T]) -> logits [1, T, V]`` adapts the call (default:
    ``model(window)``, or ``.logits`` of an HF output). Tokens predicted: ``T - 1`` per window.
    """
    total, count = 0.0, 0
    for start in range(0, ids.numel() - 1, seq_len):
        window = ids[start : start + seq_len].unsqueeze(0)
        if window.shape[1] < 2:
            break
        out = logits_fn(model, window) if logits_fn else model(window)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits[0, :-1].float(), window[0, 1:], reduction="sum")
        total += loss.item()
        count += window.shape[1] - 1
    return math.exp(total / count)


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity of matching rows of two ``[n, d]`` embedding matrices."""
    return F.cosine_similarity(a.float(), b.float(), dim=-1).mean().item()


# -- configuration tables (shared by `slipstream quant eval` and examples) --------------------

ConfigFactory = Callable[[str, int], QuantConfig | None]

EVAL_CONFIGS: dict[str, ConfigFactory] = {
    "fp32": lambda b, g: None,
    "w8a8-int": lambda b, g: W8A8Int(backend=b),  # type: ignore[arg-type]
    "w8a8-int-lorc8": lambda b, g: W8A8Int(backend=b, lorc_rank=8),  # type: ignore[arg-type]
    "w8a8-int-attn-float": lambda b, g: W8A8Int(backend=b, modes=HeroModes(attn_core=False)),  # type: ignore[arg-type]
    "w8a8-fp8": lambda b, g: W8A8FP8(),
    "w8a8-fp8-lorc8": lambda b, g: W8A8FP8(lorc_rank=8),
    "w8a8-fp8-e5m2": lambda b, g: W8A8FP8(act_format="e5m2"),
    "w4a8-int4": lambda b, g: W4A8Int4(backend=b, group_size=g),  # type: ignore[arg-type]
    "w4a8-int4-lorc8": lambda b, g: W4A8Int4(backend=b, group_size=g, lorc_rank=8),  # type: ignore[arg-type]
    "w4a8-fp4": lambda b, g: W4A8FP4(group_size=g),
    "w4a8-fp4-lorc8": lambda b, g: W4A8FP4(group_size=g, lorc_rank=8),
}
"""Named rows of an evaluation table: ``factory(int_backend, group_size) -> config`` (None =
the unquantized model). ``int_backend`` is ``"int_mm"`` (exact W8A8) or ``"fbgemm"`` (W7A8)."""


def eval_configs(
    names: list[str], int_backend: str = "int_mm", group_size: int = 64
) -> list[tuple[str, QuantConfig | None]]:
    """``[(name, config)]`` for ``names`` from :data:`EVAL_CONFIGS`.

    Raises ValueError naming an unknown entry and the valid ones.
    """
    unknown = [n for n in names if n not in EVAL_CONFIGS]
    if unknown:
        raise ValueError(
            f"unknown quantization config(s) {unknown}; choose from {', '.join(EVAL_CONFIGS)}"
        )
    return [(n, EVAL_CONFIGS[n](int_backend, group_size)) for n in names]


def _quantized_copy(model: nn.Module, config: QuantConfig | None) -> nn.Module:
    m = copy.deepcopy(model)
    return m if config is None else quantize_(m, config)


def perplexity_rows(
    model: nn.Module,
    ids: torch.Tensor,
    seq_len: int,
    configs: list[tuple[str, QuantConfig | None]],
) -> list[tuple[str, float, float]]:
    """``[(name, perplexity, seconds)]``: each config applied to a deep copy of ``model``.

    Memory: one extra copy of the model at a time.
    """
    rows = []
    for name, cfg in configs:
        m = _quantized_copy(model, cfg)
        t0 = time.perf_counter()
        rows.append((name, perplexity(m, ids, seq_len), time.perf_counter() - t0))
    return rows


def cosine_rows(
    model: nn.Module,
    embed: Callable[[nn.Module], torch.Tensor],
    configs: list[tuple[str, QuantConfig | None]],
) -> list[tuple[str, float, float]]:
    """``[(name, mean cosine, min cosine)]`` of ``embed(quantized) [n, d]`` to ``embed(model)``."""
    with torch.no_grad():
        ref = embed(model)
    rows = []
    for name, cfg in configs:
        with torch.no_grad():
            e = embed(_quantized_copy(model, cfg))
        cos = F.cosine_similarity(e.float(), ref.float(), dim=-1)
        rows.append((name, cos.mean().item(), cos.min().item()))
    return rows


def format_table(header: tuple[str, ...], rows: list[tuple[str, float, float]]) -> str:
    """A fixed-width text table: first column names, then numbers with 4 decimals."""
    width = max(len(header[0]), *(len(r[0]) for r in rows)) if rows else len(header[0])
    lines = [f"{header[0]:{width}s} " + " ".join(f"{h:>11s}" for h in header[1:])]
    lines += [f"{r[0]:{width}s} " + " ".join(f"{v:11.4f}" for v in r[1:]) for r in rows]
    return "\n".join(lines)
