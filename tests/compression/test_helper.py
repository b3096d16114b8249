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


def test_convert_conv1d_to_linear_keeps_the_function() -> None:
    """GPT-2's Conv1D (x @ W + b, W of shape (in, out)) becomes an nn.Linear computing the
    same thing, so compression groups can select it."""
    import torch

    from slipstream.compression.helper import convert_conv1d_to_linear

    class Conv1D(nn.Module):
        def __init__(self, nf: int, nx: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf))
            self.bias = nn.Parameter(torch.randn(nf))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight + self.bias

    model = nn.Sequential(Conv1D(5, 3), nn.ReLU(), Conv1D(2, 5))
    x = torch.randn(4, 3)
    want = model(x)
    assert convert_conv1d_to_linear(model, Conv1D) is model
    assert isinstance(model[0], nn.Linear) and model[0].weight.shape == (5, 3)
    torch.testing.assert_close(model(x), want)


def test_unprepared_model_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """compression_training enabled but init_compression never called: the engine warns
    (a DeepSpeed teacher engine shares the config and trains uncompressed on purpose)."""
    import logging

    from slipstream.compression.config import get_compression_config
    from slipstream.compression.engine import _warn_unprepared
    from slipstream.compression.scheduler import CompressionScheduler
    from tests.compression import _models as m

    model = m.tiny_bert(0)
    cfg = get_compression_config(m.ds_config(weight_quantization=m.weight_quantization()))
    with caplog.at_level(logging.WARNING, logger="slipstream"):
        _warn_unprepared(model, CompressionScheduler(model, cfg))
    assert "weight_quantization is enabled but no module" in caplog.text
    assert "init_compression" in caplog.text
