"""build_optimizer / build_scheduler / optimizer_defaults: name mapping and pinned errors."""

from __future__ import annotations

import pytest
import torch

from slipstream.config._errors import ConfigError
from slipstream.optim import (
    Lamb,
    Lion,
    WarmupCosineLR,
    WarmupLR,
    build_optimizer,
    build_scheduler,
    optimizer_defaults,
)


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(3))]


@pytest.mark.parametrize("name", ["Adam", "adam", "ADAM", "AdamW", "adamw"])
def test_adam_family_is_adamw_with_deepspeed_defaults(name: str) -> None:
    """Adam defaults to adam_w_mode (torch AdamW) with DeepSpeed's weight_decay=0."""
    opt = build_optimizer(name, {"lr": 0.01, "torch_adam": False, "set_grad_none": True}, _params())
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["weight_decay"] == 0.0 and opt.defaults["lr"] == 0.01


def test_adam_w_mode_false_is_torch_adam_with_l2() -> None:
    """adam_w_mode false gives torch Adam (L2 added to the gradient); AdamW rejects it."""
    opt = build_optimizer("Adam", {"adam_w_mode": False, "weight_decay": 0.1}, _params())
    assert type(opt) is torch.optim.Adam and opt.defaults["weight_decay"] == 0.1
    with pytest.raises(ConfigError, match=r"optimizer\.params\.adam_w_mode is false"):
        build_optimizer("AdamW", {"adam_w_mode": False}, _params())


def test_torch_adam_keeps_torch_defaults() -> None:
    """torch_adam true builds torch AdamW with its own weight_decay default, as DeepSpeed does."""
    opt = build_optimizer("Adam", {"torch_adam": True}, _params())
    assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.01


def test_own_and_torch_optimizers_by_name() -> None:
    """Lamb/Lion are ours (Lion with FusedLion defaults); others come from torch.optim, any case."""
    lamb = build_optimizer("LAMB", {"lr": 0.01, "betas": [0.8, 0.99], "amsgrad": False}, _params())
    assert isinstance(lamb, Lamb) and lamb.defaults["betas"] == (0.8, 0.99)
    lion = build_optimizer("lion", {"set_grad_none": True}, _params())
    assert isinstance(lion, Lion) and lion.defaults["betas"] == (0.9, 0.999)
    expected = {"sgd": torch.optim.SGD, "Adagrad": torch.optim.Adagrad,
                "rmsprop": torch.optim.RMSprop, "NAdam": torch.optim.NAdam}  # fmt: skip
    for name, cls in expected.items():
        assert type(build_optimizer(name, {"lr": 0.01}, _params())) is cls
    opt = build_optimizer("AdamW", {"fused": False, "foreach": False}, _params())  # torch knobs
    assert opt.defaults["foreach"] is False


def test_unknown_param_names_key_suggestion_and_valid_keys() -> None:
    """A misspelled param names optimizer.params.<key>, a suggestion and the valid keys."""
    with pytest.raises(ConfigError) as err:
        build_optimizer("AdamW", {"lr": 1e-3, "betass": [0.9, 0.99]}, _params())
    msg = str(err.value)
    assert "optimizer.params.betass" in msg and "did you mean 'betas'" in msg
    assert "Valid keys:" in msg and "weight_decay" in msg and "adam_w_mode" in msg
    with pytest.raises(ConfigError, match=r"optimizer\.params\.fused.*Valid keys: .*max_coeff"):
        build_optimizer("Lamb", {"fused": True}, _params())


def test_unknown_and_unimplemented_types() -> None:
    """Unknown type names optimizer.type with a suggestion; 1-bit and Mu* are not implemented."""
    with pytest.raises(ConfigError) as err:
        build_optimizer("AdamWW", {}, _params())
    msg = str(err.value)
    assert "optimizer.type 'AdamWW'" in msg and "did you mean 'AdamW'" in msg
    assert "Lamb" in msg and "RMSprop" in msg
    for name in ("OneBitAdam", "zerooneadam", "OneBitLamb", "MuAdam", "Muon"):
        with pytest.raises(ConfigError, match="does not implement yet"):
            build_optimizer(name, {}, _params())


def test_rejected_values() -> None:
    """max_grad_norm points to gradient_clipping; 'auto' and invalid values name the key."""
    with pytest.raises(ConfigError, match="gradient_clipping"):
        build_optimizer("Lamb", {"max_grad_norm": 1.0}, _params())
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr is 'auto'"):
        build_optimizer("Adam", {"lr": "auto"}, _params())
    with pytest.raises(ConfigError, match=r"'AdamW' rejected optimizer\.params: .*learning rate"):
        build_optimizer("Adam", {"lr": -1.0}, _params())
    with pytest.raises(ConfigError, match=r"optimizer\.params\.bias_correction=false"):
        build_optimizer("Adam", {"bias_correction": False}, _params())
    with pytest.raises(ConfigError, match=r"optimizer\.params\.torch_adam must be true or false"):
        build_optimizer("Adam", {"torch_adam": "yes"}, _params())


def test_optimizer_defaults() -> None:
    """Defaults are what build_optimizer would use, without implementation knobs."""
    adam = optimizer_defaults("Adam")
    assert adam["lr"] == 1e-3 and adam["betas"] == (0.9, 0.999) and adam["eps"] == 1e-8
    assert adam["weight_decay"] == 0.0 and "foreach" not in adam and "fused" not in adam
    assert optimizer_defaults("adam", {"torch_adam": True})["weight_decay"] == 0.01
    lamb = optimizer_defaults("lamb")
    assert (lamb["max_coeff"], lamb["min_coeff"], lamb["bias_correction"]) == (10.0, 0.01, True)
    assert optimizer_defaults("Lion") == {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}
    assert optimizer_defaults("RMSprop")["alpha"] == 0.99


def test_build_deepspeed_and_torch_schedulers() -> None:
    """DeepSpeed schedules and torch.optim.lr_scheduler classes are found case-insensitively."""
    opt = torch.optim.Adam(_params(), lr=0.1)
    sched = build_scheduler("warmuplr", {"warmup_max_lr": 0.2, "warmup_num_steps": 5}, opt)
    assert isinstance(sched, WarmupLR) and opt.param_groups[0]["lr"] == 0.0
    sched = build_scheduler("WARMUPCOSINELR", {"total_num_steps": 10}, opt)
    assert isinstance(sched, WarmupCosineLR)
    step = build_scheduler("steplr", {"step_size": 2, "gamma": 0.5}, opt)
    assert type(step) is torch.optim.lr_scheduler.StepLR


def test_scheduler_errors() -> None:
    """Unknown type/key, a missing required key and bad values name scheduler.* keys."""
    opt = torch.optim.Adam(_params(), lr=0.1)
    with pytest.raises(ConfigError) as err:
        build_scheduler("WarmupCosine", {}, opt)
    msg = str(err.value)
    assert "scheduler.type 'WarmupCosine'" in msg and "did you mean 'WarmupCosineLR'" in msg
    assert "OneCycle" in msg and "StepLR" in msg
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_max_lrr.*'warmup_max_lr'"):
        build_scheduler("WarmupLR", {"warmup_max_lrr": 0.1}, opt)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.total_num_steps is required"):
        build_scheduler("WarmupDecayLR", {}, opt)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.step_size is required"):
        build_scheduler("StepLR", {}, opt)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_num_steps is 'auto'"):
        build_scheduler("WarmupLR", {"warmup_num_steps": "auto"}, opt)
