"""INT8 attention core (ZeroQuant-HERO): exact integer products, softmax codes, GPT wiring."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slipstream.config._errors import ConfigError
from slipstream.models import GPT, GPTConfig
from slipstream.models.gpt import Attention
from slipstream.quant import (
    HeroModes,
    Int8Attention,
    QuantLinear,
    W8A8Int,
    calibrate,
    int8_attention,
    int8_bmm,
    load_quantized,
    quantize_,
    quantize_per_token,
    quantize_softmax,
    save_quantized,
)
from slipstream.quant.attention import quantize_per_channel_tokens


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_int8_bmm_equals_int64_reference() -> None:
    """Batched int8 x int8 -> int32 equals an int64 matmul exactly, extremes included."""
    a = torch.randint(-127, 128, (2, 3, 9, 40), generator=_gen(0), dtype=torch.int8)
    b = torch.randint(-127, 128, (2, 3, 7, 40), generator=_gen(1), dtype=torch.int8)
    a[0, 0], b[0, 0] = -127, -127  # worst case: 40 * 127^2 per sum
    out = int8_bmm(a, b)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), a.long() @ b.long().transpose(-1, -2))


def test_int8_bmm_rejects_float_operands() -> None:
    """A float operand is refused, naming both dtypes."""
    with pytest.raises(TypeError, match=r"int8_bmm needs int8 operands, got torch\.float32"):
        int8_bmm(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.int8))


def test_softmax_codes_in_range_and_row_sums() -> None:
    """P_q in [0, 127]; row sums of P_q/127 within n/254 of 1 (spec sec. 1.5, invariant 5)."""
    p = torch.softmax(torch.randn(64, 50, generator=_gen(2)) * 3, dim=-1)
    p_q = quantize_softmax(p)
    assert p_q.dtype == torch.int8 and p_q.min() >= 0 and p_q.max() <= 127
    assert ((p_q.float().sum(-1) / 127 - 1).abs() <= 50 / 254).all()


def _emulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same chain with the integer products done in int64 (exact reference)."""
    t, d = q.shape[-2], q.shape[-1]
    q_q, s_q = quantize_per_token(q)
    k_q, s_k = quantize_per_token(k)
    s = (q_q.long() @ k_q.long().transpose(-1, -2)).float() * (s_q * s_k.transpose(-1, -2))
    s = (s / math.sqrt(d)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    p_q = quantize_softmax(torch.softmax(s, -1))
    v_q, s_v = quantize_per_channel_tokens(v)
    return (p_q.long() @ v_q.long()).float() * (s_v / 127)


def test_int8_attention_matches_integer_emulation_and_float() -> None:
    """Equals the int64-emulated chain bit for bit, and is within 5% (Frobenius) of float SDPA
    on unit-normal q/k/v (T=32, D=16; measured ~2.5%)."""
    q, k, v = (torch.randn(2, 3, 32, 16, generator=_gen(i)) for i in range(3))
    out = int8_attention(q, k, v)
    assert torch.equal(out, _emulated(q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out - ref).norm() / ref.norm() < 0.05


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=64)).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=_gen(5))


def test_gpt_attention_core_switch() -> None:
    """attn_core=True swaps every GPT Attention to Int8Attention (names kept, GQA); False keeps
    the float core; attention-only INT8 logits stay within cosine 0.999 of float."""
    model, ids = _gpt(), _ids()
    ref = model(ids)
    names = [n for n, _ in model.named_parameters()]
    quantize_(model, W8A8Int(skip=("*",)))  # no linear quantized: isolate the core
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    assert attn and all(isinstance(m, Int8Attention) for m in attn)
    assert [n for n, _ in model.named_parameters()] == names
    out = model(ids)
    assert not torch.equal(out, ref)
    assert F.cosine_similarity(out.flatten(), ref.flatten(), 0) > 0.999
    off = _gpt()
    quantize_(off, W8A8Int(modes=HeroModes(attn_core=False)))
    assert not any(isinstance(m, Int8Attention) for m in off.modules())
    assert any(isinstance(m, QuantLinear) for m in off.modules())


