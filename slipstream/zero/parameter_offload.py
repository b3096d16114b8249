"""``deepspeed.runtime.zero.parameter_offload``: the ZeRO-3 hooks API frameworks reach into.

TRL's ``unwrap_model_for_generation`` (and trainers built on it) gathers a ZeRO-3 model with
``GatheredParameters``, takes the gather/release hooks off for generation, and puts them back:

    offload = engine.optimizer.parameter_offload
    for p in params(offload.module) + offload.module.ds_external_parameters():
        p.ds_active_sub_modules.clear()
    for h in offload.forward_hooks + offload.backward_hooks: h.remove()
    offload.forward_hooks = []; offload.backward_hooks = []
    ...  # generate: every parameter is gathered, no hook releases one
    offload._register_deepspeed_module(offload.module)

:class:`DeepSpeedZeRoOffload` answers that over slipstream's stage-3 store: ``forward_hooks``
are the store's module hooks (slipstream's backward gathers are hooks on each forward's
output tensors, made per forward, so ``backward_hooks`` is empty), removing them and
``_register_deepspeed_module(module)`` re-installs them for the whole model. Parameters carry
``ds_active_sub_modules`` and modules ``ds_external_parameters()`` under DeepSpeed's names
(see :func:`add_deepspeed_attributes`).
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from slipstream.zero.param import EXTERNAL_ATTR
from slipstream.zero.sharded_store import ShardedStore

__all__ = ["DeepSpeedZeRoOffload", "add_deepspeed_attributes"]


def _external_parameters(module: nn.Module) -> list[tuple[int, nn.Parameter]]:
    """DeepSpeed's ``module.ds_external_parameters()``: (id, parameter) of each parameter
    registered with ``register_external_parameter(module, p)``."""
    return [(id(p), p) for p in module.__dict__.get(EXTERNAL_ATTR, [])]


def add_deepspeed_attributes(model: nn.Module) -> None:
    """Give every module of ``model`` DeepSpeed's ``ds_external_parameters()`` and every
    parameter ``ds_active_sub_modules``.

    DeepSpeed's set holds the modules whose forward is using the parameter right now, and is
    empty between forward passes. slipstream counts those uses per unit, not per parameter, so
    the set is always empty: what DeepSpeed's holds wherever code outside a forward reads or
    clears it (TRL clears it before it removes the hooks).
    """
    for module in model.modules():
        if "ds_external_parameters" not in module.__dict__:
            # __dict__ directly: nn.Module.__setattr__ takes only tensors and modules.
            module.__dict__["ds_external_parameters"] = types.MethodType(
                _external_parameters, module
            )
        for p in module.parameters(recurse=False):
            if not hasattr(p, "ds_active_sub_modules"):
                p.ds_active_sub_modules = set()  # type: ignore[attr-defined]


class DeepSpeedZeRoOffload:
    """``engine.optimizer.parameter_offload`` at ZeRO stage 3 (see the module docstring).

    Args:
        store: the engine's stage-3 parameter store; its units' root module is ``module``.
    """

    def __init__(self, store: ShardedStore) -> None:
        self._store = store
        self.module: nn.Module = store.units[0].module
        """The model whose hooks these are (the engine's module)."""
        add_deepspeed_attributes(self.module)

    @property
    def forward_hooks(self) -> list[RemovableHandle]:
        """The module hooks that gather and release the parameters (removable handles)."""
        return self._store.handles

    @forward_hooks.setter
    def forward_hooks(self, handles: list[RemovableHandle]) -> None:
        self._store.handles = list(handles)

    @property
    def backward_hooks(self) -> list[RemovableHandle]:
        """Empty: backward gathers hang on each forward's outputs, not on the modules."""
        return []

    @backward_hooks.setter
    def backward_hooks(self, handles: list[RemovableHandle]) -> None:
        if handles:
            raise ValueError(
                "parameter_offload.backward_hooks can only be emptied: slipstream's backward "
                "gathers are hooks on each forward's outputs, not module hooks"
            )

    def _register_deepspeed_module(self, module: nn.Module, count: Any = None) -> None:
        """Install the gather/release hooks again (after they were removed).

        Raises:
            ValueError: ``module`` is not the engine's model: slipstream installs the hooks for
                the whole model at once.
        """
        if module is not self.module:
            raise ValueError(
                f"_register_deepspeed_module({type(module).__name__}): slipstream installs the "
                "ZeRO-3 hooks for the whole model at once; pass parameter_offload.module"
            )
        self._store.remove_hooks()  # never twice: a second set would gather twice
        self._store.install_hooks()
        add_deepspeed_attributes(module)
