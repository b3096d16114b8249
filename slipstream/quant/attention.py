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

Scales are *dynamic* by default (per-token Q/K, per-feature V over the current tokens: no
calibration, tightest error). With ``W8A8Int(attn_scales="static")`` they are the spec's
*static* scales (operator 1-2): one per head for Q and for K, one per (head, feature) for V,
recorded by :func:`~slipstream.quant.calibrate` as ``absmax / 127`` over the calibration
batches and stored as buffers of the attention module (so save/load keeps them). Values beyond
the calibrated range clamp. On a fused kernel static scales fold into the QKV GEMM epilogue
and need no row reductions; in eager PyTorch they save the max passes.
:class:`Int8Attention` puts the core into slipstream's GPT attention (the projections stay
whatever ``quantize_`` made them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from slipstream.models.gpt import Attention, CausalAttention, _apply_rope
from slipstream.models.kv_cache import LayerKV
from slipstream.quant._formats import int_absmax_scale, quantize_int, quantize_per_token
from slipstream.quant._gemm import int_mm

__all__ = [
    "SOFTMAX_QMAX",
    "AttnScales",
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

AttnScales = Literal["dynamic", "static"]


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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention ``softmax(q k^T / sqrt(D)) v`` with both products in INT8 (see module doc).

    Args:
        q: ``[..., T, D]`` float queries; k, v: ``[..., S, D]`` (same leading dims, e.g.
            ``[B, H]``; repeat grouped kv heads first).
        causal: mask key ``j`` for query ``i`` when ``j > i + (S - T)`` (the usual
            bottom-right alignment; ``S == T`` in a prefill).
        q_scale, k_scale: static scales broadcastable to ``[..., 1, 1]`` (e.g. ``[H, 1, 1]``,
            one per head); None = dynamic per token.
        v_scale: static scale broadcastable to ``[..., 1, D]`` (one per head and feature);
            None = dynamic per feature over the ``S`` tokens.

    Returns:
        ``[..., T, D]`` in ``q.dtype``. Cost: two int32 GEMMs per (batch, head) and an fp32
        ``[..., T, S]`` score matrix (no flash-style tiling).
    """
    t, s, d = q.shape[-2], k.shape[-2], q.shape[-1]
    q_q, s_q = _quantize_rows(q.float(), q_scale)
    k_q, s_k = _quantize_rows(k.float(), k_scale)
    scores = int8_bmm(q_q, k_q).float() * (s_q * s_k.transpose(-1, -2)) / math.sqrt(d)
    if causal:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).triu_(s - t + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    p_q = quantize_softmax(torch.softmax(scores, dim=-1))
    if v_scale is None:
        v_q, s_v = quantize_per_channel_tokens(v.float())
    else:
        v_q, s_v = quantize_int(v.float(), v_scale), v_scale
    out = int8_bmm(p_q, v_q.transpose(-1, -2).contiguous()).float() * (s_v / SOFTMAX_QMAX)
    return out.to(q.dtype)


def _quantize_rows(
    x: torch.Tensor, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if scale is None:
        return quantize_per_token(x)
    return quantize_int(x, scale), scale


_STATIC_BUFFERS = ("attn_q_absmax", "attn_k_absmax", "attn_v_absmax")


class Int8Attention(Attention):
    """slipstream GPT :class:`~slipstream.models.gpt.Attention` with the INT8 core.

    Installed by :func:`quantize_attention_` by switching the module's class in place, so the
    parameters, their names and the q/k/v/o projections (float or :class:`QuantLinear`) are
    untouched. Sequence-parallel attention and training dropout are not supported in INT8.

    With static scales (``scales == "static"``) the module holds the buffers
    ``attn_q_absmax [H]``, ``attn_k_absmax [H_kv]`` and ``attn_v_absmax [H_kv, D]`` (saved in
    ``state_dict``), filled by :func:`~slipstream.quant.calibrate`.
    """

    scales: AttnScales = "dynamic"
    takes_kv_cache = False  # the INT8 core attends causally over its input only
    observing: bool = False
    attn_q_absmax: torch.Tensor
    attn_k_absmax: torch.Tensor
    attn_v_absmax: torch.Tensor

    def use_scales(self, scales: AttnScales) -> None:
        """Select dynamic or static scales; static registers zeroed range buffers."""
        if scales not in ("dynamic", "static"):
            raise ValueError(f"attention scales={scales!r} is invalid; use 'dynamic' or 'static'")
        self.scales = scales
        if scales == "static":
            dev = next(iter(self.o_proj.state_dict().values())).device
            n_q = self.o_proj.in_features // self.head_dim
            n_kv = self.k_proj.out_features // self.head_dim
            self.register_buffer("attn_q_absmax", torch.zeros(n_q, device=dev))
            self.register_buffer("attn_k_absmax", torch.zeros(n_kv, device=dev))
            self.register_buffer("attn_v_absmax", torch.zeros(n_kv, self.head_dim, device=dev))

    def reset_ranges(self) -> None:
        """Zero the static ranges (start of a calibration)."""
        for name in _STATIC_BUFFERS:
            getattr(self, name).zero_()

    def _observe(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # q, k: [B, H, T, D] -> per-head max; v: [B, H_kv, T, D] -> per (head, feature) max.
        self.attn_q_absmax = torch.maximum(self.attn_q_absmax, q.abs().amax(dim=(0, 2, 3)))
        self.attn_k_absmax = torch.maximum(self.attn_k_absmax, k.abs().amax(dim=(0, 2, 3)))
        self.attn_v_absmax = torch.maximum(self.attn_v_absmax, v.abs().amax(dim=(0, 2)))

    def _static_scales(self, n_rep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not bool((self.attn_q_absmax > 0).any()):
            raise RuntimeError(
                "Int8Attention uses static scales (W8A8Int.attn_scales='static') but was never "
                "calibrated; run slipstream.quant.calibrate(model, batches) first, or use "
                "attn_scales='dynamic'"
            )
        s_q = int_absmax_scale(self.attn_q_absmax, 8).reshape(-1, 1, 1)
        s_k = int_absmax_scale(self.attn_k_absmax, 8).repeat_interleave(n_rep).reshape(-1, 1, 1)
        s_v = int_absmax_scale(self.attn_v_absmax, 8).repeat_interleave(n_rep, dim=0)
        return s_q, s_k, s_v.unsqueeze(1)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        if mask is not None or kv is not None:
            raise NotImplementedError(
                "the INT8 attention core has no KV-cache or padding-mask path; quantize with "
                "HeroModes(attn_core=False) to generate with a KV cache"
            )
        if not isinstance(self.core, CausalAttention):  # a sequence-parallel plan's core
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
        if self.observing:
            self._observe(q.detach().float(), k.detach().float(), v.detach().float())
        scales = (
            self._static_scales(n_rep) if self.scales == "static" and not self.observing else None
        )
        if n_rep > 1:  # GQA, as in the float module: kv head h serves query heads h*n_rep...
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        if scales is None:
            y = int8_attention(q, k, v, causal=True)
        else:
            s_q, s_k, s_v = scales
            y = int8_attention(q, k, v, causal=True, q_scale=s_q, k_scale=s_k, v_scale=s_v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


AttentionHandler = Callable[[nn.Module, AttnScales], None]
_ATTN_HANDLERS: dict[type, AttentionHandler] = {}


def register_attention_handler(
    module_type: type[nn.Module],
) -> Callable[[AttentionHandler], AttentionHandler]:
    """Decorator registering ``fn(module, scales)`` that puts an INT8 core (with ``"dynamic"`` or
    ``"static"`` scales) into ``module_type`` in place."""

    def deco(fn: AttentionHandler) -> AttentionHandler:
        _ATTN_HANDLERS[module_type] = fn
        return fn

    return deco


@register_attention_handler(Attention)
def _gpt_attention(mod: nn.Module, scales: AttnScales) -> None:
    mod.__class__ = Int8Attention
    assert isinstance(mod, Int8Attention)
    mod.use_scales(scales)


def quantize_attention_(model: nn.Module, scales: AttnScales = "dynamic") -> int:
    """Give every supported attention module of ``model`` the INT8 core, in place.

    ``scales="static"`` needs :func:`~slipstream.quant.calibrate` before the first forward.

    Supported: modules whose exact type has a registered handler (slipstream GPT
    ``Attention``). Returns the number converted; logs a warning when there were none.
    """
    n = 0
    for mod in model.modules():
        handler = _ATTN_HANDLERS.get(type(mod))
        if handler is not None:
            handler(mod, scales)
            n += 1
    if n == 0:
        logger.warning(
            "INT8 attention core requested but %s has no supported attention module (%s); "
            "attention stays in float",
            type(model).__name__,
            ", ".join(t.__name__ for t in _ATTN_HANDLERS),
        )
    return n
