"""quantize_ / calibrate / save-load / HERO pieces on slipstream's GPT and a tiny HF GPT-2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.models import GPT, GPTConfig
from slipstream.quant import (
    W4A8FP4,
    W8A8FP8,
    QuantLinear,
    W4A8Int4,
    W8A8Int,
    calibrate,
    hero_preset,
    layer_norm_quant,
    load_quantized,
    quantize_,
    quantize_per_token,
    rms_norm_quant,
    save_quantized,
    smooth_,
)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=64)).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "cfg",
    [
        W8A8Int(),
        W8A8Int(backend="fbgemm"),
        W8A8FP8(),
        W4A8Int4(group_size=32),
        W4A8FP4(group_size=32, lorc_rank=4),
    ],
)
def test_quantize_keeps_names_and_logits(cfg) -> None:
    """Every linear but lm_head is replaced under its own name; logits stay close to float."""
    model, ids = _gpt(), _ids()
    ref = model(ids)
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantize_(model, cfg)
    q = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert q == names - {"lm_head"}
    out = model(ids)
    assert nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0) > 0.98


def test_hero_modes_and_skip_leave_float_layers() -> None:
    """A preset switching FC2 to float and a skip pattern keep those layers nn.Linear."""
    model = quantize_(
        _gpt(), W8A8Int(modes=hero_preset("fc2_float"), skip=("lm_head", "layers.0.*"))
    )
    for name, mod in model.named_modules():
        if name.endswith("down_proj") or (name.startswith("layers.0.") and name.endswith("proj")):
            assert isinstance(mod, nn.Linear), name
        elif name.startswith("layers.1.") and name.endswith(("q_proj", "up_proj")):
            assert isinstance(mod, QuantLinear), name


def test_config_errors_name_field_and_fix() -> None:
    """Bad config values raise ConfigError naming the field; unknown configs a TypeError."""
    with pytest.raises(ConfigError, match=r"W8A8Int\.backend=.cuda."):
        W8A8Int(backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lorc_rank=-1"):
        W4A8FP4(lorc_rank=-1)
    with pytest.raises(ConfigError, match=r"skip=.*tuple"):
        W8A8FP8(skip="lm_head")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown HERO preset 'M3'"):
        hero_preset("M3")
    with pytest.raises(TypeError, match="no quantization handler for object"):
        quantize_(_gpt(), object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cannot quantize module .layers\.0\.attn\.q_proj."):
        quantize_(_gpt(), W4A8Int4(group_size=48))


def test_static_scales_need_calibration_then_work() -> None:
    """Per-tensor static INT8 errors before calibrate and tracks the float model after."""
    model, ids = _gpt(), _ids()
    ref = model(ids)
    quantize_(model, W8A8Int(act_scheme="tensor"))
    with pytest.raises(RuntimeError, match="never calibrated"):
        model(ids)
    assert calibrate(model, [ids, ids[:1]]) == 2
    out = model(ids)
    assert nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0) > 0.98


@pytest.mark.parametrize("cfg", [W8A8Int(), W4A8FP4(group_size=32, lorc_rank=2)])
def test_save_load_round_trip(tmp_path, cfg) -> None:
    """save_quantized / load_quantized reproduce the quantized logits exactly."""
    model, ids = quantize_(_gpt(), cfg), _ids()
    save_quantized(model, tmp_path / "q.safetensors")
    torch.manual_seed(123)  # a different float init: everything must come from the file
    fresh = GPT(GPTConfig.preset("tiny", vocab_size=64)).eval()
    load_quantized(fresh, tmp_path / "q.safetensors")
    assert torch.equal(fresh(ids), model(ids))


def test_fused_norm_quant_bit_exact() -> None:
    """LN^quant / RMSNorm^quant equal norm followed by per-token quantization bit for bit."""
    x = torch.randn(3, 7, 64) * 5
    model = _gpt()
    norm = model.layers[0].attn_norm
    norm.weight.data.uniform_(0.5, 2)
    y, q, s = rms_norm_quant(x, norm.weight, norm.eps)
    q_ref, s_ref = quantize_per_token(norm(x))
    assert torch.equal(y, norm(x)) and torch.equal(q, q_ref) and torch.equal(s, s_ref)
    ln = nn.LayerNorm(64)
    y, q, s = layer_norm_quant(x, ln.weight, ln.bias, ln.eps)
    q_ref, s_ref = quantize_per_token(ln(x))
    assert torch.equal(y, ln(x)) and torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_norm_handoff_equals_quantizing_in_each_gemm() -> None:
    """Quantizing once in the norm epilogue gives exactly the logits of per-GEMM quantization."""
    ids = _ids()
    fused = quantize_(_gpt(), W8A8Int(fuse_norms=True))
    plain = quantize_(_gpt(), W8A8Int(fuse_norms=False))
    assert torch.equal(fused(ids), plain(ids))


def test_smoothing_preserves_float_forward_and_helps_outliers() -> None:
    """Folding smoothing scales changes the float logits by < 1e-5 relative."""
    model, ids = _gpt(), _ids()
    with torch.no_grad():  # function-preserving outlier channel: gamma x 30, next rows / 30
        for blk in model.layers:
            blk.attn_norm.weight[3] *= 30
            for p in (blk.attn.q_proj, blk.attn.k_proj, blk.attn.v_proj):
                p.weight[:, 3] /= 30
    ref = model(ids)
    folded = smooth_(model, [ids])
    assert len(folded) == 5  # attn_norm + mlp_norm of 2 layers, final norm -> lm_head
    out = model(ids)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_hf_gpt2_conv1d_and_generate() -> None:
    """HF GPT-2 Conv1D layers are quantized in place and generate() still runs."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 50, (1, 8))
    ref = model(ids).logits
    quantize_(model, W8A8Int())
    assert isinstance(model.transformer.h[0].attn.c_attn, QuantLinear)
    out = model(ids).logits
    assert nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0) > 0.99
    gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert gen.shape == (1, 11)
