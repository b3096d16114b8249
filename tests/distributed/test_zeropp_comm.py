"""ZeRO++ building blocks: block quantization, quantized all-gather, 2-hop all-to-all."""

from __future__ import annotations

import pytest
import torch

from slipstream.distributed.quantize import dequantize_blocks, quantize_blocks, wire_bytes
from tests.distributed import _zeropp_workloads as w
from tests.distributed.harness import run_world


@pytest.mark.parametrize("bits", [8, 4])
def test_block_quantization_error_is_at_most_half_a_step_per_block(bits):
    x = torch.randn(10_000) * torch.linspace(0.01, 10, 10_000)  # very different block ranges
    x[:512] = 0.0  # an all-zero block
    q = quantize_blocks(x, bits=bits, block=256)
    y = dequantize_blocks(q)
    blocks = torch.nn.functional.pad(x, (0, 40 * 256 - 10_000)).view(40, 256)
    scale = blocks.abs().amax(1) / (2 ** (bits - 1) - 1)
    err = torch.nn.functional.pad((y - x).abs(), (0, 40 * 256 - 10_000)).view(40, 256)
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())
    assert torch.equal(y[:512], torch.zeros(512))
    # the extremes of each block are exact (no clipping of +absmax)
    i = x.abs().argmax()
    torch.testing.assert_close(y[i], x[i])
    assert q.codes.numel() * 8 // bits == 40 * 256
    assert wire_bytes(10_000, bits, 256) == q.codes.numel() + 4 * 40


@pytest.mark.parametrize(("world", "per_node"), [(4, 2), (8, 2)])
def test_two_hop_all_to_all_equals_reduce_scatter(world, per_node):
    """2 and 4 "nodes": every chunk lands on its owner and matches reduce-scatter within the
    quantization bound of two hops (int8 and int4 codes)."""
    for r in run_world(w.two_hop, world, per_node):
        for bits, got in r.items():
            torch.testing.assert_close(got["ref"], got["exact"], rtol=1e-5, atol=1e-5)
            err = (got["out"] - got["exact"]).abs().max()
            # each of the two hops rounds every summand by at most half a step of absmax/qmax
            assert err <= world * got["absmax"] / (2 ** (bits - 1) - 1), (bits, err)
            if bits == 8:
                assert err < 0.05 * got["exact"].abs().max()


def test_quantized_all_gather_is_close_and_halves_cross_node_bytes():
    for r in run_world(w.qwz_gather, 4, 2):
        err = (r["full"].float() - r["exact"].float()).abs().max()
        assert err <= r["exact"].float().abs().max() / 127
        assert r["q_cross"] < 0.56 * r["cross"]  # int8 + fp32 scales per 64 vs bf16
