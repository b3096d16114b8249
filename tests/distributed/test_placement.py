"""The per-parameter placement record: defaults, composition of writers, and copies that do
not change behind each other's back."""

from __future__ import annotations

import torch
from torch import nn

from slipstream.distributed.placement import (
    Placement,
    TPShard,
    is_duplicate,
    mark_duplicate_,
    mark_tp_grad_summed_,
    placement,
    set_tp_shard_,
    tp_grad_summed,
    tp_shard,
)


def test_an_ordinary_parameter_is_replicated() -> None:
    p = nn.Parameter(torch.zeros(3))
    assert placement(p) == Placement()
    assert tp_shard(p) is None and not is_duplicate(p) and not tp_grad_summed(p)


def test_writers_compose_and_copies_stay_independent() -> None:
    p = nn.Parameter(torch.zeros(4))
    shard = TPShard(dim=0, parts=3, rank=1, size=2)
    set_tp_shard_(p, shard)
    copy = nn.Parameter(torch.zeros(4))
    copy.__dict__.update(p.__dict__)  # as zero.Init's meta swap copies attributes
    mark_duplicate_(p)
    mark_tp_grad_summed_(p)
    assert placement(p) == Placement(tp=shard, duplicate=True, tp_grad_summed=True)
    assert placement(copy) == Placement(tp=shard)  # the copy's record did not change