def test_gpt_all_int8_save_load_roundtrip(tmp_path) -> None:
    """All-INT8 (linears + attention core) survives save/load with identical logits."""
    model, ids = _gpt(), _ids()
    quantize_(model, W8A8Int())
    out = model(ids)
    save_quantized(model, tmp_path / "q.safetensors")
    loaded = load_quantized(_gpt(), tmp_path / "q.safetensors")
    assert isinstance(loaded.layers[0].attn, Int8Attention)
    assert torch.equal(loaded(ids), out)


def _static_gpt() -> GPT:
    model = _gpt()
    quantize_(model, W8A8Int(skip=("*",), attn_scales="static"))  # isolate the core
    return model


def _calib_batches() -> list[torch.Tensor]:
    return [torch.randint(0, 64, (2, 16), generator=_gen(10 + i)) for i in range(4)]


def test_static_attention_core_matches_emulation() -> None:
    """With given per-head Q/K and per-feature V scales the core equals the int64-emulated
    static chain bit for bit."""
    q, k, v = (torch.randn(2, 3, 16, 8, generator=_gen(20 + i)) for i in range(3))
    s_q, s_k = (
        q.abs().amax((0, 2, 3)).reshape(3, 1, 1) / 127,
        k.abs().amax((0, 2, 3)).reshape(3, 1, 1) / 127,
    )
    s_v = v.abs().amax((0, 2)).unsqueeze(1) / 127
    out = int8_attention(q, k, v, q_scale=s_q, k_scale=s_k, v_scale=s_v)
    q_q, k_q, v_q = (torch.round(x / s).clamp(-127, 127) for x, s in ((q, s_q), (k, s_k), (v, s_v)))
    sc = (q_q.long() @ k_q.long().transpose(-1, -2)).float() * (s_q * s_k) / math.sqrt(8)
    sc = sc.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), -math.inf)
    ref = (quantize_softmax(torch.softmax(sc, -1)).long() @ v_q.long()).float() * (s_v / 127)
    assert torch.equal(out, ref)


def test_static_attention_scales_reproduce_dynamic() -> None:
    """Calibrated static scales on the calibration batches give logits within 1% (relative
    Frobenius) of the dynamic-scale core; calibration records one range per head / feature."""
    batches = _calib_batches()
    static, dynamic = _static_gpt(), _gpt()
    quantize_(dynamic, W8A8Int(skip=("*",)))
    assert calibrate(static, batches) == 4
    attn = static.layers[0].attn
    assert attn.attn_q_absmax.shape == (4,) and attn.attn_k_absmax.shape == (2,)
    assert attn.attn_v_absmax.shape == (2, 16) and bool((attn.attn_v_absmax > 0).all())
    for ids in batches:
        out, ref = static(ids), dynamic(ids)
        assert (out - ref).norm() / ref.norm() < 0.01


def test_static_attention_scales_state_roundtrip(tmp_path) -> None:
    """Static attention ranges are buffers: save/load restores them and identical logits."""
    model, ids = _static_gpt(), _ids()
    calibrate(model, _calib_batches())
    out = model(ids)
    save_quantized(model, tmp_path / "q.safetensors")
    loaded = load_quantized(_gpt(), tmp_path / "q.safetensors")
    assert loaded.layers[0].attn.scales == "static"
    assert torch.equal(loaded.layers[0].attn.attn_v_absmax, model.layers[0].attn.attn_v_absmax)
    assert torch.equal(loaded(ids), out)


def test_static_attention_scales_need_calibration() -> None:
    """Static attention scales without calibrate() raise, naming the option and the fix; an
    unknown attn_scales value is refused at config construction."""
    with pytest.raises(RuntimeError, match=r"attn_scales='static'.*calibrate\(model, batches\)"):
        _static_gpt()(_ids())
    with pytest.raises(ConfigError, match=r"W8A8Int\.attn_scales='per-row' is invalid"):
        W8A8Int(attn_scales="per-row")  # type: ignore[arg-type]
