"""The pruning kinds against hand-computed masks: l1 masks keep the ceil(dense_ratio x n)
largest weights / rows / kernels, apply from schedule_offset on, and redundancy_clean removes
pruned rows and heads together with the related layers' inputs (same outputs after)."""

from __future__ import annotations

import math

import torch

from slipstream.compression.compress import init_compression, redundancy_clean
from slipstream.compression.config import get_compression_config
from slipstream.compression.scheduler import CompressionScheduler
from tests.compression import _models as m


def _run(cfg: dict, model: torch.nn.Module, steps: int) -> CompressionScheduler:
    init_compression(model, cfg)
    sched = CompressionScheduler(model, get_compression_config(cfg))
    sched.step(step_zero_check=True)
    for _ in range(steps):
        sched.step()
    return sched


def test_sparse_l1_keeps_the_largest_weights_from_the_offset() -> None:
    cfg = m.ds_config(**m.pruning("sparse_pruning", "l1", offset=1))
    model = m.tiny_bert(0)
    w = model.bert.encoder.layer[0].attention.self.key.weight.detach().clone()
    keep = math.ceil(0.5 * w.numel())
    want = (w.abs() >= w.abs().flatten().sort(descending=True).values[keep - 1]).float()
    sched = _run(cfg, model, 0)
    key = model.bert.encoder.layer[0].attention.self.key
    torch.testing.assert_close(key.sparse_pruning_mask, want)
    assert not key.sparse_pruning_enabled
    sched.step()
    assert key.sparse_pruning_enabled
    x = torch.randn(2, m.HIDDEN)
    torch.testing.assert_close(key(x), torch.nn.functional.linear(x, w * want, key.bias))
    redundancy_clean(model, cfg)
    torch.testing.assert_close(key.weight.detach(), w * want)
    assert (key.weight == 0).sum() == w.numel() - keep


def test_row_pruning_removes_rows_and_related_columns() -> None:
    """l1 rows of intermediate.dense; its output.dense loses the matching input columns and
    the cleaned model computes what the masked model computed."""
    cfg = m.ds_config(**m.pruning("row_pruning", "l1", offset=0))
    model = m.tiny_bert(0)
    inter_w = model.bert.encoder.layer[2].intermediate.dense.weight.detach().clone()
    _run(cfg, model, 0)
    ids, _ = m.batch(3)
    masked = model(ids)
    redundancy_clean(model, cfg)
    layer = model.bert.encoder.layer[2]
    kept = inter_w.abs().sum(dim=1).argsort(descending=True)[: m.INTER // 2].sort().values
    torch.testing.assert_close(layer.intermediate.dense.weight.detach(), inter_w[kept])
    assert layer.output.dense.weight.shape == (m.HIDDEN, m.INTER // 2)
    torch.testing.assert_close(model(ids), masked, rtol=1e-5, atol=1e-6)


def test_head_pruning_removes_heads_from_qkv_and_output() -> None:
    cfg = m.ds_config(**m.pruning("head_pruning", "topk", offset=0, num_heads=m.HEADS))
    model = m.tiny_bert(0)
    _run(cfg, model, 0)
    attn = model.bert.encoder.layer[0].attention
    with torch.no_grad():
        attn.output.dense.head_pruning_scores.copy_(torch.tensor([[0.3, -1.0, 2.0, 0.1]]))
    ids, _ = m.batch(4)
    masked = model(ids)
    q_before = attn.self.query.weight.detach().clone()
    redundancy_clean(model, cfg)
    d = m.HIDDEN // m.HEADS
    keep = torch.cat([torch.arange(0, d), torch.arange(2 * d, 3 * d)])  # heads 0 and 2
    torch.testing.assert_close(attn.self.query.weight.detach(), q_before[keep])
    assert attn.output.dense.weight.shape == (m.HIDDEN, 2 * d)
    torch.testing.assert_close(model(ids), masked, rtol=1e-5, atol=1e-6)


def test_channel_pruning_l1_follows_the_kernel_norm() -> None:
    """Conv2d output channels by the kernel's L1 norm; the related conv2 and bn1 shrink."""
    cfg = m.ds_config(**m.pruning("channel_pruning", "l1", offset=0))
    model = m.tiny_cnn(0)
    w = model.layer1[0].conv1.weight.detach().clone()
    _run(cfg, model, 0)
    block = model.layer1[0]
    kept = w.abs().sum(dim=(1, 2, 3)).argsort(descending=True)[:4].sort().values
    h = torch.randn(2, 8, 6, 6)
    masked = block.conv1(h)
    torch.testing.assert_close(masked[:, kept], torch.nn.functional.conv2d(h, w[kept], padding=1))
    assert masked.abs().sum(dim=(0, 2, 3)).count_nonzero() == 4
    redundancy_clean(model, cfg)
    torch.testing.assert_close(block.conv1.weight.detach(), w[kept])
    assert block.conv2.weight.shape[1] == 4 and block.bn1.running_mean.shape == (4,)
    assert model(m.cnn_batch(0)).shape == (2, 10)
