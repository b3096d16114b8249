"""Expert-parallel inference: ``init_inference(model, moe={"ep_size": N})``.

Each of the ``N`` ranks holds ``1/N`` of every MoE layer's experts; a layer's tokens go to
the ranks owning their experts and back with the same uneven all-to-all as in training
(:mod:`slipstream.moe.dispatch`). A model built with ``slipstream.moe`` layers (the reference
GPT's ``GPTMoEConfig(ep_size=N)``, ``deepspeed.moe.layer.MoE(ep_size=N)``) must already hold
its local experts; a Hugging Face MoE model (Mixtral, Qwen3-MoE, DeepSeek-V2/V3) with all its
experts is converted by AutoEP and keeps this rank's share.

Every forward of an MoE layer is a collective over the expert-parallel group, so the ranks
must run the same number of forwards. As with tensor parallelism, the ranks of the group
generate the same request: the request is checked to be equal, rank 0's RNG stream is used
and its chosen tokens are broadcast each step (:class:`~slipstream.inference.parallel.
TPRankSync` over the expert-parallel group).
"""

from __future__ import annotations

from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.config.expert import ExpertParallelConfig
from slipstream.inference.parallel import TPRankSync
from slipstream.moe import expert_parallel_, moe_layers
from slipstream.moe.autoep import autoep_, detect_preset

__all__ = ["expert_parallel_for_inference"]


def expert_parallel_for_inference(model: nn.Module, ep_size: int) -> TPRankSync | None:
    """Spread ``model``'s experts over ``ep_size`` ranks; the sync that keeps them alike.

    Raises:
        ConfigError: ``ep_size`` > 1 for a model without MoE layers (nor an AutoEP preset),
            or MoE layers built for another ``ep_size``.
    """
    layers = moe_layers(model)
    if not layers and ep_size > 1:
        try:
            detect_preset(model)
        except ConfigError:
            raise ConfigError(
                f"init_inference: config key 'ep_size' = {ep_size}: the model has no MoE layers "
                "(slipstream.moe / deepspeed.moe) and is not a Hugging Face MoE model AutoEP "
                "converts (Mixtral, Qwen3-MoE, DeepSeek-V2/V3); use ep_size 1"
            ) from None
        autoep_(model, ExpertParallelConfig(enabled=True, autoep_size=ep_size), None)
        layers = moe_layers(model)
    sizes = sorted({layer.ep_size for layer in layers})
    if layers and sizes != [ep_size]:
        raise ConfigError(
            f"init_inference: config key 'ep_size' = {ep_size} but the model's MoE layers were "
            f"built with ep_size {sizes}: build them with ep_size={ep_size} (each rank holding "
            "its experts) or set ep_size to theirs"
        )
    if ep_size == 1:
        return None
    groups = expert_parallel_(model, None)
    return TPRankSync(groups[f"ep_size_{ep_size}"].ep_group)
