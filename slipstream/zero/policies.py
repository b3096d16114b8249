"""The policies ZeRO is configured with: small frozen records built once from the config
(``zero_optimization`` and its neighbours) by ``shard_zero_``'s caller and by ``shard_zero_``.

``StepPolicy`` shapes the optimizer step, ``Stage3Options`` how ZeRO-3 gathers and keeps
parameters (with ``ZeroPPWeights``, the ZeRO++ weight options); the reducer's
``ReducePolicy`` sits next to the reducer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slipstream.distributed import comm
from slipstream.precision import LossScaler
from slipstream.zero.zeropp import ZeroPPWeights

__all__ = ["OPTIMIZER_CHUNK", "Stage3Options", "StepPolicy", "ZeroPPWeights"]

OPTIMIZER_CHUNK = 1 << 22


@dataclass(frozen=True)
class StepPolicy:
    """What happens at the optimizer step besides the update itself.

    Attributes:
        loss_scaler: fp16 loss scale (``enabled=False`` for fp32/bf16).
        clip: global gradient-norm clip (0 disables).
        check_overflow: skip the step when the global gradient norm is inf/nan (every rank
            agrees: the norm is reduced over all of them). On by default in every precision.
        prescale_gradients: divide gradients by ``predivide_factor`` before reduction.
        predivide_factor: see ``prescale_gradients``.
        sub_group_size: largest tensor handed to an elementwise optimizer.
        allow_untested_optimizer: accept optimizer classes not known to be elementwise.
        swap_dir: keep optimizer states (and separate fp32 masters) in files here between
            steps (``offload_optimizer.device = "nvme"``).
        offload_device: keep master weights and optimizer states here (host memory, for
            ``offload_optimizer.device = "cpu"`` on a GPU) and run the optimizer step there;
            gradients are copied over per bucket and updated weights copied back.
        pin_memory: page-lock the offloaded masters (faster copies on CUDA).
        tp_group: tensor-parallel group: the global gradient norm sums the squares of
            tensor-parallel shards (parameters with a ``TPShard`` placement) over it, and
            counts replicated parameters once.
        pp_group: pipeline group: each stage holds different parameters, so the norm sums
            over it (parameters placed as duplicates, e.g. the second copy of a tied
            weight, are left out).
        gradient_average: see the field.
    """

    loss_scaler: LossScaler
    clip: float = 0.0
    check_overflow: bool = True
    prescale_gradients: bool = False
    predivide_factor: float = 1.0
    sub_group_size: int = OPTIMIZER_CHUNK
    allow_untested_optimizer: bool = False
    swap_dir: str | None = None
    offload_device: torch.device | None = None
    pin_memory: bool = False
    tp_group: comm.Group = None
    pp_group: comm.Group = None
    gradient_average: bool = True
    """Average gradients over the data-parallel ranks (``gradient_allreduce_op: "mean"``);
    false sums them (``"sum"``)."""


@dataclass(frozen=True)
class Stage3Options:
    """How a :class:`ShardedStore` gathers and keeps parameters.

    Attributes:
        prefetch_numel: elements all-gathered ahead of the running unit
            (``stage3_prefetch_bucket_size``; 0 disables prefetching).
        max_live_numel: prefetching never takes the gathered elements beyond this
            (``stage3_max_live_parameters``).
        persistence_threshold: units with fewer elements stay gathered
            (``stage3_param_persistence_threshold``).
        offload_device: keep this rank's shards here (``offload_param``: host memory); each
            gather copies them to the compute device first. None keeps them there.
        pin_memory: page-lock the offloaded shards (faster copies on CUDA).
        weights: ZeRO++ options of the weight all-gathers.
    """

    prefetch_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    persistence_threshold: int = 100_000
    offload_device: torch.device | None = None
    pin_memory: bool = False
    weights: ZeroPPWeights = field(default_factory=ZeroPPWeights)
