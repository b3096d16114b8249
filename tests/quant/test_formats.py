"""Number formats: INT round trips, FP8/FP4 against their tables (every value, ties, clamping)."""

from __future__ import annotations

import pytest
import torch

from slipstream.quant import (
    E2M1,
    E4M3,
    E5M2,
    dequantize_int,
    fp4_decode,
    fp4_encode,
    fp4_pack,
    fp4_unpack,
    fp_round,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_per_token,
)

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _all_fp8(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an FP8 dtype, sorted and unique."""
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return vals[torch.isfinite(vals)].unique()


def test_int_round_trip_within_half_scale() -> None:
    """Per-token / per-channel / per-tensor: |x - q*s| <= s/2 and q in [-127, 127]."""
    x = torch.randn(16, 64) * torch.logspace(-3, 2, 16).unsqueeze(1)
    for q, s in (quantize_per_token(x), quantize_per_channel(x), quantize_per_tensor(x)):
        assert q.dtype == torch.int8 and q.abs().max() <= 127
        assert ((x - dequantize_int(q, s)).abs() <= s / 2 + 1e-7 * s).all()


def test_int_zero_rows_and_static_clamp() -> None:
    """An all-zero token quantizes to zeros; values past a calibrated range clamp to ±127."""
    x = torch.zeros(2, 8)
    x[1] = torch.linspace(-1, 1, 8)
    q, s = quantize_per_token(x)
    assert torch.equal(q[0], torch.zeros(8, dtype=torch.int8)) and s[0].item() == 1.0
    q, _ = quantize_per_tensor(torch.tensor([-10.0, 0.5, 10.0]), absmax=1.0)
    assert q.tolist() == [-127, 64, 127]


@pytest.mark.parametrize("fmt,dtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_fp8_representable_values_and_limits(fmt, dtype) -> None:
    """Every finite value of the torch FP8 dtype is a fixed point; max/min match the spec."""
    vals = _all_fp8(dtype)
    assert torch.equal(fp_round(vals, fmt), vals)
    assert vals.max().item() == fmt.max_value
    assert vals[vals > 0].min().item() == fmt.min_subnormal
    assert fmt.torch_dtype is dtype


@pytest.mark.parametrize("fmt,dtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_fp8_ties_and_dense_sweep_match_torch_cast(fmt, dtype) -> None:
    """All midpoints (ties -> even) and a dense sweep round exactly as torch's RNE cast."""
    vals = _all_fp8(dtype)
    mids = (vals[1:] + vals[:-1]) / 2
    sweep = torch.linspace(-fmt.max_value, fmt.max_value, 200_001)
    tiny = torch.logspace(-20, 0, 20_001, base=2.0)
    x = torch.cat([mids, sweep, tiny, -tiny])
    assert torch.equal(fp_round(x, fmt), x.to(dtype).float())


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1])
def test_fp_saturates_instead_of_nan(fmt) -> None:
    """Overflow and ±inf clamp to ±max, never NaN/inf (whatever the cast backend does)."""
    x = torch.tensor([fmt.max_value * 1.07, 1e30, float("inf"), -float("inf"), -1e9])
    out = fp_round(x, fmt)
    assert out.tolist() == [
        fmt.max_value,
        fmt.max_value,
        fmt.max_value,
        -fmt.max_value,
        -fmt.max_value,
    ]


def test_e2m1_table_ties_and_idempotence() -> None:
    """E2M1: the 8 magnitudes, the spec's tie cases, clamping, and q(q(x)) = q(x)."""
    table = torch.tensor(E2M1_VALUES)
    assert torch.equal(fp_round(torch.cat([table, -table]), E2M1), torch.cat([table, -table]))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])
    assert fp_round(ties, E2M1).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0]
    x = torch.linspace(-8, 8, 10_001)
    q = fp_round(x, E2M1)
    assert torch.equal(fp_round(q, E2M1), q)
    assert set(q.abs().unique().tolist()) <= set(E2M1_VALUES)
    # nearest: no table value is strictly closer than the chosen one
    dist = (
        (x.clamp(-6, 6).unsqueeze(1) - torch.cat([table, -table]).unsqueeze(0)).abs().min(1).values
    )
    assert torch.allclose((x.clamp(-6, 6) - q).abs(), dist)


def test_e2m1_matches_ml_dtypes() -> None:
    """Cross-check E2M1 rounding with ml_dtypes' float4_e2m1fn where installed."""
    ml = pytest.importorskip("ml_dtypes")
    x = torch.linspace(-6, 6, 4801)
    ref = torch.from_numpy(x.numpy().astype(ml.float4_e2m1fn).astype("float32"))
    assert torch.equal(fp_round(x, E2M1), ref)


def test_fp4_codes_and_packing_round_trip() -> None:
    """All 16 codes decode to the table, encode back, and pack two per byte losslessly."""
    codes = torch.arange(16, dtype=torch.uint8)
    vals = fp4_decode(codes)
    assert vals[:8].tolist() == E2M1_VALUES and vals[8:].tolist() == [-v for v in E2M1_VALUES]
    keep = codes != 8  # -0.0 encodes as +0 (code 0)
    assert torch.equal(fp4_encode(vals[keep]), codes[keep])
    packed = fp4_pack(codes.reshape(2, 8))
    assert packed.shape == (2, 4) and packed.dtype == torch.uint8
    assert torch.equal(fp4_unpack(packed), codes.reshape(2, 8))
    with pytest.raises(ValueError, match="not E2M1 grid points"):
        fp4_encode(torch.tensor([0.7]))


def test_e2m1_times_pow2_exact_in_e4m3() -> None:
    """Every E2M1 value x 2^k, k in [-8, 6], is exactly representable in E4M3."""
    vals = torch.tensor(E2M1_VALUES)
    for k in range(-8, 7):
        x = vals * 2.0**k
        assert torch.equal(x.to(torch.float8_e4m3fn).float(), x), k
