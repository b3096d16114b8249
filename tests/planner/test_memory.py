"""Memory terms against values computed by hand from Korthikanti et al. 2022 and ZeRO."""

from __future__ import annotations

import pytest
import torch

from slipstream.planner import Layout, model_preset, predict_memory
from slipstream.planner.memory import (
    activation_bytes_per_layer,
    in_flight_micro_batches,
    stage_params,
)

M = model_preset("megatron-22b")  # h=6144, a=64, s=2048
S, H, A = 2048, 6144, 64


@pytest.mark.parametrize(
    ("recompute", "sp", "expected"),
    [
        ("none", False, S * H * (10 + 24 / 8) + 5 * A * S * S / 8),
        ("none", True, S * H * 34 / 8 + 5 * A * S * S / 8),
        ("selective", False, S * H * (10 + 24 / 8)),
        ("selective", True, S * H * 34 / 8),
        ("full", False, 2 * S * H),
        ("full", True, 2 * S * H / 8),
    ],
)
def test_activation_bytes_per_layer(recompute: str, sp: bool, expected: float) -> None:
    """Korthikanti et al. 2022, Table 2, at t = 8 and one sequence."""
    layout = Layout(tp=8, recompute=recompute, sequence_parallel=sp)  # type: ignore[arg-type]
    assert activation_bytes_per_layer(M, layout) == pytest.approx(expected)


def test_activations_scale_with_the_micro_batch() -> None:
    one = activation_bytes_per_layer(M, Layout(tp=8, micro_batch=1))
    assert activation_bytes_per_layer(M, Layout(tp=8, micro_batch=4)) == pytest.approx(4 * one)


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (Layout(pp=1, global_batch=8), 1.0),
        (Layout(pp=4, global_batch=16), 4.0),
        (Layout(pp=4, global_batch=2), 2.0),
        (Layout(pp=4, virtual_stages=2, global_batch=16), 4 * (1 + 3 / 8)),
        (Layout(pp=4, gpipe=True, global_batch=16), 16.0),
    ],
)
def test_in_flight_micro_batches(layout: Layout, expected: float) -> None:
    assert in_flight_micro_batches(layout) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("stage", "bytes_per_param"),
    [(0, 2 + 4 + 12), (1, 2 + 4 + 12 / 4), (2, 2 + (4 + 12) / 4), (3, (2 + 4 + 12) / 4)],
)
def test_zero_states_per_param(stage: int, bytes_per_param: float) -> None:
    """Mixed-precision Adam with fp32 gradients: 2 + 4 + 12 bytes, divided as ZeRO does."""
    layout = Layout(tp=8, dp=4, zero_stage=stage, recompute="full")
    mem = predict_memory(M, layout)
    numel = stage_params(M, layout, "only")
    assert numel % 4 == 0
    assert mem.params + mem.grads + mem.optimizer == bytes_per_param * numel


def test_stage_params_split_matrices_and_vocabulary() -> None:
    """Per TP rank: (12h^2 + 9h)/t + 4h per layer (norms replicated), V h / t words, s h
    positions, final norm 2h."""
    numel = stage_params(M, Layout(tp=8), "only")
    per_layer = (12 * H * H + 9 * H) // 8 + 4 * H
    assert numel == 48 * per_layer + 51200 * H // 8 + S * H + 2 * H


def test_hpz_adds_a_secondary_copy() -> None:
    base = Layout(tp=1, dp=16, zero_stage=3, recompute="full")
    hpz = Layout(tp=1, dp=16, zero_stage=3, recompute="full", hpz_partition_size=8)
    plain, secondary = predict_memory(M, base), predict_memory(M, hpz)
    assert secondary.hpz_secondary == pytest.approx(2 * M.num_params() / 8, rel=1e-6)
    assert secondary.params - plain.params == secondary.hpz_secondary


