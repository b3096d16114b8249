"""ZeRO data parallelism, stages 0-3, applied in place: ``shard_zero_``."""

from __future__ import annotations

from slipstream.zero.estimate import estimate_memory
from slipstream.zero.export import gathered_model, save_16bit_model
from slipstream.zero.flat import Bucket, ParamStore
from slipstream.zero.gathered import (
    GatheredParameters,
    register_external_parameter,
    unregister_external_parameter,
)
from slipstream.zero.init import Init, materialize_
from slipstream.zero.leaf_modules import (
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    z3_leaf_parameter,
)
from slipstream.zero.optimizer import ZeroOptimizer
from slipstream.zero.param import ZeroParamStatus, is_zero_param
from slipstream.zero.policies import StepPolicy
from slipstream.zero.shard import shard_zero_
from slipstream.zero.stage3 import set_z3_leaf_modules
from slipstream.zero.units import get_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

__all__ = [
    "Bucket",
    "GatheredParameters",
    "Init",
    "ParamStore",
    "StepPolicy",
    "ZeroOptimizer",
    "ZeroParamStatus",
    "estimate_memory",
    "gathered_model",
    "is_zero_param",
    "materialize_",
    "register_external_parameter",
    "save_16bit_model",
    "set_z3_leaf_modules",
    "shard_zero_",
    "unregister_external_parameter",
]
__all__ += ["get_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module"]
__all__ += ["set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "z3_leaf_parameter"]
