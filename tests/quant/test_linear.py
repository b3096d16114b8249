"""QuantLinear: exact integer GEMMs, R1 epilogue, 4-bit scale constraints, LoRC, backends."""

from __future__ import annotations

import pytest
import torch

from slipstream.quant import (
    QuantLinear,
    constrain_group_scales,
    dequantize_group_weight,
    expand_group_weight,
    fp4_unpack,
    lorc_factors,
    quantize_group_weight,
    quantize_per_token,
)
from slipstream.quant._gemm import FbgemmPacked, fp8_gemm, int_mm

torch.manual_seed(0)


@pytest.mark.parametrize("m,k,n", [(1, 16, 16), (5, 17, 3), (33, 64, 48), (16, 8, 24)])
def test_int_mm_exact_on_odd_shapes(m, k, n) -> None:
    """torch._int_mm (padded where the device needs it) equals the float64 integer product."""
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    ref = (a.double() @ w.double().t()).to(torch.int32)
    assert torch.equal(int_mm(a, w), ref)


def test_fbgemm_7bit_weights_exact_even_at_saturation_worst_case() -> None:
    """With |w| <= 63 the FBGEMM u8 x s8 kernel cannot saturate: exact at the worst case."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        pytest.skip("no FBGEMM engine")
    a = torch.cat([torch.full((4, 64), 127), torch.randint(-127, 128, (4, 64))]).to(torch.int8)
    w = torch.cat([torch.full((4, 64), 63), torch.randint(-63, 64, (4, 64))]).to(torch.int8)
    out = FbgemmPacked(w)(a)
    assert torch.equal(out, a.double().matmul(w.double().t()).float())
    with pytest.raises(ValueError, match=r"\[-63, 63\]"):
        FbgemmPacked(torch.full((2, 8), 100, dtype=torch.int8))


def test_w8a8_int_forward_matches_r1_formula() -> None:
    """Y = s_x s_w (X_q W_q^T) + b exactly as the dequantize-then-multiply formula."""
    lin = torch.nn.Linear(64, 32)
    ql = QuantLinear.from_float(lin.weight, lin.bias, "int8", "int8")
    x = torch.randn(2, 5, 64)
    xq, sx = quantize_per_token(x.reshape(-1, 64))
    ref = (xq.double() @ ql.qweight.double().t()) * sx.double() * ql.weight_scale.double().t()
    ref = (ref + lin.bias.double()).float().reshape(2, 5, 32)
    torch.testing.assert_close(ql(x), ref, rtol=1e-6, atol=1e-6)
    assert torch.nn.functional.cosine_similarity(ql(x).flatten(), lin(x).flatten(), 0) > 0.999


@pytest.mark.parametrize(
    "wf,af",
    [("int8", "int8"), ("e4m3", "e4m3"), ("e4m3", "e5m2"), ("int4", "int8"), ("e2m1", "e4m3")],
)
def test_all_schemes_close_to_float(wf, af) -> None:
    """Every scheme approximates the float layer (looser for 4-bit weights)."""
    lin = torch.nn.Linear(128, 64)
    x = torch.randn(8, 128)
    ql = QuantLinear.from_float(lin.weight, lin.bias, wf, af, group_size=32)
    rel = (ql(x) - lin(x)).norm() / lin(x).norm()
    assert rel < (0.15 if wf in ("int4", "e2m1") else 0.1 if af == "e5m2" else 0.05), rel


def test_fp8_gemm_fallback_equals_scaled_mm() -> None:
    """The exact-operand fallback matches torch._scaled_mm (when available) to fp32 rounding."""
    a = torch.randn(9, 32).to(torch.float8_e4m3fn)
    b = torch.randn(7, 32).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(9, 1) + 0.5, torch.rand(7, 1) + 0.5
    ref = (a.double() @ b.double().t()) * sa.double() * sb.double().t()
    torch.testing.assert_close(fp8_gemm(a, b, sa, sb).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("constraint", ["pow2", "row_pow2"])
def test_scale_constraints_pow2_ratios_no_clipping(constraint) -> None:
    """Constrained group scales are >= the raw ones and differ from the row scale by 2^e."""
    raw = torch.rand(8, 6) * torch.logspace(-4, 0, 6)
    row, e = constrain_group_scales(raw, constraint, -8)
    new = row * torch.exp2(e.float())
    assert (new >= raw).all() and (e <= 0).all() and (e >= -8).all()
    if constraint == "pow2":
        assert torch.equal(torch.log2(row), torch.log2(row).round())
    free = e > -8  # not clamped at the smallest ratio: rounded up by less than 2x
    assert (new[free] < 2 * raw[free]).all()


@pytest.mark.parametrize("fmt", ["int4", "e2m1"])
def test_4bit_to_8bit_runtime_conversion_is_exact(fmt) -> None:
    """FP4 -> E4M3 and INT4 -> INT8 by exponent shift equal 'dequantize, then cast' bit-exactly."""
    w = torch.randn(16, 128) * torch.logspace(-3, 1, 128)  # wide range across groups
    gw = quantize_group_weight(w, fmt, 32)
    w8, row = expand_group_weight(gw)
    deq = dequantize_group_weight(gw)
    if fmt == "e2m1":
        assert w8.dtype == torch.float8_e4m3fn
        assert torch.equal((deq / row).to(torch.float8_e4m3fn).float(), w8.float())
    else:
        assert w8.dtype == torch.int8 and w8.abs().max() <= 112
        codes = fp4_unpack(gw.packed).to(torch.int16)
        q4 = ((codes ^ 8) - 8).double()
        shift = gw.group_exp.double().repeat_interleave(32, dim=1)
        assert torch.equal(q4 * torch.exp2(shift + 4), w8.double())
    err = (w - deq).abs().reshape(16, 4, 32).amax(-1)
    assert (
        err
        <= gw.row_scale * torch.exp2(gw.group_exp.float()) * (1.0 if fmt == "e2m1" else 0.5) + 1e-6
    ).all()


def test_group_size_error_names_constraint() -> None:
    """A group size not dividing in_features is a clear error."""
    with pytest.raises(ValueError, match="not a multiple of the even group_size=64"):
        quantize_group_weight(torch.randn(4, 96), "int4", 64)


def test_lorc_error_monotone_and_eckart_young() -> None:
    """LoRC residual is non-increasing in rank and equals sqrt(sum_{i>r} s_i^2)."""
    w = torch.randn(48, 64)
    ql = QuantLinear.from_float(w, None, "int4", "int8", group_size=32)
    err = w - ql.dequantized_weight()
    s = torch.linalg.svdvals(err.double())
    prev = float("inf")
    for r in (1, 2, 4, 8, 16):
        a, b = lorc_factors(err, r)
        res = (err - (a @ b).t()).norm().item()
        assert res <= prev + 1e-6
        torch.testing.assert_close(res, s[r:].pow(2).sum().sqrt().item(), rtol=1e-5, atol=1e-6)
        prev = res
    with pytest.raises(ValueError, match="LoRC rank=100"):
        lorc_factors(err, 100)


def test_lorc_reduces_output_error() -> None:
    """A LoRC-compensated W4 layer is closer to the float layer than the plain one."""
    lin = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(32, 64)
    plain = QuantLinear.from_float(lin.weight, None, "e2m1", "e4m3", group_size=32)
    comp = QuantLinear.from_float(lin.weight, None, "e2m1", "e4m3", group_size=32, lorc_rank=8)
    assert (comp(x) - lin(x)).norm() < (plain(x) - lin(x)).norm()


def test_weight_bytes_per_format() -> None:
    """4-bit weights store half a byte per value (+ scales), int8/fp8 one byte."""
    w = torch.randn(64, 128)
    sizes = {
        f: QuantLinear.from_float(
            w, None, f, "int8" if f.startswith("int") else "e4m3"
        ).weight_bytes()
        for f in ("int8", "e4m3", "int4", "e2m1")
    }
    assert sizes["int8"] == sizes["e4m3"] == 64 * 128 + 64 * 4 + 4
    assert sizes["int4"] == sizes["e2m1"] == 64 * 64 + 64 * 2 + 64 * 4 + 4


def test_int_codes_equal_int8_codes() -> None:
    """The fp32 codes handed to FBGEMM equal quantize_per_token's int8 codes exactly."""
    from slipstream.quant._formats import per_token_codes

    x = torch.randn(37, 96) * torch.rand(37, 1) * 10
    x[3] = 0.0  # a zero row: scale 1, codes 0
    q, s = quantize_per_token(x)
    qf, sf = per_token_codes(x)
    assert qf.dtype == torch.float32 and torch.equal(sf, s)
    assert torch.equal(qf, q.float())


