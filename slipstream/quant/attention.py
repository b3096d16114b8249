"""ZeroQuant-HERO's INT8 attention core (arXiv 2310.17723; spec sec. 1.2, operator 2).

For one head with ``q, k [T, D]`` and ``v [S, D]`` (float), :func:`int8_attention` computes

1. ``Q_q, s_q = per-token(q)`` and ``K_q, s_k = per-token(k)`` (int8, one scale per row);
2. ``S = (Q_q K_q^T)`` as a real int8 x int8 -> int32 product (``torch._int_mm``), then in fp32
   ``S * s_q[i] * s_k[j] / sqrt(D)`` (rule R1: a row scale times a column scale);
3. causal mask and softmax in fp32;
4. ``P_q = round(127 * P)`` in [0, 127] — the fixed scale 1/127, no calibration (spec sec. 1.3;
   P >= 0, so the codes use the non-negative half of int8);
5. ``V_q, s_v = per-channel(v)`` (one scale per feature, over the tokens);
6. ``O = (P_q V_q)`` as int8 x int8 -> int32, then ``O * (1/127) * s_v[d]`` (a column scale,
   R1 again), cast back to the input dtype.

The spec plans *static* per-head Q/K and per-feature V scales from calibration; this core uses
dynamic per-token / per-channel scales instead (no calibration, tighter error). On a fused
kernel these row maxima come for free from the QKV GEMM epilogue; in eager PyTorch they are
extra passes. :class:`Int8Attention` puts the core into slipstream's GPT attention (the
projections stay whatever ``quantize_`` made them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from slipstream.models.gpt import Attention, _apply_rope
from slipstream.quant._formats import int_absmax_scale, quantize_int, quantize_per_token
from slipstream.quant._gemm import int_mm

__all__ = [
    "SOFTMAX_QMAX",
    "Int8Attention",
    "int8_attention",
    "int8_bmm",
    "quantize_attention_",
    "quantize_softmax",
    "register_attention_handler",
]

logger = logging.getLogger(__name__)

SOFTMAX_QMAX = 127
"""Softmax probabilities are stored as ``round(127 * P)``: the fixed scale 1/127."""


def int8_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [..., M, K] int8 @ b[..., N, K]^T int8 -> int32 [..., M, N]``, exact.

    ``torch._int_mm`` is 2-D only, so the leading (batch x head) dims are looped over; each
    product is the same exact-int32 GEMM that :class:`~slipstream.quant.QuantLinear` uses.
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_bmm needs int8 operands, got {a.dtype} and {b.dtype}")
    if a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"int8_bmm shapes {tuple(a.shape)} and {tuple(b.shape)} do not match: need "
            "[..., M, K] and [..., N, K] with the same leading dims"
        )
    lead = a.shape[:-2]
    a3 = a.reshape(-1, *a.shape[-2:])
    b3 = b.reshape(-1, *b.shape[-2:])
    out = torch.stack([int_mm(a3[g].contiguous(), b3[g].contiguous()) for g in range(a3.shape[0])])
    return out.reshape(*lead, a.shape[-2], b.shape[-2])


def quantize_softmax(p: torch.Tensor) -> torch.Tensor:
    """``round(127 * p)`` as int8 in [0, 127] for probabilities ``p`` in [0, 1] (RNE)."""
    return torch.round(p.float() * SOFTMAX_QMAX).clamp_(0, SOFTMAX_QMAX).to(torch.int8)


def quantize_per_channel_tokens(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature quantization of ``v [..., S, D]`` over its tokens: ``(q int8, s [..., 1, D])``."""
    scale = int_absmax_scale(v.detach().abs().amax(dim=-2, keepdim=True), 8)
    return quantize_int(v, scale), scale


def int8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True
) -> torch.Tensor:
    """Attention ``softmax(q k^T / sqrt(D)) v`` with both products in INT8 (see module doc).

    Args:
        q: ``[..., T, D]`` float queries; k, v: ``[..., S, D]`` (same leading dims, e.g.
            ``[B, H]``; repeat grouped kv heads first).
        causal: mask key ``j`` for query ``i`` when ``j > i + (S - T)`` (the usual
            bottom-right alignment; ``S == T`` in a prefill).

    Returns:
        ``[..., T, D]`` in ``q.dtype``. Cost: two int32 GEMMs per (batch, head) and an fp32
        ``[..., T, S]`` score matrix (no flash-style tiling).
    """
    t, s, d = q.shape[-2], k.shape[-2], q.shape[-1]
    q_q, s_q = quantize_per_token(q.float())
    k_q, s_k = quantize_per_token(k.float())
    scores = int8_bmm(q_q, k_q).float() * (s_q * s_k.transpose(-1, -2)) / math.sqrt(d)
    if causal:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).triu_(s - t + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    p_q = quantize_softmax(torch.softmax(scores, dim=-1))
    v_q, s_v = quantize_per_channel_tokens(v.float())
    out = int8_bmm(p_q, v_q.transpose(-1, -2).contiguous()).float() * (s_v / SOFTMAX_QMAX)
    return out.to(q.dtype)


class Int8Attention(Attention):
    """slipstream GPT :class:`~slipstream.models.gpt.Attention` with the INT8 core.

    Installed by :func:`quantize_attention_` by switching the module's class in place, so the
    parameters, their names and the q/k/v/o projections (float or :class:`QuantLinear`) are
    untouched. Sequence-parallel attention and training dropout are not supported in INT8.
    """

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.sp_group is not None:
            raise NotImplementedError(
                "the INT8 attention core does not support sequence-parallel attention; quantize "
                "with HeroModes(attn_core=False) or run without a sequence-parallel group"
            )
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # GQA, as in the float module: kv head h serves query heads h*n_rep...
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        y = int8_attention(q, k, v, causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


AttentionHandler = Callable[[nn.Module], None]
_ATTN_HANDLERS: dict[type, AttentionHandler] = {}


def register_attention_handler(
    module_type: type[nn.Module],
) -> Callable[[AttentionHandler], AttentionHandler]:
    """Decorator registering ``fn(module)`` that puts an INT8 core into ``module_type`` in place."""

    def deco(fn: AttentionHandler) -> AttentionHandler:
        _ATTN_HANDLERS[module_type] = fn
        return fn

    return deco


@register_attention_handler(Attention)
def _gpt_attention(mod: nn.Module) -> None:
    mod.__class__ = Int8Attention


def quantize_attention_(model: nn.Module) -> int:
    """Give every supported attention module of ``model`` the INT8 core, in place.

    Supported: modules whose exact type has a registered handler (slipstream GPT
    ``Attention``). Returns the number converted; logs a warning when there were none.
    """
    n = 0
    for mod in model.modules():
        handler = _ATTN_HANDLERS.get(type(mod))
        if handler is not None:
            handler(mod)
            n += 1
    if n == 0:
        logger.warning(
            "INT8 attention core requested but %s has no supported attention module (%s); "
            "attention stays in float",
            type(model).__name__,
            ", ".join(t.__name__ for t in _ATTN_HANDLERS),
        )
    return n
