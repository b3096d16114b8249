"""bf16 weights with fp32 GEMMs: same parameters and state_dict, results of a bf16 GEMM."""

from __future__ import annotations

import torch

from slipstream.inference import init_inference
from slipstream.inference.kernels import (
    Fp32GemmLinear,
    PackedHeadLinear,
    fp32_gemm_for_half_weights_,
)
from tests._tiny_models import left_padded, tiny_gpt2, tiny_llama


def test_swap_keeps_weights_and_matches_the_native_bf16_product():
    torch.manual_seed(0)
    native = torch.nn.Linear(64, 32).to(torch.bfloat16)
    swapped = torch.nn.Sequential(torch.nn.Linear(64, 32)).to(torch.bfloat16)
    swapped[0].load_state_dict(native.state_dict())
    assert fp32_gemm_for_half_weights_(swapped) == 1
    assert isinstance(swapped[0], Fp32GemmLinear)
    assert swapped[0].weight.dtype == torch.bfloat16
    x = torch.randn(8, 64).to(torch.bfloat16)
    got, want = swapped(x), native(x)
    assert got.dtype == torch.bfloat16
    # Both accumulate in fp32: at most a rounding step of bf16 apart (2**-8 relative).
    assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-2)
    exact = torch.nn.functional.linear(x.float(), native.weight.float(), native.bias.float())
    assert torch.equal(got, exact.to(torch.bfloat16))
    one_row = x[:1]  # below min_rows: the native half-precision kernel
    assert torch.equal(swapped(one_row), native(one_row))


def test_engine_applies_it_to_bf16_only_when_asked_or_emulated():
    fp32 = init_inference(tiny_llama(), cpu_half_gemm="fp32", dtype="bf16").module
    assert isinstance(fp32.model.layers[0].mlp.up_proj, Fp32GemmLinear)
    native = init_inference(tiny_llama(), cpu_half_gemm="native", dtype="bf16").module
    assert type(native.model.layers[0].mlp.up_proj) is torch.nn.Linear
    plain = init_inference(tiny_llama(), cpu_half_gemm="fp32").module  # fp32 model
    assert type(plain.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert set(fp32.state_dict()) == set(native.state_dict())
    ids, mask = left_padded([5, 2])
    out = init_inference(fp32).generate(ids, attention_mask=mask, max_new_tokens=4)
    assert out.shape[0] == 2


def test_packed_head_matches_linear_for_one_and_many_rows_and_follows_weight_updates():
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 300, bias=True)
    packed = torch.nn.Sequential(torch.nn.Linear(64, 300, bias=True))
    packed[0].load_state_dict(plain.state_dict())
    packed[0].__class__ = PackedHeadLinear
    assert set(packed[0].state_dict()) == set(plain.state_dict())
    with torch.inference_mode():
        for shape in [(1, 1, 64), (3, 1, 64), (16, 64)]:
            x = torch.randn(shape)
            got = packed[0](x)
            assert got.shape == plain(x).shape
            torch.testing.assert_close(got, plain(x), rtol=1e-5, atol=1e-5)
        # An in-place update (an optimizer step, load_state_dict) must not leave stale copies.
        with torch.no_grad():
            plain.weight.mul_(-2.0)
            packed[0].weight.mul_(-2.0)
        for rows in (1, 5):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(packed[0](x), plain(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 64)  # gradients wanted: the plain product, differentiable
    packed[0](x).sum().backward()
    assert packed[0].weight.grad is not None


def test_packed_head_in_bf16_is_the_fp32_product_rounded():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 200, bias=False).to(torch.bfloat16)
    weight = head.weight.detach().float()
    head.__class__ = PackedHeadLinear
    with torch.inference_mode():
        for rows in (1, 8):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            got = head(x)
            assert got.dtype == torch.bfloat16
            want = (x.float() @ weight.t()).to(torch.bfloat16)
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)


def test_engine_packs_the_tied_head_and_generates_hf_greedy_tokens():
    model = tiny_gpt2()  # lm_head tied to the token embedding
    reference = tiny_gpt2()
    engine = init_inference(model)
    assert isinstance(model.lm_head, PackedHeadLinear)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert type(init_inference(tiny_gpt2(), cpu_lm_head="native").module.lm_head) is (
        torch.nn.Linear
    )
    native_bf16 = init_inference(tiny_gpt2(), dtype="bf16", cpu_half_gemm="native").module
    assert type(native_bf16.lm_head) is torch.nn.Linear  # bf16 kernels chosen: left alone
    for lengths in ([7], [7, 3, 5]):
        ids, mask = left_padded(lengths)
        want = reference.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0
        )
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
        assert torch.equal(got, want)


def test_native_bf16_is_read_from_the_cpu_flags_where_torch_does_not_say(tmp_path, monkeypatch):
    import functools

    from slipstream.inference import kernels

    read = kernels._cpuinfo_flags
    # torch 2.13 has no _is_avx512_bf16_supported: the answer comes from /proc/cpuinfo.
    monkeypatch.setattr(torch._C, "_cpu", object())
    cases = (("fpu avx2 avx512f", False), ("avx512f avx512_bf16", True), ("amx_bf16 sse", True))
    for flags, want in cases:
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
        monkeypatch.setattr(kernels, "_cpuinfo_flags", functools.partial(read, str(info)))
        assert kernels.native_half_gemm() is want, flags
    monkeypatch.setattr(kernels, "_cpuinfo_flags", functools.partial(read, str(tmp_path / "no")))
    assert kernels.native_half_gemm() is False
