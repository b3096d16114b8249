"""Rank-side run for the engine behaviours DeepSpeed's own unit tests check (issue 33 item 7)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from torch import nn


class Tied(nn.Module):
    """DeepSpeed's test_shared_weights model: layer1's weight is layer2's."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0 = nn.Linear(3, 3)
        self.layer1 = nn.Linear(5, 5)
        self.layer2 = nn.Linear(5, 5)
        self.layer1.weight = self.layer2.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)).square().mean()


def behaviours() -> dict[str, Any]:
    import torch.distributed as dist

    import slipstream
    from slipstream.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = slipstream.initialize(model=Tied(), config=config)
    loss = engine(torch.randn(2, 5))
    out["loss"] = loss.item()
    out["returned"] = engine.backward(loss).item()
    out["returned_unscaled"] = engine.backward(engine(torch.randn(2, 5)), scale_wrt_gas=False)
    out["returned_unscaled"] = out["returned_unscaled"].item()
    engine.step()
    try:
        engine.save_checkpoint(None)
    except ValueError as exc:
        out["save_none"] = str(exc)
    # The checkpoint directory is rank 0's temporary directory, shared with every rank.
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    engine.save_checkpoint(holder[0], tag="tied")
    engine.wait_for_checkpoint()
    first_draw = torch.rand(3)
    engine.load_checkpoint(holder[0], tag="tied")
    out["rng_restored"] = torch.equal(torch.rand(3), first_draw)
    keep_rng = {**config, "checkpoint": {"load_rng_state": False}}
    other, *_ = slipstream.initialize(model=Tied(), config=keep_rng)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    other.load_checkpoint(holder[0], tag="tied")
    out["rng_left_alone"] = torch.equal(torch.rand(3), expected)
    state = get_fp32_state_dict_from_zero_checkpoint(holder[0], tag="tied")
    out["keys"] = sorted(state)
    fresh = Tied()
    fresh.load_state_dict(state, strict=True)
    out["tied_kept"] = fresh.layer1.weight is fresh.layer2.weight

    stage0, *_ = slipstream.initialize(
        model=nn.Linear(2, 2), config={**config, "zero_optimization": {"stage": 0}}
    )
    with stage0.no_sync():
        try:
            with stage0.no_sync():
                pass
        except RuntimeError as exc:
            out["reentry"] = str(exc)
    z3 = {"train_batch_size": 2, "zero_optimization": {"stage": 3}}
    with slipstream.zero.Init(config_dict_or_path=z3):
        with slipstream.zero.Init(config_dict_or_path=z3):
            inner = nn.Linear(4, 4)
        out["nested_ds_id"] = hasattr(inner.weight, "ds_id")
    return out
