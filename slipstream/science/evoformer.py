"""Evoformer attention modules (AlphaFold2 / OpenFold) on :func:`evoformer_attention`.

AlphaFold2 (Jumper et al. 2021, supplement sec. 1.6) attends in four ways inside each
Evoformer block, all gated multi-head attention (supplement Algorithm 7 pattern: LayerNorm,
q/k/v projections without bias, a sigmoid gate, an output projection):

* :class:`MSARowAttentionWithPairBias` (Algorithm 7): along residues within each MSA row,
  biased by a per-head projection of the pair representation;
* :class:`MSAColumnAttention` (Algorithm 8): along sequences within each MSA column;
* :class:`TriangleAttention` (Algorithms 13 and 14), starting or ending node: along one
  axis of the pair representation, biased by the pair representation itself.

Every module maps its problem onto the kernel's [B, N, L, H, D] layout (N = the axis
attended *within*, L = the axis attended *over*) and computes either with the tiled kernel
(``use_memory_efficient_kernel=True``, the default) or the naive formula (False); both give
the same result (tests pin parity to 1e-10 in fp64). Modules return the update only: the
caller adds the residual and applies AF2's row/column-wise dropout.

Masks are 0/1 (or bool) over positions, turned into the additive bias
``inf * (mask - 1)`` with OpenFold's inf = 1e9 (capped for fp16).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from slipstream.science.attention import evoformer_attention, evoformer_attention_reference

__all__ = [
    "GatedAttention",
    "MSAColumnAttention",
    "MSARowAttentionWithPairBias",
    "TriangleAttention",
    "TriangleAttentionEndingNode",
    "TriangleAttentionStartingNode",
    "mask_to_bias",
]

MASK_INF = 1e9
"""Magnitude of the additive mask bias (OpenFold's convention)."""


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, N, L] 0/1 mask -> [B, N, 1, 1, L] additive bias: 0 where 1, -1e9 where 0.

    The magnitude is capped at half the dtype's max (fp16: ~3.3e4), still far below any
    logit, so the bias stays finite.
    """
    inf = min(MASK_INF, torch.finfo(dtype).max / 2)
    return ((mask.to(dtype) - 1) * inf)[:, :, None, None, :]


class GatedAttention(nn.Module):
    """Gated multi-head attention over the L axis of x [B, N, L, c_in].

    ``o = W_o concat_h(sigmoid(W_g x + b_g)_h * attention_h(W_q x, W_k x, W_v x, biases))
    + b_o`` with q/k/v projections without bias (AF2 supplement Algorithm 7, lines 1-6).

    Args:
        c_in: input and output channels.
        c_hidden: per-head width D.
        num_heads: H.
        use_memory_efficient_kernel: default for ``forward``: the tiled kernel (True) or the
            naive formula (False).
    """

    def __init__(
        self, c_in: int, c_hidden: int, num_heads: int, use_memory_efficient_kernel: bool = True
    ) -> None:
        super().__init__()
        for name, value in (("c_in", c_in), ("c_hidden", c_hidden), ("num_heads", num_heads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GatedAttention: {name}={value!r} must be an int >= 1")
        self.c_hidden, self.num_heads = c_hidden, num_heads
        self.use_memory_efficient_kernel = use_memory_efficient_kernel
        width = c_hidden * num_heads
        self.linear_q = nn.Linear(c_in, width, bias=False)
        self.linear_k = nn.Linear(c_in, width, bias=False)
        self.linear_v = nn.Linear(c_in, width, bias=False)
        self.linear_g = nn.Linear(c_in, width)
        self.linear_o = nn.Linear(width, c_in)

    @torch.no_grad()
    def af2_init_(self) -> GatedAttention:
        """AlphaFold2's initialisation: gate weights 0 and bias 1 (gates open at 0.73),
        output projection 0 (the block starts as the identity). Returns self."""
        nn.init.zeros_(self.linear_g.weight)
        nn.init.ones_(self.linear_g.bias)
        nn.init.zeros_(self.linear_o.weight)
        nn.init.zeros_(self.linear_o.bias)
        return self

    def forward(
        self,
        x: torch.Tensor,
        biases: Sequence[torch.Tensor | None] = (),
        use_memory_efficient_kernel: bool | None = None,
    ) -> torch.Tensor:
        """Attend over dim -2 of ``x`` [B, N, L, c_in]; returns [B, N, L, c_in].

        ``biases`` as for :func:`evoformer_attention`: [mask [B, N, 1, 1, L], pair
        [B, 1, H, L, L]]. ``use_memory_efficient_kernel`` overrides the module default.
        """
        if x.dim() != 4:
            raise ValueError(
                f"GatedAttention: x has shape {list(x.shape)}; expected [B, N, L, c_in]"
            )
        b, n, length, _ = x.shape
        heads = (b, n, length, self.num_heads, self.c_hidden)
        q = self.linear_q(x).view(heads)
        k = self.linear_k(x).view(heads)
        v = self.linear_v(x).view(heads)
        use_kernel = self.use_memory_efficient_kernel
        if use_memory_efficient_kernel is not None:
            use_kernel = use_memory_efficient_kernel
        attend = evoformer_attention if use_kernel else evoformer_attention_reference
        o = attend(q, k, v, list(biases)).reshape(b, n, length, -1)
        return self.linear_o(torch.sigmoid(self.linear_g(x)) * o)


class MSARowAttentionWithPairBias(nn.Module):
    """MSA row-wise gated self-attention with pair bias (AF2 supplement Algorithm 7).

    For each sequence s, residue i attends over residues j with logits
    ``q_si . k_sj / sqrt(c) + b_ij^h + mask_bias_sj``, ``b^h = W_b LayerNorm(z)``.
    Kernel layout: N = sequences, L = residues.
    """

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden: int = 32,
        num_heads: int = 8,
        use_memory_efficient_kernel: bool = True,
    ) -> None:
        super().__init__()
        self.layer_norm_m = nn.LayerNorm(c_m)
        self.layer_norm_z = nn.LayerNorm(c_z)
        self.linear_z = nn.Linear(c_z, num_heads, bias=False)
        self.mha = GatedAttention(c_m, c_hidden, num_heads, use_memory_efficient_kernel)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        mask: torch.Tensor | None = None,
        use_memory_efficient_kernel: bool | None = None,
    ) -> torch.Tensor:
        """``m`` [B, S, R, c_m], ``z`` [B, R, R, c_z], ``mask`` [B, S, R] -> [B, S, R, c_m]."""
        m_hat = self.layer_norm_m(m)
        pair = self.linear_z(self.layer_norm_z(z)).permute(0, 3, 1, 2).unsqueeze(1)
        mask_bias = None if mask is None else mask_to_bias(mask, m_hat.dtype)
        return self.mha(m_hat, [mask_bias, pair], use_memory_efficient_kernel)


class MSAColumnAttention(nn.Module):
    """MSA column-wise gated self-attention (AF2 supplement Algorithm 8).

    For each residue i, sequence s attends over sequences t. Kernel layout: N = residues,
    L = sequences (the MSA transposed), so the mask bias is [B, N_res, 1, 1, N_seq].
    """

    def __init__(
        self,
        c_m: int,
        c_hidden: int = 32,
        num_heads: int = 8,
        use_memory_efficient_kernel: bool = True,
    ) -> None:
        super().__init__()
        self.layer_norm_m = nn.LayerNorm(c_m)
        self.mha = GatedAttention(c_m, c_hidden, num_heads, use_memory_efficient_kernel)

    def forward(
        self,
        m: torch.Tensor,
        mask: torch.Tensor | None = None,
        use_memory_efficient_kernel: bool | None = None,
    ) -> torch.Tensor:
        """``m`` [B, S, R, c_m], ``mask`` [B, S, R] -> [B, S, R, c_m]."""
        m_t = self.layer_norm_m(m.transpose(1, 2))
        mask_bias = None if mask is None else mask_to_bias(mask.transpose(1, 2), m_t.dtype)
        return self.mha(m_t, [mask_bias], use_memory_efficient_kernel).transpose(1, 2)


class TriangleAttention(nn.Module):
    """Triangle gated self-attention around the starting or ending node (AF2 Alg. 13/14).

    Starting node: edge (i, j) attends over edges (i, k) with bias ``b_jk^h = W z_jk`` and
    mask over (i, k). Ending node: edge (i, j) attends over edges (k, j) with bias
    ``b_ki^h``; computed as the starting node on the transposed pair representation.
    Kernel layout: N = the fixed node i, L = the attended node k.
    """

    def __init__(
        self,
        c_z: int,
        c_hidden: int = 32,
        num_heads: int = 4,
        starting: bool = True,
        use_memory_efficient_kernel: bool = True,
    ) -> None:
        super().__init__()
        self.starting = starting
        self.layer_norm = nn.LayerNorm(c_z)
        self.linear = nn.Linear(c_z, num_heads, bias=False)
        self.mha = GatedAttention(c_z, c_hidden, num_heads, use_memory_efficient_kernel)

    def forward(
        self,
        z: torch.Tensor,
        mask: torch.Tensor | None = None,
        use_memory_efficient_kernel: bool | None = None,
    ) -> torch.Tensor:
        """``z`` [B, R, R, c_z], ``mask`` [B, R, R] -> [B, R, R, c_z]."""
        if not self.starting:
            z = z.transpose(1, 2)
            mask = None if mask is None else mask.transpose(1, 2)
        z_hat = self.layer_norm(z)
        tri = self.linear(z_hat).permute(0, 3, 1, 2).unsqueeze(1)  # [B, 1, H, R, R]
        mask_bias = None if mask is None else mask_to_bias(mask, z_hat.dtype)
        out = self.mha(z_hat, [mask_bias, tri], use_memory_efficient_kernel)
        return out if self.starting else out.transpose(1, 2)


class TriangleAttentionStartingNode(TriangleAttention):
    """:class:`TriangleAttention` around the starting node (AF2 Algorithm 13)."""

    def __init__(
        self,
        c_z: int,
        c_hidden: int = 32,
        num_heads: int = 4,
        use_memory_efficient_kernel: bool = True,
    ) -> None:
        super().__init__(c_z, c_hidden, num_heads, True, use_memory_efficient_kernel)


class TriangleAttentionEndingNode(TriangleAttention):
    """:class:`TriangleAttention` around the ending node (AF2 Algorithm 14)."""

    def __init__(
        self,
        c_z: int,
        c_hidden: int = 32,
        num_heads: int = 4,
        use_memory_efficient_kernel: bool = True,
    ) -> None:
        super().__init__(c_z, c_hidden, num_heads, False, use_memory_efficient_kernel)
