"""The ``compression_training`` block: DeepSpeed 0.19.8's keys and defaults, unknown keys named
with a did-you-mean, and nothing enabled that slipstream cannot act on slips through."""

from __future__ import annotations

from typing import Any

import pytest

from slipstream.compression.config import get_compression_config
from slipstream.config import ConfigError, parse_config
from slipstream.config.compression import NOT_BUILT, CompressionConfig


def _wq(**shared: Any) -> dict[str, Any]:
    return {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, **shared},
            "different_groups": {
                "wq1": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["fc"]}
            },
        }
    }


def test_defaults_are_deepspeeds() -> None:
    """Absent block: every technique off with DeepSpeed's default offsets and kinds."""
    cfg = get_compression_config({})
    assert not cfg.enabled
    wq = cfg.weight_quantization.shared_parameters
    assert (wq.schedule_offset, wq.quantize_groups, wq.quantization_type, wq.rounding) == (
        0,
        1,
        "symmetric",
        "nearest",
    )
    assert not wq.quantize_weight_in_forward
    assert wq.fp16_mixed_quantize.quantize_change_ratio == 0.001
    aq = cfg.activation_quantization.shared_parameters
    assert (aq.schedule_offset, aq.range_calibration) == (1000, "dynamic")
    assert cfg.sparse_pruning.shared_parameters.method == "l1"
    assert cfg.head_pruning.shared_parameters.method == "topk"
    assert cfg.row_pruning.shared_parameters.schedule_offset == 1000


def test_group_defaults() -> None:
    """quantization_period defaults to 1 and related_modules to None, as in DeepSpeed."""
    raw = _wq()
    raw["weight_quantization"]["shared_parameters"]["enabled"] = False
    group = get_compression_config({"compression_training": raw}).weight_quantization
    assert group.different_groups is not None
    g = group.different_groups["wq1"]
    assert g.params.quantization_period == 1 and g.related_modules is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"weight_quantization": {"shared_parameters": {"enabeld": True}}},
            "unknown config key 'compression_training.weight_quantization.shared_parameters"
            ".enabeld'; did you mean 'enabled'?",
        ),
        (
            {"weight_quantizaton": {}},
            "unknown config key 'compression_training.weight_quantizaton'; did you mean "
            "'weight_quantization'?",
        ),
        (
            {
                "activation_quantization": {
                    "different_groups": {"a": {"params": {"bit": 8}, "modules": ["x"]}}
                }
            },
            "unknown config key 'compression_training.activation_quantization.different_groups"
            ".a.params.bit'; did you mean 'bits'?",
        ),
        (
            {"weight_quantization": {"shared_parameters": {"enabled": True}}},
            "'compression_training.weight_quantization.shared_parameters.enabled' is true but "
            "'weight_quantization.different_groups' is missing",
        ),
        (
            {"weight_quantization": {"shared_parameters": {"quantization_type": "sym"}}},
            "quantization_type",
        ),
        (
            {
                "weight_quantization": _wq(quantization_type="asymmetric")["weight_quantization"]
                | {
                    "different_groups": {
                        "g": {"params": {"start_bits": 2, "target_bits": 2}, "modules": ["x"]}
                    }
                }
            },
            "different_groups.g.params.target_bits' = 2: ternary (2) and binary (1) weights are "
            "symmetric only",
        ),
        (
            {"layer_reduction": {"enabled": True, "teacher_layer": [1, 3]}},
            "'compression_training.layer_reduction.module_name_prefix' is missing",
        ),
    ],
)
def test_bad_blocks_are_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        get_compression_config({"compression_training": raw})
    assert message in str(err.value)


_UNBUILT = {
    "sparse_pruning.shared_parameters.method": {
        "sparse_pruning": {"shared_parameters": {"enabled": True, "method": "snip_momentum"}}
    },
    "head_pruning.shared_parameters.method": {
        "head_pruning": {
            "shared_parameters": {"enabled": True, "method": "l1", "num_heads": 2},
            "different_groups": {"g": {"params": {"dense_ratio": 0.5}, "modules": ["o"]}},
        }
    },
}


@pytest.mark.parametrize("key", sorted(NOT_BUILT))
def test_unbuilt_options_are_refused_by_name(key: str) -> None:
    """Every option slipstream does not build is refused when enabled, never dropped."""
    with pytest.raises(ConfigError) as err:
        get_compression_config({"compression_training": _UNBUILT[key]})
    assert f"config key 'compression_training.{key}' = " in str(err.value)
    assert NOT_BUILT[key] in str(err.value)


def test_disabled_techniques_parse_in_the_whole_config() -> None:
    """A config whose techniques are all disabled trains as it is (DeepSpeed does the same)."""
    raw = _wq()
    raw["weight_quantization"]["shared_parameters"]["enabled"] = False
    cfg = parse_config({"train_batch_size": 2, "compression_training": raw})
    assert isinstance(cfg.compression_training, CompressionConfig)
    assert not cfg.compression_training.enabled


def test_sparse_attention_is_refused_without_an_enabled_key() -> None:
    """DeepSpeed's sparse_attention block has no switch: its presence asks for it."""
    with pytest.raises(ConfigError) as err:
        parse_config({"train_batch_size": 2, "sparse_attention": {"mode": "fixed", "block": 16}})
    assert "config key 'sparse_attention'" in str(err.value)
    assert "slipstream.sequence" in str(err.value)
