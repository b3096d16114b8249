"""deepspeed.compression.helper's dotted-path get/set, as DeepSpeed-Chat's LoRA code uses them."""

from __future__ import annotations

import pytest
import torch.nn as nn

from slipstream.compression.helper import recursive_getattr, recursive_setattr


def test_get_and_set_by_dotted_name() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 4)))
    assert recursive_getattr(model, "1.1") is model[1][1]
    new = nn.Linear(3, 5)
    recursive_setattr(model, "1.1", new)
    assert model[1][1] is new
    recursive_setattr(model, "0", nn.Identity())
    assert isinstance(model[0], nn.Identity)


def test_missing_part_is_named() -> None:
    with pytest.raises(AttributeError, match=r"'nope'.*'1\.nope'"):
        recursive_getattr(nn.Sequential(nn.Linear(2, 2), nn.Sequential()), "1.nope")
