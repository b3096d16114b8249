"""Evoformer modules: tiled kernel == naive path == the AF2 formulas written out with einsum."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from slipstream.science import evoformer as evo
from slipstream.science.attention import evoformer_attention
from slipstream.science.evoformer import (
    GatedAttention,
    MSAColumnAttention,
    MSARowAttentionWithPairBias,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    mask_to_bias,
)

B, S, R, C_M, C_Z, H, C = 2, 5, 19, 16, 8, 2, 4


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    # Tiles smaller than S and R so the modules exercise several query, key and N tiles.
    monkeypatch.setattr(
        evo,
        "evoformer_attention",
        functools.partial(evoformer_attention, q_tile=4, kv_tile=6, n_tile=2),
    )


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # One-hot MSA (21 residue types) projected to c_m, like AF2's MSA embedding.
    tokens = torch.randint(0, 21, (B, S, R), generator=g)
    embed = torch.randn(21, C_M, generator=g, dtype=torch.float64)
    m = nn.functional.one_hot(tokens, 21).double() @ embed
    z = torch.randn(B, R, R, C_Z, generator=g, dtype=torch.float64)
    msa_mask = (torch.rand(B, S, R, generator=g) > 0.2).double()
    pair_mask = (torch.rand(B, R, R, generator=g) > 0.2).double()
    return m, z, msa_mask, pair_mask


def _gated_out(mha: GatedAttention, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return mha.linear_o(torch.sigmoid(mha.linear_g(x)) * o.flatten(-2))


def _heads(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x).unflatten(-1, (H, C))


def _bias(mask: torch.Tensor) -> torch.Tensor:
    return (mask - 1) * 1e9


def naive_row(
    mod: MSARowAttentionWithPairBias, m: torch.Tensor, z: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """AF2 Alg. 7: a[s,h,i,j] = softmax_j(q_si.k_sj/sqrt(c) + b_ij^h + mask_bias_sj)."""
    x = mod.layer_norm_m(m)
    q, k, v = (_heads(lin, x) for lin in (mod.mha.linear_q, mod.mha.linear_k, mod.mha.linear_v))
    b = mod.linear_z(mod.layer_norm_z(z))  # [B, i, j, H]
    logits = torch.einsum("bsihd,bsjhd->bshij", q, k) / math.sqrt(C)
    logits = logits + b.permute(0, 3, 1, 2)[:, None] + _bias(mask)[:, :, None, None, :]
    o = torch.einsum("bshij,bsjhd->bsihd", logits.softmax(-1), v)
    return _gated_out(mod.mha, x, o)


def naive_column(mod: MSAColumnAttention, m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """AF2 Alg. 8: a[i,h,s,t] = softmax_t(q_si.k_ti/sqrt(c) + mask_bias_ti)."""
    x = mod.layer_norm_m(m)
    q, k, v = (_heads(lin, x) for lin in (mod.mha.linear_q, mod.mha.linear_k, mod.mha.linear_v))
    logits = torch.einsum("bsihd,btihd->bihst", q, k) / math.sqrt(C)
    logits = logits + _bias(mask).transpose(1, 2)[:, :, None, None, :]
    o = torch.einsum("bihst,btihd->bsihd", logits.softmax(-1), v)
    return _gated_out(mod.mha, x, o)


def naive_triangle(
    mod: nn.Module, z: torch.Tensor, mask: torch.Tensor, starting: bool
) -> torch.Tensor:
    """AF2 Alg. 13 (starting: over k of (i,k), bias b_jk) and 14 (ending: over k of (k,j), bias b_ki)."""
    x = mod.layer_norm(z)
    q, k, v = (_heads(lin, x) for lin in (mod.mha.linear_q, mod.mha.linear_k, mod.mha.linear_v))
    b = mod.linear(x)  # [B, r1, r2, H]
    if starting:
        logits = torch.einsum("bijhd,bikhd->bihjk", q, k) / math.sqrt(C)
        logits = logits + b.permute(0, 3, 1, 2)[:, None] + _bias(mask)[:, :, None, None, :]
        o = torch.einsum("bihjk,bikhd->bijhd", logits.softmax(-1), v)
    else:
        logits = torch.einsum("bijhd,bkjhd->bjhik", q, k) / math.sqrt(C)
        bias_ki = b.permute(0, 3, 2, 1)  # [B, H, i, k] = b[k, i]
        logits = logits + bias_ki[:, None] + _bias(mask).transpose(1, 2)[:, :, None, None, :]
        o = torch.einsum("bjhik,bkjhd->bijhd", logits.softmax(-1), v)
    return _gated_out(mod.mha, x, o)


def _check(mod: nn.Module, inputs: list[torch.Tensor], run, reference: torch.Tensor) -> None:
    """Kernel and naive paths: same output (and = reference), same grads for inputs and params."""
    params = list(mod.parameters())
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    results = []
    for use_kernel in (True, False):
        out = run(*leaves, use_memory_efficient_kernel=use_kernel)
        grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        results.append((out, torch.autograd.grad(out, leaves + params, grad)))
    (out_k, grads_k), (out_n, grads_n) = results

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        # Denominator floored at 1e-2 (absolute error <= 1e-12): some gradients are exactly 0
        # in exact arithmetic (LayerNorm-z's bias shifts a whole row of logits, which softmax
        # ignores) and only rounding noise here.
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-2)).item()

    assert rel(out_n, reference) < 1e-10
    assert rel(out_k, out_n) < 1e-10
    for gk, gn in zip(grads_k, grads_n):
        assert rel(gk, gn) < 1e-10


def _randomize(mod: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.5)
    return mod.double()


def test_msa_row_attention_with_pair_bias_matches_naive_and_af2_formula() -> None:
    """Row attention with pair bias: kernel == naive == Alg. 7 (outputs and all gradients)."""
    m, z, msa_mask, _ = _inputs()
    mod = _randomize(MSARowAttentionWithPairBias(C_M, C_Z, C, H))
    ref = naive_row(mod, m, z, msa_mask)
    _check(mod, [m, z], lambda m, z, **kw: mod(m, z, msa_mask, **kw), ref)


def test_msa_column_attention_matches_naive_and_af2_formula() -> None:
    """Column attention: kernel == naive == Alg. 8 (mask laid out as [B, N_res, 1, 1, N_seq])."""
    m, _, msa_mask, _ = _inputs()
    mod = _randomize(MSAColumnAttention(C_M, C, H))
    ref = naive_column(mod, m, msa_mask)
    _check(mod, [m], lambda m, **kw: mod(m, msa_mask, **kw), ref)


@pytest.mark.parametrize("starting", [True, False])
def test_triangle_attention_matches_naive_and_af2_formula(starting) -> None:
    """Triangle attention, starting and ending node: kernel == naive == Alg. 13/14."""
    _, z, _, pair_mask = _inputs()
    cls = TriangleAttentionStartingNode if starting else TriangleAttentionEndingNode
    mod = _randomize(cls(C_Z, C, H))
    ref = naive_triangle(mod, z, pair_mask, starting)
    _check(mod, [z], lambda z, **kw: mod(z, pair_mask, **kw), ref)


def test_modules_accept_no_mask_and_default_switch() -> None:
    """mask=None works; the constructor's use_memory_efficient_kernel is the forward default."""
    m, z, _, _ = _inputs()
    fast = _randomize(MSARowAttentionWithPairBias(C_M, C_Z, C, H))
    slow = _randomize(
        MSARowAttentionWithPairBias(C_M, C_Z, C, H, use_memory_efficient_kernel=False)
    )
    torch.testing.assert_close(fast(m, z), slow(m, z), rtol=1e-10, atol=1e-12)


