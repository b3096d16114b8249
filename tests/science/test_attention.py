"""evoformer_attention: parity with the naive formula (outputs and every gradient), masks, errors."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.science import (
    DS4Sci_EvoformerAttention,
    evoformer_attention,
    evoformer_attention_reference,
)

# Documented tolerances (docs/evoformer.md): max |tiled - fp64 reference| / max |reference|,
# the reference computed in fp64 from the same low-precision inputs.
LOW_PRECISION_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _make(
    shape: tuple[int, ...],
    mask_shape: tuple[int, ...] | None,
    pair_shape: tuple[int, ...] | None,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def leaf(s: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    qkv = [leaf(shape) for _ in range(3)]
    biases = [None if s is None else leaf(s) for s in (mask_shape, pair_shape)]
    return qkv, biases, torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, inputs, grad))


@pytest.mark.parametrize(
    ("shape", "tiles"),
    [
        ((1, 4, 33, 2, 8), (8, 5, 3)),  # L not divisible by any tile
        ((2, 3, 48, 4, 16), (16, 16, 2)),
        ((2, 3, 40, 2, 8), (64, 64, 8)),  # tiles larger than L and N: one tile
        ((1, 2, 5, 3, 4), (2, 3, 1)),  # L <= 16 (DeepSpeed's kernel needs L > 16)
    ],
)
def test_fp64_output_and_all_gradients_match_naive_within_1e10(shape, tiles) -> None:
    """fp64: O, dQ, dK, dV, dmask and dpair equal the naive formula to 1e-10 relative."""
    b, n, length, h, _ = shape
    qkv, biases, grad = _make(shape, (b, n, 1, 1, length), (b, 1, h, length, length))
    inputs = [*qkv, *biases]
    q_tile, kv_tile, n_tile = tiles
    out = evoformer_attention(*qkv, biases, q_tile=q_tile, kv_tile=kv_tile, n_tile=n_tile)
    ref = evoformer_attention_reference(*qkv, biases)
    assert out.shape == shape and out.dtype == torch.float64
    assert _rel(out, ref) < 1e-10
    for name, got, want in zip(
        ("q", "k", "v", "mask", "pair"), _grads(out, inputs, grad), _grads(ref, inputs, grad)
    ):
        assert got.shape == want.shape, name
        assert _rel(got, want) < 1e-10, name


@pytest.mark.parametrize(
    ("mask_shape", "pair_shape"),
    [
        ((1, 3, 1, 1, 20), (1, 1, 1, 20, 20)),  # batch-broadcast mask, head-broadcast pair bias
        ((2, 1, 1, 1, 20), None),  # mask broadcast over N, no pair bias
        (None, (2, 1, 2, 20, 20)),  # pair bias only
        (None, None),
    ],
)
def test_broadcast_biases_get_gradients_summed_over_broadcast_axes(mask_shape, pair_shape) -> None:
    """Biases broadcast over B, N or H: gradients keep the bias shape and match naive."""
    qkv, biases, grad = _make((2, 3, 20, 2, 8), mask_shape, pair_shape)
    inputs = [*qkv, *(x for x in biases if x is not None)]
    out = evoformer_attention(*qkv, biases, q_tile=6, kv_tile=7, n_tile=2)
    ref = evoformer_attention_reference(*qkv, biases)
    assert _rel(out, ref) < 1e-10
    for got, want, x in zip(_grads(out, inputs, grad), _grads(ref, inputs, grad), inputs):
        assert got.shape == x.shape
        assert _rel(got, want) < 1e-10


def test_gradcheck_fp64() -> None:
    """torch.autograd.gradcheck on Q, K, V and both biases (tiny shape, several tiles)."""
    qkv, biases, _ = _make((1, 2, 6, 2, 4), (1, 2, 1, 1, 6), (1, 1, 2, 6, 6))

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        return evoformer_attention(*xs[:3], list(xs[3:]), q_tile=4, kv_tile=3, n_tile=1)

    assert torch.autograd.gradcheck(fn, (*qkv, *biases), fast_mode=True)


def test_bias_without_requires_grad_gets_no_gradient() -> None:
    """A bias with requires_grad=False gets None; the others still get gradients."""
    qkv, biases, grad = _make((1, 2, 18, 2, 4), (1, 2, 1, 1, 18), (1, 1, 2, 18, 18))
    mask = biases[0].detach()  # type: ignore[union-attr]
    evoformer_attention(*qkv, [mask, biases[1]], q_tile=8, kv_tile=8).backward(grad)
    assert mask.grad is None
    assert biases[1] is not None and biases[1].grad is not None
    assert all(x.grad is not None for x in qkv)


def test_rows_masked_with_minus_inf_give_zero_output_and_no_nan() -> None:
    """Queries whose every key is -inf: output 0 and zero gradients; other rows as naive."""
    b, n, length, h, d = 1, 3, 24, 2, 8
    qkv, biases, grad = _make((b, n, length, h, d), (b, n, 1, 1, length), (b, 1, h, length, length))
    mask, pair = (x.detach().clone() for x in biases)  # type: ignore[union-attr]
    mask[:, 1] = -math.inf  # sequence 1: every key masked for every query
    pair[:, :, 0, 5] = -math.inf  # head 0, query 5: every key masked (all sequences)
    mask[:, 2, ..., : length // 2] = -math.inf  # sequence 2: first key tiles fully masked
    mask.requires_grad_()
    pair.requires_grad_()
    dead = torch.zeros(b, n, length, h, dtype=torch.bool)
    dead[:, 1] = True
    dead[:, :, 5, 0] = True

    inputs = [*qkv, mask, pair]
    out = evoformer_attention(*qkv, [mask, pair], q_tile=5, kv_tile=6, n_tile=2)
    grads = _grads(out, inputs, grad)
    assert not any(torch.isnan(t).any() for t in (out, *grads))
    assert (out[dead] == 0).all()

    # Reference: -inf -> a finite huge negative (same probabilities elsewhere), and the dead
    # rows contribute no gradient (their upstream gradient zeroed, as our definition implies).
    ref_in = [x.detach().clone().requires_grad_() for x in inputs]
    finite = [ref_in[3].clamp(min=-1e300), ref_in[4].clamp(min=-1e300)]
    ref = evoformer_attention_reference(*ref_in[:3], finite)
    ref_grads = _grads(ref, ref_in, grad.masked_fill(dead.unsqueeze(-1), 0.0))
    assert _rel(out[~dead], ref[~dead]) < 1e-10
    for name, got, want in zip(("q", "k", "v", "mask", "pair"), grads, ref_grads):
        assert _rel(got, want) < 1e-10, name
    assert (grads[0][dead] == 0).all()


def test_finite_mask_fully_masked_row_is_uniform_average_like_naive() -> None:
    """OpenFold's finite -1e9 mask over a whole row: no NaN, same as naive (fp32)."""
    qkv, _, _ = _make((1, 2, 20, 2, 8), None, None, dtype=torch.float32)
    mask = torch.zeros(1, 2, 1, 1, 20)
    mask[:, 0] = -1e9
    out = evoformer_attention(*qkv, [mask], q_tile=8, kv_tile=8)
    ref = evoformer_attention_reference(*qkv, [mask])
    assert not torch.isnan(out).any()
    assert _rel(out, ref) < 1e-5
    uniform = qkv[2][:, 0].mean(dim=1, keepdim=True).expand(-1, 20, -1, -1)
    torch.testing.assert_close(out[:, 0], uniform, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_within_documented_tolerance(dtype) -> None:
    """bf16/fp16/fp32 outputs and gradients within LOW_PRECISION_TOL of fp64, in the input dtype."""
    shape = (2, 3, 40, 4, 16)
    qkv, biases, grad = _make(shape, (2, 3, 1, 1, 40), (2, 1, 4, 40, 40), dtype=dtype)
    inputs = [*qkv, *biases]
    out = evoformer_attention(*qkv, biases, q_tile=16, kv_tile=12, n_tile=2)
    grads = _grads(out, inputs, grad)
    wide = [x.detach().double().requires_grad_() for x in inputs]
    ref = evoformer_attention_reference(*wide[:3], wide[3:])
    ref_grads = _grads(ref, wide, grad.double())
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    tol = LOW_PRECISION_TOL[dtype]
    assert _rel(out, ref) < tol
    for name, got, want in zip(("q", "k", "v", "mask", "pair"), grads, ref_grads):
        assert _rel(got, want) < tol, name


def test_deepspeed_name_is_the_same_function() -> None:
    """DS4Sci_EvoformerAttention is a drop-in alias of evoformer_attention."""
    assert DS4Sci_EvoformerAttention is evoformer_attention


def test_no_grad_forward_matches() -> None:
    """Inference (no autograd) gives the same output."""
    qkv, biases, _ = _make((1, 2, 17, 2, 4), (1, 2, 1, 1, 17), (1, 1, 2, 17, 17))
    with torch.no_grad():
        out = evoformer_attention(*qkv, biases, q_tile=4, kv_tile=4)
    assert _rel(out, evoformer_attention_reference(*qkv, biases)) < 1e-10


def _qkv(shape: tuple[int, ...] = (2, 3, 8, 2, 4), dtype: torch.dtype = torch.float32):
    return [torch.randn(shape, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t: (t[0][0], t[1][0], t[2][0], None), r"q has shape \[3, 8, 2, 4\] \(4-D\); expected 5-D \[B, N, L, H, D\]"),
        (lambda t: (t[0], t[1][:, :, :7], t[2], None), r"k has shape \[2, 3, 7, 2, 4\]; expected the shape of q, \[2, 3, 8, 2, 4\]"),
        (lambda t: (t[0], t[1], t[2].double(), None), r"v is torch.float64 on cpu but q is torch.float32"),
        (lambda t: (t[0].int(), t[1].int(), t[2].int(), None), r"q has dtype torch.int32; supported dtypes are float16"),
        (lambda t: (*t, [torch.zeros(2, 3, 1, 8)]), r"biases\[0\] \(mask bias\) has shape \[2, 3, 1, 8\]; expected \[B, N, 1, 1, L\] = \[2, 3, 1, 1, 8\]"),
        (lambda t: (*t, [None, torch.zeros(2, 3, 2, 8, 8)]), r"biases\[1\] \(pair bias\) has shape \[2, 3, 2, 8, 8\]; expected \[B, 1, H, L, L\] = \[2, 1, 2, 8, 8\]"),
        (lambda t: (*t, [torch.ones(2, 3, 1, 1, 8, dtype=torch.bool)]), r"biases\[0\] \(mask bias\) has dtype torch.bool; .*1e9 \* \(mask - 1\)"),
        (lambda t: (*t, [None, None, None]), r"biases must be a list of at most 2 tensors"),
    ],
)  # fmt: skip
def test_errors_name_the_tensor_its_shape_and_the_expected_shape(change, match) -> None:
    """Bad shapes, dtypes and bias lists raise with the tensor, its shape and the expected one."""
    with pytest.raises((ValueError, TypeError), match=match):
        evoformer_attention(*change(_qkv()))
    with pytest.raises((ValueError, TypeError), match=match):
        evoformer_attention_reference(*change(_qkv()))


def test_tutorial_column_mask_shape_gets_a_hint() -> None:
    """The DeepSpeed tutorial's column-attention mask [B, N_seq, 1, 1, N_res] is rejected, with the fix."""
    n_res, n_seq = 12, 5
    qkv = _qkv((1, n_res, n_seq, 2, 4))  # column attention: N = N_res, L = N_seq
    wrong = torch.zeros(1, n_seq, 1, 1, n_res)
    with pytest.raises(ValueError, match=r"mask must be \[B, N_res, 1, 1, N_seq\]"):
        evoformer_attention(*qkv, [wrong])


def test_bad_tile_size_is_rejected() -> None:
    """Tile sizes must be positive ints."""
    with pytest.raises(ValueError, match=r"kv_tile=0 must be an int >= 1"):
        evoformer_attention(*_qkv(), kv_tile=0)
