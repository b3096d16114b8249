"""init_inference with DeepSpeed's moe keys at ep_size 2: the reference GPT with dropless
experts and a Hugging Face Mixtral (converted by AutoEP) generate with the KV cache, each
rank holding half the experts, the same tokens as one process holding all of them. In the
same world, tp_size 2 at ep_size 1: attention split over the ranks, every expert on each."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import slipstream
from slipstream.config._errors import ConfigError
from tests.distributed.harness import run_world
from tests.moe import _inference_workloads as w

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_world(w.world, 2, timeout_s=400)


def test_gpt_ep2_generates_the_ep1_tokens(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        got, want = res["gpt"]
        assert got.shape == (2, 5 + w.NEW)
        assert got.tolist() == want.tolist()


def test_hf_mixtral_ep2_generates_hf_tokens(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        got, want, local_shape = res["hf"]
        assert local_shape[0] == 2  # 4 experts over 2 ranks
        assert got.tolist() == want.tolist()


def test_gpt_tp2_with_replicated_experts_generates_the_ep1_tokens(
    ranks: list[dict[str, Any]],
) -> None:
    for res in ranks:
        got, want, (q_shape, w1_shape) = res["gpt_tp"]
        assert q_shape == (32, 64)  # attention split over the 2 ranks
        assert w1_shape == (4, 64, 192)  # every expert, whole, on each rank
        assert got.tolist() == want.tolist()


def test_hf_mixtral_tp2_with_replicated_experts_generates_hf_tokens(
    ranks: list[dict[str, Any]],
) -> None:
    for res in ranks:
        got, want, (q_shape, gate_up_shape) = res["hf_tp"]
        assert q_shape == (16, 32)  # attention split over the 2 ranks
        assert gate_up_shape == (4, 96, 32)  # every expert, whole, on each rank
        assert got.tolist() == want.tolist()


def test_ep_size_refusals() -> None:
    with pytest.raises(ConfigError, match="'ep_size' = 2: the model has no MoE layers"):
        slipstream.init_inference(torch.nn.Linear(4, 4), config={"moe": {"ep_size": 2}})
    with pytest.raises(ConfigError, match="must be a positive integer"):
        slipstream.init_inference(torch.nn.Linear(4, 4), config={"ep_size": 0})
    with pytest.raises(ConfigError, match="built with ep_size \\[1\\]"):
        slipstream.init_inference(w._gpt(1), config={"moe": {"ep_size": 2}})
    both = r"'ep_size' = 2 with tensor_parallel\.tp_size = 2: .* ep_size 1 .* tp_size 1"
    with pytest.raises(ConfigError, match=both):
        slipstream.init_inference(torch.nn.Linear(4, 4), tensor_parallel={"tp_size": 2}, ep_size=2)
