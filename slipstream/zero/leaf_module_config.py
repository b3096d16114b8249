"""``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module`` block
(``DeepSpeedZeroLeafModuleConfig``) and its defaults. The block lives in
``slipstream.config.zero``; ``initialize`` marks the leaves it names at stage 3."""

from slipstream.config.zero import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig

DeepSpeedZeroLeafModuleConfig = LeafModuleConfig
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]