def test_first_stage_holds_p_micro_batches() -> None:
    """With 1F1B the first stage keeps p micro-batches of its l/p layers."""
    layout = Layout(tp=8, pp=4, global_batch=16, recompute="full")
    mem = predict_memory(M, layout)
    stored = 12 * 4 * activation_bytes_per_layer(M, layout)
    working = activation_bytes_per_layer(M, layout, stored=False) - activation_bytes_per_layer(
        M, layout
    )
    assert mem.stage == "first"
    assert mem.activations == int(stored + working + S * H * 4)  # + embedding dropout mask


def _saved_bytes_of_one_block(config: object, batch: int, dtype: torch.dtype) -> int:
    """Bytes of the distinct storages autograd saves in one reference-GPT block's forward
    (parameters and the RoPE tables excluded: they are not activations)."""
    from slipstream.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(config).to(dtype)
    block = model.layers[0]
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(batch, config.max_seq_len, config.hidden_size, dtype=dtype,  # type: ignore[attr-defined]
                    requires_grad=True)  # fmt: skip
    cos, sin = model.rope_cos.to(dtype), model.rope_sin.to(dtype)
    owned |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin).sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize(("dtype", "param_bytes"), [(torch.float32, 4), (torch.bfloat16, 2)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_reference_gpt_block_saves_what_the_planner_counts(
    dtype: torch.dtype, param_bytes: int, kv_heads: int
) -> None:
    """The HF-Llama accounting (fp32 RMSNorm internals, repeated K/V, SDPA output and its
    copy) against the tensors autograd really saves (specs/parallelism.md sec. 4.5.3)."""
    from slipstream.models.gpt import GPTConfig
    from slipstream.planner import from_gpt_config

    config = GPTConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=kv_heads,
                       max_seq_len=32, vocab_size=64)  # fmt: skip
    measured = _saved_bytes_of_one_block(config, batch=2, dtype=dtype)
    layout = Layout(micro_batch=2, param_bytes=param_bytes)
    predicted = activation_bytes_per_layer(from_gpt_config(config), layout)
    assert predicted == pytest.approx(measured, rel=0.05)


def test_fp32_states_have_no_master_copy() -> None:
    """fp32 training: 4 (weights) + 4 (gradients) + 8 (Adam moments) bytes per parameter."""
    model = model_preset("megatron-22b", layers=2, hidden=256, heads=4, seq=128)
    numel = stage_params(model, Layout(), "only")
    mem = predict_memory(model, Layout(param_bytes=4))
    assert (mem.params, mem.grads, mem.optimizer) == (4 * numel, 4 * numel, 8 * numel)


@pytest.mark.parametrize(("stage", "buffer_params"), [(0, 0), (1, 0), (2, 1)])
def test_reduction_buffers_follow_slipstreams_reducer(stage: int, buffer_params: int) -> None:
    """Stages 0/1 all-reduce the accumulation buffer in place; stage 2 stages a bucket."""
    model = model_preset("megatron-22b", layers=2, hidden=256, heads=4, seq=128)
    numel = stage_params(model, Layout(), "only")
    mem = predict_memory(model, Layout(dp=4, zero_stage=stage))
    assert mem.comm_buffers == buffer_params * numel * 4


@pytest.mark.parametrize(("stage", "buffer_params"), [(0, 0), (1, 0), (2, 2)])
def test_gloo_reduce_scatter_keeps_a_scratch_copy_of_the_bucket(
    stage: int, buffer_params: int
) -> None:
    """On gloo slipstream's reduce-scatter is an all-to-all into a kept scratch buffer of the
    bucket's size: stage 2 holds the staged bucket and its scratch copy; 0/1 all-reduce."""
    model = model_preset("megatron-22b", layers=2, hidden=256, heads=4, seq=128)
    numel = stage_params(model, Layout(), "only")
    mem = predict_memory(model, Layout(dp=4, zero_stage=stage), reduce_scatter_scratch=True)
    assert mem.comm_buffers == buffer_params * numel * 4
