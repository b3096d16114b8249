"""A layout as a slipstream/DeepSpeed JSON config that ``slipstream.initialize`` accepts."""

from __future__ import annotations

from typing import Any

from slipstream.planner.layout import Layout

__all__ = ["layout_to_config"]


def layout_to_config(layout: Layout, *, dtype: str = "bf16") -> dict[str, Any]:
    """The config keys of ``layout``: the batch triple, precision, ``zero_optimization``
    (with the ZeRO++ keys and offload when used), ``tensor_parallel``, ``pipeline`` and
    ``activation_checkpointing``. Optimizer and scheduler are left to the user. ``dtype``
    "fp32" writes no precision block (fp32 training, e.g. on a CPU).

    Recompute "full" is the model's own switch (``GPTConfig.activation_checkpointing`` or a
    ``PipelineModule``'s ``activation_checkpoint_interval=1``); "selective" sets
    ``activation_checkpointing.selective``.
    """
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"dtype must be 'bf16', 'fp16' or 'fp32', got {dtype!r}")
    zero: dict[str, Any] = {"stage": layout.zero_stage, "overlap_comm": layout.overlap_comm}
    if layout.hpz_partition_size > 1:
        zero["zero_hpz_partition_size"] = layout.hpz_partition_size
    if layout.quantized_weights:
        zero["zero_quantized_weights"] = True
    if layout.quantized_gradients:
        zero["zero_quantized_gradients"] = True
    if layout.offload_optimizer:
        zero["offload_optimizer"] = {"device": layout.offload_optimizer}
    if layout.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_batch_size": layout.batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.micro_batches,
        "zero_optimization": zero,
        "data_parallel_size": layout.dp,
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    if layout.tp > 1:
        config["tensor_parallel"] = {
            "autotp_size": layout.tp,
            "sequence_parallel": layout.sequence_parallel,
        }
    if layout.pp > 1:
        schedule = "gpipe" if layout.gpipe else "1f1b"
        if layout.virtual_stages > 1:
            schedule = "interleaved"
        config["pipeline"] = {
            "stages": layout.pp,
            "schedule": schedule,
            "virtual_stages": layout.virtual_stages,
            "activation_checkpoint_interval": 1 if layout.recompute == "full" else 0,
        }
    if layout.recompute == "selective":
        config["activation_checkpointing"] = {"selective": True}
    return config
