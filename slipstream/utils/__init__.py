"""``deepspeed.utils``: the names training scripts and integrations import from it.

``logger`` and ``log_dist``; ``OnDevice``; the ZeRO helpers that read or write a parameter's
whole fp32 value, gradient or optimizer state (``safe_get_full_*`` / ``safe_set_full_*``);
``set_z3_leaf_modules``; ``zero_to_fp32`` (a submodule); ``RepeatingLoader``.
"""

from slipstream.data.loader import RepeatingLoader
from slipstream.utils.init_on_device import OnDevice
from slipstream.utils.logging import log_dist, logger
from slipstream.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
)
from slipstream.zero import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "OnDevice",
    "RepeatingLoader",
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "set_z3_leaf_modules",
]
__all__ += ["get_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module"]
__all__ += ["set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "z3_leaf_parameter"]
