"""bf16 weights with fp32 GEMMs: same parameters and state_dict, results of a bf16 GEMM."""

from __future__ import annotations

import torch

from slipstream.inference import init_inference
from slipstream.inference.kernels import Fp32GemmLinear, fp32_gemm_for_half_weights_
from tests.inference.conftest import left_padded, tiny_llama


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
