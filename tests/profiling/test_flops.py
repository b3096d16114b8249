"""FLOPs profiler: counts equal hand-computed values under the stated rule (matmul-family by
PyTorch's formulas, 2 FLOPs per MAC; elementwise 1 per element), module attribution, backward,
DeepSpeed's ``get_model_profile`` return values, and the engine's ``flops_profiler`` block."""

from __future__ import annotations

import importlib.util
import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models import GPT, GPTConfig
from slipstream.models.gpt import RMSNorm
from slipstream.profiling.flops import FlopsProfiler, get_model_profile, training_flops
from tests.distributed.harness import run_code, run_world
from tests.profiling import _flops_workloads as w


def _profile(model: nn.Module, *args: torch.Tensor, backward: bool = False) -> FlopsProfiler:
    prof = FlopsProfiler(model)
    prof.start_profile()
    out = model(*args)
    if backward:
        prof.backward_phase()
        (out if out.dim() == 0 else out.sum()).backward()
    prof.stop_profile()
    return prof


def test_linear_forward_and_backward() -> None:
    """A linear layer: 2*B*in*out forward (the bias add is inside addmm, not counted), and
    backward = grad input + grad weight = twice that."""
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=False)
    x = torch.randn(6, 24, requires_grad=True)
    prof = _profile(layer, x, backward=True)
    assert prof.get_total_flops() == 2 * 6 * 24 * 40
    assert prof.get_total_macs() == 6 * 24 * 40
    assert prof.get_total_backward_flops() == 2 * (2 * 6 * 24 * 40) + 6 * 40  # + the sum()
    assert prof.get_total_params() == 24 * 40


def test_conv2d() -> None:
    """Conv: 2 * B * Cout * Hout * Wout * Cin * kh * kw."""
    conv = nn.Conv2d(3, 8, kernel_size=3, padding=1, bias=False)
    prof = _profile(conv, torch.randn(2, 3, 10, 12))
    assert prof.get_total_flops() == 2 * 2 * 8 * 10 * 12 * 3 * 3 * 3


def test_scaled_dot_product_attention() -> None:
    """SDPA (the CPU flash kernel included): Q K^T and A V, 2 * B*H*S*S*D each."""

    class Attn(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v)

    b, h, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    prof = _profile(Attn(), q, k, v)
    assert prof.get_total_flops() == 4 * b * h * s * s * d


def test_rms_norm_elementwise_rule() -> None:
    """RMSNorm over N elements in R rows: pow N, mean N, +eps R, rsqrt R, two muls N each."""
    norm = RMSNorm(32, 1e-5)
    prof = _profile(norm, torch.randn(3, 5, 32))
    n, r = 3 * 5 * 32, 3 * 5
    assert prof.get_total_flops() == 4 * n + 2 * r
    assert prof.get_total_macs() == 0


def _gpt_matmul_macs(c: GPTConfig, b: int, s: int) -> int:
    """Multiply-accumulates of the reference GPT's matrix products, by hand."""
    h, i = c.hidden_size, c.intermediate_size
    assert i is not None and c.num_kv_heads in (None, c.num_heads)
    tokens = b * s
    per_layer = tokens * (4 * h * h + 3 * h * i) + 2 * b * s * s * h  # qkvo, MLP, attention
    return c.num_layers * per_layer + tokens * h * c.vocab_size


def test_gpt_block_and_whole_model() -> None:
    """The GPT's MACs equal the hand count; each block carries 1/L of the layer MACs and the
    module tree attributes the head and the blocks correctly."""
    torch.manual_seed(0)
    c = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16)
    model = GPT(c)
    x = torch.randint(0, 64, (2, 16))
    prof = _profile(model, x, x)
    assert prof.get_total_macs() == _gpt_matmul_macs(c, 2, 16)
    rows = {p.name: p for p in prof.module_profiles()}
    layer_macs = (_gpt_matmul_macs(c, 2, 16) - 2 * 16 * 32 * 64) // 2
    assert rows["layers.0"].forward_macs == layer_macs
    assert rows["layers"].forward_macs == 2 * layer_macs  # a ModuleList sums its children
    assert rows["lm_head"].forward_flops == 2 * 2 * 16 * 32 * 64
    assert rows[""].forward_flops == prof.get_total_flops()
    assert rows[""].params == sum(p.numel() for p in model.parameters())
    # Elementwise work is counted but small next to the products in a transformer.
    elementwise = prof.get_total_flops() - 2 * prof.get_total_macs()
    assert 0 < elementwise < 0.2 * prof.get_total_flops()


