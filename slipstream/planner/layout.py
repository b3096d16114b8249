"""A parallel layout: how one training step is cut across devices."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from slipstream.planner.model import ModelSpec

__all__ = ["Layout", "Recompute", "check_layout"]

Recompute = Literal["none", "selective", "full"]
_RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """TP x PP x DP with ZeRO, micro-batching and recomputation. ``world = tp * pp * dp``.

    Rank order is TP fastest, then DP, then PP (``slipstream.distributed.mesh`` and
    Megatron-LM), so a TP group is ``tp`` consecutive devices and a DP group strides by ``tp``.
    """

    tp: int = 1
    """Tensor-parallel size (Megatron column/row split)."""
    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel size (the ZeRO partition count)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank; > 1 is the interleaved 1F1B schedule."""
    micro_batch: int = 1
    """Sequences per device per forward/backward."""
    global_batch: int = 0
    """Sequences per optimizer step; 0 means ``micro_batch * dp`` (no accumulation)."""
    zero_stage: int = 0
    """ZeRO stage 0-3 over the DP group."""
    hpz_partition_size: int = 1
    """ZeRO++ hpZ: a secondary 1/G weight copy so backward gathers stay inside G devices."""
    quantized_weights: bool = False
    """ZeRO++ qwZ: int8 forward weight all-gathers (half the bytes)."""
    quantized_gradients: bool = False
    """ZeRO++ qgZ: int4 two-hop gradient reduce-scatter (a quarter of the bytes)."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (attention core) or full (every layer)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside the TP group (needs ``tp > 1``)."""
    gpipe: bool = False
    """All forwards then all backwards (holds every micro-batch) instead of 1F1B."""
    offload_optimizer: Literal["cpu", "nvme"] | None = None
    """Where master weights and optimizer states live."""
    offload_param: bool = False
    """ZeRO-3 parameter shards in host memory."""
    grad_bytes: int = 4
    """Gradient accumulation bytes per element (fp32 like slipstream and Megatron's
    main_grad; 2 for a bf16/fp16 accumulation)."""
    param_bytes: int = 2
    """Bytes per element of the working weights and activations: 2 for bf16/fp16 mixed
    precision (with fp32 master weights), 4 for fp32 training (the optimizer updates the
    weights themselves: no master copy), as on a CPU."""
    overlap_comm: bool = True
    """Data-parallel reduction overlaps the backward pass (bucketed, as DDP/ZeRO do)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def batch(self) -> int:
        """Global batch (sequences per optimizer step)."""
        return self.global_batch or self.micro_batch * self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step per pipeline, ``m = B / (b * dp)``."""
        return self.batch // (self.micro_batch * self.dp)

    @property
    def schedule(self) -> str:
        if self.pp == 1:
            return "none"
        if self.gpipe:
            return "gpipe"
        return "interleaved" if self.virtual_stages > 1 else "1f1b"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            world=self.world, global_batch=self.batch, micro_batches=self.micro_batches,
            schedule=self.schedule,
        )  # fmt: skip
        return data


def check_layout(model: ModelSpec, layout: Layout) -> None:
    """Raise ``ValueError`` naming the field, its value and the fix when ``layout`` cannot run
    ``model`` at all (what merely does not fit or is slow is the search's business)."""
    for name in ("tp", "pp", "dp", "virtual_stages", "micro_batch", "hpz_partition_size"):
        if getattr(layout, name) < 1:
            raise ValueError(f"Layout.{name} = {getattr(layout, name)} must be >= 1")
    if model.heads % layout.tp or model.kv % layout.tp:
        raise ValueError(
            f"Layout.tp = {layout.tp} must divide the {model.heads} attention heads "
            f"({model.kv} key/value heads): pick a divisor"
        )
    chunks = layout.pp * layout.virtual_stages
    if model.layers % chunks:
        raise ValueError(
            f"Layout.pp * virtual_stages = {chunks} must divide the {model.layers} layers"
        )
    if layout.batch % (layout.micro_batch * layout.dp):
        raise ValueError(
            f"Layout.global_batch = {layout.batch} is not a multiple of micro_batch * dp = "
            f"{layout.micro_batch * layout.dp}"
        )
    if layout.param_bytes not in (2, 4) or layout.grad_bytes not in (2, 4):
        raise ValueError(
            f"Layout.param_bytes = {layout.param_bytes} and grad_bytes = {layout.grad_bytes} "
            "must be 2 (bf16/fp16) or 4 (fp32)"
        )
    if layout.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"Layout.zero_stage = {layout.zero_stage} must be 0-3")
    if layout.recompute not in _RECOMPUTE:
        raise ValueError(f"Layout.recompute = {layout.recompute!r} must be one of {_RECOMPUTE}")
    if layout.sequence_parallel and layout.tp == 1:
        raise ValueError("Layout.sequence_parallel needs tp > 1 (it splits within the TP group)")
    if layout.virtual_stages > 1 and (layout.pp == 1 or layout.gpipe):
        raise ValueError("Layout.virtual_stages > 1 needs pp > 1 and the 1F1B schedule")
    if layout.dp % layout.hpz_partition_size:
        raise ValueError(
            f"Layout.hpz_partition_size = {layout.hpz_partition_size} must divide dp = {layout.dp}"
        )
    if (layout.hpz_partition_size > 1 or layout.offload_param) and layout.zero_stage != 3:
        raise ValueError("hpZ and parameter offload need Layout.zero_stage = 3")
