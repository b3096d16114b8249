"""LoRA for DeepSpeed-Chat's trained RLHF models (the actor and the critic).

DeepSpeed-Chat (``dschat/rlhf/rlhf_engine.py``, Hu et al. 2021, arXiv 2106.09685) takes
``--actor_lora_dim`` / ``--critic_lora_dim``, ``--actor_lora_module_name`` /
``--critic_lora_module_name`` and ``--only_optimize_lora``: it converts the matching linear
layers of the model *before* ``deepspeed.initialize``, so that with ``only_optimize_lora`` the
optimizer (and its ZeRO partitions of master weights and states) covers only the adapters.
:class:`LoRAPolicy` holds those flags and :func:`apply_lora_policy_` applies them; the hybrid
engine fuses the adapters into the base weights for generation
(:mod:`slipstream.rlhf.hybrid`). The frozen reference and reward models are offloaded by
:mod:`slipstream.rlhf.offload`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from slipstream.config import ConfigError
from slipstream.models.lora import LoRALinear, apply_lora_, only_optimize_lora_parameters
from slipstream.runtime.engine import Engine

__all__ = ["LoRAPolicy", "apply_lora_policy_", "merge_lora_state_dict"]


@dataclass(frozen=True)
class LoRAPolicy:
    """LoRA for one trained RLHF model (DeepSpeed-Chat's flags; ``dim=0`` is off)."""

    dim: int = 0
    """``--actor_lora_dim`` / ``--critic_lora_dim``: the adapters' rank; 0 disables LoRA."""
    module_name: str | tuple[str, ...] = "layers."
    """``--*_lora_module_name``: substring(s) of the qualified names of the ``nn.Linear``
    layers to convert (DeepSpeed-Chat's default is ``decoder.layers.`` for OPT; ``layers.``
    matches LLaMA-style models' decoder blocks and leaves ``lm_head`` / ``v_head`` alone)."""
    scaling: float = 1.0
    """``lora_scaling`` (alpha): the update is ``scaling / dim * B A``."""
    dropout: float = 0.0
    """Dropout on the adapters' input (DeepSpeed-Chat: 0)."""
    only_optimize_lora: bool = False
    """``--only_optimize_lora``: freeze every other parameter, so the optimizer holds only
    the adapters (and ``force_optimize``)."""
    force_optimize: tuple[str, ...] = field(default_factory=tuple)
    """Parameter names kept trainable with ``only_optimize_lora`` (DeepSpeed-Chat trains the
    critic's ``v_head.weight`` this way)."""

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ConfigError(f"LoRAPolicy.dim={self.dim} must be >= 0 (0 disables LoRA)")
        if self.only_optimize_lora and self.dim == 0:
            raise ConfigError(
                "LoRAPolicy: only_optimize_lora=True with dim=0 would train nothing; set dim "
                "(e.g. 8-128) or only_optimize_lora=False"
            )
        if self.force_optimize and not self.only_optimize_lora:
            raise ConfigError(
                f"LoRAPolicy.force_optimize={list(self.force_optimize)} only matters with "
                "only_optimize_lora=True (otherwise every parameter is trained); set it or "
                "drop force_optimize"
            )


def apply_lora_policy_(model: nn.Module, policy: LoRAPolicy) -> list[str]:
    """Apply ``policy`` to ``model`` in place; call it before ``slipstream.initialize``.

    Converts the matching layers (:func:`slipstream.models.lora.convert_linear_layer_to_lora`
    semantics: substring match, ``alpha = scaling``) and, with ``only_optimize_lora``, freezes
    every other parameter, so ``initialize`` builds the optimizer over the adapters only.

    Returns:
        The converted layers' names (empty when ``policy.dim`` is 0).

    Raises:
        RuntimeError: ``model`` is already wrapped by an engine (too late: its optimizer
            and ZeRO partitions were built for the unconverted parameters).
        ValueError: no linear layer matches ``module_name`` (the model's linear layers are
            listed), or a ``force_optimize`` name is not a parameter.
    """
    if isinstance(model, Engine):
        raise RuntimeError(
            "apply_lora_policy_: got an Engine; convert the module before "
            "slipstream.initialize so the optimizer and ZeRO see the adapters"
        )
    if policy.dim == 0:
        return []
    names = [policy.module_name] if isinstance(policy.module_name, str) else policy.module_name
    converted = apply_lora_(
        model, [re.escape(n) for n in names], policy.dim, policy.scaling, policy.dropout
    )
    if policy.only_optimize_lora:
        only_optimize_lora_parameters(model, policy.force_optimize)
    return converted


def merge_lora_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state`` (a whole-tensor state dict of ``model``) with every adapter merged into its
    base weight (``W + scaling * B A``, in fp32) and the ``lora_a`` / ``lora_b`` keys dropped:
    what DeepSpeed-Chat saves after ``convert_lora_to_linear_layer``, a plain model that loads
    without LoRA.

    Raises:
        KeyError: ``state`` lacks a converted layer's weight or adapters (not ``model``'s).
    """
    out = dict(state)
    for name, layer in model.named_modules():
        if not isinstance(layer, LoRALinear):
            continue
        prefix = f"{name}." if name else ""
        a, b = out.pop(prefix + "lora_a"), out.pop(prefix + "lora_b")
        w = out[prefix + "weight"]
        out[prefix + "weight"] = (w.float() + (b.float() @ a.float()) * layer.scaling).to(w.dtype)
    return out