def test_get_model_profile_matches_deepspeed_signature(tmp_path: Path) -> None:
    """(flops, macs, params) as numbers or as strings; the table goes to output_file."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    out = tmp_path / "profile.txt"
    flops, macs, params = get_model_profile(
        model, input_shape=(4, 16), as_string=False, output_file=str(out)
    )
    assert macs == 4 * 16 * 32 + 4 * 32 * 8
    assert flops == 2 * macs + 4 * 32  # + the ReLU, one per element
    assert params == 16 * 32 + 32 + 32 * 8 + 8
    text = out.read_text()
    assert "fwd FLOPs" in text and "0 (Linear)" in text
    as_text = get_model_profile(model, args=[torch.randn(4, 16)], print_profile=False)
    assert as_text == ("6.27 K", "3.07 KMACs", "808")  # DeepSpeed's formatting
    with pytest.raises(ValueError, match="input_shape, args or kwargs"):
        get_model_profile(model)


_PROFILE_THROUGH_DEEPSPEED = textwrap.dedent(
    """
    import json
    import torch
    from torch import nn
    from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 10),
        nn.ReLU(),
    )
    numbers = get_model_profile(model, input_shape=(8, 64), print_profile=False, as_string=False)
    text = get_model_profile(model, args=[torch.randn(8, 64)], print_profile=False)
    print(json.dumps({
        "numbers": numbers, "text": text, "training": model.training,
        "module": get_model_profile.__module__, "profiler": FlopsProfiler.__module__,
    }))
    """
)


def _profile_through_deepspeed(alias: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_AS_DEEPSPEED"}
    env |= {"SLIPSTREAM_AS_DEEPSPEED": "1"} if alias else {"DS_ACCELERATOR": "cpu"}
    # Forked warm, the alias applied as at interpreter start.
    proc = run_code(_PROFILE_THROUGH_DEEPSPEED, env=env | {"OMP_NUM_THREADS": "1"}, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_get_model_profile_at_deepspeeds_import_path() -> None:
    """With SLIPSTREAM_AS_DEEPSPEED=1, DeepSpeed's documented import gives slipstream's
    profiler (also as slipstream.profiling.get_model_profile); with DeepSpeed 0.19.8
    installed, its own get_model_profile counts the same FLOPs, MACs and parameters of a
    Linear/LayerNorm/GELU/Dropout/ReLU model and formats them the same."""
    import slipstream.profiling

    assert slipstream.profiling.get_model_profile is get_model_profile
    ours = _profile_through_deepspeed(alias=True)
    assert ours["module"] == ours["profiler"] == "slipstream.profiling.flops"
    macs = 8 * 64 * 128 + 8 * 128 * 10
    assert ours["numbers"][1] == macs and ours["numbers"][2] == 64 * 128 + 128 * 3 + 128 * 10 + 10
    assert ours["training"] is False  # eval mode, as DeepSpeed leaves it
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed: checked against hand counts only")
    theirs = _profile_through_deepspeed(alias=False)
    assert theirs["module"].startswith("deepspeed.")
    assert ours["numbers"] == theirs["numbers"] and ours["text"] == theirs["text"]
    assert ours["training"] == theirs["training"]


def test_engine_profiles_one_step_on_rank_zero(tmp_path: Path) -> None:
    """With the config block (beside tensorboard and csv_monitor): rank 0 writes the profile of step 1 and knows the FLOPs of a
    step (2 micro-batches: 2 x (forward + counted backward)); rank 1 does not profile."""
    results = run_world(w.profiled_training, 2, str(tmp_path))
    rank0, rank1 = results
    assert rank0["profiled"] and not rank1["profiled"]
    text = (tmp_path / "profile.txt").read_text()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "csv" / "Train_Samples_train_loss.csv").is_file()
    assert "Profile summary at step 1" in text and "MFU" in text
    c = rank0["config"]
    fwd_macs = _gpt_matmul_macs(c, 2, 16)
    assert f"fwd MACs:{' ' * 32}" in text
    per_micro = rank0["flops_per_step"] / 2
    # forward + backward >= 3 x the products' FLOPs (backward of every product is 2x)
    assert per_micro >= 3 * 2 * fwd_macs
    assert per_micro == pytest.approx(training_flops(per_micro / 3, 2 * per_micro / 3), rel=0.2)
    assert rank0["report"].startswith(" TFLOPS=") and "MFU=" in rank0["report"]
