"""The CUDA paths, at world 1 with NCCL: ZeRO 0-3 against plain PyTorch, CPU offload through
page-locked buffers and asynchronous copies, checkpoints, ``engine.compile``, quantized
linears and generation. Skipped without a GPU (CI has none); run on one with
``pytest tests/cuda``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import slipstream
from slipstream.models import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def _single_process_world() -> None:
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29533",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(key, value)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _config(stage: int, **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
        "gradient_clipping": 1.0,
    }


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", num_layers=3)).to(CUDA)


def _data(steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 33), generator=g).to(CUDA) for _ in range(steps)]


def _train(
    config: dict[str, Any], steps: int = 3, compile_: bool = False
) -> tuple[list[float], list[torch.Tensor], Any]:
    engine, _, _, _ = slipstream.initialize(model=_model(), config=config)
    if compile_:
        engine.compile()
    losses = []
    for x in _data(steps):
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().float().cpu().clone() for p in engine.module.parameters()]
    return losses, params, engine


def _reference(steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    losses = []
    for x in _data(steps):
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, [p.detach().cpu().clone() for p in model.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> float:
    worst = max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))
    assert worst < tol, f"parameters differ by {worst:.2e} (relative), bound {tol}"
    return worst


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_match_plain_pytorch(stage: int) -> None:
    ref_losses, ref_params = _reference()
    losses, params, engine = _train(_config(stage))
    engine.destroy()
    assert all(p.is_cuda for p in engine.module.parameters() if p.numel())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _close(params, ref_params, 1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_runs_through_pinned_async_copies(stage: int) -> None:
    zero: dict[str, Any] = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    base_losses, base_params, base = _train(_config(stage))
    base.destroy()
    losses, params, engine = _train(_config(stage, **zero))
    opt = engine.optimizer
    assert all(m.device.type == "cpu" and m.is_pinned() for m in opt.masters)
    assert opt._host_grads and all(g.is_pinned() for g in opt._host_grads.values())
    assert all(p.is_cuda for p in engine.module.parameters() if p.numel())
    if stage == 2:
        _assert_weights_are_masters(opt, torch.float32)
    engine.destroy()
    # The fused AdamW kernel on the CPU and on the GPU: equal up to rounding.
    assert losses == pytest.approx(base_losses, rel=1e-5)
    _close(params, base_params, 1e-5)


def _assert_weights_are_masters(opt: Any, dtype: torch.dtype) -> None:
    """The device weights are exactly the host masters cast to ``dtype``: every queued
    copy back to the device landed."""
    torch.cuda.synchronize()
    for b, master in enumerate(opt.masters):
        weights = opt.store.owned(b)
        assert weights.is_cuda and weights.dtype == dtype
        assert torch.equal(weights.cpu(), master.to(dtype)), f"bucket {b}: weights != masters"


def test_bf16_offload_casts_on_the_host() -> None:
    zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    cfg = dict(_config(2, **zero), bf16={"enabled": True})
    losses, params, engine = _train(cfg, steps=4)
    opt = engine.optimizer
    assert opt._host_params
    assert all(t.dtype == torch.bfloat16 and t.is_pinned() for t in opt._host_params.values())
    _assert_weights_are_masters(opt, torch.bfloat16)
    held = opt.memory_bytes()["host_staging"]
    est = slipstream.zero.estimate_memory(
        engine.module, 1, 2, param_dtype=torch.bfloat16, offload_optimizer="cpu"
    )["host_staging"]
    assert abs(held - est) <= 0.05 * est, (held, est)  # buckets are padded
    engine.destroy()
    base_losses, base_params, base = _train(dict(_config(2), bf16={"enabled": True}), steps=4)
    base.destroy()
    assert losses == pytest.approx(base_losses, rel=2e-2)
    # bf16 runs drift apart by roundings that Adam turns into whole updates (lr 1e-3 a
    # step): bound the absolute difference by two updates a step.
    worst = max(float((a - b).abs().max()) for a, b in zip(params, base_params))
    assert worst < 2 * 4 * 1e-3 + 1e-3, f"bf16 offload drifted {worst:.2e} from no offload"


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_resume_on_gpu(stage: int, tmp_path: Path) -> None:
    data = _data(4)
    engine, _, _, _ = slipstream.initialize(model=_model(), config=_config(stage))
    straight = []
    for i, x in enumerate(data):
        if i == 2:
            engine.save_checkpoint(str(tmp_path), tag="mid")
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        straight.append(float(loss.detach()))
    engine.destroy()
    resumed, _, _, _ = slipstream.initialize(model=_model(), config=_config(stage))
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    again = []
    for x in data[2:]:
        loss = resumed(x[:, :-1], x[:, 1:])
        resumed.backward(loss)
        resumed.step()
        again.append(float(loss.detach()))
    resumed.destroy()
    assert again == pytest.approx(straight[2:], rel=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_compile_matches_eager(stage: int) -> None:
    eager, eager_params, a = _train(_config(stage))
    a.destroy()
    compiled, compiled_params, b = _train(_config(stage), compile_=True)
    assert b.is_compiled
    b.destroy()
    assert compiled == pytest.approx(eager, rel=1e-4)
    _close(compiled_params, eager_params, 1e-4)


def test_int8_linear_close_to_fp32() -> None:
    from slipstream.quant import W8A8Int, quantize_

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=64)).eval().to(CUDA)
    ids = torch.randint(0, 64, (4, 32), device=CUDA)
    with torch.no_grad():
        ref = model(ids)
        quantize_(model, W8A8Int())
        got = model(ids)
    assert got.is_cuda
    err = float((got - ref).norm() / ref.norm())
    assert err < 0.05, f"INT8 logits differ from fp32 by {err:.3f} (relative L2)"


def test_generate_matches_hf_greedy() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(CUDA)
    ids = torch.randint(1, 128, (2, 7), device=CUDA)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    want = model.generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    engine = slipstream.init_inference(model, dtype=torch.float32)
    got = engine.generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    assert torch.equal(got.cpu(), want.cpu())


def test_gpt_kv_cache_generation_equals_recompute() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", num_layers=2)).eval().to(CUDA)
    ids = torch.randint(0, model.config.vocab_size, (3, 9), device=CUDA)
    with torch.no_grad():
        want = model.generate(ids, 16, temperature=0)
    got = slipstream.init_inference(model).generate(ids, max_new_tokens=16)
    assert got.is_cuda
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_generation_matches_eager(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """enable_cuda_graph: replaying the captured decode step gives the tokens of the same step
    run eagerly (left padding, rows ending early kept in the batch)."""
    from slipstream.inference import graphs

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(CUDA, dtype)
    ids = torch.randint(1, 128, (3, 9), device=CUDA)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=20, pad_token_id=0, eos_token_id=7)
    graphed = slipstream.init_inference(model, enable_cuda_graph=True)
    made: list[graphs.GraphedDecoder] = []
    real_make = graphs.make

    def recording_make(m: torch.nn.Module, n: int) -> graphs.GraphedDecoder:
        made.append(real_make(m, n))
        return made[-1]

    monkeypatch.setattr(graphs, "make", recording_make)
    got = graphed.generate(ids, **kwargs)
    assert made[-1].graph is not None and made[-1].steps >= 2
    monkeypatch.setattr(graphs, "make", lambda m, n: graphs.GraphedDecoder(m, n, capture=False))
    want = graphed.generate(ids, **kwargs)
    assert torch.equal(got, want)


def test_rlhf_frozen_model_offload_streams_from_pinned_host_memory() -> None:
    """offload_frozen_ (--offload_reference_model) on a GPU: page-locked host copies between
    forwards, the same logits as the model resident on the GPU."""
    import copy

    transformers = pytest.importorskip("transformers")
    from slipstream.rlhf import offload_frozen_

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).requires_grad_(False).eval()
    resident = copy.deepcopy(model).to(CUDA)
    state = offload_frozen_(model, device=CUDA)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    ids = torch.randint(0, 64, (2, 9), device=CUDA)
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, resident(input_ids=ids).logits
    assert got.is_cuda and torch.equal(got, want)
    assert state.fetched_bytes == 0 and all(p.device.type == "cpu" for p in model.parameters())
