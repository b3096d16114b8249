"""The GPT's parallelism plans are objects the model names through ``tp_plan()`` /
``sp_plan()``; ``parallelize_tp_`` asks the model, never its class name, and the model holds no
process group. Multi-rank behaviour: tests/parallel/test_tensor_parallel.py,
tests/sequence/test_sequence_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.config import ConfigError
from slipstream.models import GPT, GPTConfig
from slipstream.models.gpt import CausalAttention, FullSequence, LMOutput
from slipstream.parallel.tensor import TPPlan, VocabParallelOutput
from slipstream.parallel.tensor.apply import _model_plan
from slipstream.sequence import ShardedSequence


class _Renamed(GPT):
    """A GPT under another class name: the plan must still be the GPT's own."""


def test_the_model_plan_comes_from_the_hook_not_the_class_name() -> None:
    torch.manual_seed(0)
    model = _Renamed(GPTConfig.preset("tiny"))
    plan = _model_plan(model, sequence_parallel=True)
    assert plan.styles["embed_tokens"] == "vocab_embed"
    assert plan.styles["lm_head"] == "colwise"
    assert plan.styles["layers.0.attn.q_proj"] == "colwise"
    assert plan.styles["layers.1.mlp.down_proj"] == "rowwise"
    assert plan.styles["norm"] == "sp_norm" and plan.sequence_parallel
    assert len(plan.after_split) == 1  # swaps in the vocabulary-parallel output

    # A model without the hook gets the automatic plan: no vocabulary-parallel loss.
    blocks = nn.ModuleList(
        nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)}) for _ in range(2)
    )
    auto = _model_plan(nn.Sequential(blocks), sequence_parallel=False)
    assert auto.styles == {"0.0.up": "colwise", "0.0.down": "rowwise"} | {
        "0.1.up": "colwise",
        "0.1.down": "rowwise",
    }
    assert not auto.after_split and not auto.sequence_parallel


def test_the_plan_installs_the_group_holding_output_from_outside() -> None:
    """The TP plan's step replaces ``output``; the GPT class itself has no group fields."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    assert isinstance(model.output, LMOutput) and isinstance(model.positions, FullSequence)
    assert all(isinstance(layer.attn.core, CausalAttention) for layer in model.layers)
    groupish = [
        (name, attr)
        for name, module in model.named_modules()
        for attr in vars(module)
        if attr.endswith("_group") or attr.startswith("set_")
    ]
    assert not groupish, groupish
    assert not any(hasattr(GPT, a) for a in ("tp_group", "sp_group", "set_tensor_parallel_group"))
    plan = model.tp_plan(False)
    assert isinstance(plan, TPPlan)
    plan.after_split[0](None)  # the step with a group: the output becomes vocabulary-parallel
    assert isinstance(model.output, VocabParallelOutput)


def test_megatron_sp_after_ulysses_is_refused() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", sequence_parallel="ulysses"))
    model.positions = ShardedSequence(None)  # what the sequence-parallel plan installs
    with pytest.raises(ConfigError, match="cannot be combined on one GPT"):
        model.tp_plan(True)