def test_fbgemm_row_scale_applied_by_kernel() -> None:
    """FbgemmPacked(w, row_scale) returns the exact integer sums times the row scale."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        pytest.skip("no FBGEMM engine")
    a = torch.randint(-127, 128, (9, 40), dtype=torch.int8)
    w = torch.randint(-63, 64, (12, 40), dtype=torch.int8)
    scale = torch.rand(12) + 0.1
    ref = (a.double() @ w.double().t()) * scale.double()
    torch.testing.assert_close(FbgemmPacked(w, scale)(a).double(), ref, rtol=1e-6, atol=0)


def test_fbgemm_and_int_mm_linears_agree_on_7bit_weights() -> None:
    """The FBGEMM path (row scale in the kernel, fp32 codes) equals the int_mm path's R1
    result for the same 7-bit weights, to fp32 rounding; with LoRC and bias too."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        pytest.skip("no FBGEMM engine")
    lin = torch.nn.Linear(64, 48)
    fb = QuantLinear.from_float(lin.weight, lin.bias, "int8", "int8", backend="fbgemm", lorc_rank=4)
    mm = QuantLinear.from_float(lin.weight, lin.bias, "int8", "int8", lorc_rank=4)
    mm.load_state_dict(fb.state_dict())  # the same 7-bit codes and scales on int_mm
    x = torch.randn(3, 7, 64)
    torch.testing.assert_close(fb(x), mm(x), rtol=1e-5, atol=1e-5)