def test_af2_init_makes_the_update_zero() -> None:
    """af2_init_ zeroes the output projection (AF2 starts each block as the identity)."""
    mod = MSAColumnAttention(C_M, C, H)
    mod.mha.af2_init_()
    m, _, _, _ = _inputs()
    assert mod(m.float()).abs().max().item() == 0.0
    assert torch.all(mod.mha.linear_g.bias == 1)


def test_mask_to_bias_is_finite_in_fp16() -> None:
    """OpenFold's -1e9 would overflow fp16 to -inf; the bias is capped and stays finite."""
    mask = torch.tensor([[[1.0, 0.0]]])
    bias = mask_to_bias(mask, torch.float16)
    assert bias.shape == (1, 1, 1, 1, 2)
    assert bias[..., 0].item() == 0 and torch.isfinite(bias).all() and bias[..., 1].item() < -1e4
    assert mask_to_bias(mask, torch.float32)[..., 1].item() == -1e9


def test_wrong_mask_shape_is_reported_with_expected_layout() -> None:
    """A column-attention mask given as [B, R, S] instead of [B, S, R] fails with the kernel's shape error."""
    m, _, msa_mask, _ = _inputs()
    mod = MSAColumnAttention(C_M, C, H).double()
    with pytest.raises(
        ValueError, match=r"mask bias\) has shape \[2, 5, 1, 1, 19\]; expected \[B, N, 1, 1, L\]"
    ):
        mod(m, msa_mask.transpose(1, 2))
