"""LoRC: low-rank compensation of weight quantization error (ZeroQuant-V2, reused by
ZeroQuant-FP; spec sec. 2.2 "LoRC").

For ``E = W - W_hat = U S V^T`` keep the top ``rank`` singular triplets and split
``S^(1/2)`` between two factors. With PyTorch's ``W [N, K]`` layout (``y = x W^T``) the
correction is ``x E_r^T = (x A) B`` with ``A = V_r S_r^(1/2)`` [K, r] and
``B = S_r^(1/2) U_r^T`` [r, N]. By Eckart-Young, ``||E - (A B)^T||_F^2 = sum_{i>r} s_i^2``,
which is non-increasing in ``r``. Factors are kept in fp32 (the paper's optional 8-bit
factors are not implemented). Extra storage: ``r * (K + N)`` floats.
"""

from __future__ import annotations

import torch

__all__ = ["lorc_factors"]


def lorc_factors(error: torch.Tensor, rank: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors ``(A [K, r], B [r, N])`` with ``(A @ B).T ~= error [N, K]``.

    Raises:
        ValueError: ``rank`` is not in ``[1, min(N, K)]``.
    """
    n, k = error.shape
    if not 1 <= rank <= min(n, k):
        raise ValueError(
            f"LoRC rank={rank} must be in [1, min(out, in)={min(n, k)}] for a weight "
            f"[{n}, {k}]; lower lorc_rank or skip this module"
        )
    u, s, vh = torch.linalg.svd(error.double(), full_matrices=False)
    root = s[:rank].sqrt()
    a = (vh[:rank].t() * root).float()  # [K, r]
    b = (root.unsqueeze(1) * u[:, :rank].t()).float()  # [r, N]
    return a, b
