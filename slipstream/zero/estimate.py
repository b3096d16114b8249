"""Per-rank memory of model states under ZeRO, predicted before building anything.

Rajbhandari et al. 2020, section 3 / Figure 1: with mixed-precision Adam a parameter costs
2 (bf16 weights) + 2-4 (gradient) + 12 (fp32 master + two moments) bytes; ZeRO-1 divides the
optimizer part by N, ZeRO-2 also the gradients, ZeRO-3 also the weights. The numbers follow
slipstream's own layout (fp32 gradient accumulation, master copies only when the weights are
not fp32), so they match what the runtime holds (``tests/zero/test_estimate``).
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.zero.param import full_numel

__all__ = ["estimate_memory"]


def estimate_memory(
    model: nn.Module,
    world: int,
    stage: int,
    *,
    param_dtype: torch.dtype | None = None,
    master_dtype: torch.dtype = torch.float32,
    grad_dtype: torch.dtype = torch.float32,
    optimizer_states: int = 2,
    hpz_partition_size: int = 1,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
) -> dict[str, int]:
    """Bytes per data-parallel rank for parameters, gradients, master weights, optimizer states.

    Args:
        model: the model (may live on the meta device: only shapes and dtypes are read).
        world: data-parallel size.
        stage: ZeRO stage 0-3.
        param_dtype: compute dtype of the weights (default: the model's).
        master_dtype: dtype of the weights the optimizer updates (fp32 unless
            ``bf16_master_weights_and_grads``).
        grad_dtype: gradient accumulation dtype.
        optimizer_states: state tensors per parameter in the master dtype (Adam: 2, SGD with
            momentum: 1, Lion: 1).
        hpz_partition_size: ZeRO++ hpZ group size G (stage 3): each rank also keeps a
            secondary copy of 1/G of the trainable weights, ``2 Psi / G`` bytes in bf16.
        offload_optimizer: ``"cpu"`` or ``"nvme"``: where master weights and optimizer
            states live (with ``"cpu"`` the master is always a separate copy).
        offload_param: ``"cpu"`` (stage 3): the parameter shards live in host memory.
    Returns:
        ``{"params", "grads", "master", "optimizer", "hpz_secondary", "host_staging",
        "total", "device", "host", "nvme"}`` in bytes (``hpz_secondary`` is also counted in
        ``params``; ``device + host + nvme == total``). ``host_staging`` is what offloading
        the optimizer to the CPU keeps in host memory besides the states: a gradient buffer
        in ``grad_dtype`` and, when the weights' dtype differs from the master's, a buffer
        of weights in their dtype, each the size of the rank's shard (docs/gpu.md). Transient
        buffers (reduction staging, gathered ZeRO-3 units, activations) are not included.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {stage}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    frozen = sum(full_numel(p) for p in model.parameters() if not p.requires_grad)
    first = next(iter(model.parameters()), None)
    pdtype = param_dtype or (first.dtype if first is not None else torch.float32)
    pb = torch.empty((), dtype=pdtype).element_size()
    mb = torch.empty((), dtype=master_dtype).element_size()
    gb = torch.empty((), dtype=grad_dtype).element_size()
    shard = -(-trainable // world)
    owned = trainable if stage == 0 else shard
    params = (shard if stage == 3 else trainable) * pb + frozen * pb
    grads = (shard if stage >= 2 else trainable) * gb
    separate = master_dtype != pdtype or offload_optimizer == "cpu"
    master = owned * mb if separate else 0
    optimizer = optimizer_states * owned * mb
    if hpz_partition_size < 1 or world % hpz_partition_size:
        raise ValueError(f"hpz_partition_size must divide world={world}, got {hpz_partition_size}")
    secondary = (
        -(-trainable // hpz_partition_size) * pb if stage == 3 and hpz_partition_size > 1 else 0
    )
    params += secondary
    staging = 0
    if offload_optimizer == "cpu":
        staging = owned * gb + (owned * pb if pdtype != master_dtype else 0)
    total = params + grads + master + optimizer + staging
    if offload_param not in (None, "cpu") or (offload_param and stage != 3):
        raise ValueError(f"offload_param must be None or 'cpu' (stage 3), got {offload_param!r}")
    if offload_optimizer not in (None, "cpu", "nvme"):
        raise ValueError(
            f"offload_optimizer must be None, 'cpu' or 'nvme', got {offload_optimizer!r}"
        )
    states = master + optimizer
    host = states + staging if offload_optimizer == "cpu" else 0
    nvme = states if offload_optimizer == "nvme" else 0
    if offload_param == "cpu":
        host += params - secondary
    return {
        "params": params,
        "grads": grads,
        "master": master,
        "optimizer": optimizer,
        "hpz_secondary": secondary,
        "host_staging": staging,
        "total": total,
        "device": total - host - nvme,
        "host": host,
        "nvme": nvme,
    }
